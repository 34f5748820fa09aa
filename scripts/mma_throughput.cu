// Sustained throughput of the tensor-core instruction the decode kernels use
// (mma.sync m16n8k16, fp16 operands, fp32 accumulators) on the local GPU:
// the ceiling of docs/PERFORMANCE.md's arithmetic for several query tokens
// per sequence. Every warp runs independent accumulator chains, so the
// number is the pipe's throughput, not one chain's latency.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -o /tmp/mma_throughput scripts/mma_throughput.cu && /tmp/mma_throughput
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace {

constexpr int kChains = 8;        // independent accumulators per warp
constexpr int kIterations = 4096;  // of kChains mma each

__global__ void mma_loop(float* sink, std::uint32_t seed) {
  std::uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = seed * (threadIdx.x + i) | 0x3c003c00u;
  for (int i = 0; i < 2; ++i) b[i] = seed * (threadIdx.x + 7 * i) | 0x3c003c00u;
  float c[kChains][4] = {};
  for (int it = 0; it < kIterations; ++it) {
#pragma unroll
    for (int k = 0; k < kChains; ++k) {
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(c[k][0]), "+f"(c[k][1]), "+f"(c[k][2]), "+f"(c[k][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
  }
  float total = 0.0f;
  for (int k = 0; k < kChains; ++k) total += c[k][0] + c[k][1] + c[k][2] + c[k][3];
  if (total == 1.2345f) sink[threadIdx.x] = total;  // keeps the loop; never true for these operands
}

}  // namespace

int main() {
  int device = 0, sms = 0, clock_khz = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device);
  float* sink = nullptr;
  cudaMalloc(&sink, 1024 * sizeof(float));
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::printf("%d SMs, max SM clock %.0f MHz\n", sms, clock_khz / 1000.0);
  for (const int warps : {4, 8, 16}) {  // warps per CTA, one CTA per SM at a time (several waves)
    const int ctas = sms * 8;
    mma_loop<<<ctas, 32 * warps>>>(sink, 3);  // warm-up
    cudaEventRecord(start);
    for (int r = 0; r < 5; ++r) mma_loop<<<ctas, 32 * warps>>>(sink, 3 + r);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    const double flops = 5.0 * ctas * warps * double(kIterations) * kChains * 2.0 * 16 * 8 * 16;
    std::printf("%2d warps per CTA: %.1f TFLOP/s (mma.sync m16n8k16 f16 -> f32)\n", warps, flops / (ms * 1e-3) / 1e12);
  }
  if (cudaGetLastError() != cudaSuccess) return 1;
  return 0;
}
