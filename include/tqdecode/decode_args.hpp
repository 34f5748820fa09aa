// Inputs of one decode step (docs/FORMAT.md section 5, and 5b for several
// query tokens per sequence), shared by the CPU reference, the CUDA launcher
// and the bindings.
//
// One struct serves both entry forms, so there is one launcher and one
// validation path: with `query_start_loc` null a step has one query token per
// sequence (query and output [B, Hq, D], row b for sequence b); with it set,
// the engines' varlen form: query and output [T, Hq, D] with T = num_tokens,
// sequence b's tokens at rows query_start_loc[b] .. query_start_loc[b + 1],
// at most max_query_len of them, and seq_lens counting them (token j of a
// sequence of q_len new tokens sits at position seq_lens[b] - q_len + j and
// attends to positions 0 through its own). The "batch" strides then step
// over tokens.
#pragma once

#include <cstdint>
#include <span>

#include "tqdecode/common.hpp"
#include "tqdecode/format.hpp"

namespace tqdecode {

/// The largest max_query_len a call may declare.
inline constexpr int kMaxQueryLen = 1 << 16;

/// One decode step: one query token per sequence, or several with
/// query_start_loc. Pointers are host memory for the CPU paths and device
/// memory for the CUDA paths. Strides are in elements; 0 means contiguous.
struct DecodeArgs {
  const void* query = nullptr;  ///< [B, Hq, D] (or [T, Hq, D] with query_start_loc) bf16 or fp16
  DType query_dtype = DType::bf16;
  int batch = 0;        ///< B
  int num_q_heads = 0;  ///< Hq = QG * Hk
  std::int64_t query_stride_batch = 0;  ///< between query rows: sequences, or tokens with query_start_loc
  std::int64_t query_stride_head = 0;

  /// Several query tokens per sequence (docs/FORMAT.md section 5b): [B + 1]
  /// int32, non-decreasing from 0 to num_tokens; null: one token per
  /// sequence (then num_tokens and max_query_len must be 0).
  const std::int32_t* query_start_loc = nullptr;
  int num_tokens = 0;     ///< T, rows of query and output (with query_start_loc)
  /// The most query tokens any sequence of the call has (with
  /// query_start_loc; >= 1). A shape the caller declares: grids and buffers
  /// depend on it, never on the values in query_start_loc, so a CUDA graph
  /// captured with it replays for any lengths up to it.
  int max_query_len = 0;

  CacheLayout layout;
  std::int64_t num_blocks = 0;
  const std::uint8_t* cache = nullptr;

  const std::int32_t* block_table = nullptr;  ///< [B, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::int64_t block_table_stride = 0;  ///< between rows in elements; 0: max_blocks_per_seq
  /// Every sequence reads row 0 of block_table: the expanded [B, M] view of
  /// one row (stride 0) that vLLM passes with a continuation chunk's rows,
  /// read as it is rather than copied. block_table_stride must be 0.
  bool block_table_one_row = false;
  /// [B]: context lengths, the new tokens included; 0 gives an all-zero
  /// output row (one token per sequence)
  const std::int32_t* seq_lens = nullptr;

  const float* centroids = nullptr;  ///< [2^key_bits] (MSE presets)
  int num_centroids = 0;
  const float* PiT = nullptr;  ///< [D, D], transpose of the rotation (MSE presets)
  float scale = 1.0f;          ///< softmax scale
  const float* sinks = nullptr;  ///< [Hq] or null
  /// PiT and the centroids were not written by the kernel just before this
  /// decode on its stream. false launches the Hopper kernel without
  /// programmatic dependent launch for this call, so it reads them only after
  /// that kernel has finished (DecodeWorkspace::set_programmatic_launch).
  bool constants_stable = true;

  void* output = nullptr;  ///< [B, Hq, D] (or [T, Hq, D] with query_start_loc), dtype = query dtype
  std::int64_t output_stride_batch = 0;  ///< between output rows, as query_stride_batch
  std::int64_t output_stride_head = 0;   ///< no two rows, heads or dims of the output may share an element

  bool varlen() const { return query_start_loc != nullptr; }
  /// Rows of query and output: B, or T with query_start_loc.
  int query_rows() const { return varlen() ? num_tokens : batch; }
  /// Query tokens a sequence may have: 1, or max_query_len with query_start_loc.
  int query_tokens_bound() const { return varlen() ? max_query_len : 1; }
  int group_size() const { return layout.num_kv_heads ? num_q_heads / layout.num_kv_heads : 0; }
  std::int64_t q_stride_b() const { return query_stride_batch ? query_stride_batch : std::int64_t(num_q_heads) * layout.head_dim; }
  std::int64_t q_stride_h() const { return query_stride_head ? query_stride_head : layout.head_dim; }
  std::int64_t out_stride_b() const { return output_stride_batch ? output_stride_batch : std::int64_t(num_q_heads) * layout.head_dim; }
  std::int64_t out_stride_h() const { return output_stride_head ? output_stride_head : layout.head_dim; }
  /// Elements between the block-table rows of consecutive sequences (0: one row for all).
  std::int64_t table_stride() const {
    return block_table_one_row ? 0 : block_table_stride ? block_table_stride : max_blocks_per_seq;
  }
};

/// Whether a strided view (`sizes` and element `strides`, one per dimension)
/// addresses no element twice: ordered by stride, each dimension of several
/// elements steps past the extent of those inside it. Sufficient, and true of
/// every dense, padded or permuted layout.
bool strided_elements_distinct(std::span<const std::int64_t> sizes, std::span<const std::int64_t> strides);

/// Checks shapes, dtypes, strides, layout, codebook size, null pointers and
/// the varlen shapes (num_tokens <= batch * max_query_len); reads no tensor
/// memory. Throws Error naming the argument. With
/// `output_required` false a null output passes (the CUDA launcher then
/// writes its pooled output).
void validate_decode_shapes(const DecodeArgs& args, bool output_required = true);

/// Also checks tensor contents that live in host memory: every seq_len in
/// [0, max_blocks_per_seq * block_size] and every block-table entry a
/// sequence uses in [0, num_blocks); with query_start_loc, that it starts at
/// 0, never decreases and ends at num_tokens, and that every sequence's
/// query length is at most max_query_len and its seq_len. Throws Error
/// naming the element.
void validate_decode_host_contents(const DecodeArgs& args);

}  // namespace tqdecode
