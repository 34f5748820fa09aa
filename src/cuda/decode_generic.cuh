// Generic split-KV partition kernel (internal): every preset, head dim 64 /
// 128 / 256, group size 1..16, block size 16..128, either cache order
// (blocks, token_slots), one or several query tokens per sequence, any GPU
// from sm_75 up.
//
// Grid (num_partitions * query tiles, num_kv_heads, batch); the CTA
// (q * N + p, h, b) runs the online softmax of docs/FORMAT.md section 5 over
// partition_range(seq_lens[b], ...) for its query rows and writes the
// normalized partial results. Its rows are the QG query heads of kv head h
// for each of the tokens_per_cta query tokens of query tile q of sequence b
// (row r: token r / QG, head r % QG; one token per sequence: the QG heads),
// so every key and value it loads serves all of them; each row is masked
// causally (section 5b: token j of q_len sees positions below seq_len -
// q_len + j + 1), and the range stops at the last row's limit. The grid
// depends on shapes only (B, max_query_len), never on seq_lens or
// query_start_loc (CUDA graphs).
//
// CTA of 4 warps (8 for 32 rows at D = 256). The warps form kTokenGroups
// groups; each group walks its own tiles of the range (tiles g, g +
// kTokenGroups, ...) and keeps its own online-softmax state, merged through
// shared memory at the end. Within a group the kHeadGroups warps split the
// query rows (kHeadsPerWarp each), so the per-lane accumulator stays at
// D * kHeadsPerWarp / 32 <= 32 registers.
//
// One tile = kTileTokens consecutive tokens (32, or 16 at D = 256):
//  1. Staging: the group copies the tile's records (key then value bytes,
//     contiguous per (slot, head) in the blocks order; the key data and the
//     value data of each slot in the token_slots order) into shared memory,
//     one row per token, key data then value data, with 16-byte cp.async
//     where alignment allows (8/4/2/1 otherwise; token_slots copies of 2
//     bytes are loads and stores, four in flight per lane),
//     double-buffered: tile i+1 is in flight while tile i is computed. The
//     fp16 metadata of the next tile is loaded into registers meanwhile.
//  2. Scores, one token per lane (two lanes per token at D = 256): the lane
//     reads its key bits from its row with 16-byte loads (rows are padded to
//     an odd multiple of 16 bytes, so the loads are bank-conflict free),
//     decodes codes to centroids (table in shared memory) or fp8 to float,
//     and dots them with the query rows (shared memory, broadcast reads).
//     The key norm and the softmax scale multiply the dot once per token;
//     a token_slots layout that renormalizes keys also sums the squares of
//     the token's centroids (a second pass over the row) and divides by
//     their root.
//  3. Online softmax per head: warp max, rescale of the running state,
//     p_t = exp2(s_t - m); lane t stores p_t * vscale_t for the value pass
//     and accumulates p_t and p_t * vzero_t (the zero point folded out).
//  4. Values, lanes over head dims: every lane reads its D/32 codes of each
//     token from the row and accumulates acc[g][d] += (p_t vscale_t) code.
// Scores are kept in log2 units (scale pre-multiplied by log2 e) so every
// exponential is one exp2; part_max is converted back to natural units.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda_check.hpp"
#include "device_utils.cuh"
#include "dynamic_shared_memory.hpp"
#include "kernel_params.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"
#include "tqdecode/partition.hpp"

namespace tqdecode::cuda::generic {

constexpr int round_up(int value, int multiple) { return (value + multiple - 1) / multiple * multiple; }
constexpr int max_of(int a, int b) { return a > b ? a : b; }
constexpr int min_of(int a, int b) { return a < b ? a : b; }

/// Compile-time shape of one kernel instance: preset P, head dim D, and rows
/// bucket R: the smallest of 1, 2, 4, 8, 16, 32 holding QG x tokens_per_cta
/// query rows (one token per sequence: the QG heads); a CTA whose sequence
/// has fewer tokens left holds fewer.
template <Preset P, int D, int R>
struct Config {
  static constexpr int kHeadDim = D;
  static constexpr int kMaxRows = R;
  static constexpr PresetInfo kInfo = preset_info(P);
  static constexpr bool kKeyFp8 = kInfo.key_fp8;
  static constexpr int kKeyBits = kInfo.key_bits;
  static constexpr int kValueBits = kInfo.value_bits;
  static constexpr int kKeyBytes = packed_bytes(D, kKeyBits);      ///< KD
  static constexpr int kValueBytes = packed_bytes(D, kValueBits);  ///< VD
  static constexpr int kRecordBytes = kKeyBytes + kValueBytes;
  static constexpr int kFields = kKeyFp8 ? 2 : 3;
  static constexpr int kCentroids = kKeyFp8 ? 0 : 1 << kKeyBits;
  /// token_slots: where the value data and the fp16 fields lie within a slot.
  static constexpr CacheLayout kSlot{P, D, 16, 1, 0, CacheOrder::token_slots};
  static constexpr int kSlotValueOffset = kSlot.slot_value_offset();
  static constexpr int kSlotKeyNormOffset = kKeyFp8 ? 0 : kSlot.slot_field_offset(kSlot.key_norm_field());
  static constexpr int kSlotValueScaleOffset = kSlot.slot_field_offset(kSlot.value_scale_field());
  static constexpr int kSlotValueZeroOffset = kSlot.slot_field_offset(kSlot.value_zero_field());
  /// token_slots: the widest copy piece that divides the key data, the value
  /// data and the value data's offset in the slot (at most 16 bytes; 2 for
  /// MSE keys, whose norm puts the value data 2 bytes past the key data).
  static constexpr int kSlotPieceLimit =
      min_of(16, (kKeyBytes | kValueBytes | kSlotValueOffset) & -(kKeyBytes | kValueBytes | kSlotValueOffset));

  /// Query rows per warp: at most 8, and the value accumulator at most
  /// 32 floats per lane (D * rows / 32).
  static constexpr int kHeadsPerWarp = min_of(R, min_of(8, 1024 / D));
  static constexpr int kHeadGroups = R / kHeadsPerWarp;
  /// 4 warps, or one per head group where rows need more (32 rows at D = 256).
  static constexpr int kWarps = max_of(4, kHeadGroups);
  static constexpr int kThreads = 32 * kWarps;
  /// Occupancy target: caps registers at 168 (8 rows per warp) or 128, the
  /// most each needs without spilling.
  static constexpr int kMinBlocksPerSm = (kHeadsPerWarp >= 8 ? 3 : 4) * 4 / kWarps;
  static constexpr int kTokenGroups = kWarps / kHeadGroups;
  /// Lanes that share one token's dot product (2 at D = 256 halve the tile's smem).
  static constexpr int kLanesPerToken = D > 128 ? D / 128 : 1;
  static constexpr int kTileTokens = 32 / kLanesPerToken;
  static constexpr int kLaneKeyDims = D / kLanesPerToken;
  static constexpr int kValueDimsPerLane = D / 32;
  /// Shared-memory row of one token: an odd number of 16-byte units, so 8
  /// lanes reading 16 bytes from 8 consecutive rows hit 32 distinct banks.
  static constexpr int kRowPitch =
      round_up(kRecordBytes, 16) / 16 % 2 == 1 ? round_up(kRecordBytes, 16) : round_up(kRecordBytes, 16) + 16;
  static constexpr int kTileBytes = kTileTokens * kRowPitch;

  // Dynamic shared memory layout (bytes).
  static constexpr int kQueryOffset = 0;                            ///< float [R][D]: rotated queries of the rows
  static constexpr int kCentroidOffset = kQueryOffset + R * D * 4;  ///< float [16]
  static constexpr int kRowLimitOffset = kCentroidOffset + 16 * 4;  ///< int [R]: positions each row sees (causal)
  /// float [warp][token][row]: p_t * vscale_t (16-byte aligned: read as float4)
  static constexpr int kWeightOffset = kRowLimitOffset + round_up(R * 4, 16);
  static constexpr int kStageOffset = round_up(kWeightOffset + kWarps * kTileTokens * kHeadsPerWarp * 4, 16);
  /// Per token group, two tile buffers.
  static constexpr int kStageBytes = kTokenGroups * 2 * kTileBytes;
  /// After the tile loop the stage area holds each warp's state: acc [heads][D], then m, l, z [heads]
  /// (padded to a multiple of 4 floats, so the next warp's acc stays 16-byte aligned).
  static constexpr int kMergeFloatsPerWarp = kHeadsPerWarp * D + round_up(3 * kHeadsPerWarp, 4);
  static constexpr int kMergeBytes = kWarps * kMergeFloatsPerWarp * 4;
  static constexpr int kSmemBytes = kStageOffset + max_of(kStageBytes, kMergeBytes);

  static_assert(R == 1 || R == 2 || R == 4 || R == 8 || R == 16 || R == 32, "rows bucket");
  static_assert(kHeadGroups * kHeadsPerWarp == R && kTokenGroups * kHeadGroups == kWarps, "warp split");
  static_assert(kValueDimsPerLane * kValueBits <= 32, "a lane's value codes fit one 32-bit window");
  static_assert(kKeyBytes % 8 == 0 && kRecordBytes % 8 == 0, "records are 8-byte multiples");
  static_assert(kMergeFloatsPerWarp % 4 == 0, "each warp's merged state starts 16-byte aligned");
};

/// Converts a small unsigned integer to float exactly, with one integer OR
/// and one float subtraction instead of a (lower-throughput) I2F.
__device__ __forceinline__ float small_uint_to_float(unsigned code) {
  return __uint_as_float(0x4b000000u | code) - 8388608.0f;
}

/// Code `Index` of a `Bits`-bit LSB-first packed string held in registers
/// (Index is a compile-time constant after unrolling, so this is a shift and
/// a mask, plus a funnel shift for 3-bit codes that straddle two words).
template <int Bits, int Index, int Words>
__device__ __forceinline__ unsigned packed_code(const unsigned (&words)[Words]) {
  constexpr int kBit = Index * Bits;
  constexpr int kWord = kBit / 32;
  constexpr int kShift = kBit % 32;
  static_assert(kWord < Words, "code outside the loaded words");
  unsigned value = words[kWord] >> kShift;
  if constexpr (kShift + Bits > 32) value |= words[kWord + 1] << (32 - kShift);
  return value & ((1u << Bits) - 1u);
}

/// Four fp8 e4m3 bytes (little-endian in `word`) as floats times 2^-8, bit for
/// bit fp8_e4m3_bits_to_float(byte) / 256: sign, exponent and mantissa are
/// moved into fp16 fields, which reads the e4m3 value with the fp16 bias (15
/// instead of 7), subnormals included; the caller multiplies by 256 once per
/// token. Bytes 0x7f / 0xff (e4m3 NaN) are patched to NaN.
__device__ __forceinline__ void fp8x4_to_float_over_256(unsigned word, float (&out)[4]) {
  const unsigned even = ((word & 0x00800080u) << 8) | ((word & 0x007f007fu) << 7);  // bytes 0 and 2
  const unsigned odd = (word & 0x80008000u) | ((word & 0x7f007f00u) >> 1);          // bytes 1 and 3
  const float2 e = __half22float2(*reinterpret_cast<const __half2*>(&even));
  const float2 o = __half22float2(*reinterpret_cast<const __half2*>(&odd));
  out[0] = e.x;
  out[1] = o.x;
  out[2] = e.y;
  out[3] = o.y;
  if ((((word & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0u) {  // some byte is 0x7f or 0xff
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (((word >> (8 * i)) & 0x7fu) == 0x7fu) out[i] = quiet_nan();
    }
  }
}

/// Adds dot(q[g][dim .. dim+4), k[0..4)) to s[g] for every head of the warp.
template <class C>
__device__ __forceinline__ void accumulate_dot4(const float* q, int dim, const float (&k)[4],
                                                float (&s)[C::kHeadsPerWarp]) {
#pragma unroll
  for (int g = 0; g < C::kHeadsPerWarp; ++g) {
    const float4 qv = *reinterpret_cast<const float4*>(q + g * C::kHeadDim + dim);  // broadcast read
    s[g] = fmaf(qv.x, k[0], s[g]);
    s[g] = fmaf(qv.y, k[1], s[g]);
    s[g] = fmaf(qv.z, k[2], s[g]);
    s[g] = fmaf(qv.w, k[3], s[g]);
  }
}

/// Adds dot(q[g][4 Quad .. 4 Quad + 4), centroids[codes 4 Quad .. 4 Quad + 4)) to s[g].
template <class C, int Quad, int Words>
__device__ __forceinline__ void score_mse_quad(const unsigned (&words)[Words], const float* q, const float* centroids,
                                               float (&s)[C::kHeadsPerWarp]) {
  const float k[4] = {centroids[packed_code<C::kKeyBits, 4 * Quad + 0>(words)],
                      centroids[packed_code<C::kKeyBits, 4 * Quad + 1>(words)],
                      centroids[packed_code<C::kKeyBits, 4 * Quad + 2>(words)],
                      centroids[packed_code<C::kKeyBits, 4 * Quad + 3>(words)]};
  accumulate_dot4<C>(q, 4 * Quad, k, s);
}

template <class C, int Words, int... Quad>
__device__ __forceinline__ void score_mse_quads(const unsigned (&words)[Words], const float* q, const float* centroids,
                                                float (&s)[C::kHeadsPerWarp], std::integer_sequence<int, Quad...>) {
  (score_mse_quad<C, Quad>(words, q, centroids, s), ...);
}

/// MSE keys: adds dot(q[g][chunk dims], centroids[idx[chunk dims]]) to s[g].
/// `key` is the chunk's first key byte (16-byte aligned), `q` the query of
/// the chunk's first dim for the warp's first head. A chunk is whole 16-byte
/// loads: 32 dims of 4-bit codes, or 128 dims (D = 64: 64) of 3-bit codes; a
/// 3-bit chunk of 24 bytes reads 8 bytes past it, still inside the record.
/// Code positions are compile-time constants (shifts and masks only).
template <class C, int ChunkDims>
__device__ __forceinline__ void score_mse_chunk(const unsigned char* key, const float* q, const float* centroids,
                                                float (&s)[C::kHeadsPerWarp]) {
  constexpr int kLoads = (ChunkDims * C::kKeyBits / 8 + 15) / 16;
  unsigned words[4 * kLoads];
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const uint4 v = *reinterpret_cast<const uint4*>(key + 16 * i);
    words[4 * i + 0] = v.x;
    words[4 * i + 1] = v.y;
    words[4 * i + 2] = v.z;
    words[4 * i + 3] = v.w;
  }
  score_mse_quads<C>(words, q, centroids, s, std::make_integer_sequence<int, ChunkDims / 4>{});
}

/// Dot products of this lane's token with the warp's query heads, over the
/// lane's kLaneKeyDims dims (unscaled: no key norm, no softmax scale; fp8
/// keys come out divided by 256). The chunk loops are not unrolled: one
/// chunk already has HC independent FMA chains, and unrolling further only
/// makes the compiler hoist query loads into registers.
template <class C>
__device__ __forceinline__ void key_scores(const unsigned char* key, const float* q, const float* centroids,
                                           float (&s)[C::kHeadsPerWarp]) {
#pragma unroll
  for (int g = 0; g < C::kHeadsPerWarp; ++g) s[g] = 0.0f;
  if constexpr (C::kKeyFp8) {
#pragma unroll 1
    for (int dim = 0; dim < C::kLaneKeyDims; dim += 16) {
      const uint4 v = *reinterpret_cast<const uint4*>(key + dim);
      const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float k[4];
        fp8x4_to_float_over_256(words[i], k);
        accumulate_dot4<C>(q, dim + 4 * i, k, s);
      }
    }
  } else {
    constexpr int kChunkDims = C::kKeyBits == 4 ? 32 : min_of(128, C::kLaneKeyDims);
#pragma unroll 1
    for (int dim = 0; dim < C::kLaneKeyDims; dim += kChunkDims) {
      score_mse_chunk<C, kChunkDims>(key + dim * C::kKeyBits / 8, q + dim, centroids, s);
    }
  }
}

/// The kValueDimsPerLane value codes of `lane` (dims lane * kValueDimsPerLane
/// onwards) of the record in `row`, as one LSB-first bit window.
template <class C>
__device__ __forceinline__ unsigned value_code_window(const unsigned char* row, int lane) {
  constexpr int kBits = C::kValueDimsPerLane * C::kValueBits;
  constexpr int kBase = C::kKeyBytes * 8;  // bit offset of the value data in the row (a multiple of 64)
  if constexpr (kBits == 8) {
    return row[C::kKeyBytes + lane];
  } else if constexpr (kBits == 16) {
    return reinterpret_cast<const unsigned short*>(row + C::kKeyBytes)[lane];
  } else if constexpr (kBits == 32) {
    return reinterpret_cast<const unsigned*>(row + C::kKeyBytes)[lane];
  } else {  // 3-bit codes: 6, 12 or 24 bits at any bit offset
    const int bit = kBase + lane * kBits;
    const unsigned* words = reinterpret_cast<const unsigned*>(row);
    const unsigned lo = words[bit >> 5];
    // The next word only when the window straddles it: the last lane's window
    // ends at the record end, which may be the end of the row.
    const unsigned hi = (bit & 31) + kBits > 32 ? words[(bit >> 5) + 1] : 0u;
    return __funnelshift_r(lo, hi, bit & 31);
  }
}

/// fp16 metadata of one token, as raw bits.
struct TokenMeta {
  std::uint16_t key_norm;  ///< MSE presets only
  std::uint16_t value_scale;
  std::uint16_t value_zero;
};

// NOTE: cache addressing reads the layout from the kernel parameters (the
// constant bank) at each use instead of caching it in registers: the tile
// loop is register-bound, constant-bank operands are free.

/// Start of physical cache block `block`.
__device__ __forceinline__ const unsigned char* block_start(const PartitionParams& p, int block) {
  return p.cache + block * p.layout.block_stride;
}

/// Slot of `token` in its block, and the block's index in the block-table
/// row (block sizes are powers of two).
__device__ __forceinline__ int token_slot(const PartitionParams& p, int token) {
  return token & (p.layout.block_size - 1);
}
__device__ __forceinline__ int token_block_index(const PartitionParams& p, int token) {
  return token >> (__ffs(p.layout.block_size) - 1);
}

/// Offset from the block start of metadata field 0 of (slot, kv head blockIdx.y).
template <class C>
__device__ __forceinline__ std::int64_t field0_offset(const PartitionParams& p, int slot) {
  const int block_size = p.layout.block_size;
  const std::int64_t region = static_cast<std::int64_t>(block_size) * p.layout.num_kv_heads * C::kRecordBytes;
  return region + 2 * (static_cast<std::int64_t>(blockIdx.y) * C::kFields * block_size + slot);
}

__device__ __forceinline__ std::uint16_t load_u16(const unsigned char* address, bool aligned) {
  if (aligned) return *reinterpret_cast<const std::uint16_t*>(address);
  return static_cast<std::uint16_t>(address[0] | (address[1] << 8));
}

/// Issues the copies of the records of tokens [first, first + count) of
/// kv head blockIdx.y into the tile buffer `tile` (row t = token first + t);
/// blocks order.
/// `block` is, in lane t, the physical block of token first + t. Every warp
/// of the token group calls this with the same tile; the group's warps split
/// the `Bytes`-sized pieces.
template <class C, int Bytes>
__device__ __forceinline__ void copy_tile_records(const PartitionParams& p, int first, int count, int block,
                                                  unsigned char* tile, int lane, int warp_in_group) {
  constexpr int kPieces = C::kRecordBytes / Bytes;
  constexpr int kTotal = C::kTileTokens * kPieces;
  // Not unrolled: unrolling hoists all the pieces' addresses into registers
  // that the tile computation needs.
#pragma unroll 1
  for (int base = warp_in_group * 32; base < kTotal; base += 32 * C::kHeadGroups) {  // uniform per warp
    const int piece_index = base + lane;
    const int t = piece_index / kPieces;
    const int piece = piece_index - t * kPieces;
    const int source_block = __shfl_sync(kFullMask, block, t & 31);
    if (piece_index < kTotal && t < count) {
      const std::int64_t record =
          static_cast<std::int64_t>(token_slot(p, first + t)) * p.layout.num_kv_heads + blockIdx.y;
      const unsigned char* source = block_start(p, source_block) + record * C::kRecordBytes + piece * Bytes;
      copy_to_shared<Bytes>(tile + t * C::kRowPitch + piece * Bytes, source);
    }
  }
}

/// copy_tile_records for the token_slots order: row t gets the key data and
/// the value data of token first + t's slot. 2-byte pieces (no cp.async) are
/// loads and stores: a lane issues the loads of kBatch pieces before their
/// stores.
template <class C, int Bytes>
__device__ __forceinline__ void copy_tile_slots(const PartitionParams& p, int first, int count, int block,
                                                unsigned char* tile, int lane, int warp_in_group) {
  static_assert(Bytes >= 2, "token_slots caches are 2-byte aligned");
  static_assert(C::kKeyBytes % Bytes == 0 && C::kValueBytes % Bytes == 0, "pieces do not straddle key and value data");
  constexpr int kKeyPieces = C::kKeyBytes / Bytes;
  constexpr int kPieces = C::kRecordBytes / Bytes;
  constexpr int kTotal = C::kTileTokens * kPieces;
  constexpr int kBatch = Bytes >= 4 ? 1 : 4;
  constexpr int kStep = 32 * kBatch;
  // Piece `piece_index` of the tile (rows of kPieces pieces): whether it
  // holds data, its offset in the tile and its source.
  const auto piece_at = [&](int piece_index, int& destination) -> const unsigned char* {
    const int t = piece_index / kPieces;
    const int piece = piece_index - t * kPieces;
    const int source_block = __shfl_sync(kFullMask, block, t & 31);
    destination = piece_index < kTotal && t < count ? t * C::kRowPitch + piece * Bytes : -1;
    const unsigned char* slot =
        block_start(p, source_block) + p.layout.slot_offset(token_slot(p, first + t), static_cast<int>(blockIdx.y));
    return slot + (piece < kKeyPieces ? piece * Bytes : C::kSlotValueOffset + (piece - kKeyPieces) * Bytes);
  };
#pragma unroll 1
  for (int base = warp_in_group * kStep; base < kTotal; base += kStep * C::kHeadGroups) {  // uniform per warp
    if constexpr (Bytes >= 4) {
      int destination;
      const unsigned char* source = piece_at(base + lane, destination);
      if (destination >= 0) copy_to_shared<Bytes>(tile + destination, source);
    } else {
      unsigned short pieces[kBatch];
      int destinations[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const unsigned char* source = piece_at(base + 32 * j + lane, destinations[j]);
        pieces[j] = destinations[j] >= 0 ? *reinterpret_cast<const unsigned short*>(source) : 0;
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (destinations[j] >= 0) *reinterpret_cast<unsigned short*>(tile + destinations[j]) = pieces[j];
      }
    }
  }
}

/// Starts loading tile [first, first + count): records into `tile` (async),
/// and returns the metadata of this lane's token (lane % kTileTokens; zeros
/// past the range). Reads only block-table entries of tokens in the range.
template <class C>
__device__ __forceinline__ TokenMeta issue_tile(const PartitionParams& p, const std::int32_t* block_table_row,
                                                int first, int count, unsigned char* tile, int lane, int warp_in_group,
                                                int copy_bytes) {
  const int t = lane % C::kTileTokens;
  TokenMeta meta{0, 0, 0};
  int block = 0;
  const bool token_slots = p.layout.token_slots();
  if (t < count) {
    const int token = first + t;
    block = block_table_row[token_block_index(p, token)];
    const bool aligned = copy_bytes >= 2;
    if (token_slots) {
      const unsigned char* slot =
          block_start(p, block) + p.layout.slot_offset(token_slot(p, token), static_cast<int>(blockIdx.y));
      if constexpr (!C::kKeyFp8) meta.key_norm = load_u16(slot + C::kSlotKeyNormOffset, aligned);
      meta.value_scale = load_u16(slot + C::kSlotValueScaleOffset, aligned);
      meta.value_zero = load_u16(slot + C::kSlotValueZeroOffset, aligned);
    } else {
      const unsigned char* field0 = block_start(p, block) + field0_offset<C>(p, token_slot(p, token));
      const std::int64_t field_stride = 2 * static_cast<std::int64_t>(p.layout.block_size);
      if constexpr (C::kKeyFp8) {
        meta.value_scale = load_u16(field0, aligned);
        meta.value_zero = load_u16(field0 + field_stride, aligned);
      } else {
        meta.key_norm = load_u16(field0, aligned);
        meta.value_scale = load_u16(field0 + field_stride, aligned);
        meta.value_zero = load_u16(field0 + 2 * field_stride, aligned);
      }
    }
  }
  if (token_slots) {
    // copy_bytes is at most kSlotPieceLimit and at least 2 (token_slots
    // caches are 2-byte aligned: the launcher checks the pointer,
    // validate_layout the strides); the limits keep the instantiations that
    // cannot happen out.
    const auto copy = [&]<int Bytes>() {
      copy_tile_slots<C, min_of(Bytes, C::kSlotPieceLimit)>(p, first, count, block, tile, lane, warp_in_group);
    };
    switch (copy_bytes) {
      case 16: copy.template operator()<16>(); break;
      case 8: copy.template operator()<8>(); break;
      case 4: copy.template operator()<4>(); break;
      default: copy.template operator()<2>(); break;
    }
    return meta;
  }
  switch (copy_bytes) {
    case 16: copy_tile_records<C, 16>(p, first, count, block, tile, lane, warp_in_group); break;
    case 8: copy_tile_records<C, 8>(p, first, count, block, tile, lane, warp_in_group); break;
    case 4: copy_tile_records<C, 4>(p, first, count, block, tile, lane, warp_in_group); break;
    case 2: copy_tile_records<C, 2>(p, first, count, block, tile, lane, warp_in_group); break;
    default: copy_tile_records<C, 1>(p, first, count, block, tile, lane, warp_in_group); break;
  }
  return meta;
}

/// Sum of the squares of the centroids of this lane's kLaneKeyDims key codes
/// at `key` (MSE keys; 0 for fp8): the token's ||c||^2, or its half at
/// D = 256. A plain loop beside key_scores' unrolled chunks, run only when
/// renormalizing, so the blocks order's code is unchanged and the kernels
/// compile once.
template <class C>
__device__ __forceinline__ float centroid_square_sum(const unsigned char* key, const float* centroids) {
  float square = 0.0f;
  if constexpr (!C::kKeyFp8) {
#pragma unroll 4
    for (int d = 0; d < C::kLaneKeyDims; ++d) {
      const float c = centroids[unpack_code(key, d, C::kKeyBits)];
      square = fmaf(c, c, square);
    }
  }
  return square;
}

/// Running online-softmax state of one warp for its kHeadsPerWarp heads:
/// m (log2 units, uniform across the warp), per-lane partial sums of p and of
/// p * vzero (reduced at the end), and the lane's slice of sum p * vscale * code.
template <class C>
struct WarpState {
  float m[C::kHeadsPerWarp];
  float l[C::kHeadsPerWarp];
  float z[C::kHeadsPerWarp];
  float acc[C::kHeadsPerWarp][C::kValueDimsPerLane];
};

/// Steps 2-4 of the file comment for one staged tile of `count` tokens at
/// positions `first_position` onwards. Row g of the warp sees the positions
/// below limits[g] (at most the range's end, so the tile's tokens past
/// `count` are masked in every row). `renormalize`: divide each key by the
/// norm of its centroid vector (token_slots with renormalize_keys; MSE keys
/// only).
template <class C>
__device__ __forceinline__ void process_tile(WarpState<C>& state, const unsigned char* tile, const TokenMeta& meta,
                                             int count, int first_position, const int* limits, const float* q,
                                             const float* centroids, float* weights, float scale_log2,
                                             bool renormalize, int lane) {
  constexpr int kHeads = C::kHeadsPerWarp;
  const int t = lane % C::kTileTokens;
  const int part = lane / C::kTileTokens;

  float s[kHeads];
  const unsigned char* key = tile + t * C::kRowPitch + part * (C::kLaneKeyDims * C::kKeyBits / 8);
  key_scores<C>(key, q + part * C::kLaneKeyDims, centroids, s);
  float square = renormalize ? centroid_square_sum<C>(key, centroids) : 0.0f;
  if constexpr (C::kLanesPerToken == 2) {
#pragma unroll
    for (int g = 0; g < kHeads; ++g) s[g] += __shfl_xor_sync(kFullMask, s[g], C::kTileTokens);
    if (renormalize) square += __shfl_xor_sync(kFullMask, square, C::kTileTokens);
  }
  static_assert(C::kLanesPerToken <= 2, "one shuffle combines the token's halves");

  // The key norm (MSE; over the centroids' norm when renormalizing, 0 for a
  // zero centroid vector) or the fp8 factor 256, the softmax scale and log2
  // e, applied once per token rather than once per element.
  float factor = C::kKeyFp8 ? scale_log2 * 256.0f : scale_log2 * half_bits_to_float(meta.key_norm);
  if (!C::kKeyFp8 && renormalize) factor *= square > 0.0f ? rsqrtf(square) : 0.0f;
  const float value_scale = half_bits_to_float(meta.value_scale);
  const float value_zero = half_bits_to_float(meta.value_zero);
  const int position = first_position + t;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    const float score = position < limits[g] ? s[g] * factor : -INFINITY;  // broadcast read
    const float m_new = fmaxf(state.m[g], warp_max(score));
    // A row whose scores are all -inf so far keeps everything at 0 instead of NaN.
    const float m_use = m_new == -INFINITY ? 0.0f : m_new;
    const float alpha = exp2f(state.m[g] - m_use);
    const float p = exp2f(score - m_use);
    const float own = part == 0 ? p : 0.0f;  // each token counted by one lane
    state.l[g] = fmaf(state.l[g], alpha, own);
    state.z[g] = fmaf(state.z[g], alpha, own * value_zero);
#pragma unroll
    for (int i = 0; i < C::kValueDimsPerLane; ++i) state.acc[g][i] *= alpha;
    state.m[g] = m_new;
    if (part == 0) weights[t * kHeads + g] = p * value_scale;
  }
  __syncwarp();

  for (int token = 0; token < count; ++token) {
    const unsigned window = value_code_window<C>(tile + token * C::kRowPitch, lane);
    float w[kHeads];
    if constexpr (kHeads % 4 == 0) {
#pragma unroll
      for (int g = 0; g < kHeads; g += 4) {
        const float4 v = *reinterpret_cast<const float4*>(weights + token * kHeads + g);  // broadcast
        w[g] = v.x;
        w[g + 1] = v.y;
        w[g + 2] = v.z;
        w[g + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int g = 0; g < kHeads; ++g) w[g] = weights[token * kHeads + g];
    }
#pragma unroll
    for (int i = 0; i < C::kValueDimsPerLane; ++i) {
      const float code = small_uint_to_float((window >> (i * C::kValueBits)) & ((1u << C::kValueBits) - 1u));
#pragma unroll
      for (int g = 0; g < kHeads; ++g) state.acc[g][i] = fmaf(w[g], code, state.acc[g][i]);
    }
  }
}

/// The query rows of one CTA: row r is head r % group of kv head h (query
/// head first_head + r % group) for query token first_token + r / group of
/// its sequence; its partition entries are those of query slot (sequence b,
/// token j) = first_slot + r / group.
struct CtaRows {
  std::int64_t first_slot;  ///< b * max_query_len + the CTA's first token
  int first_token_row;      ///< the query row (of T) of the CTA's first token
  int first_head;           ///< kv head * group
  int group;
  int num_q_heads;
  int count;  ///< rows: tokens x group

  /// Index of row r's partition entries: (slot * Hq + query head); times N plus p addresses them.
  __device__ __forceinline__ std::int64_t entry(int r) const {
    return (first_slot + r / group) * num_q_heads + first_head + r % group;
  }
  /// Row r's query in the [T, Hq] rows of q_rot.
  __device__ __forceinline__ std::int64_t query_row(int r) const {
    return static_cast<std::int64_t>(first_token_row + r / group) * num_q_heads + first_head + r % group;
  }
};

/// Writes the empty-partition values (max -inf, sum 0, out 0) for the CTA's rows.
template <class C>
__device__ __forceinline__ void write_empty_partition(const PartitionParams& p, const CtaRows& rows, int partition) {
  constexpr int kQuads = C::kHeadDim / 4;
  for (int i = threadIdx.x; i < rows.count * kQuads; i += C::kThreads) {
    const std::int64_t entry = rows.entry(i / kQuads);
    float* out = p.part_out + (entry * p.num_partitions + partition) * C::kHeadDim + (i % kQuads) * 4;
    *reinterpret_cast<float4*>(out) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  for (int r = threadIdx.x; r < rows.count; r += C::kThreads) {
    p.part_max[rows.entry(r) * p.num_partitions + partition] = -INFINITY;
    p.part_sum[rows.entry(r) * p.num_partitions + partition] = 0.0f;
  }
}

template <class C>
__device__ __forceinline__ void partitions_body(const PartitionParams& p, const QueryRows& query_rows,
                                                unsigned char* smem) {
  constexpr int D = C::kHeadDim;
  constexpr int kHeads = C::kHeadsPerWarp;
  const int partition = blockIdx.x % p.num_partitions;
  const int query_tile = blockIdx.x / p.num_partitions;
  const int kv_head = blockIdx.y;
  const int b = blockIdx.z;
  const int num_kv_heads = p.layout.num_kv_heads;
  const int group = p.num_q_heads / num_kv_heads;

  // This CTA's query tokens of sequence b; none (a tile past its q_len) writes nothing, as the reducer reads nothing there.
  const QueryRows::Span span = query_rows.span(b);
  const int first_token = query_tile * query_rows.tokens_per_cta;
  const int tokens = min(query_rows.tokens_per_cta, span.count - first_token);
  if (tokens <= 0) return;
  const CtaRows rows{static_cast<std::int64_t>(b) * query_rows.max_query_len + first_token, span.first + first_token,
                     kv_head * group, group, p.num_q_heads, tokens * group};

  // NOTE: only entries of this sequence's block-table row are ever read.
  // Token j of the span sees positions below seq_len - count + j + 1; the
  // range stops at the CTA's last token's limit (the whole partition with
  // one token per sequence), which is <= 0 on inconsistent lengths.
  const int seq_len = p.covered_length(p.seq_lens[b]);
  const int context_base = seq_len - span.count + first_token + 1;  // limit of the CTA's first token
  const TokenRange partition_tokens = partition_range(seq_len, p.num_partitions, p.partition_align, partition);
  const TokenRange range{partition_tokens.begin, min(partition_tokens.end, context_base + tokens - 1)};
  if (range.begin >= range.end) {  // past the sequence end or every row's limit: no block-table or cache read
    write_empty_partition<C>(p, rows, partition);
    return;
  }

  float* q_s = reinterpret_cast<float*>(smem + C::kQueryOffset);
  float* centroids_s = reinterpret_cast<float*>(smem + C::kCentroidOffset);
  int* row_limits_s = reinterpret_cast<int*>(smem + C::kRowLimitOffset);
  {
    constexpr int kQuads = D / 4;
    for (int i = threadIdx.x; i < C::kMaxRows * kQuads; i += C::kThreads) {
      // Rows past the CTA's are zero: they compute harmless zeros, never stored.
      const int r = i / kQuads;
      reinterpret_cast<float4*>(q_s)[i] =
          r < rows.count ? reinterpret_cast<const float4*>(p.q_rot + rows.query_row(r) * D)[i % kQuads]
                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (int r = threadIdx.x; r < C::kMaxRows; r += C::kThreads) {
      row_limits_s[r] = r < rows.count ? min(context_base + r / group, range.end) : range.end;
    }
    if constexpr (C::kCentroids > 0) {
      if (threadIdx.x < C::kCentroids) centroids_s[threadIdx.x] = p.centroids[threadIdx.x];
    }
  }
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int head_group = warp % C::kHeadGroups;
  const int token_group = warp / C::kHeadGroups;
  const float* q_warp = q_s + head_group * kHeads * D;
  const int* limits_warp = row_limits_s + head_group * kHeads;
  float* weights = reinterpret_cast<float*>(smem + C::kWeightOffset) + warp * C::kTileTokens * kHeads;
  unsigned char* stage = smem + C::kStageOffset + token_group * 2 * C::kTileBytes;

  const std::int32_t* block_table_row = p.block_table + b * p.block_table_stride;  // resolved: 0 is one row
  // Widest copy that every record address allows (the record size is a
  // multiple of 8); in the token_slots order, every key and value data
  // address (MSE slots put the value data 2 bytes past a multiple of 8).
  const bool token_slots = p.layout.token_slots();
  const bool renormalize = token_slots && p.layout.renormalize_keys;
  const std::uint64_t slot_strides =
      static_cast<std::uint64_t>(p.layout.token_stride) |
      (p.layout.num_kv_heads > 1 ? static_cast<std::uint64_t>(p.layout.head_stride) : 0u) |
      static_cast<std::uint64_t>(C::kSlotPieceLimit);
  const unsigned alignment = static_cast<unsigned>(reinterpret_cast<std::uintptr_t>(p.cache) |
                                                   static_cast<std::uint64_t>(p.layout.block_stride) |
                                                   (token_slots ? slot_strides : std::uint64_t{C::kRecordBytes}));
  const int copy_bytes = (alignment & 15u) == 0  ? 16
                         : (alignment & 7u) == 0 ? 8
                         : (alignment & 3u) == 0 ? 4
                         : (alignment & 1u) == 0 ? 2
                                                 : 1;
  const float scale_log2 = p.scale * kLog2e;

  WarpState<C> state;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    state.m[g] = -INFINITY;
    state.l[g] = 0.0f;
    state.z[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < C::kValueDimsPerLane; ++i) state.acc[g][i] = 0.0f;
  }

  // NOTE: the tile loop's trip count is the same for every warp of a token
  // group, so the group barriers below are always matched.
  const auto group_sync = [&] {
    if constexpr (C::kHeadGroups == 1) {
      __syncwarp();
    } else {
      named_barrier_sync<C::kTokenGroups>(token_group, 32 * C::kHeadGroups);
    }
  };
  const int range_tokens = range.end - range.begin;
  const int num_tiles = (range_tokens + C::kTileTokens - 1) / C::kTileTokens;
  const auto tile_count = [&](int tile) { return min(C::kTileTokens, range_tokens - tile * C::kTileTokens); };

  int tile = token_group;
  TokenMeta next_meta{0, 0, 0};
  if (tile < num_tiles) {
    next_meta = issue_tile<C>(p, block_table_row, range.begin + tile * C::kTileTokens, tile_count(tile), stage, lane,
                              head_group, copy_bytes);
  }
  cp_async_commit();
  for (int iteration = 0; tile < num_tiles; ++iteration, tile += C::kTokenGroups) {
    const TokenMeta meta = next_meta;
    const int next_tile = tile + C::kTokenGroups;
    if (next_tile < num_tiles) {  // prefetch into the other buffer, freed by the barrier ending the last iteration
      next_meta = issue_tile<C>(p, block_table_row, range.begin + next_tile * C::kTileTokens, tile_count(next_tile),
                                stage + ((iteration + 1) & 1) * C::kTileBytes, lane, head_group, copy_bytes);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this thread's copies of `tile` have landed
    group_sync();        // ... and everyone else's
    process_tile<C>(state, stage + (iteration & 1) * C::kTileBytes, meta, tile_count(tile),
                    range.begin + tile * C::kTileTokens, limits_warp, q_warp, centroids_s, weights, scale_log2,
                    renormalize, lane);
    group_sync();  // the buffer and `weights` are free for the next iteration
  }

  // Merge the token groups' states through shared memory (aliasing the stage area).
  __syncthreads();
  float* merge = reinterpret_cast<float*>(smem + C::kStageOffset);
  {
    float* mine = merge + warp * C::kMergeFloatsPerWarp;
#pragma unroll
    for (int g = 0; g < kHeads; ++g) {
#pragma unroll
      for (int i = 0; i < C::kValueDimsPerLane; ++i) mine[g * D + lane * C::kValueDimsPerLane + i] = state.acc[g][i];
      const float l = warp_sum(state.l[g]);
      const float z = warp_sum(state.z[g]);
      if (lane == 0) {
        mine[kHeads * D + g] = state.m[g];
        mine[kHeads * D + kHeads + g] = l;
        mine[kHeads * D + 2 * kHeads + g] = z;
      }
    }
  }
  __syncthreads();

  constexpr int kQuads = D / 4;
  for (int i = threadIdx.x; i < rows.count * kQuads; i += C::kThreads) {
    const int r = i / kQuads;
    const int dim = (i % kQuads) * 4;
    const int owner_head_group = r / kHeads;
    const int head = r % kHeads;
    float m_max = -INFINITY;
#pragma unroll
    for (int tg = 0; tg < C::kTokenGroups; ++tg) {
      const float* st = merge + (tg * C::kHeadGroups + owner_head_group) * C::kMergeFloatsPerWarp + kHeads * D;
      m_max = fmaxf(m_max, st[head]);
    }
    const float m_use = m_max == -INFINITY ? 0.0f : m_max;
    float4 num = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float den = 0.0f;
#pragma unroll
    for (int tg = 0; tg < C::kTokenGroups; ++tg) {
      const float* base = merge + (tg * C::kHeadGroups + owner_head_group) * C::kMergeFloatsPerWarp;
      const float* st = base + kHeads * D;
      const float e = exp2f(st[head] - m_use);
      const float z = st[2 * kHeads + head];
      const float4 a = *reinterpret_cast<const float4*>(base + head * D + dim);
      den = fmaf(e, st[kHeads + head], den);
      num.x = fmaf(e, a.x + z, num.x);
      num.y = fmaf(e, a.y + z, num.y);
      num.z = fmaf(e, a.z + z, num.z);
      num.w = fmaf(e, a.w + z, num.w);
    }
    const float inverse = den > 0.0f ? 1.0f / den : 0.0f;
    const std::int64_t out_index = rows.entry(r) * p.num_partitions + partition;
    *reinterpret_cast<float4*>(p.part_out + out_index * D + dim) =
        make_float4(num.x * inverse, num.y * inverse, num.z * inverse, num.w * inverse);
    if (dim == 0) {
      p.part_max[out_index] = den > 0.0f ? m_max * 0.6931471805599453f : -INFINITY;  // back to natural units
      p.part_sum[out_index] = den;
    }
  }
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocksPerSm)
    partitions_kernel(const __grid_constant__ PartitionParams params, const __grid_constant__ QueryRows rows) {
  extern __shared__ __align__(16) unsigned char smem[];
  partitions_body<C>(params, rows, smem);
}

/// Launches one instance. Explicitly instantiated in src/cuda/instances/.
template <Preset P, int D, int R>
void launch_instance(const PartitionParams& params, const QueryRows& rows, cudaStream_t stream) {
  using C = Config<P, D, R>;
  constexpr int kSmem = C::kSmemBytes;
  if constexpr (kSmem > 48 * 1024) allow_dynamic_shared_memory<partitions_kernel<C>>(kSmem);
  const int query_tiles = (rows.max_query_len + rows.tokens_per_cta - 1) / rows.tokens_per_cta;
  const dim3 grid(params.num_partitions * query_tiles, params.layout.num_kv_heads, params.batch);
  partitions_kernel<C><<<grid, C::kThreads, kSmem, stream>>>(params, rows);
  TQ_CUDA_CHECK_LAUNCH();
}

// The instance list, for the explicit instantiations and the dispatcher.
#define TQ_GENERIC_ROW_BUCKETS(X, P, D) X(P, D, 1) X(P, D, 2) X(P, D, 4) X(P, D, 8) X(P, D, 16) X(P, D, 32)
#define TQ_GENERIC_INSTANCES_OF_PRESET(X, P) \
  TQ_GENERIC_ROW_BUCKETS(X, P, 64) TQ_GENERIC_ROW_BUCKETS(X, P, 128) TQ_GENERIC_ROW_BUCKETS(X, P, 256)
#define TQ_GENERIC_INSTANTIATE(P, D, R) \
  template void launch_instance<P, D, R>(const PartitionParams&, const QueryRows&, cudaStream_t);
#define TQ_GENERIC_EXTERN(P, D, R) \
  extern template void launch_instance<P, D, R>(const PartitionParams&, const QueryRows&, cudaStream_t);

}  // namespace tqdecode::cuda::generic
