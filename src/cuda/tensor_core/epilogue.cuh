// Epilogue stages of the tensor-core decode kernel (internal): the merge of
// a CTA's warps (stage 3), and the split-KV reduction that the last CTA of a
// (sequence, kv heads, row tile) runs over the N partitions (stage 4), each
// row's targets from the CTA's RowTable. The merge rule is
// partition_merge.cuh's, shared with the CUDA and CPU reducers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>

#include "../device_utils.cuh"
#include "../kernel_params.hpp"
#include "../partition_merge.cuh"
#include "../policy.hpp"
#include "cta_rows.cuh"
#include "fragments.cuh"
#include "shape.cuh"
#include "softmax.cuh"
#include "tile_layout.cuh"
#include "tqdecode/numeric.hpp"

namespace tqdecode::cuda::tensor_core {

// The factor on a row's merged output (the warps' weighted sum, whose
// weights sum to `sum`) with one partition (max in natural-log units): the
// fused reduction's arithmetic for N = 1, without the trip through memory;
// 0 for an all-zero row.
__device__ __forceinline__ float single_partition_scale(float max, float sum, bool has_sink, float sink) {
  const float merged_max = merge_max(sink, max_for_merge(max));
  const float weight = partition_weight(max, sum, merged_max);
  const float own_weight = output_weight(weight, weight, partition_has_tokens(max, sum), partition_is_nan(max, sum),
                                         has_sink, sink, merged_max);
  return own_weight != 0.0f ? own_weight / sum : 0.0f;
}

/// A CTA's rows (`table`), `finish(row, max, sum)` once per row (stores the
/// partition's statistics, returns the factor on the row's merged output,
/// 0 for an all-zero row) and `store(element, dim, value)` per element.
template <int CtaRows, class Finish, class Store>
struct RowTargets {
  const RowTable<CtaRows>& table;
  const Finish& finish;
  const Store& store;

  /// Element `dim` of a row with no token in the partition.
  __device__ __forceinline__ void write_empty(int row, int dim) const {
    if (table.element[row] < 0) return;
    if (dim == 0) finish(row, -INFINITY, 0.0f);
    store(table.element[row], dim, 0.0f);
  }
};

// Stage 3: merges the CTA's warps' softmax states (each row's maximum,
// sum and warp weights once, by a group of lanes per row whose first lane
// finishes the row's statistics through `targets`; then the weighted
// outputs, one head dim per thread) in shared memory over the dead table
// and rings, and stores each valid row's elements through `targets`.
// `range_begin`: the partition's first position; a row whose causal limit
// is at or before it has no token there (empty values). `dim_rotation`: the
// accumulators hold dims that many below their natural ones, mod D (rotated
// token_slots reads, SlotReadLayout; unused elsewhere).
template <class Shape, class Shared, CacheFormat Format, class Targets>
__device__ __forceinline__ void merge_warps(OnlineSoftmax<Shape>& softmax, std::uint8_t* shared,
                                            const CtaRows<Shape::kRows>& rows, int range_begin, int warp, int lane,
                                            int dim_rotation, const Targets& targets) {
  constexpr int HeadDim = Shape::kHeadDim;
  constexpr int HeadTiles = Shape::kHeadTiles;
  constexpr int kDimTiles = Shape::kDimTiles;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kWarpsPerHead = Shape::kWarpsPerHead;
  constexpr int kRows = Shape::kRows;
  constexpr int kCtaRows = Shape::kCtaRows;
  constexpr int kRowStep = Shape::kRowStep;
  const int head_slot = Shape::head_slot(warp);
  const int head_warp = Shape::head_warp(warp);
  const int c = lane & 3;
  const int g = lane >> 2;
  const int dim = Shape::thread_dim();
  const int first_row = Shape::thread_first_row();
#pragma unroll
  for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int offset = 4; offset < 32; offset <<= 1) {
        softmax.row_sum[nt][e] += __shfl_xor_sync(kFullMask, softmax.row_sum[nt][e], offset);
        softmax.zero_sum[nt][e] += __shfl_xor_sync(kFullMask, softmax.zero_sum[nt][e], offset);
      }
    }
  }
  __syncthreads();  // lookup table and rings are dead; the region becomes the merge buffer
  auto& merge = *reinterpret_cast<typename Shared::Merge*>(shared);
  // Value code `code`'s sum over the tokens, from its accumulator (value_code_position).
  const auto code_sum = [](float accumulated, float ones, float zero, int code) {
    return fmaf(accumulated - ones, static_cast<float>(1 << (10 - value_code_position(Format, code))), zero);
  };
#pragma unroll
  for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = kRows * head_slot + kHeadsPerTile * nt + 2 * c + e;
      float* out = merge.out[head_warp][row];
#pragma unroll
      for (int m = 0; m < kDimTiles; ++m) {
        int dims = HeadDim / 8 * g + 2 * m;
        if constexpr (kReadsRotatedSlots<typename Shared::Layout>) dims = (dims - dim_rotation) & (HeadDim - 1);
        *reinterpret_cast<float2*>(out + merge_dim<HeadDim>(row, dims)) =
            make_float2(code_sum(softmax.acc[nt][m][e], softmax.pv_sum[nt][e], softmax.zero_sum[nt][e], 2 * m),
                        code_sum(softmax.acc[nt][m][2 + e], softmax.pv_sum[nt][e], softmax.zero_sum[nt][e], 2 * m + 1));
      }
      if (g == 0) {
        merge.max[head_warp][row] = softmax.row_max[nt][e];
        merge.sum[head_warp][row] = softmax.row_sum[nt][e];
      }
    }
  }
  __syncthreads();
  // Each row's maximum, weights and sum, once per row: a group of
  // kRowLanes lanes per row, lane m of the group holding warp m's, so a
  // warp takes 32 / kRowLanes rows at once (every thread computing them for
  // its own head dims makes the merge a large part of a small grid's call);
  // the group's first lane finishes the row's statistics (RowTargets).
  // A warp without tiles holds (-inf, 0, 0) and weighs 0; a NaN warp (a
  // non-finite query) makes the partition NaN so the reduction keeps it.
  constexpr int kRowLanes = std::bit_ceil(static_cast<unsigned>(kWarpsPerHead));
  constexpr int kRowsPerPass = 32 / kRowLanes;
  constexpr unsigned kGroupLanes = kRowLanes == 32 ? kFullMask : (1u << kRowLanes) - 1u;
  const int member = lane % kRowLanes;
  for (int first = warp * kRowsPerPass; first < kCtaRows; first += kWarps * kRowsPerPass) {
    const int row = first + lane / kRowLanes;
    const bool active = row < kCtaRows && targets.table.element[row] >= 0;
    const bool present = active && member < kWarpsPerHead;
    const float max = present ? merge.max[member][row] : -INFINITY;
    const float sum = present ? merge.sum[member][row] : 0.0f;
    const unsigned nan_lanes = __ballot_sync(kFullMask, partition_is_nan(max, sum));
    const bool any_nan = ((nan_lanes >> (lane - member)) & kGroupLanes) != 0;
    const float merged_max = warp_max<kRowLanes>(max_for_merge(max));
    const float weight = max == -INFINITY ? 0.0f : fast_exp2(max - merged_max);
    const float merged_sum = warp_sum<kRowLanes>(weight * sum);
    if (present) merge.weight[row][member] = weight;
    if (active && member == 0) {
      // A row with no token in the range (only other rows' warps ran) has the empty values.
      merge.scale[row] = rows.limit(row) <= range_begin
                             ? targets.finish(row, -INFINITY, 0.0f)
                             : targets.finish(row, (any_nan ? quiet_nan() : merged_max) * kLn2,
                                              any_nan ? quiet_nan() : merged_sum);
    }
  }
  __syncthreads();
  // The thread's rows kRowBatch at a time, their products first, then their
  // stores: the stores go through a generic pointer, which shared-memory
  // loads are not moved past, so each row would wait for its loads in turn.
  constexpr int kRowsPerThread = Shape::kRowsPerThread;
  // Four at a time where a thread has many rows (several kv heads per CTA);
  // batching a thread's two rows of one kv head spills in the 128-register shapes.
  constexpr int kRowBatch = kRowsPerThread >= 8 ? 4 : 1;
#pragma unroll 1
  for (int i0 = 0; i0 < kRowsPerThread; i0 += kRowBatch) {
    float value[kRowBatch];
#pragma unroll
    for (int i = 0; i < kRowBatch; ++i) {
      const int row = first_row + kRowStep * (i0 + i);
      value[i] = 0.0f;
      if (row >= kCtaRows) continue;
      // The row's warp weights in 16-byte (8-byte) broadcast loads: a 4-byte
      // load per warp and head dim would be 64 loads per thread).
      float merged_out = 0.0f;
      const auto add_warp = [&](int w, float weight) {
        merged_out = fmaf(weight, merge.out[w][row][merge_dim<HeadDim>(row, dim)], merged_out);
      };
      static_assert(kWarpsPerHead % 2 == 0, "the row's weights in 8- or 16-byte loads");
#pragma unroll
      for (int w = 0; w < kWarpsPerHead; w += kWarpsPerHead % 4 == 0 ? 4 : 2) {
        if constexpr (kWarpsPerHead % 4 == 0) {
          const float4 weights = *reinterpret_cast<const float4*>(&merge.weight[row][w]);
          add_warp(w, weights.x), add_warp(w + 1, weights.y), add_warp(w + 2, weights.z), add_warp(w + 3, weights.w);
        } else {
          const float2 weights = *reinterpret_cast<const float2*>(&merge.weight[row][w]);
          add_warp(w, weights.x), add_warp(w + 1, weights.y);
        }
      }
      const float scale = merge.scale[row];
      value[i] = scale != 0.0f ? merged_out * scale : 0.0f;  // a padding row's is never stored
    }
#pragma unroll
    for (int i = 0; i < kRowBatch; ++i) {
      const int row = first_row + kRowStep * (i0 + i);
      if (row < kCtaRows && targets.table.element[row] >= 0) targets.store(targets.table.element[row], dim, value[i]);
    }
  }
}

// The last CTA of (sequence, kv heads, row tile) to finish reduces the
// sequence's num_partitions partitions of its query rows with the sink and
// writes the output (then resets the arrival counter, so CUDA-graph replays
// need no memset).
// `Shape` is the kernel's (shape.cuh).
template <class Shape>
__device__ __forceinline__ void reduce_partitions_in_cta(const FusedDecodeParams& params,
                                                         const CtaRows<Shape::kRows>& rows,
                                                         const RowTable<Shape::kCtaRows>& table, int partition,
                                                         int num_partitions, int warp, int lane) {
  constexpr int HeadDim = Shape::kHeadDim;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kCtaRows = Shape::kCtaRows;
  const PartitionParams& p = params.partitions;
  const ReduceParams& r = params.reduce;
  const int num_kv_heads = p.layout.num_kv_heads;
  const bool has_sink = r.sinks != nullptr;
  // The barriers around thread 0's acquire-release arrival order this CTA's
  // partition writes before it and the earlier CTAs' writes before the
  // reduction's loads (arrive_acq_rel).
  __shared__ bool is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* arrival =
        params.arrivals + (static_cast<std::int64_t>(rows.batch) * num_kv_heads + rows.first_head) * params.row_tiles +
        rows.row_tile;
    is_last = arrive_acq_rel(arrival) == static_cast<unsigned>(num_partitions - 1);
    if (is_last) *arrival = 0u;  // ready for the next launch (graph replay)
  }
  __syncthreads();
  if (!is_last) return;
  // One warp per output row, or per half row where the CTA has twice as many
  // warps as rows (the 16-warp shape with one kv head: all warps load); lane
  // q holds partition q's max and sum. The partitions' rows are loaded
  // together with their maxima and sums, kRowBatch at a time, so the
  // reduction costs one round trip to L2 for N <= kRowBatch.
  // The merge rule is partition_merge.cuh's, shared with the CUDA and CPU reducers.
  static_assert(kMaxPartitions <= 32, "one lane per partition");
  constexpr int kRowParts = kWarps >= 2 * kCtaRows ? 2 : 1;
  constexpr int kLaneDims = HeadDim / 32 / kRowParts;  // dims first_dim + kLaneDims lane, ...
  constexpr int kRowBatch = std::min(16, 64 / kLaneDims);  // at most 64 registers of partition rows
  constexpr int kVectorDims = std::min(kLaneDims, 4);
  constexpr int kVectors = kLaneDims / kVectorDims;
  using LaneVector = std::conditional_t<kVectorDims == 4, float4, std::conditional_t<kVectorDims == 2, float2, float>>;
  union LaneValues {
    LaneVector vector[kVectors];
    float element[kLaneDims];
  };
  for (int item = warp; item < kCtaRows * kRowParts; item += kWarps) {
    const int row = item / kRowParts;
    const std::int64_t element = table.element[row];
    if (element < 0) continue;
    const int first_dim = (item % kRowParts) * (HeadDim / kRowParts) + kLaneDims * lane;
    const std::int64_t base = element / HeadDim - partition;  // the row's partition 0
    const bool present = lane < num_partitions;
    const float max = present ? __ldcg(p.part_max + base + lane) : -INFINITY;
    const float sum = present ? __ldcg(p.part_sum + base + lane) : 0.0f;
    LaneValues partition_rows[kRowBatch];  // dims first_dim .. + kLaneDims - 1 of partitions q0 + i
    const auto load_rows = [&](int q0) {
#pragma unroll
      for (int i = 0; i < kRowBatch; ++i) {
        const float* partition_row = p.part_out + (base + q0 + i) * HeadDim;
#pragma unroll
        for (int v = 0; v < kVectors; ++v) {
          partition_rows[i].vector[v] = q0 + i < num_partitions
                                  ? __ldcg(reinterpret_cast<const LaneVector*>(partition_row + first_dim + kVectorDims * v))
                                  : LaneVector{};
        }
      }
    };
    load_rows(0);
    const float sink = table.sink[row];
    const bool any_tokens = __any_sync(kFullMask, partition_has_tokens(max, sum));
    const bool any_nan = __any_sync(kFullMask, partition_is_nan(max, sum));
    const float merged_max = merge_max(sink, warp_max(max_for_merge(max)));
    const float weight = present ? partition_weight(max, sum, merged_max) : 0.0f;
    const float own_weight = output_weight(weight, warp_sum(weight), any_tokens, any_nan, has_sink, sink, merged_max);
    float value[kLaneDims] = {};
    for (int q0 = 0; q0 < num_partitions; q0 += kRowBatch) {
      if (q0 > 0) load_rows(q0);
#pragma unroll
      for (int i = 0; i < kRowBatch; ++i) {
        const float w = __shfl_sync(kFullMask, own_weight, (q0 + i) & 31);
        if (q0 + i < num_partitions && w != 0.0f) {
#pragma unroll
          for (int j = 0; j < kLaneDims; ++j) value[j] = fmaf(w, partition_rows[i].element[j], value[j]);
        }
      }
    }
    const std::int64_t output = table.output[row] + first_dim;
#pragma unroll
    for (int j = 0; j < kLaneDims; ++j) store_from_float(r.output, r.output_dtype, output + j, value[j]);
  }
}

}  // namespace tqdecode::cuda::tensor_core
