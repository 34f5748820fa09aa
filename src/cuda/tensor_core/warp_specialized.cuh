// The warp-specialized partition kernel (internal; sm_90a): several query
// tokens per sequence (docs/FORMAT.md section 5b) for turboquant_4bit_nc in
// the blocks order at D = 128, with up to 64 query rows (group x query
// tokens) of one kv head per CTA, or 128 for kv heads of more rows, each
// 64-token tile of the cache read and dequantized once for all of them. It takes the place of the generic
// partition kernel between the query rotation (rotate_queries.cu, q_rot)
// and the reducer (reduce_partitions.cu), with its partition format: grid
// (N x query tiles, Hk, B), each CTA writes the (max, sum, normalized out)
// of its rows for its partition, or the empty values.
//
// The roles are split as FlashAttention-3 splits them:
// - Two producer warpgroups (warps 0-7, setmaxnreg.dec to 96 registers) on
//   alternate tiles, so that each scheduler has two producer warps to hide
//   the lookups' latency: after each of the group's tiles one of its warps,
//   in turn, copies the boxes of the tile kStages ahead (per 16 tokens the
//   128-byte records of the kv head, 128-byte swizzled, and its three fp16
//   fields) into that tile's input stage by bulk tensor copies, their
//   block-table entries copied to shared memory while it dequantizes; warp
//   w of the group dequantizes the tile's tokens 16w ..
//   16w + 15 into a slot of a ring of kSlots:
//     K [token][dim]: fp16 centroid pairs from the wide table (the
//       centroids x 2^table_exponent, prologue.cuh), the B operand of S;
//     V'^T [column][token]: columns 0-127 the codes (64-row CTAs, as
//       fp16 2^e + code; their consumers multiply p by the value scale)
//       or code x scale (128-row CTAs: the code made exact in fp16, then
//       one rounding of the product; a token whose scale would overflow it
//       has its column times 2^-kValueShift, its p times 2^kValueShift),
//       128 the tokens' zeros, 129 ones, 130-135 zeros: the B operand of
//       O, whose columns 128 and 129 sum p x zero and p;
//     factors [token]: norm x scale x log2 e (0 past the range, whose
//       scale and zero are 0 too, so stale stage bytes never reach the
//       products as NaN).
// - Two consumer warpgroups (setmaxnreg.inc to 160) take alternate tiles
//   of a 64-row CTA, or every tile for 64 rows each of a 128-row CTA:
//   S = Q K^T (m64n64k16 x 8, the query rows in registers as A), the
//   scores times their token's factor, masked past the range and each
//   row's causal limit, less the row's reference (base 2; it moves only
//   when a score passes it by kLazyRescaleLog2, so p <= 16); P in fp16 as
//   the A operand of O = P V' (m64n136k16 x 4); the slot is released after
//   that product's wait.
// - After the loop (64 rows) the second consumer hands its (reference, O)
//   to the first through shared memory, which merges them per element; the
//   rows' writer writes each valid row's partition: out = (O[d] + O[128]) /
//   O[129], max = reference x ln 2, sum = O[129].
//
// The token_slots order (docs/FORMAT.md section 4b, vLLM's CUDA cache) where
// its token rows are 16-byte multiples: per 16 tokens one box of the kv
// head's slots (token_slots_box_bytes wide, from the 16-byte boundary at or
// below the slot, the fused kernel's tensor map) instead of the records and
// fields boxes; the producers read the slots where they landed (2-byte
// aligned) and, with norm correction, divide each token's factor by its
// centroid vector's norm (the squares of its table values summed on the
// tensor cores, as the fused kernel does). The consumers are the same.
//
// Query row r of a CTA is head r % group of the kv head at query token
// first_token + r / group (the generic kernel's CtaRows); rows past the
// CTA's count compute on zero queries and are never written. Warp w of a
// consumer holds rows base + 16w .. + 15 (lane (g, c): rows base + 16w + g
// and + 8; base 64 for the second consumer of a 128-row CTA, else 0).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>

#include "../device_utils.cuh"
#include "../kernel_params.hpp"
#include "bulk_copy.cuh"
#include "fragments.cuh"
#include "prologue.cuh"
#include "tqdecode/partition.hpp"
#include "wgmma.cuh"

namespace tqdecode::cuda::tensor_core::specialized {

inline constexpr int kHeadDim = 128;
inline constexpr int kTileTokens = 64;    ///< a ring slot's tokens, the K side of O = P V'
inline constexpr int kConsumerRows = 64;  ///< query rows of a consumer warpgroup: M of both products
inline constexpr int kBoxTokens = 16;     ///< the tensor maps' box (kHopperTileTokens)
inline constexpr int kBoxes = kTileTokens / kBoxTokens;
inline constexpr int kRecordBytes = 128;  ///< 64 key bytes, then 64 value bytes (docs/FORMAT.md section 4)
inline constexpr int kValueOffset = 64;
inline constexpr int kFields = 3;       ///< norm, value scale, value zero
inline constexpr int kValueRows = 136;  ///< V'^T: 128 dims, the zeros, the ones, padding to N = 136
inline constexpr int kZeroRow = 128;
inline constexpr int kOnesRow = 129;
/// Value scales past this would let code x scale overflow fp16: the largest fp16 whose 15-fold is finite.
inline constexpr float kMaxValueScale = 4364.0f;
static_assert(15.0f * kMaxValueScale <= 65504.0f && 15.0f * (kMaxValueScale + 4.0f) > 65504.0f);
/// Per-token fp16 words for the consumers' A operand in a slot's factor area past the factors: the pair of
/// tokens 16 kt + 8 h + 2c, + 1 at word token_pair_word(kt, h, c), so that consumer lane c loads those of
/// its A operand as two 16-byte words. The 64-row CTAs' tiles leave the value scales to the consumers
/// (ScaledProbabilities): V'^T holds each code as fp16 2^e + code and the words are the value scales. The
/// 128-row CTAs' producers store code x scale, a token of scale past kMaxValueScale with its column (codes
/// x scale, zero, one) times 2^-kValueShift, and the words are the p multipliers (1, or 2^kValueShift
/// there), after them a byte per box: whether it has such a token (the consumers multiply only then).
inline constexpr int kTokenWordsOffset = 256;  ///< bytes into a slot's factor area
inline constexpr int kDownScaledOffset = kTokenWordsOffset + 128;
__host__ __device__ constexpr int token_pair_word(int warp, int half, int pair) { return 8 * pair + 2 * warp + half; }
inline constexpr float kValueShift = 8.0f;
/// The exponents' offsets: dims 4l + k hold 2^10 + code (k even) or 2^6 + code (k odd).
inline constexpr float kEvenDimOffset = 1024.0f, kOddDimOffset = 64.0f;
/// token_slots: the slot's bytes (SlotTile: key data, norm, value data, value scale, value zero) and a box row's.
using SlotBlocks = TileLayout<CacheFormat::mse4, kHeadDim>;
using SlotFormat = SlotTile<SlotBlocks, CacheFormat::mse4>;
inline constexpr int kSlotPitch = token_slots_box_bytes(SlotFormat::kSlotBytes);
inline constexpr int kSlotValueOffset = SlotFormat::kKeyBytes + SlotFormat::kNormBytes;
inline constexpr int kSlotNormOffset = SlotFormat::slot_field_offset(SlotBlocks::kNormField);
inline constexpr int kSlotScaleOffset = SlotFormat::slot_field_offset(SlotBlocks::kValueScaleField);
inline constexpr int kSlotZeroOffset = SlotFormat::slot_field_offset(SlotBlocks::kValueZeroField);
static_assert(SlotFormat::kKeyBytes == kValueOffset && kSlotPitch % 16 == 0 && SlotFormat::kFields == kFields);

/// Producer warpgroups (alternate tiles: one warp of each per scheduler hides
/// the other's lookup latency), then two consumer warpgroups.
inline constexpr int kProducerGroups = 2;
inline constexpr int kProducerWarps = 4;  ///< of a producer warpgroup, one box of a tile each
static_assert(kProducerWarps == kBoxes);
inline constexpr int kProducerRegisters = 96;
inline constexpr int kConsumerRegisters = 160;
inline constexpr int kThreads = (kProducerGroups + 2) * 128;
static_assert(128 * (kProducerGroups * kProducerRegisters + 2 * kConsumerRegisters) <= 65536,
              "the register file of one CTA per SM");

/// Shared memory: the wide table at the start of the dynamic shared memory
/// (a lookup's address is then the byte permute's result, no base to add);
/// from the first 1024-byte boundary at or past the dynamic shared memory's
/// start (the 128-byte swizzle's period; offsets below from there), past
/// the table, the ring's slots (each K, V'^T, the factors), the input stages
/// (the boxes' records, then their fields), the barriers.
struct SharedLayout {
  static constexpr int kCodebookSize = 16;
  static constexpr int kLutRowBytes = 256;
  static constexpr int kTableBytes = 256 * kLutRowBytes;
  static constexpr int kKeyBytes = kTileTokens * kHeadDim * 2;
  static constexpr int kValueBytes = kValueRows * kTileTokens * 2;
  static constexpr int kFactorBytes = 1024;
  static constexpr int kSlotBytes = kKeyBytes + kValueBytes + kFactorBytes;
  static constexpr int kSlots = 3;
  static constexpr int kRing = kTableBytes;
  static constexpr int kRecordsBytes = kTileTokens * kRecordBytes;
  static constexpr int kFieldBoxBytes = kBoxTokens * kFields * 2;
  static constexpr int kFieldBoxStride = 128;   // a bulk tensor copy's destination is 128-byte aligned
  // The blocks order's records and fields, or the token_slots boxes (10 KB), padded to the next 1024.
  static constexpr int kStageBytes = 10 * 1024;
  static constexpr int kStages = 5;
  static constexpr int kInput = kRing + kSlots * kSlotBytes;
  /// A full and an empty barrier per slot and tile parity (tile % kRingBarriers): each is then used by one
  /// producer warpgroup and (alternate tiles) one consumer, in tile order, so no waiter is two phases behind.
  static constexpr int kRingBarriers = kSlots * kProducerGroups;
  static constexpr int kBarriers = kInput + kStages * kStageBytes;
  /// Each producer warp's block-table entries of its next refill (one per box).
  static constexpr int kIssueBlocks = kBarriers + (2 * kRingBarriers + 2 * kStages) * 8;
  static constexpr int kBytes = kIssueBlocks + kProducerGroups * kProducerWarps * kBoxes * 4;
  /// Dynamic shared memory to ask for: the layout starts at the first 1024-byte boundary of it.
  static constexpr int kAllocationBytes = kBytes + 1024;
  /// After the loop: the second consumer's state for the first (74 floats a thread), over the ring.
  static constexpr int kMerge = kRing;
  static constexpr int kMergeFloats = 2 + kValueRows / 2 + 4;
  static_assert(kDownScaledOffset + kBoxes <= kFactorBytes, "the factor area's words and flags");
  static_assert(kSlotBytes % 1024 == 0 && kRing % 1024 == 0 && kInput % 1024 == 0 && kStageBytes % 1024 == 0);
  static_assert(kRecordsBytes + kBoxes * kFieldBoxStride <= kStageBytes && kFieldBoxBytes <= kFieldBoxStride);
  static_assert(kBoxes * kBoxTokens * kSlotPitch <= kStageBytes, "a tile's token_slots boxes fit a stage");
  static_assert(kMergeFloats * 128 * 4 <= kSlots * kSlotBytes);
  static_assert(kIssueBlocks % 16 == 0, "a warp's entries are one 16-byte load");
  static_assert(kAllocationBytes <= 227 * 1024, "one CTA per SM");
};

/// The ring's and the input stages' barriers and addresses (shared-memory
/// addresses). full[tile % kRingBarriers]: a producer warpgroup's 128 threads;
/// empty[tile % kRingBarriers]: the consumers that read the tile;
/// input[stage]: the issuing warp's expect_tx; read[stage]: one arrival per
/// producer warp once it has read the stage.
struct Barriers {
  std::uint32_t base;
  __device__ __forceinline__ std::uint32_t full(int index) const { return base + SharedLayout::kBarriers + 8 * index; }
  __device__ __forceinline__ std::uint32_t empty(int index) const {
    return base + SharedLayout::kBarriers + 8 * (SharedLayout::kRingBarriers + index);
  }
  __device__ __forceinline__ std::uint32_t input(int stage) const {
    return base + SharedLayout::kBarriers + 8 * (2 * SharedLayout::kRingBarriers + stage);
  }
  __device__ __forceinline__ std::uint32_t read(int stage) const {
    return base + SharedLayout::kBarriers + 8 * (2 * SharedLayout::kRingBarriers + SharedLayout::kStages + stage);
  }
  __device__ __forceinline__ std::uint32_t slot_address(int slot) const {
    return base + SharedLayout::kRing + slot * SharedLayout::kSlotBytes;
  }
  __device__ __forceinline__ std::uint32_t stage_address(int stage) const {
    return base + SharedLayout::kInput + stage * SharedLayout::kStageBytes;
  }
};

/// What every thread of a CTA knows of its work.
struct CtaWork {
  std::int64_t first_slot;  ///< b x max_query_len + the CTA's first query token (partition slots)
  int first_token_row;      ///< the query row (of T) of the CTA's first token
  int first_head;           ///< kv head x group
  int group;
  int count;         ///< valid rows: tokens x group
  int context_base;  ///< the causal limit of the CTA's first token
  TokenRange range;  ///< the partition's tokens, up to the last row's limit
  int partition;
  int kv_head;
  int batch;

  __device__ __forceinline__ std::int64_t entry(int row, int num_q_heads) const {
    return (first_slot + row / group) * num_q_heads + first_head + row % group;
  }
  __device__ __forceinline__ std::int64_t query_row(int row, int num_q_heads) const {
    return static_cast<std::int64_t>(first_token_row + row / group) * num_q_heads + first_head + row % group;
  }
  /// Positions below this are row `row`'s (causal limit and the partition's end).
  __device__ __forceinline__ int limit(int row) const { return min(context_base + row / group, range.end); }
};

// setmaxnreg: in the kernel's role branches themselves (in a helper
// ptxas ignores it and spills, C7507).
#define TQ_RELEASE_REGISTERS(n) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(n))
#define TQ_CLAIM_REGISTERS(n) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(n))

/// The wide table's fp16 centroid pairs of the four bytes of `word` (dims 2b, 2b + 1 of byte b).
__device__ __forceinline__ void look_up_word(const std::uint8_t* table, std::uint32_t word, std::uint32_t lane_lut,
                                             std::uint32_t (&pairs)[4]) {
#pragma unroll
  for (int b = 0; b < 4; ++b) {
    const std::uint32_t offset = __byte_perm(word, lane_lut, 0x5504u | (b << 4));  // byte x 256 + lane x 4
    pairs[b] = *reinterpret_cast<const std::uint32_t*>(table + offset);
  }
}

/// Producer lane `lane` (0-15)'s token: whether its value column is down-scaled (`own_down_scaled`), and
/// any of the box's (the return value); writes the token's p multiplier and the box's flag (128-row CTAs).
/// `factors`: the slot's factor area.
__device__ __forceinline__ bool mark_down_scaled(std::uint8_t* factors, int warp, int lane, bool own_down_scaled) {
  const bool down_scaled = __any_sync(kFullMask, own_down_scaled);
  const std::uint32_t own = own_down_scaled ? 0x5c00u : 0x3c00u;  // fp16 2^kValueShift or 1
  const std::uint32_t pair = own | __shfl_down_sync(kFullMask, own, 1) << 16;
  if (lane < kBoxTokens && lane % 2 == 0) {
    reinterpret_cast<std::uint32_t*>(factors + kTokenWordsOffset)[token_pair_word(warp, lane / 8, lane % 8 / 2)] = pair;
  }
  if (lane == 0) factors[kDownScaledOffset + warp] = down_scaled;
  return down_scaled;
}

/// The down-scaling multipliers (fp16 1 or 2^-kValueShift) of two tokens of value scales `scale_pair`.
__device__ __forceinline__ std::uint32_t down_scaling_pair(std::uint32_t scale_pair) {
  const __half2 large =
      __hgt2(__habs2(*reinterpret_cast<const __half2*>(&scale_pair)), __float2half2_rn(kMaxValueScale));
  const __half2 m = __hfma2(large, __float2half2_rn(exp2f(-kValueShift) - 1.0f), __float2half2_rn(1.0f));
  return *reinterpret_cast<const std::uint32_t*>(&m);
}

__device__ __forceinline__ std::uint32_t multiply_pairs(std::uint32_t a, std::uint32_t b) {
  const __half2 r = __hmul2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
  return *reinterpret_cast<const std::uint32_t*>(&r);
}

/// Producer lane p < 4's scale pairs for the consumers (ScaledProbabilities):
/// tokens 16 warp + 8 h + 2p, + 1 for halves h = 0, 1 (0 past the range).
__device__ __forceinline__ void store_scale_pairs(std::uint8_t* values, int warp, int lane, std::uint32_t first_half,
                                                  std::uint32_t second_half) {
  static_assert(token_pair_word(0, 1, 0) == token_pair_word(0, 0, 0) + 1, "the halves' words side by side");
  *reinterpret_cast<uint2*>(values + SharedLayout::kValueBytes + kTokenWordsOffset +
                            4 * token_pair_word(warp, 0, lane)) = make_uint2(first_half, second_half);
}

/// Columns 4 lane .. + 3 of V'^T for tokens 16 warp + 8 half .. + 7: `code`
/// holds each token's two value bytes of those dims, `scale_pair` the value
/// scales of tokens (2p, 2p + 1) of the eight (0 past the range). Raw: the
/// codes as fp16 2^e + code (ScaledProbabilities; `scale_pair` unused)
/// instead of the products code x scale.
template <bool Raw>
__device__ __forceinline__ void store_value_codes(std::uint8_t* values, int warp, int half, int lane,
                                                  const std::uint32_t (&code)[8],
                                                  const std::uint32_t (&scale_pair)[4]) {
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    // Dim 4 lane + k: nibble k % 2 of value byte 2 lane + k / 2, as fp16 2^e + code (e 10 or 6).
    const int k = (step + (lane >> 1)) & 3;
    const std::uint32_t selector = k & 2 ? 0x7571u : 0x7470u;
    const std::uint32_t mask = k & 1 ? 0x00f000f0u : 0x000f000fu, exponent = k & 1 ? 0x54005400u : 0x64006400u;
    std::uint32_t row[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const std::uint32_t x = (__byte_perm(code[2 * p], code[2 * p + 1], selector) & mask) | exponent;
      if constexpr (Raw) {
        row[p] = x;
      } else {
        const __half2 offset = __float2half2_rn(k & 1 ? -kOddDimOffset : -kEvenDimOffset);
        const __half2 exact_code = __hadd2(*reinterpret_cast<const __half2*>(&x), offset);
        const __half2 v = __hmul2(exact_code, *reinterpret_cast<const __half2*>(&scale_pair[p]));
        row[p] = *reinterpret_cast<const std::uint32_t*>(&v);
      }
    }
    *reinterpret_cast<uint4*>(values + swizzled_offset(kValueRows, 4 * lane + k, kBoxTokens * warp + 8 * half)) =
        make_uint4(row[0], row[1], row[2], row[3]);
  }
}

/// Producer warp `warp`'s share of a tile: tokens 16 warp .. + 15 of the
/// stage at `stage` (records, then fields) into the slot at `slot`;
/// `valid` of them (0 .. 16) lie in the range (Partial: fewer than 16,
/// the last tile's; the others skip the masks). A lane takes one 16-byte
/// key chunk (dims 32c ..) of two tokens and value dims 4l .. 4l + 3 of
/// lane l (write order rotated by the lane pair), so that no shared-memory
/// access conflicts. `wait_for_slot` waits for the slot's release.
/// LookupsFirst (a 64-row CTA, whose producers set the pace): the first
/// token's lookups are issued before that wait, and each token's 16 before
/// its stores; the compiler cannot tell the slot's addresses from the
/// table's, so a store holds back every lookup after it, and storing per 4
/// lookups would pay their latency 8 times a tile. Otherwise (a 128-row
/// CTA, whose consumers set the pace) the wait comes first and each 4
/// lookups are stored at once: the lookups first measured slower there
/// (they are issued while the consumers' products read the shared memory).
template <bool Partial, bool LookupsFirst, bool ScaledProbabilities, class WaitForSlot>
__device__ __forceinline__ void dequantize_tile(const std::uint8_t* table, const std::uint8_t* stage,
                                                std::uint8_t* slot, int warp, int lane, int valid, float score_scale,
                                                const WaitForSlot& wait_for_slot) {
  using L = SharedLayout;
  const std::uint8_t* records = stage + warp * kBoxTokens * kRecordBytes;
  const std::uint8_t* fields = stage + L::kRecordsBytes + warp * L::kFieldBoxStride;
  std::uint8_t* const keys = slot;
  std::uint8_t* const values = slot + L::kKeyBytes;
  float* const factors = reinterpret_cast<float*>(slot + L::kKeyBytes + L::kValueBytes);
  const std::uint32_t lane_lut = static_cast<std::uint32_t>(lane) << 2;
  // Lane pair p of quarter warp q takes tokens token8 (and + 8), chunks c and c + 1 of which between
  // them: the quarter warp's eight 16-byte loads and each round of its stores land in eight distinct
  // chunk positions of the 128-byte swizzle (no bank conflict).
  const int quarter = lane >> 3, pair = (lane >> 1) & 3, upper = quarter >> 1;
  const int token8 = pair < 2 ? pair + 2 * upper : pair + 4 - 2 * upper;
  const int c = 2 * ((pair & 1) ^ (quarter & 1)) + (lane & 1);
  // Field 0 of token `lane`.
  const float norm = lane < kBoxTokens ? __half2float(reinterpret_cast<const __half*>(fields)[lane]) : 0.0f;
  if constexpr (!LookupsFirst) wait_for_slot();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int token = 8 * j + token8;  // of the box; its row's swizzle is token8 (boxes start on 8-token rows)
    const uint4 chunk = *reinterpret_cast<const uint4*>(records + token * kRecordBytes + ((c ^ token8) << 4));
    const std::uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    std::uint32_t pairs[4][4];  // [dims 32c + 8s ..][byte b]
    const auto store = [&](int s) {
      *reinterpret_cast<uint4*>(keys + swizzled_offset(kTileTokens, kBoxTokens * warp + token, 32 * c + 8 * s)) =
          make_uint4(pairs[s][0], pairs[s][1], pairs[s][2], pairs[s][3]);
    };
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      look_up_word(table, words[s], lane_lut, pairs[s]);
      if constexpr (!LookupsFirst) store(s);
    }
    if constexpr (LookupsFirst) {
      if (j == 0) wait_for_slot();
#pragma unroll
      for (int s = 0; s < 4; ++s) store(s);
    }
  }
  if (lane < kBoxTokens) factors[kBoxTokens * warp + lane] = !Partial || lane < valid ? norm * score_scale : 0.0f;
  // The mask of the value fields of tokens (first, first + 1): 0 past the range.
  const auto keep_pair = [&](int first) {
    return !Partial || first + 1 < valid ? 0xffffffffu : first < valid ? 0x0000ffffu : 0u;
  };
  bool down_scaled = false;
  if constexpr (ScaledProbabilities) {
    if (lane < 4) {
      const auto pair = [&](int half) {
        return *reinterpret_cast<const std::uint32_t*>(fields + 32 + 16 * half + 4 * lane) &
               keep_pair(8 * half + 2 * lane);
      };
      store_scale_pairs(values, warp, lane, pair(0), pair(1));
    }
  } else {
    const bool own_valid = lane < kBoxTokens && (!Partial || lane < valid);
    down_scaled = mark_down_scaled(
        reinterpret_cast<std::uint8_t*>(factors), warp, lane,
        own_valid && fabsf(__half2float(reinterpret_cast<const __half*>(fields + 32)[lane])) > kMaxValueScale);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // Value codes: dims 4 lane .. + 3 of the half's eight tokens.
    std::uint32_t code[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      code[t] = *reinterpret_cast<const std::uint16_t*>(
          records + (8 * half + t) * kRecordBytes + (((kValueOffset / 16 + (lane >> 3)) ^ t) << 4) + ((2 * lane) & 15));
    }
    // Scale and zero pairs of tokens (2p, 2p + 1) of the eight (one 16-byte load each); 0 past the range.
    const uint4 zeros = *reinterpret_cast<const uint4*>(fields + 64 + 16 * half);
    const std::uint32_t zero_words[4] = {zeros.x, zeros.y, zeros.z, zeros.w};
    std::uint32_t scale_pair[4] = {}, zero_pair[4], one_pair[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) zero_pair[p] = zero_words[p] & keep_pair(8 * half + 2 * p), one_pair[p] = kHalfOnes;
    if constexpr (!ScaledProbabilities) {
      const uint4 scales = *reinterpret_cast<const uint4*>(fields + 32 + 16 * half);
      const std::uint32_t scale_words[4] = {scales.x, scales.y, scales.z, scales.w};
#pragma unroll
      for (int p = 0; p < 4; ++p) scale_pair[p] = scale_words[p] & keep_pair(8 * half + 2 * p);
      if (down_scaled) {  // warp-uniform, rare
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          one_pair[p] = down_scaling_pair(scale_pair[p]);
          scale_pair[p] = multiply_pairs(scale_pair[p], one_pair[p]);
          zero_pair[p] = multiply_pairs(zero_pair[p], one_pair[p]);
        }
      }
    }
    store_value_codes<ScaledProbabilities>(values, warp, half, lane, code, scale_pair);
    if (lane == 0) {
      *reinterpret_cast<uint4*>(values + swizzled_offset(kValueRows, kZeroRow, kBoxTokens * warp + 8 * half)) =
          make_uint4(zero_pair[0], zero_pair[1], zero_pair[2], zero_pair[3]);
      if constexpr (!ScaledProbabilities) {
        *reinterpret_cast<uint4*>(values + swizzled_offset(kValueRows, kOnesRow, kBoxTokens * warp + 8 * half)) =
            make_uint4(one_pair[0], one_pair[1], one_pair[2], one_pair[3]);
      }
    }
  }
}

/// dequantize_tile for the token_slots order: box `warp` of the stage holds
/// its 16 tokens' rows, kSlotPitch bytes apart, the kv head's slot `lead`
/// bytes into each (2-byte aligned). Lane (g, c) takes key bytes 16c .. + 15
/// of tokens g and g + 8 (three 8-byte loads and funnel shifts each) and
/// stores their chunks rotated by two where c >= 2, so that a quarter warp's
/// stores land in eight distinct chunk positions of the swizzle; the values
/// as dequantize_tile's, the scales loaded per token. Renormalize (norm
/// correction): each token's factor over its centroid vector's norm, its
/// squared table values summed in fp16 pairs over the lane's chunks, then
/// over the quad's lanes by mma against ones in fp32 (rows g and g + 8).
template <bool Partial, bool LookupsFirst, bool Renormalize, bool ScaledProbabilities, class WaitForSlot>
__device__ __forceinline__ void dequantize_slots_tile(const std::uint8_t* table, const std::uint8_t* stage,
                                                      std::uint8_t* slot, int warp, int lane, int valid, int lead,
                                                      float score_scale, float renormalized_scale,
                                                      const WaitForSlot& wait_for_slot) {
  using L = SharedLayout;
  const std::uint8_t* const box = stage + warp * kBoxTokens * kSlotPitch;  // token t's row at t kSlotPitch
  std::uint8_t* const keys = slot;
  std::uint8_t* const values = slot + L::kKeyBytes;
  float* const factors = reinterpret_cast<float*>(slot + L::kKeyBytes + L::kValueBytes);
  const std::uint32_t lane_lut = static_cast<std::uint32_t>(lane) << 2;
  const int g = lane >> 2, c = lane & 3;
  const int rotation = 2 * (c >> 1);
  // Token `lane`'s norm and value zero (lanes 0-15; 0 past the range, and the zeros' pairs on even lanes).
  const std::uint8_t* const own = box + (lane & 15) * kSlotPitch + lead;
  const bool own_valid = lane < kBoxTokens && (!Partial || lane < valid);
  const float norm = own_valid ? __half2float(load_shared<__half>(own + kSlotNormOffset)) : 0.0f;
  const std::uint32_t zero = own_valid ? load_shared<std::uint16_t>(own + kSlotZeroOffset) : 0u;
  const auto square_sum = [](std::uint32_t sum, std::uint32_t x) {  // sum + x * x, fp16 pairs
    const __half2 h = *reinterpret_cast<const __half2*>(&x);
    const __half2 r = __hfma2(h, h, *reinterpret_cast<const __half2*>(&sum));
    return *reinterpret_cast<const std::uint32_t*>(&r);
  };
  std::uint32_t squares[2][4] = {};  // [token g, g + 8][byte b]: the lane's squared table values, summed
  if constexpr (!LookupsFirst) wait_for_slot();
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int token = 8 * j + g;
    const int at = lead + 16 * c;
    const uint4 chunk = load_shared_unaligned_16(box + token * kSlotPitch + (at & ~7), at & 7);
    // Word s then holds dims 32c + 8 ((s + rotation) & 3) ..
    const std::uint32_t words[4] = {rotation ? chunk.z : chunk.x, rotation ? chunk.w : chunk.y,
                                    rotation ? chunk.x : chunk.z, rotation ? chunk.y : chunk.w};
    std::uint32_t pairs[4][4];  // [word s][byte b]
    const auto store = [&](int s) {
      *reinterpret_cast<uint4*>(
          keys + swizzled_offset(kTileTokens, kBoxTokens * warp + token, 32 * c + 8 * ((s + rotation) & 3))) =
          make_uint4(pairs[s][0], pairs[s][1], pairs[s][2], pairs[s][3]);
    };
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      look_up_word(table, words[s], lane_lut, pairs[s]);
      if constexpr (!LookupsFirst) store(s);
    }
    if constexpr (Renormalize) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
#pragma unroll
        for (int b = 0; b < 4; ++b)
          squares[j][b] = s == 0 ? square_f16x2(pairs[0][b]) : square_sum(squares[j][b], pairs[s][b]);
      }
    }
    if constexpr (LookupsFirst) {
      if (j == 0) wait_for_slot();
#pragma unroll
      for (int s = 0; s < 4; ++s) store(s);
    }
  }
  if constexpr (Renormalize) {
    // Row g of the sums: token g (lanes of quad g), row g + 8: token g + 8.
    float square[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    const std::uint32_t first[4] = {squares[0][0], squares[1][0], squares[0][1], squares[1][1]};
    const std::uint32_t second[4] = {squares[0][2], squares[1][2], squares[0][3], squares[1][3]};
    mma_f16(square, first, kHalfOnes, kHalfOnes);
    mma_f16(square, second, kHalfOnes, kHalfOnes);
    const float low = __shfl_sync(kFullMask, square[0], 4 * (lane & 7));
    const float high = __shfl_sync(kFullMask, square[2], 4 * (lane & 7));
    const float sum = lane < 8 ? low : high;  // token `lane`'s (lanes 0-15)
    if (lane < kBoxTokens) {
      factors[kBoxTokens * warp + lane] = sum > 0.0f ? norm * renormalized_scale * fast_rsqrt(sum) : 0.0f;
    }
  } else if (lane < kBoxTokens) {
    factors[kBoxTokens * warp + lane] = norm * score_scale;
  }
  // The value scales of tokens (first, first + 1); 0 past the range.
  const auto slot_scale_pair = [&](int first) {
    const std::uint8_t* scales = box + first * kSlotPitch + lead + kSlotScaleOffset;
    const std::uint32_t low = !Partial || first < valid ? load_shared<std::uint16_t>(scales) : 0u;
    const std::uint32_t high = !Partial || first + 1 < valid ? load_shared<std::uint16_t>(scales + kSlotPitch) : 0u;
    return low | high << 16;
  };
  // 128-row CTAs: token `lane`'s column down-scaled where its scale is past kMaxValueScale (after the slot's wait:
  // the marks are in the slot).
  bool own_down_scaled = false, down_scaled = false;
  if constexpr (ScaledProbabilities) {
    if (lane < 4) store_scale_pairs(values, warp, lane, slot_scale_pair(2 * lane), slot_scale_pair(8 + 2 * lane));
  } else {
    own_down_scaled = own_valid && fabsf(__half2float(load_shared<__half>(own + kSlotScaleOffset))) > kMaxValueScale;
    down_scaled = mark_down_scaled(reinterpret_cast<std::uint8_t*>(factors), warp, lane, own_down_scaled);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    std::uint32_t code[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      code[t] = load_shared<std::uint16_t>(box + (8 * half + t) * kSlotPitch + lead + kSlotValueOffset + 2 * lane);
    }
    std::uint32_t scale_pair[4] = {};
    if constexpr (!ScaledProbabilities) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        scale_pair[p] = slot_scale_pair(8 * half + 2 * p);
        if (down_scaled) scale_pair[p] = multiply_pairs(scale_pair[p], down_scaling_pair(scale_pair[p]));  // rare
      }
    }
    store_value_codes<ScaledProbabilities>(values, warp, half, lane, code, scale_pair);
  }
  // Token `lane`'s zero and one, down-scaled where its column is.
  const std::uint32_t own_one = own_down_scaled ? 0x1c00u : 0x3c00u;  // fp16 2^-kValueShift or 1
  const std::uint32_t own_zero =
      down_scaled
          ? __half_as_ushort(__hmul(__ushort_as_half(static_cast<unsigned short>(zero)), __ushort_as_half(own_one)))
          : zero;
  const std::uint32_t zero_pair = own_zero | __shfl_down_sync(kFullMask, own_zero, 1) << 16;
  const std::uint32_t one_pair = own_one | __shfl_down_sync(kFullMask, own_one, 1) << 16;
  if (lane < kBoxTokens && lane % 2 == 0) {
    *reinterpret_cast<std::uint32_t*>(values + swizzled_offset(kValueRows, kZeroRow, kBoxTokens * warp + lane)) =
        zero_pair;
    if constexpr (!ScaledProbabilities) {
      *reinterpret_cast<std::uint32_t*>(values + swizzled_offset(kValueRows, kOnesRow, kBoxTokens * warp + lane)) =
          one_pair;
    }
  }
}

/// The empty partition's values for the CTA's rows (max -inf, sum 0, out 0).
__device__ __forceinline__ void write_empty_partition(const PartitionParams& p, const CtaWork& work) {
  constexpr int kQuads = kHeadDim / 4;
  const int num_partitions = p.num_partitions;
  for (int i = threadIdx.x; i < work.count * kQuads; i += kThreads) {
    const std::int64_t index = work.entry(i / kQuads, p.num_q_heads) * num_partitions + work.partition;
    reinterpret_cast<float4*>(p.part_out + index * kHeadDim)[i % kQuads] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  for (int r = threadIdx.x; r < work.count; r += kThreads) {
    const std::int64_t index = work.entry(r, p.num_q_heads) * num_partitions + work.partition;
    p.part_max[index] = -INFINITY;
    p.part_sum[index] = 0.0f;
  }
}

/// The CTA's rows, partition and range (the generic kernel's rules), or
/// count 0 for a query tile past its sequence's tokens (nothing to write).
__device__ __forceinline__ CtaWork cta_work(const PartitionParams& p, const QueryRows& query_rows) {
  CtaWork work{};
  work.partition = blockIdx.x % p.num_partitions;
  const int query_tile = blockIdx.x / p.num_partitions;
  work.kv_head = blockIdx.y;
  work.batch = blockIdx.z;
  work.group = p.num_q_heads / p.layout.num_kv_heads;
  const QueryRows::Span span = query_rows.span(work.batch);
  const int first_token = query_tile * query_rows.tokens_per_cta;
  const int tokens = min(query_rows.tokens_per_cta, span.count - first_token);
  if (tokens <= 0) return work;
  work.first_slot = static_cast<std::int64_t>(work.batch) * query_rows.max_query_len + first_token;
  work.first_token_row = span.first + first_token;
  work.first_head = work.kv_head * work.group;
  work.count = tokens * work.group;
  const int seq_len = p.covered_length(p.seq_lens[work.batch]);
  work.context_base = seq_len - span.count + first_token + 1;
  const TokenRange partition_tokens = partition_range(seq_len, p.num_partitions, p.partition_align, work.partition);
  work.range = {partition_tokens.begin, min(partition_tokens.end, work.context_base + tokens - 1)};
  return work;
}

/// Producer warpgroup `group`'s loop over tiles group, group + kProducerGroups,
/// ...: group 0's warp 0 issues the copies of the first kStages tiles; then,
/// for each tile t of the group, warp issuing_warp(t) issues tile t + kStages
/// into t's stage once the group's warps have read it. The issuing warp
/// rotates so that the refills (the wait for the group's reads, the copies'
/// issue) are spread over the group's warps: the group's tile is complete
/// only when its last warp is, and a fixed issuer would be that warp on every
/// tile. SharedTiles: a 128-row CTA (dequantize_tile's LookupsFirst for the
/// others). Slots: the token_slots order, one box of the kv head's slots per
/// 16 tokens; `renormalized_scale` the factor's scale over the centroid
/// norms (norm correction).
template <bool SharedTiles, bool Slots>
__device__ __forceinline__ void produce(const PartitionParams& p, const CacheTensorMaps& maps, std::uint8_t* shared,
                                        const std::uint8_t* table, const Barriers& barriers, const CtaWork& work,
                                        int group, int warp, int lane, float score_scale, float renormalized_scale) {
  using L = SharedLayout;
  // token_slots: the box's first byte in a token's row (a bulk tensor copy starts on a 16-byte boundary) and
  // the slot's lead past it.
  const int head_byte = work.kv_head * static_cast<int>(p.layout.head_stride);
  const int box_column = head_byte & ~15, lead = head_byte & 15;
  const bool renormalize = Slots && p.layout.renormalize_keys;
  constexpr bool kScaledProbabilities = !SharedTiles;  // consume's ScaledProbabilities
  constexpr int kBoxBytes = Slots ? kBoxTokens * kSlotPitch : kBoxTokens * kRecordBytes + L::kFieldBoxBytes;
  const int tiles = (work.range.end - work.range.begin + kTileTokens - 1) / kTileTokens;
  // Block sizes are powers of two (kBlockSizes): shifts, not divisions, on the issue path.
  const int block_shift = __ffs(p.layout.block_size) - 1;
  const int slot_mask = p.layout.block_size - 1;
  const std::int32_t* table_row = p.block_table + static_cast<std::int64_t>(work.batch) * p.block_table_stride;
  // The first token of box q of `tile`; only entries of this sequence's block-table row below its range's end
  // are ever read.
  const auto box_token = [&](int tile, int q) { return work.range.begin + tile * kTileTokens + kBoxTokens * q; };
  const auto issuing_warp = [](int tile) { return tile / kProducerGroups % kProducerWarps; };
  // The stage's boxes of `tile` in `blocks`' blocks; warp converged.
  const auto issue = [&](int tile, int stage, const int(&blocks)[kBoxes]) {
    const int first = box_token(tile, 0);
    const int boxes = min(kBoxes, (work.range.end - first + kBoxTokens - 1) / kBoxTokens);
    if (elect_one_lane()) {
      const std::uint32_t barrier = barriers.input(stage), destination = barriers.stage_address(stage);
      mbarrier_arrive_expect_tx(barrier, boxes * kBoxBytes);
      for (int q = 0; q < boxes; ++q) {
        const int slot = (first + kBoxTokens * q) & slot_mask;
        if constexpr (Slots) {
          bulk_tensor_load(destination + q * kBoxBytes, &maps.records, box_column, slot, blocks[q], barrier);
        } else {
          bulk_tensor_load(destination + q * kBoxTokens * kRecordBytes, &maps.records, 0, work.kv_head, slot, blocks[q],
                           barrier);
          bulk_tensor_load(destination + L::kRecordsBytes + q * L::kFieldBoxStride, &maps.fields, slot,
                           kFields * work.kv_head, blocks[q], barrier);
        }
      }
    }
    __syncwarp();
  };
  if (warp == 0 && group == 0) {
    // Lane kBoxes s + q: box q of tile s.
    const int token = box_token(lane / kBoxes, lane % kBoxes);
    const int block =
        lane < kBoxes * L::kStages && token < work.range.end ? __ldg(table_row + (token >> block_shift)) : 0;
    for (int tile = 0; tile < L::kStages && tile < tiles; ++tile) {
      int blocks[kBoxes];
#pragma unroll
      for (int q = 0; q < kBoxes; ++q) blocks[q] = __shfl_sync(kFullMask, block, kBoxes * tile + q);
      issue(tile, tile, blocks);
    }
  }
  // The issuing warp's block-table entries of its next refill, copied asynchronously while it dequantizes (no
  // register waits for them across the dequantization).
  int* const issue_blocks = reinterpret_cast<int*>(shared + L::kIssueBlocks) + (kProducerWarps * group + warp) * kBoxes;
  // The input barriers are per stage, not per (stage, tile parity): a group waiting on tile t's stage cannot see
  // the phase of tile t - 2 kStages because it first waited for tile t - kSlots's release, a tile of the other
  // group (kSlots odd) that group took after its tile t - kStages (kStages > kSlots), so that one had landed.
  static_assert(kProducerGroups == 1 || (L::kSlots % 2 == 1 && L::kStages > L::kSlots));
  for (int tile = group; tile < tiles; tile += kProducerGroups) {
    const int first = work.range.begin + tile * kTileTokens + kBoxTokens * warp;
    // The tile's stage and slot, the stage's phase parity; the slot is free once its previous tile is released.
    const int stage = tile % L::kStages, slot = tile % L::kSlots;
    const unsigned stage_parity = (tile / L::kStages) & 1u;
    const bool refills = warp == issuing_warp(tile) && tile + L::kStages < tiles;  // warp-uniform
    if (refills && lane < kBoxes) {
      const int token = box_token(tile + L::kStages, lane);
      if (token < work.range.end) copy_to_shared<4>(issue_blocks + lane, table_row + (token >> block_shift));
      cp_async_commit();
    }
    mbarrier_wait_parity(barriers.input(stage), stage_parity);
    const auto wait_for_slot = [&] {
      if (tile >= L::kSlots) {
        const int previous = tile - L::kSlots;
        mbarrier_wait_parity(barriers.empty(previous % L::kRingBarriers), (previous / L::kRingBarriers) & 1u);
      }
    };
    const std::uint8_t* input = shared + L::kInput + stage * L::kStageBytes;
    std::uint8_t* ring_slot = shared + L::kRing + slot * L::kSlotBytes;
    const int valid = work.range.end - first;
    const auto dequantize = [&]<bool Partial>(int tokens) {
      if constexpr (Slots) {
        // Norm correction as a template argument: each form of the tile is one straight-line block, so the
        // squares' products and shuffles overlap the value codes' work.
        if (renormalize) {
          dequantize_slots_tile<Partial, !SharedTiles, true, kScaledProbabilities>(
              table, input, ring_slot, warp, lane, tokens, lead, score_scale, renormalized_scale, wait_for_slot);
        } else {
          dequantize_slots_tile<Partial, !SharedTiles, false, kScaledProbabilities>(
              table, input, ring_slot, warp, lane, tokens, lead, score_scale, renormalized_scale, wait_for_slot);
        }
      } else {
        dequantize_tile<Partial, !SharedTiles, kScaledProbabilities>(table, input, ring_slot, warp, lane, tokens,
                                                                     score_scale, wait_for_slot);
      }
    };
    if (valid >= kBoxTokens) {  // warp-uniform
      dequantize.template operator()<false>(kBoxTokens);
    } else {
      dequantize.template operator()<true>(max(0, valid));
    }
    fence_proxy_async_shared();  // the generic-proxy stores before the products' reads
    mbarrier_arrive(barriers.full(tile % L::kRingBarriers));
    // The stage's refill waits only for the warps' reads of it, not for the warps themselves.
    __syncwarp();
    if (lane == 0) mbarrier_arrive(barriers.read(stage));
    if (refills) {
      mbarrier_wait_parity(barriers.read(stage), stage_parity);
      cp_async_wait<0>();
      __syncwarp();  // every lane's entry visible to the elected one
      const int4 entries = *reinterpret_cast<const int4*>(issue_blocks);
      const int blocks[kBoxes] = {entries.x, entries.y, entries.z, entries.w};
      issue(tile + L::kStages, stage, blocks);
    }
  }
}

/// A consumer warpgroup's loop over tiles consumer, consumer + 2, ... (64
/// rows a CTA), or over every tile for its own 64 rows from `row_base` (128
/// rows a CTA: SharedTiles); its (reference, O) per thread on return.
/// `query`: the A operand of S for rows row_base + 16 w + g (+ 8), k-step ks
/// dims 16 ks + 2c (+ 1, + 8, + 9).
/// ScaledProbabilities (the 64-row CTAs, whose producers set the pace: the
/// value scales move from their dequantization to here): O = P' V' with
/// P' = p x the token's value scale (fp16) and V' the codes as 2^e + code,
/// so O[d] = sum p' code + 2^e O[129] (the ones row); `sums` = P (V'^T rows
/// 128..135), columns 0 and 1: sum p x zero and sum p. A tile with a scale
/// too large for p' to stay finite in fp16 moves every reference to its row's
/// maximum (p <= 1), as the fused kernel does.
template <bool SharedTiles>
__device__ __forceinline__ void consume(std::uint8_t* shared, const Barriers& barriers, const CtaWork& work,
                                        const std::uint32_t (&query)[8][4], int consumer, int row_base, int wg_warp,
                                        int lane, float (&reference)[2], float (&acc)[kValueRows / 2],
                                        float (&sums)[4]) {
  using L = SharedLayout;
  constexpr bool kScaledProbabilities = !SharedTiles;
  const int g = lane / 4, c = lane % 4;
  const int tiles = (work.range.end - work.range.begin + kTileTokens - 1) / kTileTokens;
  const int rows[2] = {row_base + 16 * wg_warp + g, row_base + 16 * wg_warp + g + 8};
  const int limit[2] = {work.limit(rows[0]), work.limit(rows[1])};
  const int mask_from = work.limit(0);                          // the smallest row limit
  const bool real_rows = row_base + 16 * wg_warp < work.count;  // warp-uniform
  // The ring's K descriptor's low word.
  constexpr int kStep = SharedTiles ? 1 : 2;
  const std::uint32_t ring_low = descriptor_low(barriers.slot_address(0));
  for (int tile = SharedTiles ? 0 : consumer; tile < tiles; tile += kStep) {
    const int first = work.range.begin + tile * kTileTokens;
    const int slot = tile % L::kSlots, ring_barrier = tile % L::kRingBarriers;
    mbarrier_wait_parity(barriers.full(ring_barrier), (tile / L::kRingBarriers) & 1u);
    const std::uint32_t keys_low = ring_low + slot * (L::kSlotBytes >> 4);
    const std::uint32_t values_low = keys_low + (L::kKeyBytes >> 4);
    const float* factors =
        reinterpret_cast<const float*>(shared + L::kRing + slot * L::kSlotBytes + L::kKeyBytes + L::kValueBytes);
    // S = Q K^T: rows 16 w + g (+ 8), tokens 8i + 2c (+ 1).
    float score[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      wgmma_rs<64>(score, query[ks], descriptor_of_low(keys_low + (k_step_offset(kTileTokens, ks) >> 4)), ks > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    keep(score);
    std::uint32_t probability[4][4];
    // The per-token words of the lane's A operand tokens (16 kt + 8 h + 2c, + 1: word 2 kt + h): value scales
    // (ScaledProbabilities) or p multipliers; loaded where used (held across a product, they would not fit the
    // registers).
    const auto token_pair_words = [&] {
      const uint4* words =
          reinterpret_cast<const uint4*>(reinterpret_cast<const std::uint8_t*>(factors) + kTokenWordsOffset) + 2 * c;
      const uint4 low = words[0], high = words[1];
      return std::array<std::uint32_t, 8>{low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
    };
    if (real_rows) {
      bool large_scale = false;
      if constexpr (kScaledProbabilities) {
        const std::array<std::uint32_t, 8> pairs = token_pair_words();
        __half2 largest = __habs2(*reinterpret_cast<const __half2*>(&pairs[0]));
#pragma unroll
        for (int i = 1; i < 8; ++i) largest = __hmax2(largest, __habs2(*reinterpret_cast<const __half2*>(&pairs[i])));
        large_scale = __hgt(__hmax(__low2half(largest), __high2half(largest)), __float2half_rn(kMaxLazyValueScale));
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 factor = *reinterpret_cast<const float2*>(factors + 8 * i + 2 * c);
#pragma unroll
        for (int e = 0; e < 4; ++e) score[4 * i + e] *= e & 1 ? factor.y : factor.x;
      }
      // The mask only on the tiles that reach a row's limit (warp-uniform): one branch around it, not a compare
      // and a select per score on every tile.
      if (first + kTileTokens > mask_from) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (first + 8 * i + 2 * c + (e & 1) >= limit[e / 2]) score[4 * i + e] = -INFINITY;
          }
        }
      }
      float local[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < 32; ++i) local[(i / 2) % 2] = fmaxf(local[(i / 2) % 2], score[i]);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        local[r] = fmaxf(local[r], __shfl_xor_sync(kFullMask, local[r], 1));
        local[r] = fmaxf(local[r], __shfl_xor_sync(kFullMask, local[r], 2));
      }
      // Rare past the first tile; the vote keeps the branch warp-uniform (a divergent branch beside the
      // accumulators serializes the products). A row with every score masked so far keeps -inf (NaN
      // comparisons are false).
      const float threshold = kScaledProbabilities && __any_sync(kFullMask, large_scale) ? 0.0f : kLazyRescaleLog2;
      const bool moves[2] = {local[0] - reference[0] > threshold, local[1] - reference[1] > threshold};
      if (__any_sync(kFullMask, moves[0] || moves[1])) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float moved = moves[r] ? local[r] : reference[r];
          const float alpha = moves[r] ? fast_exp2(reference[r] - moved) : 1.0f;  // 0 from -inf
          reference[r] = moved;
#pragma unroll
          for (int i = 0; i < kValueRows / 8; ++i) acc[4 * i + 2 * r] *= alpha, acc[4 * i + 2 * r + 1] *= alpha;
          if constexpr (kScaledProbabilities) sums[2 * r] *= alpha, sums[2 * r + 1] *= alpha;
        }
      }
      // p = 2^(x - reference); a row still at -inf has only masked scores (p = 0).
      const float base[2] = {reference[0] == -INFINITY ? 0.0f : reference[0],
                             reference[1] == -INFINITY ? 0.0f : reference[1]};
      probabilities_as_a_operand(probability, [&](int i, int e) { return fast_exp2(score[4 * i + e] - base[e / 2]); });
      if constexpr (!kScaledProbabilities) {
        // Down-scaled columns (rare): their tokens' p times 2^kValueShift.
        const std::uint8_t* factor_area = reinterpret_cast<const std::uint8_t*>(factors);
        if (__any_sync(kFullMask, load_shared<std::uint32_t>(factor_area + kDownScaledOffset) != 0u)) {
          const std::array<std::uint32_t, 8> multipliers = token_pair_words();
#pragma unroll
          for (int kt = 0; kt < 4; ++kt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              probability[kt][j] = multiply_pairs(probability[kt][j], multipliers[2 * kt + j / 2]);
            }
          }
        }
      }
    } else {
      zero_words(probability);
    }
    if constexpr (kScaledProbabilities) {
      // sum p x zero and sum p: P over V'^T's rows 128..135; then P' in P's registers (a second A operand
      // beside it does not fit the consumers' registers: ptxas would serialize the products).
      float tile_sums[4];
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        wgmma_rs<8>(tile_sums, probability[kt],
                    descriptor_of_low(values_low + ((k_step_offset(kValueRows, kt) + kZeroRow * 128) >> 4)), kt > 0);
      }
      wgmma_commit();
      wgmma_wait_all();
      keep(tile_sums);
      keep_words(probability);
#pragma unroll
      for (int i = 0; i < 4; ++i) sums[i] += tile_sums[i];
      if (real_rows) {
        const std::array<std::uint32_t, 8> scales = token_pair_words();
#pragma unroll
        for (int kt = 0; kt < 4; ++kt) {
#pragma unroll
          for (int j = 0; j < 4; ++j) probability[kt][j] = multiply_pairs(probability[kt][j], scales[2 * kt + j / 2]);
        }
      }
    }
    // O = P V' (ScaledProbabilities: P' V'): k-step kt takes tokens 16 kt ..
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      wgmma_rs<kValueRows>(acc, probability[kt], descriptor_of_low(values_low + (k_step_offset(kValueRows, kt) >> 4)),
                           1);
    }
    wgmma_commit();
    wgmma_wait_all();
    keep(acc);
    keep_words(probability);
    mbarrier_arrive(barriers.empty(ring_barrier));
  }
}

/// The query rows' A operand from q_rot (fp32, bf16 values): times
/// 2^-table_exponent into fp16 (the table's centroids carry 2^table_exponent).
__device__ __forceinline__ void load_query(const PartitionParams& p, const CtaWork& work, int row_base, int wg_warp,
                                           int lane, float query_scale, std::uint32_t (&query)[8][4]) {
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int row = row_base + 16 * wg_warp + g + 8 * e;
    const bool valid = row < work.count;
    const float* q = p.q_rot + (valid ? work.query_row(row, p.num_q_heads) : 0) * kHeadDim;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float2 pair =
            valid ? __ldg(reinterpret_cast<const float2*>(q + 16 * ks + 8 * h + 2 * c)) : make_float2(0.0f, 0.0f);
        query[ks][2 * h + e] = pack_f16(pair.x * query_scale, pair.y * query_scale);
      }
    }
  }
}

/// The consumer's rows (after the merge of a 64-row CTA's two): out =
/// (O[d] + O[128]) / O[129], or ScaledProbabilities (O[d] - 2^e O[129] +
/// sum p x zero) / sum p.
template <bool ScaledProbabilities>
__device__ __forceinline__ void write_partition(const PartitionParams& p, const CtaWork& work, int row_base,
                                                int wg_warp, int lane, const float (&reference)[2],
                                                const float (&acc)[kValueRows / 2], const float (&sums)[4]) {
  const int g = lane / 4, c = lane % 4;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    // Columns 128 and 129 are lane (g, 0)'s accumulators 64 + 2e and 65 + 2e; so are the sums' columns 0 and 1.
    const float ones_sum = __shfl_sync(kFullMask, acc[kHeadDim / 2 + 2 * e + 1], lane & ~3);
    const float zero_sum =
        __shfl_sync(kFullMask, ScaledProbabilities ? sums[2 * e] : acc[kHeadDim / 2 + 2 * e], lane & ~3);
    const float sum = ScaledProbabilities ? __shfl_sync(kFullMask, sums[2 * e + 1], lane & ~3) : ones_sum;
    const float even_offset = ScaledProbabilities ? kEvenDimOffset * ones_sum : 0.0f;
    const float odd_offset = ScaledProbabilities ? kOddDimOffset * ones_sum : 0.0f;
    const int row = row_base + 16 * wg_warp + g + 8 * e;
    if (row >= work.count) continue;
    const std::int64_t index = work.entry(row, p.num_q_heads) * p.num_partitions + work.partition;
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    float* out = p.part_out + index * kHeadDim;
#pragma unroll
    for (int i = 0; i < kHeadDim / 8; ++i) {
      *reinterpret_cast<float2*>(out + 8 * i + 2 * c) =
          make_float2((acc[4 * i + 2 * e] - even_offset + zero_sum) * inverse,
                      (acc[4 * i + 2 * e + 1] - odd_offset + zero_sum) * inverse);
    }
    if (c == 0) {
      p.part_max[index] = sum > 0.0f ? reference[e] * 0.6931471805599453f : -INFINITY;  // natural units
      p.part_sum[index] = sum;
    }
  }
}

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || !defined(__CUDA_ARCH_FEAT_SM90_ALL))
inline constexpr bool kWithoutWgmma = true;
#else
inline constexpr bool kWithoutWgmma = false;
#endif

// Launched on sm_90a only (policy.cpp); other targets compile a trap.
// CtaRows: 64 (the two consumers take alternate tiles for the same rows and
// merge) or 128 (each consumer takes every tile for its own 64 rows). Slots:
// the token_slots order (produce).
template <int CtaRows, bool Slots>
__global__ void __launch_bounds__(kThreads, 1)
    warp_specialized_partitions(const __grid_constant__ PartitionParams p, const __grid_constant__ QueryRows query_rows,
                                const __grid_constant__ CacheTensorMaps maps) {
  if constexpr (kWithoutWgmma) {
    __trap();
  } else {
    using L = SharedLayout;
    constexpr bool kSharedTiles = CtaRows == 2 * kConsumerRows;
    static_assert(CtaRows == kConsumerRows || kSharedTiles);
    // The table at dynamic_shared, the rest from its first 1024-byte boundary (SharedLayout).
    extern __shared__ __align__(1024) std::uint8_t dynamic_shared[];
    const std::uint32_t dynamic_address = static_cast<std::uint32_t>(__cvta_generic_to_shared(dynamic_shared));
    std::uint8_t* const shared = dynamic_shared + (((dynamic_address + 1023u) & ~1023u) - dynamic_address);
    // The warp from lane 0, so the compiler knows it uniform (a divergent path near the products serializes them).
    const int warp = __shfl_sync(kFullMask, static_cast<int>(threadIdx.x / 32), 0);
    const int lane = threadIdx.x % 32;
    const CtaWork work = cta_work(p, query_rows);
    if (work.count == 0) return;  // a query tile past its sequence's tokens: the reducer reads nothing there
    if (work.range.begin >= work.range.end) {
      write_empty_partition(p, work);  // reads nothing else
      return;
    }
    const int table_exponent = build_lookup_table<L, kThreads / 32>(dynamic_shared, p.centroids, warp, lane);
    const Barriers barriers{(dynamic_address + 1023u) & ~1023u};
    // V'^T's ones row and the zero rows after it, in every slot; the producers write the others.
    for (int i = threadIdx.x; i < L::kSlots * (kValueRows - kOnesRow) * kTileTokens; i += kThreads) {
      const int slot = i / ((kValueRows - kOnesRow) * kTileTokens);
      const int row = kOnesRow + i / kTileTokens % (kValueRows - kOnesRow), token = i % kTileTokens;
      std::uint8_t* values = shared + L::kRing + slot * L::kSlotBytes + L::kKeyBytes;
      *reinterpret_cast<__half*>(values + swizzled_offset(kValueRows, row, token)) =
          __float2half(row == kOnesRow ? 1.0f : 0.0f);
    }
    if (threadIdx.x == 0) {
      for (int index = 0; index < L::kRingBarriers; ++index) {
        mbarrier_init(barriers.full(index), 128);                          // the tile's producer warpgroup
        mbarrier_init(barriers.empty(index), kSharedTiles ? 256 : 128);  // the consumers that read the tile
      }
      for (int stage = 0; stage < L::kStages; ++stage) {
        mbarrier_init(barriers.input(stage), 1);
        mbarrier_init(barriers.read(stage), 4);  // the producer warps
      }
      fence_barrier_init();
    }
    fence_proxy_async_shared();  // the constant rows before the products' reads
    __syncthreads();
    const int role = warp / 4, wg_warp = warp % 4;
    if (role < kProducerGroups) {
      TQ_RELEASE_REGISTERS(kProducerRegisters);
      // The stored norm is ||k||: with norm correction over ||c|| = sqrt(sum of squares) 2^-table_exponent.
      const float score_scale = p.scale * kLog2e;
      produce<kSharedTiles, Slots>(p, maps, shared, dynamic_shared, barriers, work, role, wg_warp, lane, score_scale,
                                   score_scale * power_of_two(table_exponent));
      // The merge below reuses the ring: every slot store of the producers precedes it by this barrier too,
      // not only through the slots' mbarriers.
      if constexpr (!kSharedTiles) asm volatile("bar.arrive 2, %0;\n" ::"n"(kThreads) : "memory");
      return;
    }
    TQ_CLAIM_REGISTERS(kConsumerRegisters);
    const int consumer = role - kProducerGroups;
    const int row_base = kSharedTiles ? kConsumerRows * consumer : 0;
    std::uint32_t query[8][4];
    load_query(p, work, row_base, wg_warp, lane, power_of_two(-table_exponent), query);
    keep_words(query);  // held in registers, not reloaded beside the products
    float reference[2] = {-INFINITY, -INFINITY};
    float acc[kValueRows / 2], sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < kValueRows / 2; ++i) acc[i] = 0.0f;
    consume<kSharedTiles>(shared, barriers, work, query, consumer, row_base, wg_warp, lane, reference, acc, sums);
    if constexpr (kSharedTiles) {
      write_partition<false>(p, work, row_base, wg_warp, lane, reference, acc, sums);
      return;
    }
    // Both consumers past their last product and the producers past their last store (the ring is free),
    // then the second's state through shared memory, element by element.
    float* merge = reinterpret_cast<float*>(shared + L::kMerge) + (threadIdx.x % 128);
    asm volatile("bar.sync 2, %0;\n" ::"n"(kThreads) : "memory");
    if (consumer == 1) {
      merge[0] = reference[0], merge[128] = reference[1];
#pragma unroll
      for (int i = 0; i < kValueRows / 2; ++i) merge[128 * (2 + i)] = acc[i];
#pragma unroll
      for (int i = 0; i < 4; ++i) merge[128 * (2 + kValueRows / 2 + i)] = sums[i];
    }
    asm volatile("bar.sync 2, 256;\n" ::: "memory");
    if (consumer == 1) return;
    const float other[2] = {merge[0], merge[128]};
    float weight[2], other_weight[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m = fmaxf(reference[r], other[r]);
      weight[r] = reference[r] == -INFINITY ? 0.0f : fast_exp2(reference[r] - m);
      other_weight[r] = other[r] == -INFINITY ? 0.0f : fast_exp2(other[r] - m);
      reference[r] = m;
    }
#pragma unroll
    for (int i = 0; i < kValueRows / 2; ++i) {
      const int r = (i / 2) % 2;  // accumulator 4j + 2r + h is row g + 8r
      acc[i] = acc[i] * weight[r] + merge[128 * (2 + i)] * other_weight[r];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i / 2;  // sums 2r and 2r + 1 are row g + 8r
      sums[i] = sums[i] * weight[r] + merge[128 * (2 + kValueRows / 2 + i)] * other_weight[r];
    }
    write_partition<true>(p, work, 0, wg_warp, lane, reference, acc, sums);
  }
}

#undef TQ_RELEASE_REGISTERS
#undef TQ_CLAIM_REGISTERS

}  // namespace tqdecode::cuda::tensor_core::specialized
