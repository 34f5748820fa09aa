// token_slots tiles of the tensor-core kernel (internal; docs/FORMAT.md
// section 4b): a kv head's slots are only 2-byte aligned (slot sizes such as
// 134 bytes), so cp.async, which moves aligned 16-byte pieces, brings each
// token's slot in the aligned windows that cover it into a staging row of the
// ring stage (the slot starts `lead` bytes into the row; which bytes past
// the slot a window copies: IssuePlan). At D = 128 the main loop reads the
// slots there (SlotReadLayout, as it reads the wide shape's bulk-copied
// ones); otherwise, once the stage has landed, the warp repacks it in place
// into the arrangement its TileLayout gives the blocks order (record chunks,
// then the fp16 fields), so the main loop reads both orders with the same
// code.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <utility>

#include "../device_utils.cuh"
#include "../kernel_params.hpp"
#include "fragments.cuh"
#include "tile_layout.cuh"

namespace tqdecode::cuda::tensor_core {

// cp.async of the first `bytes` (0 to 16) of an aligned 16-byte window; the
// rest of the destination is zero-filled, and nothing is read for 0.
__device__ __forceinline__ void cp_async_16_prefix(std::uint32_t shared_address, const std::uint8_t* global, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address), "l"(global), "r"(bytes)
               : "memory");
}

// cp.async of an aligned 16-byte window, or where `zero_fill` its 16 bytes
// of zeros and nothing read.
__device__ __forceinline__ void cp_async_16_unless(std::uint32_t shared_address, const std::uint8_t* global,
                                                   bool zero_fill) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(
          shared_address),
      "l"(global), "r"(static_cast<int>(zero_fill))
      : "memory");
}

// RotatedRows: rows a box wide (token_slots_box_bytes, an odd multiple of 32
// bytes for the slots read rotated), in stages as large as the others.
template <class Layout, CacheFormat Format, bool RotatedRows = false>
struct SlotTile {
  static constexpr int kKeyBytes = Layout::kKeyBytes;
  static constexpr int kRecordBytes = Layout::kRecordBytes;
  static constexpr int kFields = Layout::kFields;
  // MSE keys: the key norm sits between the key and the value data.
  static constexpr int kNormBytes = Format == CacheFormat::fp8 ? 0 : 2;
  static constexpr int kSlotBytes = kRecordBytes + 2 * kFields;  // even: no rounding
  // Windows per token: a slot starts up to 14 bytes into its first.
  static constexpr int kWindows = token_slots_box_bytes(kSlotBytes) / 16;
  static constexpr int kPitch = RotatedRows ? token_slots_box_bytes(kSlotBytes)
                                             : token_slots_stage_pitch(kSlotBytes);  // staging row of a token
  static_assert(kPitch >= 16 * kWindows && kPitch <= token_slots_stage_pitch(kSlotBytes));
  // Then 16 bytes the repack's reads may touch past the last row (a chunk's
  // second 16-byte unit), and the tile's first lead (a 32-bit word), clear
  // of what the repack writes.
  static constexpr int kLeadOffset =
      (std::max(kTileTokens * token_slots_stage_pitch(kSlotBytes) + 16, Layout::kStageBytes) + 15) / 16 * 16;
  static constexpr int kStageBytes = kLeadOffset + 16;
  static constexpr int kCopyCount = kTileTokens * kWindows;
  static constexpr int kCopies = (kCopyCount + 31) / 32;  // per lane
  // Whole windows in the tiles read in place (IssuePlan): not in rows read
  // rotated, whose fp8 loop measured slower with them.
  static constexpr bool kWholeWindows = !RotatedRows;
  // Chunks whose bytes may straddle the key data's end or the record's
  // bounds are read word by word (3-bit keys at D = 64: 24 key bytes).
  static constexpr bool kWordWise = kKeyBytes % 16 != 0 || kRecordBytes % 16 != 0;

  /// Offset within a slot of fp16 field `field` (the blocks order's indices).
  static constexpr int slot_field_offset(int field) {
    return Format != CacheFormat::fp8 && field == 0 ? kKeyBytes : kRecordBytes + 2 * field;
  }
  /// Offset within a slot of record byte `byte` (key data, then value data).
  __device__ static int slot_byte(int byte) { return byte + (byte >= kKeyBytes ? kNormBytes : 0); }

  // A lane's copies: copy i is window (32 i + lane) % kWindows of token
  // (32 i + lane) / kWindows, so the windows of a token are neighbouring
  // lanes of one instruction. FixedLeads: every tile's first slot of kv head
  // 0 lies on a 16-byte boundary (the cache and its blocks do: the slots
  // read in place), so each copy's aligned source and byte count are the
  // lane's constants; else they follow from the tile's address, and lane 0
  // stores the tile's first lead for the repack. `whole_windows` (read in
  // place, a tile of any block but the cache's last): every window holding
  // slot bytes is copied whole, a plain 16-byte copy, since the bytes past
  // a slot's end (the next slot's, or the next block's) lie inside the cache
  // and no load reads them as data; a window past the slot's end (the rows
  // are wider than a slot at most leads) is zero-filled, not read, as the
  // partial copies leave it. Only the last block's tiles stop each copy at
  // the slot's end, which costs the address and byte-count arithmetic of a
  // partial copy.
  template <bool FixedLeads>
  struct alignas(16) IssuePlan {
    std::uint32_t token_stride;
    std::uint32_t head_offset;  // head * head_stride
    // From the tile's first slot of kv head 0: FixedLeads the copy's aligned
    // window, else the token's slot.
    std::uint32_t source[kCopies];
    // Destination in a stage (bits 0..15); FixedLeads the bytes to copy,
    // else the window's start 16 w (bits 16..).
    std::uint32_t window[kCopies];

    __device__ void issue(std::uint32_t stage, const std::uint8_t* block, std::uint32_t slot0, int lane,
                          bool whole_windows) const {
      const std::uint8_t* tile = block + slot0 * token_stride;  // within a block: < 2^31
      if (FixedLeads && kWholeWindows && whole_windows) {
#pragma unroll
        for (int i = 0; i < kCopies; ++i) {
          if (kCopyCount % 32 == 0 || i + 1 < kCopies || 32 * i + lane < kCopyCount) {
            cp_async_16_unless(stage + (window[i] & 0xffffu), tile + source[i], window[i] < 0x10000u);
          }
        }
        return;
      }
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        if (kCopyCount % 32 == 0 || i + 1 < kCopies || 32 * i + lane < kCopyCount) {
          if constexpr (FixedLeads) {
            cp_async_16_prefix(stage + (window[i] & 0xffffu), tile + source[i], static_cast<int>(window[i] >> 16));
          } else {
            const std::uint8_t* slot = tile + source[i];
            const int lead = static_cast<int>(reinterpret_cast<std::uintptr_t>(slot) & 15);
            const int window_start = static_cast<int>(window[i] >> 16);
            cp_async_16_prefix(stage + (window[i] & 0xffffu), slot - lead + window_start,
                               window_bytes(lead, window_start));
          }
        }
      }
      if (!FixedLeads && lane == 0) {
        store_shared_u32(stage + kLeadOffset,
                         static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(tile) + head_offset) & 15u);
      }
    }
  };

  /// Bytes of the slot in its window from `window_start` (0 to 16), the slot `lead` bytes into its first.
  __device__ static int window_bytes(int lead, int window_start) {
    return min(max(kSlotBytes + lead - window_start, 0), 16);
  }

  template <bool FixedLeads>
  __device__ static IssuePlan<FixedLeads> make_plan(const PartitionParams& p, int head, int lane) {
    IssuePlan<FixedLeads> plan{};
    plan.token_stride = static_cast<std::uint32_t>(p.layout.token_stride);
    plan.head_offset = static_cast<std::uint32_t>(head * p.layout.head_stride);
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int copy = min(32 * i + lane, kCopyCount - 1);
      const int token = copy / kWindows;
      const int w = copy % kWindows;
      const std::uint32_t slot = token * plan.token_stride + plan.head_offset;
      const auto destination = static_cast<std::uint32_t>(token * kPitch + 16 * w);
      if constexpr (FixedLeads) {
        const int lead = static_cast<int>(slot & 15u);
        plan.source[i] = slot - lead + 16 * w;
        plan.window[i] = destination | (static_cast<std::uint32_t>(window_bytes(lead, 16 * w)) << 16);
      } else {
        plan.source[i] = slot;
        plan.window[i] = destination | (static_cast<std::uint32_t>(16 * w) << 16);
      }
    }
    return plan;
  }

  /// Four bytes of the staging area from even offset `at`.
  __device__ static std::uint32_t staged_word(const std::uint8_t* stage, int at) {
    const std::uint8_t* aligned = stage + (at & ~3);
    return __funnelshift_r(load_shared<std::uint32_t>(aligned), load_shared<std::uint32_t>(aligned + 4), 8 * (at & 3));
  }

  /// Record bytes record_byte .. + 15 of the token whose slot starts at `row` (bytes outside the record: 0).
  __device__ static uint4 staged_chunk(const std::uint8_t* stage, int row, int record_byte) {
    std::uint32_t words[4];
    if constexpr (kWordWise) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const int byte = record_byte + 4 * w;
        words[w] = byte >= 0 && byte < kRecordBytes ? staged_word(stage, row + slot_byte(byte)) : 0u;
      }
    } else {
      // Whole chunks of key or value data, at an even offset `at`: the two
      // aligned 16-byte units holding it (the lanes of a token read its row's
      // consecutive units, free of bank conflicts where 4-byte loads of the
      // chunks of four rows share 8 banks), then a shift by at mod 16 bytes:
      // two word selections and a funnel shift.
      const int at = row + slot_byte(record_byte);
      const uint4 low = load_shared<uint4>(stage + (at & ~15));
      const uint4 high = load_shared<uint4>(stage + (at & ~15) + 16);
      const std::uint32_t x[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
      const bool by_two = at & 8, by_one = at & 4;
      std::uint32_t y[6], z[5];
#pragma unroll
      for (int k = 0; k < 6; ++k) y[k] = by_two ? x[k + 2] : x[k];
#pragma unroll
      for (int k = 0; k < 5; ++k) z[k] = by_one ? y[k + 1] : y[k];
#pragma unroll
      for (int w = 0; w < 4; ++w) words[w] = __funnelshift_r(z[w], z[w + 1], 8 * (at & 3));
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }

  /// The landed stage into Layout's arrangement, in place: every lane reads
  /// its chunks and fields, then, after the warp's barrier, writes them.
  __device__ static void repack(std::uint8_t* stage, int head, int num_kv_heads, std::uint32_t token_stride, int lane) {
    const std::uint32_t first_lead = load_shared<std::uint32_t>(stage + kLeadOffset);
    const auto row_of = [&](int token) {
      return token * kPitch + static_cast<int>((first_lead + token * token_stride) & 15u);
    };
    constexpr int kChunkCount = kTileTokens * Layout::kRecordChunks;
    constexpr int kLaneChunks = (kChunkCount + 31) / 32;
    // The lane's chunk i: its record bytes and destination (recomputed for
    // the writes rather than held across the barrier: registers are scarce).
    const auto chunk_of = [&](int i) {
      const int index = 32 * i + lane;
      const int token = index / Layout::kRecordChunks;
      const RecordChunk chunk = Layout::record_chunk(token, index % Layout::kRecordChunks, head, num_kv_heads);
      const bool copied = (kChunkCount % 32 == 0 || index < kChunkCount) && chunk.record_byte + 16 > 0 &&
                          chunk.record_byte < kRecordBytes;
      return std::pair{copied ? chunk : RecordChunk{-1, -1}, token};
    };
    uint4 chunks[kLaneChunks];
#pragma unroll
    for (int i = 0; i < kLaneChunks; ++i) {
      const auto [chunk, token] = chunk_of(i);
      if (chunk.destination >= 0) chunks[i] = staged_chunk(stage, row_of(token), chunk.record_byte);
    }
    // Fields: token lane % 16, fields lane / 16, + 2, ...
    constexpr int kLaneFields = (kFields + 1) / 2;
    const int field_token = lane & 15;
    std::uint16_t fields[kLaneFields];
#pragma unroll
    for (int j = 0; j < kLaneFields; ++j) {
      const int field = (lane >> 4) + 2 * j;
      if (field < kFields) fields[j] = load_shared<std::uint16_t>(stage + row_of(field_token) + slot_field_offset(field));
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < kLaneChunks; ++i) {
      const int destination = chunk_of(i).first.destination;
      if (destination >= 0) store_shared<uint4>(stage + destination, chunks[i]);
    }
#pragma unroll
    for (int j = 0; j < kLaneFields; ++j) {
      const int field = (lane >> 4) + 2 * j;
      if (field < kFields) store_shared<std::uint16_t>(stage + Layout::kMetaOffset + 32 * field + 2 * field_token, fields[j]);
    }
  }
};

// The unaligned reads below take the bytes' aligned base and their skew
// past it, both loop invariants of a lane (LaneOperands::in_slots: the
// stages start on 16-byte boundaries), so the main loop does no address
// arithmetic for them.

/// Words 0 .. N - 2 of the bytes `skew` (0 to 3) past the aligned word at
/// `word`: N words, funnel-shifted.
template <int N>
__device__ __forceinline__ void load_shared_unaligned(const std::uint8_t* word, int skew, std::uint32_t (&out)[N - 1]) {
  std::uint32_t x[N];
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = load_shared<std::uint32_t>(word + 4 * i);
#pragma unroll
  for (int i = 0; i + 1 < N; ++i) out[i] = __funnelshift_r(x[i], x[i + 1], 8 * skew);
}

/// 16 bytes `skew` (0 to 7) past the 8-byte boundary `pairs`: three 8-byte
/// loads, then the five words from the bytes' word funnel-shifted. A warp's
/// lanes reading chunks 16 bytes apart in rows of 16-byte units conflict at
/// most 2 or 3 ways so (half warps of 8-byte pairs), where 4-byte loads
/// conflict 4.
__device__ __forceinline__ uint4 load_shared_unaligned_16(const std::uint8_t* pairs, int skew) {
  std::uint32_t x[6];
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const uint2 pair = load_shared<uint2>(pairs + 8 * i);
    x[2 * i] = pair.x, x[2 * i + 1] = pair.y;
  }
  const bool second_word = skew & 4;
  std::uint32_t z[5];
#pragma unroll
  for (int i = 0; i < 5; ++i) z[i] = second_word ? x[i + 1] : x[i];
  const int shift = 8 * (skew & 3);
  return make_uint4(__funnelshift_r(z[0], z[1], shift), __funnelshift_r(z[1], z[2], shift),
                    __funnelshift_r(z[2], z[3], shift), __funnelshift_r(z[3], z[4], shift));
}
/// 8 bytes `skew` (0 to 3) past the aligned word at `word`.
__device__ __forceinline__ uint2 load_shared_unaligned_8(const std::uint8_t* word, int skew) {
  std::uint32_t w[2];
  load_shared_unaligned<3>(word, skew, w);
  return make_uint2(w[0], w[1]);
}

/// The least odd multiple of `unit` at or above `bytes`.
constexpr int odd_multiple_of(int unit, int bytes) {
  const int pitch = (bytes + unit - 1) / unit * unit;
  return pitch % (2 * unit) ? pitch : pitch + unit;
}

// token_slots tiles read where they land, at D = 128 in every key format:
// token t's slot starts at slot_row(t) = t kPitch + (first_lead + t
// token_stride) mod 16 in a stage, first_lead = head * head_stride mod 16.
// Bulk copies (the wide shape: token rows of 16-byte multiples) bring a box
// kPitch bytes wide from the 16-byte boundary at or below each slot (the
// copy engine needs the box's first byte 16-byte aligned); cp.async (the
// narrow configuration) each slot's aligned windows into rows of kPitch
// bytes (token_slots_stage_pitch; rotated, the box's width). Either way the tile's first slot lies first_lead bytes past a
// 16-byte boundary: the cache and its blocks start on one, and a tile's
// first slot is a multiple of 16 token strides into its block. Even token
// strides put token t + 8 at the same lead, kOffset8Tokens further. The
// lanes' keys and values are read with unaligned loads
// (load_shared_unaligned_*), the fields as they are; nothing is repacked.
//
// Rotated: the bulk copies (4-bit keys), and the cp.async windows of fp8
// keys where the token rows are 16-byte multiples (codes of whole bytes):
// every slot of a stage then sits at the same lead L = first_lead, and the
// lanes read aligned words of rotated data instead of shifting it. A lane's
// 16-byte key chunks are units of the row (4-bit keys: unit c; fp8 keys:
// units c and 4 + c), unit u holding key bytes 16u - L .. 16u - L + 15,
// where lane quad 0 takes its first L bytes from the unit past the key data
// (key bytes K - L .., K the key bytes): the key bytes rotated by L, and
// the query's dims rotated to match (query_dims). The values likewise from
// the 8-byte boundary at or below their start, rotated by r = (L +
// kValueStart) mod 8 bytes, lane g = 0 taking its first r bytes from the 8
// past the value data; the merge restores the output dims
// (value_byte_rotation). The tile's tokens are permuted (token_at) so the
// rows one load's phases read lie on distinct banks of rows an odd multiple
// of 32 bytes apart.
//
// Whole rows (RowHeads kv heads, SlotRead::rows): a bulk copy brings the
// row part of a CTA's RowHeads kv heads, from a 16-byte boundary, into rows
// of kPitch bytes (the part rounded up to an odd multiple of 32 bytes read
// rotated, of 16 bytes else, as the rows above); the warps of kv head h
// read its slot from the 16-byte boundary at or below h slot bytes, at lead
// (h slot bytes) mod 16, as above.
//
// Token runs (Runs: RowHeads = Hk kv heads, the whole row): a tile's 16
// token rows are one contiguous run of 16 x Hk slot bytes in its block,
// brought by one bulk copy as they lie, rows kPitch = Hk slot bytes apart
// (any even pitch: token t's slot of kv head h starts t kPitch + h slot
// bytes into the stage, at leads that vary by token), read with the
// unaligned loads.
template <CacheFormat Format, bool BulkCopies, bool Rotated = BulkCopies, int RowHeads = 0, bool Runs = false>
struct SlotReadLayout {
  using Blocks = TileLayout<Format, 128>;
  using Slot = SlotTile<Blocks, Format, Rotated>;
  static constexpr int kRowHeads = RowHeads;
  static constexpr bool kRuns = Runs;
  static constexpr bool kFp8 = Format == CacheFormat::fp8;
  static constexpr int kKeyBytes = Blocks::kKeyBytes;
  static constexpr int kRecordBytes = Blocks::kRecordBytes;
  static constexpr int kFields = Blocks::kFields;
  // fp8 keys have no norm: their field 0 is the value scale.
  static constexpr int kNormField = 0, kValueScaleField = Blocks::kValueScaleField,
                       kValueZeroField = Blocks::kValueZeroField;
  // Rotated (the bulk copies too): the box's width.
  // Whole rows: RowHeads slots from up to kRowLead bytes past the box's
  // 16-byte-aligned start (the CTA's first slot lies a multiple of RowHeads
  // even-sized slots into the row: eight of them a multiple of 16 bytes).
  static constexpr int kRowLead = RowHeads > 0 ? 16 - std::gcd(2 * RowHeads, 16) : 0;
  static constexpr int kPitch = Runs       ? RowHeads * Slot::kSlotBytes
                                : RowHeads ? odd_multiple_of(Rotated ? 32 : 16, kRowLead + RowHeads * Slot::kSlotBytes)
                                           : Slot::kPitch;
  static constexpr int kStageBytes = kTileTokens * kPitch;  // a bulk copy's box
  static constexpr int kMetaOffset = kStageBytes;           // no fields area: the fields are in the slots
  static constexpr int kOffset8Tokens = 8 * kPitch;
  static constexpr int kKeyLoads = kFp8 ? 2 : 1;  // 16-byte loads of a lane's key bytes per token (MSE keys: one)
  static constexpr int kKeyWords = 3, kKeyWordLoads = 3, kKeyLoadBytes = 4;  // 3-bit keys: a lane's 12 bytes
  static constexpr int kValueWordLoads = 2;                                  // 3-bit values: a lane's 6 bytes
  static constexpr int kValueStart = kKeyBytes + (kFp8 ? 0 : 2);            // after the key norm

  static_assert(!BulkCopies || Runs || RowHeads > 0 || (Format == CacheFormat::mse4 && Rotated),
                "bulk copies: whole rows, or 4-bit keys by kv head, rotated");
  static_assert(RowHeads == 0 || Runs || (kPitch >= RowHeads * Slot::kSlotBytes && kPitch % 16 == 0 && kPitch <= 2048),
                "whole rows: a box of 8-byte elements (at most 256) holding the kv heads' slots");
  static_assert(!Runs || (BulkCopies && !Rotated && RowHeads > 0 && (kTileTokens * kPitch) % 16 == 0),
                "token runs: a bulk copy of whole rows (16-byte multiples), read with the unaligned loads");
  static_assert(!Rotated || Format == CacheFormat::mse4 || Format == CacheFormat::fp8, "rotated: whole-byte key codes");
  static_assert(!Rotated || kPitch % 64 == 32, "token_at's banks: rows an odd multiple of 32 bytes apart");

  /// The token of a tile's S^T row or O^T k index. Rotated: rows 2p and
  /// 2p + 1 (one phase of a 16-byte load) two tokens apart mod 4, 64 bytes
  /// apart mod 128; rows 2c + j (c = 0..3, one phase of an 8-byte load) on
  /// every token mod 4; token_at(index + 8) = token_at(index) + 8.
  template <bool Bulk>
  __device__ static int token_at(int index) {
    if constexpr (Rotated) return (index & ~3) | (((index >> 1) + 2 * (index & 1)) & 3);
    return index;
  }
  /// Rotated: where lane quad c's key chunk `part` starts in a row (a 16-byte unit).
  static constexpr int key_unit(int c, int part) { return kFp8 ? 64 * part + 16 * c : 16 * c; }
  /// The first of the query dims of k-step ks against lane quad c's keys
  /// (the next two pairs; rotated, the second pair may wrap around D).
  __device__ static int query_dims(int c, int ks, int first_lead) {
    static_assert(Rotated);
    // Key byte b of the row's units holds dims 2 (b - L) (4-bit) or b - L (fp8), mod D.
    const int byte = kFp8 ? key_unit(c, ks / 4) + 4 * (ks % 4) : key_unit(c, 0) + 2 * ks;
    return kFp8 ? (byte - first_lead) & 127 : (2 * (byte - first_lead)) & 127;
  }
  /// Rotated: the bytes the value words lag their lanes' natural ones (the output dims: twice as many).
  __device__ static int value_byte_rotation(int first_lead) {
    static_assert(Rotated);
    return (first_lead + kValueStart) & 7;
  }
  /// Where `token`'s slot starts in a stage.
  __device__ static int slot_row(int token, int first_lead, std::uint32_t token_stride) {
    if constexpr (Runs) return token * kPitch + first_lead;  // the rows as they lie in the cache
    return token * kPitch + static_cast<int>((first_lead + token * token_stride) & 15u);
  }
  /// The lane's key bytes (dims (D/4)c ..) from its slot's start, 16 bytes from part 16.
  static constexpr int key_byte(int c, int part) { return kKeyBytes / 4 * c + 16 * part; }
  /// The lane's value bytes (dims (D/8)g ..) from its slot's start.
  static constexpr int value_byte(int g) { return kValueStart + (value_bits(Format) == 4 ? 8 : 6) * g; }
  /// fp16 field `field` from a slot's start.
  static constexpr int field_offset(int field) { return Slot::slot_field_offset(field); }
};

/// Whether a tile layout reads the slots where they landed (SlotReadLayout),
/// and whether it does so with aligned loads of rotated data (the bulk
/// copies, and fp8 windows in token rows of 16-byte multiples) rather than
/// loads only 2-byte aligned.
template <class Layout>
constexpr bool kReadsSlots = false;
template <CacheFormat Format, bool BulkCopies, bool Rotated, int RowHeads, bool Runs>
constexpr bool kReadsSlots<SlotReadLayout<Format, BulkCopies, Rotated, RowHeads, Runs>> = true;
template <class Layout>
constexpr bool kReadsRotatedSlots = false;
template <CacheFormat Format, bool BulkCopies, int RowHeads, bool Runs>
constexpr bool kReadsRotatedSlots<SlotReadLayout<Format, BulkCopies, true, RowHeads, Runs>> = true;

/// N words of a rotated read (kReadsRotatedSlots) from the aligned
/// `address`: where `mask` is set, the bytes of the words Distance bytes
/// further, loaded by the lanes that `wraps` (those that take wrapped bytes
/// at some lead: every kv head's CTA then runs the same instructions, so the
/// CTAs of a sequence's kv heads, which share the L2 lines of the token
/// rows, stay together; a lead without wrapped bytes has zero masks).
template <int Distance, int N>
__device__ __forceinline__ void load_rotated(const std::uint8_t* address, bool wraps, const std::uint32_t (&mask)[N],
                                             std::uint32_t (&words)[N]) {
  static_assert(N == 2 || N == 4);
  using Vector = std::conditional_t<N == 4, uint4, uint2>;
  const auto unpack = [](const Vector& v, std::uint32_t(&out)[N]) {
    if constexpr (N == 4) {
      out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
    } else {
      out[0] = v.x, out[1] = v.y;
    }
  };
  unpack(load_shared<Vector>(address), words);
  if (wraps) {  // predicated, not branched: nothing to initialise where the lane keeps its words
    std::uint32_t wrap[N];
    unpack(load_shared<Vector>(address + Distance), wrap);
#pragma unroll
    for (int i = 0; i < N; ++i) words[i] = (words[i] & ~mask[i]) | (wrap[i] & mask[i]);
  }
}

/// The mask of the first `bytes` bytes (any integer) of word `word`.
__device__ __forceinline__ std::uint32_t prefix_mask(int bytes, int word) {
  const int bits = min(max(8 * (bytes - 4 * word), 0), 32);
  return bits == 32 ? 0xffffffffu : (1u << bits) - 1u;
}

}  // namespace tqdecode::cuda::tensor_core
