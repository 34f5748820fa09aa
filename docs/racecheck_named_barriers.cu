// compute-sanitizer racecheck reports a hazard that cannot happen
// (docs/RELIABILITY.md, "racecheck and named barriers"). The scalar decode
// kernel's barrier pattern alone: 16 warps = 8 token groups of 2 warps; group
// t runs trips[t] iterations, each with two bar.sync 1 + t, 64 (immediate ids
// or a register id); then __syncthreads; lane 0 of each warp stores a value;
// __syncthreads; every thread reads all warps' values.
//   nvcc -std=c++20 -arch=sm_90a -lineinfo -o race_pattern docs/racecheck_named_barriers.cu
//   compute-sanitizer --tool racecheck ./race_pattern
// On an H200 (CUDA 13.0, driver 580.159.04) it reports the store of
// merged[warp] against the reads of merged[] after the __syncthreads between
// them, for both barrier forms.
#include <cstdio>
#include <utility>
template <int Id> __device__ __forceinline__ void bar_imm(int n) { asm volatile("bar.sync %0, %1;" ::"n"(Id), "r"(n) : "memory"); }
template <bool Immediate>
__global__ void pattern(const int* trips, float* out) {
  __shared__ float stage[16 * 64];
  __shared__ float merged[16];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = warp / 2;
  float acc = 0.0f;
  for (int i = 0; i < trips[blockIdx.x * 8 + group]; ++i) {
    stage[warp * 64 + lane] = lane + i;
    if constexpr (Immediate) {
      [&]<int... I>(std::integer_sequence<int, I...>) { ((group == I ? bar_imm<1 + I>(64) : void()), ...); }(std::make_integer_sequence<int, 8>{});
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(64) : "memory");
    }
    acc += stage[(warp ^ 1) * 64 + lane];
    if constexpr (Immediate) {
      [&]<int... I>(std::integer_sequence<int, I...>) { ((group == I ? bar_imm<1 + I>(64) : void()), ...); }(std::make_integer_sequence<int, 8>{});
    } else {
      asm volatile("bar.sync %0, %1;" ::"r"(1 + group), "r"(64) : "memory");
    }
  }
  __syncthreads();
  for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(~0u, acc, o);
  if (lane == 0) merged[warp] = acc;
  __syncthreads();
  float sum = 0.0f;
  for (int w = 0; w < 16; ++w) sum += merged[w];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}
int main() {
  const int blocks = 4;
  int h_trips[blocks * 8];
  for (int b = 0; b < blocks; ++b) for (int t = 0; t < 8; ++t) h_trips[b * 8 + t] = (b == 0) ? 3 : (t < 3 ? 1 : 0);
  int* trips; float* out;
  cudaMalloc(&trips, sizeof h_trips); cudaMalloc(&out, blocks * 512 * sizeof(float));
  cudaMemcpy(trips, h_trips, sizeof h_trips, cudaMemcpyHostToDevice);
  pattern<false><<<blocks, 512>>>(trips, out);
  pattern<true><<<blocks, 512>>>(trips, out);
  printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}
