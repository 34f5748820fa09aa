// What the benchmark's caches and queries hold, one element at a time, for
// the device fill kernels (bench_instances.cu) and the host self-check
// (bench_self_check.cpp) alike.
//
// - Cache codes: random bytes; fp8 key bytes with bit 6 cleared (|value| < 2,
//   never the NaN pattern). Metadata: key norm ~U(5, 15), value scale
//   ~U(0.05, 0.2), value zero ~U(-1.5, -0.5). Queries: bf16 ~U(-1, 1).
//   With these, the scores s = scale * q_rot . khat of a query head have
//   mean 0 and a standard deviation of 0.3 to 0.8 (flat; tqdecode_bench
//   --self-check prints them): the running maximum rarely moves by the
//   lazy-rescale threshold after the first tile.
// - Peaked scores: in every (sequence, kv head), kPeaksPerSequence planted
//   tokens, one at a seeded position in each of as many equal segments of the
//   sequence. Planted token p (in position order) holds the key that matches
//   the rotated query of the group's first query head: code = the top
//   centroid where that query's rotated coordinate is >= 0, else the bottom
//   one, and the key norm that makes that head's score exactly
//   kPeakStep * (p + 1) (3, 6, ..., 24); each beats the one before by more
//   than the kernel's lazy-rescale threshold (2^4 in base 2, 2.77 in base e),
//   and together they hold all but ~e^-3 of that head's softmax. The group's
//   other heads see the same keys at scores of either sign up to about 6.
//   fp8 keys (no norm) hold +-m, m one of the two e4m3 values around the
//   magnitude that gives the target (plant_peak).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "tqdecode/common.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"

namespace tqbench {

TQ_HOST_DEVICE std::uint64_t mix64(std::uint64_t x) {  // SplitMix64 finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Uniform in [0, 1), a pure function of (seed, index).
TQ_HOST_DEVICE float uniform01(std::uint64_t seed, std::uint64_t index) {
  return static_cast<float>(mix64(seed ^ mix64(index + 0x9e3779b97f4a7c15ULL)) >> 40) * 0x1.0p-24f;
}

/// The 16 bytes at cache byte 16 * word (block_stride is a multiple of 16).
TQ_HOST_DEVICE void cache_code_word(std::int64_t word, const tqdecode::CacheLayout& layout, std::uint64_t seed,
                                    std::uint8_t bytes[16]) {
  const std::uint64_t halves[2] = {mix64(seed + 2 * word), mix64(seed + 2 * word + 1)};
  std::memcpy(bytes, halves, 16);
  if (layout.key_fp8()) {
    const std::int64_t in_block = (word * 16) % layout.block_stride;
    for (int j = 0; j < 16; ++j) {
      const std::int64_t offset = in_block + j;
      // token_slots: the dense order of shape_layout (head_stride = slot bytes).
      const bool key_byte = layout.token_slots()
                                ? offset % layout.head_stride < layout.key_bytes()
                                : offset < layout.metadata_region_offset() && offset % layout.record_bytes() < layout.key_bytes();
      if (key_byte) bytes[j] &= 0xbf;
    }
  }
}

/// fp16 metadata fields per block.
TQ_HOST_DEVICE std::int64_t metadata_fields_per_block(const tqdecode::CacheLayout& layout) {
  return std::int64_t(layout.num_kv_heads) * layout.fields() * layout.block_size;
}

/// Metadata field `i` of the cache (index order follows the metadata region,
/// block by block): its byte offset and its fp16 bits.
struct HalfAt {
  std::int64_t offset;
  std::uint16_t bits;
};

TQ_HOST_DEVICE HalfAt metadata_field(std::int64_t i, const tqdecode::CacheLayout& layout, std::uint64_t seed) {
  const std::int64_t per_block = metadata_fields_per_block(layout);
  const std::int64_t block = i / per_block;
  const int within = static_cast<int>(i % per_block);  // (head * F + field) * block_size + slot
  const int slot = within % layout.block_size;
  const int field = (within / layout.block_size) % layout.fields();
  const int head = within / (layout.block_size * layout.fields());
  const float u = uniform01(seed, static_cast<std::uint64_t>(i));
  float value = -1.5f + u;  // value zero
  if (!layout.key_fp8() && field == layout.key_norm_field()) {
    value = 5.0f + 10.0f * u;
  } else if (field == layout.value_scale_field()) {
    value = 0.05f + 0.15f * u;
  }
  return {layout.block_offset(block) + layout.field_offset(slot, head, field), tqdecode::float_to_half_bits(value)};
}

/// Query element `i`: bf16 ~U(-1, 1).
TQ_HOST_DEVICE std::uint16_t query_element(std::uint64_t seed, std::int64_t i) {
  return tqdecode::float_to_bf16_bits(2.0f * uniform01(seed, static_cast<std::uint64_t>(i)) - 1.0f);
}

inline constexpr int kMaxHeadDim = 256;
static_assert(kMaxHeadDim == tqdecode::kHeadDims.back(), "plant_peak's code array holds the largest head dim");

inline constexpr int kPeaksPerSequence = 8;
inline constexpr float kPeakStep = 3.0f;  // natural-log units; 4.33 in base 2

/// Planted tokens in a sequence of `length` tokens.
TQ_HOST_DEVICE int peak_count(int length) { return length < kPeaksPerSequence ? length : kPeaksPerSequence; }

/// Position of planted token `peak` (< peak_count(length)): a seeded draw
/// from the peak-th of peak_count(length) equal segments, so positions rise
/// with `peak` and never coincide.
TQ_HOST_DEVICE int peak_position(int length, int peak, int sequence, int kv_head, std::uint64_t seed) {
  const int count = peak_count(length);
  const std::int64_t begin = std::int64_t(length) * peak / count;
  const std::int64_t end = std::int64_t(length) * (peak + 1) / count;
  const std::uint64_t draw = mix64(seed ^ mix64((std::uint64_t(sequence) * tqdecode::kMaxKvHeads + kv_head) * kPeaksPerSequence + peak));
  return static_cast<int>(begin + static_cast<std::int64_t>(draw % static_cast<std::uint64_t>(end - begin)));
}

/// The score planted token `peak` gives the group's first query head.
TQ_HOST_DEVICE float peak_score(int peak) { return kPeakStep * static_cast<float>(peak + 1); }

/// One instance's inputs as plant_peak reads and writes them (device
/// pointers in the kernel, host pointers in the self-check).
struct PeakInputs {
  tqdecode::CacheLayout layout;
  std::uint8_t* cache;
  const std::int32_t* block_table;  // [B, table_width]
  int table_width;
  const std::int32_t* seq_lens;  // [B]
  const std::uint16_t* query;    // [B, Hq, D] bf16
  int num_q_heads;
  const float* PiT;        // [D, D]; null for fp8 keys
  const float* centroids;  // sorted; null for fp8 keys
  int num_centroids;
  float scale;
  std::uint64_t seed;
};

/// Writes planted token `peak` of (sequence, kv_head): its key data and, for
/// MSE keys, its key norm (see the header).
TQ_HOST_DEVICE void plant_peak(const PeakInputs& in, int sequence, int kv_head, int peak) {
  const tqdecode::CacheLayout& layout = in.layout;
  const int length = in.seq_lens[sequence];
  if (peak >= peak_count(length)) return;
  const int position = peak_position(length, peak, sequence, kv_head, in.seed);
  const std::int64_t block = in.block_table[std::int64_t(sequence) * in.table_width + position / layout.block_size];
  const int slot = position % layout.block_size;
  std::uint8_t* block_base = in.cache + layout.block_offset(block);
  std::uint8_t* key = block_base + layout.key_offset(slot, kv_head);
  const int dim = layout.head_dim;
  const int group = in.num_q_heads / layout.num_kv_heads;
  const std::uint16_t* q = in.query + (std::int64_t(sequence) * in.num_q_heads + std::int64_t(kv_head) * group) * dim;
  const float target = peak_score(peak);

  if (layout.key_fp8()) {
    // |key| is one of the two e4m3 values around target / (scale * sum |q|):
    // the lower everywhere, then the upper element by element until the
    // score reaches the target (so it lands within one element's step).
    float sum_abs = 0.0f;
    for (int d = 0; d < dim; ++d) sum_abs += fabsf(tqdecode::bf16_bits_to_float(q[d]));
    if (!(sum_abs > 0.0f)) return;
    const float magnitude = target / (in.scale * sum_abs);
    std::uint8_t lower = tqdecode::float_to_fp8_e4m3_bits(magnitude);
    if (tqdecode::fp8_e4m3_bits_to_float(lower) > magnitude && lower > 0) --lower;
    const std::uint8_t upper = lower < 0x7e ? static_cast<std::uint8_t>(lower + 1) : lower;
    const float low = tqdecode::fp8_e4m3_bits_to_float(lower), step = tqdecode::fp8_e4m3_bits_to_float(upper) - low;
    float score = in.scale * sum_abs * low;
    for (int d = 0; d < dim; ++d) {
      const float value = tqdecode::bf16_bits_to_float(q[d]);
      std::uint8_t bits = lower;
      if (score < target) {
        bits = upper;
        score += in.scale * fabsf(value) * step;
      }
      key[d] = static_cast<std::uint8_t>(bits | (value < 0.0f ? 0x80u : 0u));
    }
    return;
  }
  // The rotated query as the decode computes it: bf16(fp32(q) @ PiT).
  std::uint8_t codes[kMaxHeadDim];
  const std::uint8_t top = static_cast<std::uint8_t>(in.num_centroids - 1);
  float dot = 0.0f;
  for (int j = 0; j < dim; ++j) {
    float rotated = 0.0f;
    for (int i = 0; i < dim; ++i) rotated += tqdecode::bf16_bits_to_float(q[i]) * in.PiT[std::int64_t(i) * dim + j];
    rotated = tqdecode::round_to_bf16(rotated);
    codes[j] = rotated >= 0.0f ? top : 0;
    dot += rotated * in.centroids[codes[j]];
  }
  tqdecode::pack_codes(codes, dim, layout.info().key_bits, key);
  const std::uint16_t norm = tqdecode::float_to_half_bits(dot > 0.0f ? target / (in.scale * dot) : 0.0f);
  std::memcpy(block_base + layout.field_offset(slot, kv_head, layout.key_norm_field()), &norm, sizeof norm);
}

}  // namespace tqbench
