// Split-KV reducer (docs/FORMAT.md section 5): combines the N partition results of
// each (query slot, hq) and the optional attention sink into the output row.
//
// One warp per (query slot, hq): slot b * max_query_len + j is token j of
// sequence b, written to query row query_start_loc[b] + j (row b with one
// token per sequence); a slot past its sequence's query length writes
// nothing. Lanes first read the partitions' max and sum (32
// partitions per step) to find M; then the weights w_p = l_p exp(m_p - M) are
// broadcast one partition at a time and every lane accumulates its slice of
// the D-wide partial outputs with 16- or 8-byte loads. Empty partitions
// (max -inf, sum 0) get weight 0 and their partial output is never read.
// Empty rows, NaN partitions and sinks follow partition_merge.cuh, the CPU
// reducer's rule.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "cuda_check.hpp"
#include "device_utils.cuh"
#include "kernel_params.hpp"
#include "partition_merge.cuh"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
// An explicit occupancy target: without one, ptxas aims for the maximum (32
// registers) and spills in the unrolled partition loop.
constexpr int kMinBlocksPerSm = 8;

template <int D>
struct ReduceShape {
  static constexpr int kVec = D >= 128 ? 4 : 2;    ///< floats per lane per load
  static constexpr int kChunks = D / (32 * kVec);  ///< loads per lane per partition
  static_assert(kChunks * 32 * kVec == D, "head dim must be a multiple of 64");
};

template <int Vec>
struct FloatVec;
template <>
struct FloatVec<2> {
  using type = float2;
};
template <>
struct FloatVec<4> {
  using type = float4;
};

/// Writes `Vec` consecutive output elements, packed into one store when the
/// destination is aligned for it.
template <int Vec>
__device__ __forceinline__ void store_output(void* output, DType dtype, std::int64_t index, const float (&v)[Vec],
                                             bool packed) {
  if (packed) {
    std::uint16_t bits[Vec];
#pragma unroll
    for (int e = 0; e < Vec; ++e) {
      bits[e] = dtype == DType::f16 ? float_to_half_bits(v[e]) : float_to_bf16_bits(v[e]);
    }
    auto* dst = static_cast<std::uint16_t*>(output) + index;
    if constexpr (Vec == 4) {
      *reinterpret_cast<uint2*>(dst) =
          make_uint2(bits[0] | (unsigned(bits[1]) << 16), bits[2] | (unsigned(bits[3]) << 16));
    } else {
      *reinterpret_cast<unsigned*>(dst) = bits[0] | (unsigned(bits[1]) << 16);
    }
  } else {
#pragma unroll
    for (int e = 0; e < Vec; ++e) store_from_float(output, dtype, index + e, v[e]);
  }
}

template <int D>
__device__ __forceinline__ void reduce_partitions_body(const ReduceParams& p, const QueryRows& rows) {
  using Shape = ReduceShape<D>;
  using Vec = typename FloatVec<Shape::kVec>::type;
  const int lane = threadIdx.x % 32;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;  // (slot, hq)
  if (row >= static_cast<std::int64_t>(p.batch) * rows.max_query_len * p.num_q_heads) return;
  const int slot = static_cast<int>(row / p.num_q_heads);
  const int j = slot % rows.max_query_len;
  const QueryRows::Span span = rows.span(slot / rows.max_query_len);
  if (j >= span.count) return;  // no such token: its partition entries were not written

  const int num_partitions = p.num_partitions;
  const float* part_max = p.part_max + row * num_partitions;
  const float* part_sum = p.part_sum + row * num_partitions;
  const float* part_out = p.part_out + row * num_partitions * D;
  const std::int64_t query_row = span.first + j;
  const int hq = static_cast<int>(row % p.num_q_heads);
  const bool has_sink = p.sinks != nullptr;
  const float sink = has_sink ? p.sinks[hq] : -INFINITY;

  // M: the partitions' maxima (a NaN one is not taken; rule 2 makes the row
  // NaN), merged with the sink as the first value of std::max's fold, so a
  // NaN sink makes M NaN.
  float partitions_max = -INFINITY;
  bool any_tokens = false;
  bool any_nan = false;
  for (int i = lane; i < num_partitions; i += 32) {
    const float m = part_max[i];
    const float l = part_sum[i];
    any_tokens |= partition_has_tokens(m, l);
    any_nan |= partition_is_nan(m, l);
    partitions_max = merge_max(partitions_max, m);
  }
  const float max_all = merge_max(sink, warp_max(partitions_max));
  any_tokens = __any_sync(kFullMask, any_tokens);
  any_nan = __any_sync(kFullMask, any_nan);

  float acc[Shape::kChunks][Shape::kVec] = {};
  float weight_total = 0.0f;
  if (any_tokens && !any_nan) {
    float denominator = 0.0f;
    for (int base = 0; base < num_partitions; base += 32) {
      const int i = base + lane;
      const float weight = i < num_partitions ? partition_weight(part_max[i], part_sum[i], max_all) : 0.0f;
      denominator += weight;
      const int count = min(32, num_partitions - base);
      for (int k = 0; k < count; ++k) {
        const float w = __shfl_sync(kFullMask, weight, k);
        if (w == 0.0f) continue;  // empty or negligible partition (uniform across the warp)
        const float* out = part_out + static_cast<std::int64_t>(base + k) * D + lane * Shape::kVec;
#pragma unroll
        for (int c = 0; c < Shape::kChunks; ++c) {
          const Vec v = *reinterpret_cast<const Vec*>(out + c * 32 * Shape::kVec);
          const float* f = reinterpret_cast<const float*>(&v);
#pragma unroll
          for (int e = 0; e < Shape::kVec; ++e) acc[c][e] = fmaf(w, f[e], acc[c][e]);
        }
      }
    }
    weight_total = warp_sum(denominator);
  }
  const float scale = row_scale(weight_total, any_tokens, any_nan, has_sink, sink, max_all);

  const std::int64_t out_row = query_row * p.output_stride_batch + hq * p.output_stride_head;
  const bool packed = (reinterpret_cast<std::uintptr_t>(p.output) % (2 * Shape::kVec)) == 0 &&
                      p.output_stride_batch % Shape::kVec == 0 && p.output_stride_head % Shape::kVec == 0;
#pragma unroll
  for (int c = 0; c < Shape::kChunks; ++c) {
    float v[Shape::kVec];
#pragma unroll
    for (int e = 0; e < Shape::kVec; ++e) v[e] = acc[c][e] * scale;
    store_output<Shape::kVec>(p.output, p.output_dtype, out_row + c * 32 * Shape::kVec + lane * Shape::kVec, v, packed);
  }
}

template <int D>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, kMinBlocksPerSm)
    reduce_partitions_kernel(const __grid_constant__ ReduceParams params, const __grid_constant__ QueryRows rows) {
  reduce_partitions_body<D>(params, rows);
}

template <int D>
void launch_reduce(const ReduceParams& params, const QueryRows& rows, cudaStream_t stream) {
  const std::int64_t warps = static_cast<std::int64_t>(params.batch) * rows.max_query_len * params.num_q_heads;
  const auto blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  reduce_partitions_kernel<D><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(params, rows);
  TQ_CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_reduce_partitions(const ReduceParams& params, const QueryRows& rows, CUstream_st* stream) {
  TQ_REQUIRE(params.output_dtype == DType::bf16 || params.output_dtype == DType::f16, "output_dtype",
          std::string(dtype_name(params.output_dtype)) + " is not supported; accepted: bfloat16, float16");
  TQ_REQUIRE(params.num_partitions >= 1, "num_partitions",
          std::to_string(params.num_partitions) + " is out of range; accepted: >= 1");
  if (params.batch == 0 || params.num_q_heads == 0) return;
  // Strides follow DecodeArgs: in elements, 0 meaning contiguous [B, Hq, D].
  ReduceParams resolved = params;
  if (resolved.output_stride_head == 0) resolved.output_stride_head = params.head_dim;
  if (resolved.output_stride_batch == 0) {
    resolved.output_stride_batch = static_cast<std::int64_t>(params.num_q_heads) * params.head_dim;
  }
  switch (params.head_dim) {
    case 64: launch_reduce<64>(resolved, rows, stream); break;
    case 128: launch_reduce<128>(resolved, rows, stream); break;
    case 256: launch_reduce<256>(resolved, rows, stream); break;
    default: fail("head_dim", std::to_string(params.head_dim) + " is not supported; accepted: 64, 128, 256");
  }
}

}  // namespace tqdecode::cuda
