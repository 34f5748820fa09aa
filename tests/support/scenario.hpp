// A whole decode problem in host memory: synthetic K/V for a batch of
// sequences, stored with store_cpu into a junk-filled paged cache behind a
// shuffled block table, queries, sinks, and the unquantized K/V for exact
// attention; plus the error metrics the demo and the tests report. The one
// scenario builder of the project: the CLI's demo and the CPU and GPU tests
// use it (test support, not part of the library).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tqdecode/constants.hpp"
#include "tqdecode/decode_args.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode {

struct ScenarioConfig {
  Preset preset = Preset::turboquant_4bit_nc;
  int num_q_heads = 32;
  int num_kv_heads = 8;
  int head_dim = 128;
  int block_size = 16;
  std::vector<int> seq_lens;              ///< one per sequence; B = seq_lens.size()
  int spare_blocks = 3;                   ///< physical blocks no sequence uses (left junk)
  int spare_table_columns = 2;            ///< block-table columns past the longest sequence
  std::int64_t block_stride_padding = 0;  ///< bytes added to the natural block size (or the slots' extent)
  CacheOrder order = CacheOrder::blocks;
  bool renormalize_keys = false;  ///< token_slots: decode-time norm correction (MSE presets)
  bool heads_major = false;       ///< token_slots: the slots of a kv head side by side (else those of a token)
  std::int64_t slot_padding = 0;  ///< token_slots: even bytes between consecutive slots past the slot size
  bool sinks = false;                     ///< one sink per query head, near that head's top scores
  DType query_dtype = DType::bf16;
  DType kv_dtype = DType::bf16;           ///< dtype of the K/V handed to the store
  std::uint64_t seed = 1;
  RotationKind rotation = RotationKind::hadamard;
  bool identity_rotation = false;  ///< Pi = PiT = I (MSE presets): the rotated query is the query itself
  bool keep_unquantized = true;    ///< keep K/V for exact attention (memory heavy for long contexts)
  float value_amplitude = 1.0f;    ///< values are scaled by this (large values stress the fp16 value path)
  /// Queries are scaled by this before rounding to query_dtype: the spread of
  /// the scores. Near 0.05 the softmax is almost flat (every token carries
  /// weight), at 1 a few tokens carry it, at 8 it is sharply peaked.
  float query_amplitude = 1.0f;
  /// Query tokens per sequence (the varlen form, docs/FORMAT.md section 5b),
  /// each at most its seq_len; empty: one per sequence, no query_start_loc.
  std::vector<int> query_lens;
  int max_query_len = 0;  ///< declared with query_lens; 0: their maximum (at least 1)
};

struct Scenario {
  ScenarioConfig config;
  CacheLayout layout;
  ModelConstants constants;
  float scale = 0.0f;  ///< 1 / sqrt(D)

  std::vector<std::int32_t> seq_lens;  ///< [B]
  int max_blocks_per_seq = 0;
  std::int64_t num_blocks = 0;
  /// [B, max_blocks_per_seq]; physical blocks in random order. Entries past a
  /// sequence's last block are -1 or out of range, so a read of one is caught.
  std::vector<std::int32_t> block_table;
  std::vector<std::int64_t> slot_mapping;   ///< [total tokens], sequence-major, as handed to the store
  std::vector<std::int64_t> token_offsets;  ///< [B + 1]: sequence i is rows [offsets[i], offsets[i+1]) of keys/values
  std::vector<float> keys;    ///< [total tokens, Hk, D] as stored (rounded to kv_dtype); empty unless kept
  std::vector<float> values;  ///< same
  std::vector<std::uint8_t> cache;        ///< num_blocks * block_stride bytes; junk where nothing was stored
  std::vector<std::int32_t> query_start_loc;  ///< [B + 1] with config.query_lens, else empty
  int max_query_len = 0;                      ///< with config.query_lens, else 0
  std::vector<float> query;               ///< [query rows, Hq, D] fp32 values, representable in query_dtype
  std::vector<std::uint16_t> query_bits;  ///< the same as raw query_dtype elements
  std::vector<float> sinks;               ///< [Hq] or empty

  int batch() const { return static_cast<int>(seq_lens.size()); }
  bool varlen() const { return !query_start_loc.empty(); }
  /// Rows of query and output: B, or the total query tokens T.
  int query_rows() const { return varlen() ? query_start_loc.back() : batch(); }
  std::int64_t total_tokens() const { return token_offsets.empty() ? 0 : token_offsets.back(); }

  /// Decode arguments over this scenario's host memory writing `output`.
  DecodeArgs host_args(void* output = nullptr) const;

  /// Store arguments that write this scenario's tokens (slot_mapping, its
  /// constants, num_blocks) from `key` / `value` ([total tokens, Hk, D] of
  /// `kv_dtype`) into `cache`: how make_scenario wrote `cache`.
  StoreArgs store_args(std::uint8_t* cache, const void* key, const void* value, DType kv_dtype) const;

  /// decode_reference over the scenario's host arguments: [query rows, Hq, D].
  std::vector<float> reference_output() const;

  /// Exact fp32 attention over the unquantized K/V: [query rows, Hq, D],
  /// each varlen token over the positions up to its own.
  std::vector<float> exact_output() const;
};

/// Builds the scenario and writes its cache with store_cpu. Deterministic in config.seed.
Scenario make_scenario(const ScenarioConfig& config);

/// The cache layout make_scenario uses for `config`: its preset, geometry,
/// order and padding (token_slots: slots `slot_padding` bytes apart past
/// their size, in vLLM's dense order or heads-major, then
/// `block_stride_padding` bytes after a block's slots).
CacheLayout scenario_layout(const ScenarioConfig& config);

/// The K/V a scenario's cache holds, read back through the block table and
/// the layout, in the original (unrotated) space: keys Pi^T khat, values vhat.
/// Same shapes and token order as Scenario::keys / values.
struct DequantizedKv {
  std::vector<float> keys;
  std::vector<float> values;
};
DequantizedKv dequantize(const Scenario& scenario);

/// fp16 metadata `field` of (slot, head), as bits, from the block starting at `block`.
std::uint16_t read_field_bits(const std::uint8_t* block, const CacheLayout& layout, int slot, int head, int field);
/// Writes fp16 `bits` as metadata `field` of (slot, head) in the block starting at `block`.
void write_field_bits(std::uint8_t* block, const CacheLayout& layout, int slot, int head, int field,
                      std::uint16_t bits);

/// `count` random bytes, deterministic in `seed`.
std::vector<std::uint8_t> random_bytes(std::size_t count, std::uint64_t seed);

/// Cosine similarity of two vectors (1 when both are all zero).
double cosine_similarity(const std::vector<float>& a, const std::vector<float>& b);

/// ||actual - expected|| / ||expected|| (0 when both are all zero, infinity
/// when only `expected` is).
double relative_l2(const std::vector<float>& actual, const std::vector<float>& expected);

/// max |actual - expected| / max(max |expected|, floor): an element-wise
/// error relative to the peak, which does not blow up on near-zero elements.
double peak_relative_error(const std::vector<float>& actual, const std::vector<float>& expected, double floor = 1e-6);

/// Rounds every element of `values` through `dtype` in place and returns the
/// raw elements: what a caller holding tensors of that dtype passes, and
/// what an output of that dtype holds.
std::vector<std::uint8_t> round_through_dtype(std::vector<float>& values, DType dtype);

/// Accuracy of `actual` against `expected`.
struct ErrorStats {
  double cosine;         ///< cosine_similarity of the flattened tensors
  double relative_l2;    ///< relative_l2: ||actual - expected|| / ||expected||
  double max_abs;        ///< largest element difference
  double peak_relative;  ///< peak_relative_error: max_abs / max |expected|
};
/// Throws Error when the sizes differ.
ErrorStats compare_outputs(const std::vector<float>& actual, const std::vector<float>& expected);

}  // namespace tqdecode
