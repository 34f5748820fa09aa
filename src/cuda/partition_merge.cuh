// How the split-KV partitions of one (sequence, query head) merge into its
// output row (docs/FORMAT.md section 5), for every CUDA reducer: the rule of the
// CPU reducer, reduce_partitions_reference (src/cpu/reference.cpp), step by
// step, so the GPU and the CPU agree on empty and non-finite rows too.
//
// 1. A partition that covered no tokens holds exactly (max -inf, sum 0). A
//    row whose partitions are all empty is all zeros, sink or not.
// 2. A partition whose max or sum is NaN (a non-finite query) makes the
//    whole row NaN; it is not left out as if it were empty.
// 3. Otherwise M = max(sink, m_1, ..., m_N) as std::max folds it (a NaN sink
//    makes M NaN, hence the row NaN); partition p weighs
//    w_p = l_p exp(m_p - M) (0 for an empty partition) and the row is
//    sum_p w_p o_p / (sum_p w_p + exp(sink - M)).
#pragma once

#include <cuda_runtime.h>

#include "device_utils.cuh"

namespace tqdecode::cuda {

/// Rule 1: the partition covered tokens (it is not exactly (-inf, 0)).
__device__ __forceinline__ bool partition_has_tokens(float max, float sum) {
  return !(max == -INFINITY && sum == 0.0f);
}

/// Rule 2: the partition makes its row NaN.
__device__ __forceinline__ bool partition_is_nan(float max, float sum) { return isnan(max) || isnan(sum); }

/// A partition's max as rule 3's fold takes it: a NaN max takes no part
/// (rule 2 makes the row NaN instead).
__device__ __forceinline__ float max_for_merge(float max) { return isnan(max) ? -INFINITY : max; }

/// Rule 3's fold, std::max(merged, value): a NaN `merged` (the sink) stays
/// NaN; a NaN `value` (a partition's max) is not taken, rule 2 covers it.
/// Start from the sink, or -inf without one.
__device__ __forceinline__ float merge_max(float merged, float value) { return merged < value ? value : merged; }

/// Rule 3's weight of a partition against the merged max M.
__device__ __forceinline__ float partition_weight(float max, float sum, float merged_max) {
  return sum * expf(max - merged_max);  // empty: 0 * exp(-inf) = 0
}

/// Rule 3's sink term of the denominator (0 without a sink).
__device__ __forceinline__ float sink_weight(bool has_sink, float sink, float merged_max) {
  return has_sink ? expf(sink - merged_max) : 0.0f;
}

/// Rules 1-3's factor of the row's weighted sum of partition outputs:
/// `weight_total` is the sum of the partitions' weights (unused when the row
/// is empty or NaN).
__device__ __forceinline__ float row_scale(float weight_total, bool any_tokens, bool any_nan, bool has_sink, float sink,
                                           float merged_max) {
  if (!any_tokens) return 0.0f;  // an all-zero row, sink or not
  return any_nan ? quiet_nan() : 1.0f / (weight_total + sink_weight(has_sink, sink, merged_max));
}

/// The factor of a partition's normalized output in its row, rules 1-3:
/// `weight` is the partition's, `weight_total` the sum over the row's partitions.
__device__ __forceinline__ float output_weight(float weight, float weight_total, bool any_tokens, bool any_nan,
                                               bool has_sink, float sink, float merged_max) {
  if (!any_tokens) return 0.0f;  // not weight * 0: with no sink M is -inf, and the weights are NaN
  return weight * row_scale(weight_total, any_tokens, any_nan, has_sink, sink, merged_max);
}

}  // namespace tqdecode::cuda
