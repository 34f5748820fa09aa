// Query rotation (FORMAT.md section 5, step 1): q_rot = bf16(fp32(q) @ PiT)
// for MSE presets, q as fp32 for fp8 keys.
//
// One CTA rotates kRowsPerBlock query rows (flattened (b, hq)) with one
// thread per output column j: the rows sit in shared memory as fp32, each
// thread walks i and reads PiT[i][j] (consecutive threads, consecutive
// addresses), so PiT is read once per CTA, from L2, for all its rows.

#include <cuda_runtime.h>

#include <string>

#include "cuda_check.hpp"
#include "kernel_params.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda {
namespace {

// Rows per CTA: enough to amortise the D*D PiT read over several rows, few
// enough that a small batch still spreads over several multiprocessors.
constexpr int kRowsPerBlock = 8;

/// blockDim.x == D; block x rotates rows [x * kRowsPerBlock, ...).
template <int D>
__device__ __forceinline__ void rotate_queries_body(const RotateParams& p) {
  __shared__ __align__(16) float rows_s[kRowsPerBlock][D];
  const int num_rows = p.batch * p.num_q_heads;
  const int first_row = blockIdx.x * kRowsPerBlock;
  const int j = threadIdx.x;

#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int row = first_row + r;
    float value = 0.0f;
    if (row < num_rows) {
      const std::int64_t b = row / p.num_q_heads;
      const std::int64_t hq = row % p.num_q_heads;
      value = load_as_float(p.query, p.query_dtype, b * p.query_stride_batch + hq * p.query_stride_head + j);
    }
    rows_s[r][j] = value;
  }

  if (p.PiT == nullptr) {  // fp8 keys: the query is used unrotated
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      if (first_row + r < num_rows) p.q_rot[static_cast<std::int64_t>(first_row + r) * D + j] = rows_s[r][j];
    }
    return;
  }
  __syncthreads();

  float acc[kRowsPerBlock] = {};
#pragma unroll 2
  for (int i = 0; i < D; i += 4) {
    float column[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) column[e] = __ldg(p.PiT + (i + e) * D + j);
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const float4 q = *reinterpret_cast<const float4*>(&rows_s[r][i]);  // broadcast read
      acc[r] = fmaf(q.x, column[0], acc[r]);
      acc[r] = fmaf(q.y, column[1], acc[r]);
      acc[r] = fmaf(q.z, column[2], acc[r]);
      acc[r] = fmaf(q.w, column[3], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    if (first_row + r < num_rows) {
      p.q_rot[static_cast<std::int64_t>(first_row + r) * D + j] = round_to_bf16(acc[r]);
    }
  }
}

template <int D>
__global__ void __launch_bounds__(D) rotate_queries_kernel(const __grid_constant__ RotateParams params) {
  rotate_queries_body<D>(params);
}

template <int D>
void launch_rotate(const RotateParams& params, cudaStream_t stream) {
  const int num_rows = params.batch * params.num_q_heads;
  const int blocks = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  rotate_queries_kernel<D><<<blocks, D, 0, stream>>>(params);
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
