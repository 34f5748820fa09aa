// Query rotation (FORMAT.md section 5, step 1): q_rot = bf16(fp32(q) @ PiT)
// for MSE presets, q as fp32 for fp8 keys.
//
// One CTA computes a tile of kRowsPerBlock query rows (flattened (b, hq)) by
// kColumnsPerBlock output columns, one output per thread: PiT's columns and
// the rows are staged in shared memory with one round of copies, then each
// thread sums over i in order with fmaf (the order of the CPU reference and
// of the Hopper kernel's in-kernel rotation, so the bits agree). Small
// batches are latency-bound, hence one round trip to L2 and many small CTAs
// rather than each thread walking PiT through L2.

#include <cuda_runtime.h>

#include <string>

#include "cuda_check.hpp"
#include "device_utils.cuh"  // copy_to_shared
#include "kernel_params.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kRowsPerBlock = 8;
constexpr int kColumnsPerBlock = 32;
constexpr int kThreads = kRowsPerBlock * kColumnsPerBlock;  // warp r: row r, lane j: column j

/// Block (x, y) rotates rows [x * kRowsPerBlock, ...) into columns [y * kColumnsPerBlock, ...).
template <int D>
__global__ void __launch_bounds__(kThreads) rotate_queries_kernel(const __grid_constant__ RotateParams p) {
  __shared__ __align__(16) float rows_s[kRowsPerBlock][D];
  __shared__ __align__(16) float columns_s[D][kColumnsPerBlock];
  const int num_rows = p.batch * p.num_q_heads;
  const int first_row = blockIdx.x * kRowsPerBlock;
  const int first_column = blockIdx.y * kColumnsPerBlock;
  const int r = threadIdx.x / kColumnsPerBlock;
  const int j = threadIdx.x % kColumnsPerBlock;
  const int row = first_row + r;

  if (p.PiT != nullptr) {
    constexpr int kChunksPerRow = kColumnsPerBlock * 4 / 16;
    for (int chunk = threadIdx.x; chunk < D * kChunksPerRow; chunk += kThreads) {
      const int i = chunk / kChunksPerRow;
      const int part = chunk % kChunksPerRow;
      copy_to_shared<16>(&columns_s[i][4 * part], p.PiT + static_cast<std::int64_t>(i) * D + first_column + 4 * part);
    }
    cp_async_commit();
  }
  for (int index = threadIdx.x; index < kRowsPerBlock * D; index += kThreads) {
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
  if (row >= num_rows) return;
  float* out = p.q_rot + static_cast<std::int64_t>(row) * D + first_column + j;
  if (p.PiT == nullptr) {  // fp8 keys: the query is used unrotated
    *out = rows_s[r][first_column + j];
    return;
  }
  float acc = 0.0f;
#pragma unroll 8
  for (int i = 0; i < D; i += 4) {
    const float4 q = *reinterpret_cast<const float4*>(&rows_s[r][i]);  // broadcast within the warp
    acc = fmaf(q.x, columns_s[i + 0][j], acc);
    acc = fmaf(q.y, columns_s[i + 1][j], acc);
    acc = fmaf(q.z, columns_s[i + 2][j], acc);
    acc = fmaf(q.w, columns_s[i + 3][j], acc);
  }
  *out = round_to_bf16(acc);
}

template <int D>
void launch_rotate(const RotateParams& params, cudaStream_t stream) {
  const int num_rows = params.batch * params.num_q_heads;
  const dim3 grid((num_rows + kRowsPerBlock - 1) / kRowsPerBlock, D / kColumnsPerBlock);
  rotate_queries_kernel<D><<<grid, kThreads, 0, stream>>>(params);
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
    case 64: launch_rotate<64>(resolved, stream); break;
    case 128: launch_rotate<128>(resolved, stream); break;
    case 256: launch_rotate<256>(resolved, stream); break;
    default: fail("head_dim", std::to_string(params.head_dim) + " is not supported; accepted: 64, 128, 256");
  }
}

}  // namespace tqdecode::cuda
