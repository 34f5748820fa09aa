// Sustained throughput of the tensor cores' instructions on the local GPU:
// the ceilings of docs/PERFORMANCE.md's arithmetic for several query
// tokens per sequence.
// - mma.sync m16n8k16 (fp16 operands, fp32 accumulators), what the decode
//   kernels use. Every warp runs independent accumulator chains, so the
//   number is the pipe's throughput, not one chain's latency.
// - Warpgroup MMA (wgmma, sm_90a) as a multi-token decode would use it: A
//   (64 x 16 per k-step) from each warp's registers in mma.sync's m16n8k16
//   fragment layout, B (N x K, K-major) from shared memory in
//   128-byte-swizzled rows. One product is checked against the host (the
//   fragment and descriptor conventions; also with A from shared memory, as
//   the warp-specialized loops' S^T and O^T take it), then k = 128 products
//   (eight m64nNk16, one commit and wait each, as one tile's S^T would run)
//   are timed for N = 32, 64, 128 and one to three warpgroups per CTA.
//
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -o /tmp/mma_throughput scripts/mma_throughput.cu && /tmp/mma_throughput
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../src/cuda/tensor_core/bulk_copy.cuh"
#include "../src/cuda/tensor_core/wgmma.cuh"

using namespace tqdecode::cuda::tensor_core;  // the wgmma helpers

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

constexpr int kM = 64;
constexpr int kK = 128;           // eight k-steps of 16
constexpr int kWgmmaIterations = 2048;  // k = 128 products per warpgroup in the throughput loop

// Lane (g, c) of warp w: rows 16 w + g (+ 8), columns 16 ks + 2 c (+ 1, + 8, + 9).
__device__ void a_fragment(const __half* a, int ks, std::uint32_t (&frag)[4]) {
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const auto pair = [&](int row, int col) {
    return *reinterpret_cast<const std::uint32_t*>(a + (16 * warp + row) * kK + 16 * ks + col);
  };
  frag[0] = pair(g, 2 * c), frag[1] = pair(g + 8, 2 * c), frag[2] = pair(g, 2 * c + 8), frag[3] = pair(g + 8, 2 * c + 8);
}

// SharedA: A from shared memory too (wgmma_ss), in B's arrangement with 64 rows.
template <int N, bool SharedA>
__global__ void check_product(const __half* a, const __half* b, float* d) {
  __shared__ __align__(1024) std::uint8_t shared[N * kK * 2];
  __shared__ __align__(1024) std::uint8_t shared_a[SharedA ? kM * kK * 2 : 16];
  for (int i = threadIdx.x; i < N * kK; i += blockDim.x) {
    *reinterpret_cast<__half*>(shared + swizzled_offset(N, i / kK, i % kK)) = b[i];
  }
  if constexpr (SharedA) {
    for (int i = threadIdx.x; i < kM * kK; i += blockDim.x) {
      *reinterpret_cast<__half*>(shared_a + swizzled_offset(kM, i / kK, i % kK)) = a[i];
    }
  }
  fence_proxy_async_shared();
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  const std::uint32_t base_a = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared_a));
  std::uint32_t frags[8][4];
  for (int ks = 0; ks < 8; ++ks) a_fragment(a, ks, frags[ks]);
  float acc[N / 2] = {};
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    if constexpr (SharedA) {
      wgmma_ss<N>(acc, k_step_descriptor(base_a, kM, ks), k_step_descriptor(base, N, ks), ks > 0);
    } else {
      wgmma_rs<N>(acc, frags[ks], k_step_descriptor(base, N, ks), ks > 0);
    }
  }
  wgmma_commit();
  wgmma_wait_all();
  keep(acc);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  for (int i = 0; i < N / 8; ++i) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * warp + g + 8 * (e / 2), col = 8 * i + 2 * c + (e % 2);
      d[row * N + col] = acc[4 * i + e];
    }
  }
}

template <int N>
__global__ void product_loop(float* sink, std::uint32_t seed) {
  __shared__ __align__(1024) std::uint8_t shared[N * kK * 2];
  for (int i = threadIdx.x; i < N * kK / 2; i += blockDim.x) {
    reinterpret_cast<std::uint32_t*>(shared)[i] = (seed * (i + 1)) & 0x3bff3bffu;
  }
  fence_proxy_async_shared();
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  std::uint32_t frags[8][4];
  for (int ks = 0; ks < 8; ++ks) {
    for (int j = 0; j < 4; ++j) frags[ks][j] = (seed * (threadIdx.x + 7 * ks + j)) & 0x3bff3bffu;
  }
  float acc[N / 2] = {};
  for (int it = 0; it < kWgmmaIterations; ++it) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma_rs<N>(acc, frags[ks], k_step_descriptor(base, N, ks), 1);
    wgmma_commit();
    wgmma_wait_all();
    keep(acc);
  }
  float total = 0.0f;
  for (int i = 0; i < N / 2; ++i) total += acc[i];
  if (total == 1.2345f) sink[threadIdx.x] = total;  // keeps the loop; never true for these operands
}

template <int N, bool SharedA = false>
bool check(std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<__half> a(kM * kK), b(N * kK);
  for (auto& x : a) x = __float2half(uniform(rng));
  for (auto& x : b) x = __float2half(uniform(rng));
  __half *da = nullptr, *db = nullptr;
  float* dd = nullptr;
  cudaMalloc(&da, a.size() * sizeof(__half));
  cudaMalloc(&db, b.size() * sizeof(__half));
  cudaMalloc(&dd, kM * N * sizeof(float));
  cudaMemcpy(da, a.data(), a.size() * sizeof(__half), cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * sizeof(__half), cudaMemcpyHostToDevice);
  cudaMemset(dd, 0xff, kM * N * sizeof(float));  // NaN: an element never written fails
  check_product<N, SharedA><<<1, 128>>>(da, db, dd);
  std::vector<float> d(kM * N);
  cudaMemcpy(d.data(), dd, d.size() * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(da), cudaFree(db), cudaFree(dd);
  double worst = 0.0;
  for (int m = 0; m < kM; ++m) {
    for (int n = 0; n < N; ++n) {
      double expected = 0.0;
      for (int k = 0; k < kK; ++k) expected += double(__half2float(a[m * kK + k])) * __half2float(b[n * kK + k]);
      const double error = std::fabs(expected - d[m * N + n]);
      worst = std::isnan(d[m * N + n]) ? INFINITY : std::fmax(worst, error);
    }
  }
  const bool ok = worst < 1e-3;
  std::printf("m64n%dk16 x 8, A from %s, B 128-byte swizzled: max |error| %.2e %s\n", N,
              SharedA ? "shared memory (128-byte swizzled)" : "registers", worst, ok ? "ok" : "WRONG");
  return ok;
}

template <int N>
void measure(int sms, float* sink, cudaEvent_t start, cudaEvent_t stop) {
  for (const int groups : {1, 2, 3}) {  // warpgroups per CTA
    const int ctas = sms * 8;
    product_loop<N><<<ctas, 128 * groups>>>(sink, 3);  // warm-up
    cudaEventRecord(start);
    for (int r = 0; r < 3; ++r) product_loop<N><<<ctas, 128 * groups>>>(sink, 3 + r);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    const double flops = 3.0 * ctas * groups * double(kWgmmaIterations) * 8 * 2.0 * kM * N * 16;
    std::printf("N = %3d, %d warpgroups per CTA: %.1f TFLOP/s\n", N, groups, flops / (ms * 1e-3) / 1e12);
  }
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
  std::mt19937 rng(7);
  bool ok = check<32>(rng);
  ok = check<64>(rng) && ok;
  ok = check<128>(rng) && ok;
  ok = check<32, true>(rng) && ok;
  ok = check<64, true>(rng) && ok;
  measure<32>(sms, sink, start, stop);
  measure<64>(sms, sink, start, stop);
  measure<128>(sms, sink, start, stop);
  if (cudaGetLastError() != cudaSuccess) return 1;
  return ok ? 0 : 2;
}
