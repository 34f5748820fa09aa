// Parameters shared by the decode kernels (internal). Plain structs passed
// by value as __grid_constant__ kernel arguments; every pointer is device
// memory and every shape is fixed at graph capture (docs/LAUNCHER.md).
#pragma once

#include <cuda.h>

#include <algorithm>
#include <cstdint>

#include "tqdecode/common.hpp"
#include "tqdecode/format.hpp"

struct CUstream_st;

namespace tqdecode::cuda {

/// log2(e): the kernels' softmax runs in base 2.
inline constexpr float kLog2e = 1.4426950408889634f;

/// Tokens per tile of the Hopper kernel: its copies' box and its mma's M side.
inline constexpr int kHopperTileTokens = 16;
/// Sequences of one GPU call: every partition kernel's grid has them in z.
inline constexpr int kMaxGridSequences = 65535;

/// token_slots: the bytes of the 16-byte windows covering a slot (which
/// starts up to 14 bytes into its first): the bulk copies' box width
/// (cache_tensor_maps.cpp) and row pitch in a ring stage.
constexpr int token_slots_box_bytes(int slot_bytes) { return (14 + slot_bytes + 15) / 16 * 16; }

/// token_slots: the row pitch of a token's slot in a cp.async ring stage of
/// the tensor-core kernel: its windows and one more where their count is
/// even, so the rows of a tile's 8 tokens g start in 8 distinct bank quads
/// and the lanes' unaligned 4-byte loads conflict at most 4 ways
/// (tensor_core/slot_tile.cuh). (A wider box measured slower for the bulk
/// copies at two head tiles.)
constexpr int token_slots_stage_pitch(int slot_bytes) {
  const int box = token_slots_box_bytes(slot_bytes);
  return box / 16 % 2 ? box : box + 16;
}

/// Query rotation: q_rot[b][hq][:] = bf16(fp32(q[b][hq][:]) @ PiT) for MSE
/// presets, or q as fp32 for fp8 keys. q_rot is contiguous [B, Hq, D] fp32.
struct RotateParams {
  const void* query;
  DType query_dtype;
  std::int64_t query_stride_batch;
  std::int64_t query_stride_head;
  const float* PiT;  ///< null: copy without rotating (fp8 keys)
  float* q_rot;
  int batch;
  int num_q_heads;
  int head_dim;
};

/// Partitioned attention: block (p, h, b) covers partition_range(seq_lens[b],
/// num_partitions, partition_align, p) of sequence b for the query heads of
/// kv head h and writes part_max / part_sum [B, Hq, N] and part_out
/// [B, Hq, N, D] (normalized), empty values for an empty range. The
/// tensor-core kernel instead deals the B x N slots by length
/// (tensor_core/balanced_partitions.cuh): sequence b's rows start at its
/// first slot x max_query_len x Hq, its partitions innermost.
struct PartitionParams {
  const float* q_rot;
  const std::uint8_t* cache;
  CacheLayout layout;
  std::int64_t num_blocks;
  const std::int32_t* block_table;
  std::int64_t block_table_stride;  ///< elements, resolved (DecodeArgs::table_stride(); 0: one row for all)
  int max_blocks_per_seq;
  const std::int32_t* seq_lens;
  const float* centroids;
  float scale;
  int batch;
  int num_q_heads;
  int num_partitions;
  int partition_align;
  float* part_max;
  float* part_sum;
  float* part_out;

  /// A sequence's length as the kernels use it: clamped to [0, the block
  /// table's coverage], so that a length past the table (device checks off)
  /// reads only entries of its own row and a negative one is empty.
  TQ_HOST_DEVICE int covered_length(int seq_len) const {
    const int coverage = max_blocks_per_seq * layout.block_size;
    return static_cast<int>(std::min(static_cast<unsigned>(std::max(seq_len, 0)), static_cast<unsigned>(coverage)));
  }
};

/// The query rows of the scalar kernel and the reducer (docs/FORMAT.md
/// section 5b): sequence b's query tokens are rows query_start_loc[b] ..
/// query_start_loc[b + 1] of the [num_tokens, Hq, D] query and output, at
/// most max_query_len of them; without query_start_loc, row b alone.
/// Partition rows are per query slot (sequence, token): slot b *
/// max_query_len + j, Hq entries each.
struct QueryRows {
  const std::int32_t* query_start_loc;  ///< [B + 1], or null: one token per sequence
  int num_tokens;                       ///< T (B without query_start_loc)
  int max_query_len;                    ///< 1 without query_start_loc
  int tokens_per_cta;                   ///< query tokens one CTA of the scalar kernel serves (1 without)

  struct Span {
    int first;  ///< the sequence's first query row
    int count;  ///< its query tokens
  };
  /// Sequence b's query rows, clamped so that offsets that are decreasing,
  /// negative or past num_tokens, or lengths over max_query_len, read and
  /// write only rows of the call and slots of the sequence.
  TQ_HOST_DEVICE Span span(int b) const {
    if (query_start_loc == nullptr) return {b, 1};
    const int first = std::min(std::max(query_start_loc[b], 0), num_tokens);
    const int end = std::min(std::max(query_start_loc[b + 1], first), num_tokens);
    return {first, std::min(end - first, max_query_len)};
  }
};

/// Reducer: out[b][hq] = combination of the N partitions and the sink.
struct ReduceParams {
  const float* part_max;
  const float* part_sum;
  const float* part_out;
  const float* sinks;  ///< [Hq] or null
  void* output;
  DType output_dtype;
  std::int64_t output_stride_batch;
  std::int64_t output_stride_head;
  int batch;
  int num_q_heads;
  int head_dim;
  int num_partitions;
};

/// The wide shape's tensor maps over the cache, its kernel's second argument
/// (launch_decode_tensor_core encodes them per launch; cache_tensor_maps.cpp).
/// `records`: the data region as [block][slot][kv head][128 bytes], a box of
/// 16 slots of one kv head, 128-byte swizzled; `fields`: the metadata region
/// as [block][kv head x 3 fields][slot] fp16, a box of 16 slots of a kv
/// head's three fields.
struct CacheTensorMaps {
  CUtensorMap records;
  CUtensorMap fields;
};

/// The fused Hopper step: query rotation, partitions and reduction in one
/// launch. The last CTA of each (sequence, kv head) to finish its partition
/// (counted in `arrivals`, which it resets to 0) reduces the N partitions.
struct FusedDecodeParams {
  PartitionParams partitions;  ///< q_rot unused: each CTA rotates its own query heads
  RotateParams rotate;         ///< query, dtype, strides, PiT
  ReduceParams reduce;         ///< sinks and output; partition buffers as in `partitions`
  unsigned* arrivals;          ///< [B * Hk * row_tiles], all zero between launches
  bool wide_table;             ///< 4-bit keys: the 64 KB-table kernel (LaunchPlan::wide_table)
  int kv_heads_per_cta;        ///< 1, or 2, 4 or 8 with wide_table, or without 2 (blocks) or 4, 8 (token rows) (LaunchPlan::kv_heads_per_cta)
  bool programmatic_launch;    ///< launched as a programmatic dependent (DecodeWorkspace::set_programmatic_launch)
  /// partitions.scale x log2(e), the base-2 score scale, which the bulk-copy
  /// shapes read here (computed in the kernel, it is reloaded and multiplied
  /// again per tile at 168 registers; tensor_core/kernel.cuh). Last, so the other
  /// fields' offsets, which the narrow shapes' loops are scheduled around,
  /// stay where they were.
  float scale_log2;
  /// The sequences' query tokens (tokens_per_cta unused): group x q_len
  /// query rows per kv head and sequence, served in row tiles of one, two or four
  /// head tiles (tensor_core/cta_rows.cuh).
  QueryRows rows;
  /// Row tiles per (sequence, kv head): tensor_core_row_tiles; the grid is
  /// (N x row_tiles, Hk / kv_heads_per_cta, B) and `arrivals` has B x Hk x
  /// row_tiles counters.
  int row_tiles;
  /// token_slots: every kv head's whole token rows, one bulk copy per tile
  /// of its contiguous run of rows (LaunchPlan::token_runs).
  bool token_runs;
  /// token_slots, 4-bit keys at eight kv heads per CTA: whole token rows (LaunchPlan::whole_rows).
  bool whole_rows;
  /// Head tiles of a CTA (LaunchPlan::head_tiles): 1, 2 or 4.
  int head_tiles;
};

/// The device-side record behind DeviceCheckReport, one per pool. All zero
/// means "nothing found"; the host reads and re-zeroes it. The `first_*`
/// fields are written only under `lock`.
struct DeviceCheckState {
  unsigned long long checked_calls;
  unsigned long long failed_sequences;
  unsigned long long bad_seq_lens;
  unsigned long long bad_block_entries;
  int has_bad_seq_len;  ///< 0 until a length fails; then the two fields below hold the lowest sequence's
  int bad_seq_len_sequence;
  int bad_seq_len_value;
  int has_bad_block_entry;  ///< 0 until an entry fails; then the three fields below hold the lowest (sequence, column)
  int bad_block_entry_sequence;
  int bad_block_entry_column;
  int bad_block_entry_value;
  unsigned lock;
};

/// Device-side input checks (DecodeWorkspace::set_device_checks): writes
/// checked_seq_lens[b] = seq_lens[b], or 0 when the length is outside
/// [0, max_blocks_per_seq * block_size] or an entry it uses is outside
/// [0, num_blocks), and records the failures in `state`.
struct CheckInputsParams {
  const std::int32_t* seq_lens;
  const std::int32_t* block_table;
  std::int64_t block_table_stride;  ///< elements, resolved (DecodeArgs::table_stride(); 0: one row for all)
  int max_blocks_per_seq;
  int block_size;
  std::int64_t num_blocks;
  int batch;
  std::int32_t* checked_seq_lens;  ///< [batch]
  DeviceCheckState* state;
};

/// The tensor maps of the bulk-copy shapes over `params`' cache (4-bit keys;
/// a token_slots cache: one map of its token rows in `records`, a box of one
/// kv head's slot, or with `row_box_bytes` that many bytes of a row, from a
/// 16-byte boundary, in 8-byte elements: the whole-row reads); throws
/// CudaError if the driver rejects them.
CacheTensorMaps encode_cache_tensor_maps(const PartitionParams& params, int row_box_bytes = 0);

void launch_check_decode_inputs(const CheckInputsParams& params, CUstream_st* stream);
void launch_rotate_queries(const RotateParams& params, CUstream_st* stream);
/// The reducer over the query slots of `rows` (ReduceParams::batch is B).
void launch_reduce_partitions(const ReduceParams& params, const QueryRows& rows, CUstream_st* stream);

/// Generic partition kernel: every preset, head dim, group size, block
/// size, and several query tokens per sequence (`rows`); grid
/// (N * ceil(max_query_len / tokens_per_cta), Hk, B).
void launch_partitions_generic(const PartitionParams& params, const QueryRows& rows, CUstream_st* stream);

/// Warp-specialized partition kernel (sm_90a; tensor_core/warp_specialized.cuh):
/// turboquant_4bit_nc in the blocks order at D = 128, block sizes multiples
/// of 16, up to 64 query rows (group x tokens_per_cta) per CTA, partitions
/// aligned to 64 tokens; the generic kernel's grid and partition format
/// (between launch_rotate_queries and launch_reduce_partitions).
void launch_partitions_warp_specialized(const PartitionParams& params, const QueryRows& rows, CUstream_st* stream);

/// Tensor-core kernel, the whole decode step: turboquant_4bit_nc, _k3v4_nc,
/// _3bit_nc or _k8v4 at D = 64, 128 and 256 (tensor_core_serves). Every
/// configuration runs on sm_90 (the
/// Hopper path); the narrow one (wide_table false: 128-byte table rows, 8
/// warps, or 12 for two head tiles at D = 128) also on sm_80 and newer (the
/// generic path's tensor-core kernel). D = 64 and 256 have the narrow
/// configuration only (groups over 8 at D = 256 in two row tiles).
void launch_decode_tensor_core(const FusedDecodeParams& params, CUstream_st* stream);

/// Whether the tensor-core kernel exists for this head size (every preset has it).
bool tensor_core_serves(int head_dim);

/// What one CTA of the tensor-core kernel's instance for this preset, query
/// rows per kv head (the group x the query tokens of a sequence: head tiles
/// by tensor_core_head_tiles) and head size needs, in the wide-table shape
/// with `kv_heads_per_cta` kv heads (4-bit keys at D = 128, sm_90) or in the
/// narrow configuration (the only one for token_slots caches, whose stages
/// are larger): dynamic shared memory, and the CTAs per SM its launch bounds
/// plan for (shape.cuh's KernelShape and SharedLayout).
struct KernelFootprint {
  int shared_bytes;
  int planned_ctas_per_sm;
};
KernelFootprint tensor_core_footprint(Preset preset, int rows_per_head, int head_dim, bool wide_table,
                                      int kv_heads_per_cta, bool token_slots = false, bool token_runs = false,
                                      bool whole_rows = false);
/// The narrow configuration's footprint (one kv head per CTA).
inline KernelFootprint narrow_footprint(Preset preset, int rows_per_head, int head_dim = 128, bool token_slots = false) {
  return tensor_core_footprint(preset, rows_per_head, head_dim, false, 1, token_slots);
}

}  // namespace tqdecode::cuda
