// CPU reference of the decode math (docs/FORMAT.md section 5): the oracle every
// GPU result is checked against, and the path used when there is no GPU.
#pragma once

#include <cstdint>

#include "tqdecode/decode_args.hpp"

namespace tqdecode {

/// Step 1: rotated query, [B, Hq, D] ([T, Hq, D] with query_start_loc) fp32
/// holding bf16-rounded values (MSE presets), or the query itself as fp32
/// (fp8 keys).
void rotate_queries_reference(const DecodeArgs& args, float* q_rot);

/// The whole decode, directly: out [B, Hq, D] fp32, contiguous; with
/// query_start_loc [T, Hq, D], each token attending causally (docs/FORMAT.md
/// section 5b).
/// Validates shapes and host contents first. Query and sink values are not
/// validated: a row (sequence, query head) whose query holds a NaN or an
/// infinity, or whose sink is NaN or +inf, is all NaN when its sequence has
/// tokens (all zeros when seq_len is 0); other rows are unaffected, and the
/// cache is read only where seq_lens and the block table say (see
/// docs/RELIABILITY.md). A sink of -inf is no sink.
void decode_reference(const DecodeArgs& args, float* out);

/// Split-KV partial results, [B, Hq, N] for max and sum, [B, Hq, N, D] for out.
struct PartitionBuffers {
  float* max = nullptr;
  float* sum = nullptr;
  float* out = nullptr;
};

/// Partition step (one query token per sequence): partition p of sequence i covers
/// partition_range(seq_lens[i], num_partitions, align, p); empty partitions
/// write max = -inf, sum = 0, out = 0. num_partitions and align: 1 to 65536.
void decode_partitions_reference(const DecodeArgs& args, int num_partitions, int align,
                                 const PartitionBuffers& partitions);

/// Reducer: combines N partitions (and the sink) into out [B, Hq, D] fp32.
/// A row whose partitions are all empty is zeros (sink or not); a row with a
/// NaN partition max or sum is all NaN, as decode_reference gives it.
void reduce_partitions_reference(const DecodeArgs& args, int num_partitions,
                                 const PartitionBuffers& partitions, float* out);

/// The same API as the CUDA launcher, on host memory (both forms): writes
/// args.output in the query dtype.
void decode_cpu(const DecodeArgs& args);

/// Exact fp32 attention over unquantized K/V (double accumulation).
/// query [B, Hq, D]; keys/values [total_tokens, Hk, D] with sequence i at rows
/// [token_offsets[i], token_offsets[i+1]); sinks [Hq] or null; out [B, Hq, D].
void exact_attention(const float* query, const float* keys, const float* values,
                     const std::int64_t* token_offsets, int batch, int num_q_heads,
                     int num_kv_heads, int head_dim, float scale, const float* sinks, float* out);

}  // namespace tqdecode
