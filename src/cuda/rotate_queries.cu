// Query rotation (docs/FORMAT.md section 5, step 1): q_rot = bf16(fp32(q) @ PiT)
// for MSE presets, q as fp32 for fp8 keys.
//
// One CTA computes a tile of query rows (flattened (b, hq)) by
// kColumnsPerBlock output columns: PiT's columns and the rows are staged in
// shared memory with one round of copies, then each thread sums over i in
// order with fmaf (the CPU reference's order) for RowsPerThread rows of its
// column. (The Hopper kernel rotates on the tensor cores, tensor_core/rotation.cuh:
// the same fp32 product to about 2^-16, not the same bits.) Few rows (small batches) are latency-bound: one row per thread,
// many small CTAs, one round trip to L2. Many rows are bound by the FMAs and
// by each CTA's copy of PiT's columns: eight rows per thread use every
// staged column eight times.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "cuda_check.hpp"
#include "device_utils.cuh"  // copy_to_shared
#include "kernel_params.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kColumnsPerBlock = 32;
constexpr int kRowGroups = 8;
constexpr int kThreads = kRowGroups * kColumnsPerBlock;  // warp w: rows w, w + 8, ...; lane j: column j
/// From this many rows on (D = 128) each thread rotates eight rows.
constexpr int kManyRows = 2048;

/// Block (x, y) rotates rows [x * kRowsPerBlock, ...) into columns [y * kColumnsPerBlock, ...).
template <int D, int RowsPerThread>
__global__ void __launch_bounds__(kThreads) rotate_queries_kernel(const __grid_constant__ RotateParams p) {
  constexpr int kRowsPerBlock = kRowGroups * RowsPerThread;
  __shared__ __align__(16) float rows_s[kRowsPerBlock][D];
  __shared__ __align__(16) float columns_s[D][kColumnsPerBlock];
  const int num_rows = p.batch * p.num_q_heads;
  const int first_row = blockIdx.x * kRowsPerBlock;
  const int first_column = blockIdx.y * kColumnsPerBlock;
  const int w = threadIdx.x / kColumnsPerBlock;
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
  // The rows: every thread's loads are issued before any is used (16-bit
  // elements, bf16 or fp16, converted afterwards), so they cost one round
  // trip, not one per element.
  static_assert(kThreads % D == 0, "whole rows per pass");
  constexpr int kRowStep = kThreads / D;
  constexpr int kPasses = kRowsPerBlock / kRowStep;
  const int d = threadIdx.x % D;
  const auto* query = static_cast<const std::uint16_t*>(p.query);
  std::uint16_t bits[kPasses];
  {
    int row = first_row + threadIdx.x / D;
    std::int64_t b = row / p.num_q_heads;
    int hq = row % p.num_q_heads;
#pragma unroll
    for (int k = 0; k < kPasses; ++k) {
      bits[k] = row < num_rows ? __ldg(query + b * p.query_stride_batch + hq * p.query_stride_head + d) : 0;
      row += kRowStep;
      hq += kRowStep;
      if (hq >= p.num_q_heads) {  // the same for the whole warp (D >= 64 threads share a row)
        b += hq / p.num_q_heads;
        hq %= p.num_q_heads;
      }
    }
  }
  const bool f16 = p.query_dtype == DType::f16;
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    rows_s[threadIdx.x / D + kRowStep * k][d] = query_bits_to_float(f16, bits[k]);
  }
  cp_async_wait<0>();
  __syncthreads();
  const auto output = [&](int r) {
    return p.q_rot + static_cast<std::int64_t>(first_row + w + kRowGroups * r) * D + first_column + j;
  };
  const auto present = [&](int r) { return first_row + w + kRowGroups * r < num_rows; };
  if (p.PiT == nullptr) {  // fp8 keys: the query is used unrotated
#pragma unroll
    for (int r = 0; r < RowsPerThread; ++r) {
      if (present(r)) *output(r) = rows_s[w + kRowGroups * r][first_column + j];
    }
    return;
  }
  float acc[RowsPerThread];
#pragma unroll
  for (int r = 0; r < RowsPerThread; ++r) acc[r] = 0.0f;
#pragma unroll 4
  for (int i = 0; i < D; i += 4) {
    float column[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) column[e] = columns_s[i + e][j];
#pragma unroll
    for (int r = 0; r < RowsPerThread; ++r) {
      const float4 q = *reinterpret_cast<const float4*>(&rows_s[w + kRowGroups * r][i]);  // broadcast within the warp
      acc[r] = fmaf(q.x, column[0], acc[r]);
      acc[r] = fmaf(q.y, column[1], acc[r]);
      acc[r] = fmaf(q.z, column[2], acc[r]);
      acc[r] = fmaf(q.w, column[3], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < RowsPerThread; ++r) {
    if (present(r)) *output(r) = round_to_bf16(acc[r]);
  }
}

template <int D, int RowsPerThread>
void launch_rotate(const RotateParams& params, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kRowGroups * RowsPerThread;
  const int num_rows = params.batch * params.num_q_heads;
  const dim3 grid((num_rows + kRowsPerBlock - 1) / kRowsPerBlock, D / kColumnsPerBlock);
  rotate_queries_kernel<D, RowsPerThread><<<grid, kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_rotate_queries(const RotateParams& params, CUstream_st* stream) {
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
    case 64: launch_rotate<64, 1>(resolved, stream); break;
    case 128:
      if (params.batch * params.num_q_heads >= kManyRows) {
        launch_rotate<128, 8>(resolved, stream);  // 48 KB of shared memory
      } else {
        launch_rotate<128, 1>(resolved, stream);
      }
      break;
    case 256: launch_rotate<256, 1>(resolved, stream); break;
    default: fail("head_dim", std::to_string(params.head_dim) + " is not supported; accepted: 64, 128, 256");
  }
}

}  // namespace tqdecode::cuda
