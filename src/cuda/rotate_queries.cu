// Query rotation (FORMAT.md section 5, step 1): q_rot = bf16(fp32(q) @ PiT)
// for MSE presets, q as fp32 for fp8 keys.
//
// One CTA computes a tile of Rows query rows (flattened (b, hq)) by
// kColumnsPerBlock output columns: PiT's columns and the rows are staged in
// shared memory with one round of copies, then warp w sums rows w, w + 8, ...
// for column `lane`, over i in order with fmaf (the order of the CPU
// reference and of the Hopper kernel's in-kernel rotation, so the bits
// agree). Small batches are latency-bound, hence one round trip to L2 rather
// than each thread walking PiT through L2. Rows = 8 spreads a batch over many
// CTAs (generic path); Rows = 64 keeps the grid to a few CTAs, so the Hopper
// decode launched behind it finds its multiprocessors free.

#include <cuda_runtime.h>

#include <string>

#include "cuda_check.hpp"
#include "device_utils.cuh"
#include "kernel_params.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kColumnsPerBlock = 32;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kColumnsPerBlock;

/// Block (x, y) rotates rows [x * Rows, ...) into columns [y * kColumnsPerBlock, ...).
template <int D, int Rows>
__global__ void __launch_bounds__(kThreads) rotate_queries_kernel(const __grid_constant__ RotateParams p) {
  // A decode launched behind this kernel may start its prologue now; it
  // waits for this grid before it reads q_rot.
  allow_dependent_launch();
  constexpr int kRowsPerWarp = Rows / kWarps;
  __shared__ __align__(16) float rows_s[Rows][D];
  __shared__ __align__(16) float columns_s[D][kColumnsPerBlock];
  const int num_rows = p.batch * p.num_q_heads;
  const int first_row = blockIdx.x * Rows;
  const int first_column = blockIdx.y * kColumnsPerBlock;
  const int warp = threadIdx.x / kColumnsPerBlock;
  const int j = threadIdx.x % kColumnsPerBlock;

  if (p.PiT != nullptr) {
    constexpr int kChunksPerRow = kColumnsPerBlock * 4 / 16;
    for (int chunk = threadIdx.x; chunk < D * kChunksPerRow; chunk += kThreads) {
      const int i = chunk / kChunksPerRow;
      const int part = chunk % kChunksPerRow;
      copy_to_shared<16>(&columns_s[i][4 * part], p.PiT + static_cast<std::int64_t>(i) * D + first_column + 4 * part);
    }
    cp_async_commit();
  }
#pragma unroll 8
  for (int index = threadIdx.x; index < Rows * D; index += kThreads) {
    const int source_row = first_row + index / D;
    float value = 0.0f;
    if (source_row < num_rows) {
      const std::int64_t b = source_row / p.num_q_heads;
      const std::int64_t hq = source_row % p.num_q_heads;
      value = load_as_float(p.query, p.query_dtype, b * p.query_stride_batch + hq * p.query_stride_head + index % D);
    }
    rows_s[index / D][index % D] = value;
  }
  cp_async_wait<0>();
  __syncthreads();
  const auto output = [&](int k) {
    return p.q_rot + static_cast<std::int64_t>(first_row + warp + kWarps * k) * D + first_column + j;
  };
  const auto present = [&](int k) { return first_row + warp + kWarps * k < num_rows; };
  if (p.PiT == nullptr) {  // fp8 keys: the query is used unrotated
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      if (present(k)) *output(k) = rows_s[warp + kWarps * k][first_column + j];
    }
    return;
  }
  float acc[kRowsPerWarp] = {};
#pragma unroll 4
  for (int i = 0; i < D; i += 4) {
    float column[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) column[e] = columns_s[i + e][j];
#pragma unroll
    for (int k = 0; k < kRowsPerWarp; ++k) {
      const float4 q = *reinterpret_cast<const float4*>(&rows_s[warp + kWarps * k][i]);  // broadcast within the warp
      acc[k] = fmaf(q.x, column[0], acc[k]);
      acc[k] = fmaf(q.y, column[1], acc[k]);
      acc[k] = fmaf(q.z, column[2], acc[k]);
      acc[k] = fmaf(q.w, column[3], acc[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kRowsPerWarp; ++k) {
    if (present(k)) *output(k) = round_to_bf16(acc[k]);
  }
}

template <int D, int Rows>
void launch_rotate(const RotateParams& params, cudaStream_t stream) {
  const int num_rows = params.batch * params.num_q_heads;
  const dim3 grid((num_rows + Rows - 1) / Rows, D / kColumnsPerBlock);
  rotate_queries_kernel<D, Rows><<<grid, kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_rotate_queries(const RotateParams& params, CUstream_st* stream, bool few_ctas) {
  TQ_REQUIRE(params.query_dtype == DType::bf16 || params.query_dtype == DType::f16, "query_dtype",
          std::string(dtype_name(params.query_dtype)) + " is not supported; accepted: bfloat16, float16");
  if (params.batch == 0 || params.num_q_heads == 0) return;
  // Strides follow DecodeArgs: in elements, 0 meaning contiguous [B, Hq, D].
  RotateParams resolved = params;
  if (resolved.query_stride_head == 0) resolved.query_stride_head = params.head_dim;
  if (resolved.query_stride_batch == 0) {
    resolved.query_stride_batch = static_cast<std::int64_t>(params.num_q_heads) * params.head_dim;
  }
  switch (params.head_dim) {
    // 64 x 128 fp32 rows and 128 x 32 of PiT fill the 48 KB of static shared memory.
    case 64: return launch_rotate<64, 8>(resolved, stream);
    case 128: return few_ctas ? launch_rotate<128, 64>(resolved, stream) : launch_rotate<128, 8>(resolved, stream);
    case 256: return launch_rotate<256, 8>(resolved, stream);
    default: fail("head_dim", std::to_string(params.head_dim) + " is not supported; accepted: 64, 128, 256");
  }
}

}  // namespace tqdecode::cuda
