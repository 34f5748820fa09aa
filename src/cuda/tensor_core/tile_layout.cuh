// Where one 16-token tile of the paged cache lives in a stage of a Hopper
// decode warp's shared-memory ring, and how cp.async gets it there, per cache
// format (internal; used by kernel.cuh). Every layout keeps the lanes'
// operand loads free of bank conflicts (or at most pairwise) and makes each
// 32-byte sector of the cache come from one copy instruction.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "fragments.cuh"
#include "../kernel_params.hpp"

namespace tqdecode::cuda::tensor_core {

constexpr int kTileTokens = kHopperTileTokens;

// copy_to_shared<16> (device_utils.cuh) takes a generic pointer; the ring
// keeps precomputed 32-bit shared addresses, which save its conversion per copy.
__device__ __forceinline__ void cp_async_16(std::uint32_t shared_address, const std::uint8_t* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address), "l"(global) : "memory");
}

// Physical block of a tile.
__device__ __forceinline__ int tile_block(const std::int32_t* table, int tile, int block_shift) {
  return __ldg(table + ((tile * kTileTokens) >> block_shift));
}

// The fp16 fields of a tile: `Fields` fields x 16 tokens x 2 bytes, one
// 16-byte chunk for each of lanes 0 .. 2 Fields - 1.
template <int Fields, int MetaOffset>
struct FieldChunk {
  std::uint32_t source;       // from the block start, for slot 0 of the tile
  std::uint32_t destination;  // within a stage

  __device__ static FieldChunk make(const PartitionParams& p, int head, int lane) {
    const int field = lane >> 1;
    return {static_cast<std::uint32_t>(p.layout.metadata_region_offset() +
                                       2 * (head * Fields + field) * p.layout.block_size + 16 * (lane & 1)),
            static_cast<std::uint32_t>(MetaOffset + 32 * field + 16 * (lane & 1))};
  }
  __device__ void issue(std::uint32_t stage, const std::uint8_t* block, std::uint32_t slot0, int lane) const {
    if (lane < 2 * Fields) cp_async_16(stage + destination, block + (2 * slot0 + source));
  }
};

// A per-token run of `Chunks` 16-byte chunks for the tile's 16 tokens (one
// slot stride apart), copied so that every 32-byte sector comes from one
// instruction: copy i takes tokens kTokensPerCopy i .. + kTokensPerCopy - 1,
// lane l chunk l % Chunks of token kTokensPerCopy i + l / Chunks. (Two copies
// per sector cost a second L2 request for each.) A copy fills 512 stage
// bytes; the layout's swizzle repeats every `Period` copies, so copy i lands
// at destination[i % Period] + 512 Period (i / Period).
template <int Chunks, int Period = 2>
struct TokenRunCopy {
  static constexpr int kTokensPerCopy = 32 / Chunks;
  static constexpr int kCopies = kTileTokens / kTokensPerCopy;
  static constexpr int kPeriod = std::min(Period, kCopies);
  std::uint32_t source;       // the lane's chunk, from the tile's first slot
  std::uint32_t copy_stride;  // kTokensPerCopy slots
  std::uint32_t destination[kPeriod];

  /// `destination_of(token, chunk)`: the chunk's offset within a stage.
  template <class Destination>
  __device__ static TokenRunCopy make(int slot_stride, int run_offset, int lane, Destination destination_of) {
    const int token = lane / Chunks;
    const int chunk = lane % Chunks;
    TokenRunCopy copy{static_cast<std::uint32_t>(token * slot_stride + run_offset + 16 * chunk),
                      static_cast<std::uint32_t>(kTokensPerCopy * slot_stride)};
#pragma unroll
    for (int i = 0; i < kPeriod; ++i) {
      copy.destination[i] = static_cast<std::uint32_t>(destination_of(token + kTokensPerCopy * i, chunk));
    }
    return copy;
  }
  __device__ void issue(std::uint32_t stage, const std::uint8_t* tile) const {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      cp_async_16(stage + destination[i % kPeriod] + 512 * kPeriod * (i / kPeriod), tile + (source + i * copy_stride));
    }
  }
};

// Where one tile lives in a stage of a warp's ring and how it gets there, per
// key format and head size D (offsets take the kv head and the kv heads'
// count: the 3-bit layouts' windows start up to 24 bytes before the record,
// at D = 64 depending on the token). Lane (g, c) = (lane >> 2, lane & 3)
// reads the keys of tokens g and g + 8 (dims (D/4)c .. (D/4)(c+1) - 1) and
// the values of dims (D/8)g .. (D/8)(g+1) - 1 of tokens 2c, 2c + 1, 2c + 8,
// 2c + 9; every layout keeps those loads free of bank conflicts, or pairs
// them at most where it says so. Offsets into the cache are within a block
// (hopper_unsupported_reason requires block_stride < 2^31).
//   mse4     4-bit MSE keys, 4-bit values (turboquant_4bit_nc)
//   mse3     3-bit MSE keys, 4-bit values (turboquant_k3v4_nc)
//   mse3_v3  3-bit MSE keys, 3-bit values (turboquant_3bit_nc)
//   fp8      fp8 keys, 4-bit values (turboquant_k8v4)
enum class CacheFormat { mse4, mse3, mse3_v3, fp8 };

/// The key format of a preset.
constexpr CacheFormat cache_format(Preset preset) {
  switch (preset) {
    case Preset::turboquant_k8v4: return CacheFormat::fp8;
    case Preset::turboquant_k3v4_nc: return CacheFormat::mse3;
    case Preset::turboquant_3bit_nc: return CacheFormat::mse3_v3;
    default: return CacheFormat::mse4;
  }
}

constexpr bool three_bit_keys(CacheFormat format) { return format == CacheFormat::mse3 || format == CacheFormat::mse3_v3; }
constexpr int value_bits(CacheFormat format) { return format == CacheFormat::mse3_v3 ? 3 : 4; }

// How value code `code` of a lane's D/8 (dims (D/8)g + code) enters the mma: at
// bit `position` of an fp16 mantissa whose exponent is that of 1, so the
// operand is 1 + c 2^(position - 10). The ones are subtracted after the loop
// (the sum of P' against ones, from the same mma accumulation) and the rest
// is scaled by 2^(10 - position); one mask-and-or builds each operand, with
// no fp16 subtraction. The cost is precision: the fp32 rounding of a sum of
// magnitude sum P' becomes 2^-(14 + position) of a code step at most per
// addition. 4-bit values: byte m of a token holds
// codes 2m (position 0) and 2m + 1 (position 4). 3-bit values: code i is
// bits 3i..3i+2 of the lane's 3D/8, taken from a 16-bit window at byte
// 3i / 8 (position 3i % 8, which repeats every 8 codes).
constexpr int value_code_position(CacheFormat format, int code) {
  return value_bits(format) == 4 ? 4 * (code % 2) : 3 * code % 8;
}
// Every code fits its fp16 mantissa (10 bits).
static_assert([] {
  for (CacheFormat format : {CacheFormat::mse4, CacheFormat::mse3_v3}) {
    for (int code = 0; code < 32; ++code) {
      if (value_code_position(format, code) + value_bits(format) > 10) return false;
    }
  }
  return true;
}());

// A per-token run of `Chunks` 16-byte chunks (Chunks even, not dividing 32)
// for the tile's 16 tokens, packed: copy i takes chunks 32 i .. 32 i + 31 of
// the tile's 16 Chunks, chunk q being chunk q % Chunks of token q / Chunks.
// A 32-byte sector of a run that starts on a sector boundary is an
// even-aligned chunk pair, so each comes from one instruction.
template <int Chunks>
struct PackedRunCopy {
  static_assert(Chunks % 2 == 0 && kTileTokens * Chunks % 32 == 0);
  static constexpr int kCopies = kTileTokens * Chunks / 32;
  std::uint32_t source[kCopies];  // from the tile's first slot
  std::uint32_t destination[kCopies];

  /// No token's run starts before the run offset.
  struct NoLead {
    __device__ int operator()(int /*token*/) const { return 0; }
  };
  /// `destination_of(token, chunk)`: the chunk's offset within a stage;
  /// `lead(token)`: bytes by which the token's run starts before run_offset.
  template <class Destination, class Lead = NoLead>
  __device__ static PackedRunCopy make(int slot_stride, int run_offset, int lane, Destination destination_of,
                                       Lead lead = {}) {
    PackedRunCopy copy;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int token = (32 * i + lane) / Chunks;
      const int chunk = (32 * i + lane) % Chunks;
      copy.source[i] = static_cast<std::uint32_t>(token * slot_stride + run_offset - lead(token) + 16 * chunk);
      copy.destination[i] = static_cast<std::uint32_t>(destination_of(token, chunk));
    }
    return copy;
  }
  __device__ void issue(std::uint32_t stage, const std::uint8_t* tile) const {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) cp_async_16(stage + destination[i], tile + source[i]);
  }
};

// The issue plan of a layout whose tile is one copy of its records (whole,
// or in windows from a sector boundary) and one of its fp16 fields.
template <class RecordCopy, int Fields, int MetaOffset>
struct alignas(16) RecordIssuePlan {
  std::uint32_t slot_stride;  // Hk * record bytes
  RecordCopy records;
  FieldChunk<Fields, MetaOffset> fields;  // lanes 0 .. 2 Fields - 1

  __device__ static RecordIssuePlan make(const PartitionParams& p, int head, int lane, int slot_stride,
                                         const RecordCopy& records) {
    return {static_cast<std::uint32_t>(slot_stride), records, FieldChunk<Fields, MetaOffset>::make(p, head, lane)};
  }
  __device__ void issue(std::uint32_t stage, const std::uint8_t* block, std::uint32_t slot0, int lane) const {
    records.issue(stage, block + slot0 * slot_stride);
    fields.issue(stage, block, slot0, lane);
  }
};

// Where a token_slots tile's repack (slot_tile.cuh) puts the 16-byte
// chunk k of a token: record bytes record_byte .. + 15 (key data then value
// data, as in the blocks order; bytes outside the record are never read)
// at `destination` in a stage, as the layout's cp.async plan would.
struct RecordChunk {
  int record_byte;
  int destination;
};

// The plan of a layout packing whole records (Hk * kRecordBytes and
// head * kRecordBytes multiples of 32) with a PackedRunCopy, each record
// chunk where the layout's record_chunk puts it (whole records start on a
// sector, so their chunks' places do not depend on the kv head).
template <class Layout>
__device__ __forceinline__ typename Layout::IssuePlan packed_record_plan(const PartitionParams& p, int head, int lane) {
  constexpr int kRecordBytes = Layout::kRecordBytes;
  const int slot_stride = p.layout.num_kv_heads * kRecordBytes;
  const auto destination = [](int token, int chunk) { return Layout::record_chunk(token, chunk, 0, 0).destination; };
  const auto records = PackedRunCopy<kRecordBytes / 16>::make(slot_stride, head * kRecordBytes, lane, destination);
  return Layout::IssuePlan::make(p, head, lane, slot_stride, records);
}

template <CacheFormat Format, int HeadDim>
struct TileLayout;

// 4-bit MSE keys: one D-byte row per token (D/2 key bytes, then D/2 value
// bytes), its 16-byte chunks XOR-swizzled by token (chunk_offset); then the 3
// fp16 fields. D = 128: bulk tensor copies (the wide shape's CTAs) put chunk
// j at j ^ (token & 7), the copy engine's 128-byte swizzle; there tile index
// i (an S^T row, an O^T k index) is token i ^ 4 (i & 1), so the two tokens of
// a quarter warp's key loads fall in different halves of the bank space and
// the four of a half warp's value loads in different quarters, free of bank
// conflicts as cp.async's swizzle is. (`Bulk` selects the arrangement.)
template <int HeadDim>
struct TileLayout<CacheFormat::mse4, HeadDim> {
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256);
  static constexpr int kKeyBytes = HeadDim / 2;
  static constexpr int kRecordBytes = HeadDim;  // key + value data of one (slot, head)
  static constexpr int kFields = 3;             // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * kRecordBytes;
  static constexpr int kStageBytes = kMetaOffset + 128;  // 3 x 32 B of fields, padded
  // Token index i + 8's offsets are token index i's plus this (either arrangement).
  static constexpr int kOffset8Tokens = 8 * kRecordBytes;
  static constexpr int kLaneKeyBytes = HeadDim / 8;     // a lane's D/4 key dims
  static constexpr int kLaneValueBytes = HeadDim / 16;  // a lane's D/8 value dims
  static constexpr int kKeyLoads = HeadDim == 256 ? 2 : 1;  // of 16 bytes (8 at D = 64) per token
  // D = 256: the swizzle spans 8 tokens, 4 copies of 2 tokens.
  static constexpr int kCopyPeriod = HeadDim == 256 ? 4 : 2;

  template <bool Bulk>
  __device__ static int token_at(int index) {
    return Bulk ? index ^ ((index & 1) << 2) : index;
  }
  // D = 64: two tokens per 128-byte row, unit 4 (token & 1) + chunk stored
  // at that ^ 2 (row & 3). D = 256: chunk ^ (token & 7) within each half
  // row. Each keeps the 8- and 16-byte key loads (tokens g, chunks of c) and
  // the value loads (tokens 2c + x, chunks of g) on distinct banks.
  template <bool Bulk>
  __device__ static int chunk_offset(int token, int chunk) {
    if constexpr (HeadDim == 64) {
      const int row = token >> 1;
      return row * 128 + (((4 * (token & 1) + chunk) ^ (2 * (row & 3))) << 4);
    } else if constexpr (HeadDim == 256) {
      return token * kRecordBytes + ((chunk ^ (token & 7)) << 4);
    } else {
      const int swizzle = Bulk ? token & 7 : ((token & 1) << 2) ^ (token & 6);
      return token * kRecordBytes + ((chunk ^ swizzle) << 4);
    }
  }
  template <bool Bulk>
  __device__ static int byte_offset(int token, int byte) {
    return chunk_offset<Bulk>(token, byte >> 4) + (byte & 15);
  }
  /// The lane's key bytes of `token`, 16 bytes from `part` 16 (a load of
  /// 8 bytes at D = 64, one of 16 at D = 128, two at D = 256).
  template <bool Bulk>
  __device__ static int key_offset(int token, int c, int part = 0) {
    return byte_offset<Bulk>(token, kLaneKeyBytes * c + 16 * part);
  }
  /// The lane's value bytes of `token` (the same for every kv head).
  template <bool Bulk = false>
  __device__ static int value_offset(int token, int g, int /*head*/) {
    return byte_offset<Bulk>(token, kKeyBytes + kLaneValueBytes * g);
  }

  using IssuePlan = RecordIssuePlan<TokenRunCopy<kRecordBytes / 16, kCopyPeriod>, kFields, kMetaOffset>;

  static constexpr int kRecordChunks = kRecordBytes / 16;
  __device__ static RecordChunk record_chunk(int token, int k, int /*head*/, int /*num_kv_heads*/) {
    return {16 * k, chunk_offset<false>(token, k)};
  }

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    const int slot_stride = p.layout.num_kv_heads * kRecordBytes;
    const auto records =
        TokenRunCopy<kRecordBytes / 16, kCopyPeriod>::make(slot_stride, head * kRecordBytes, lane, chunk_offset<false>);
    return IssuePlan::make(p, head, lane, slot_stride, records);
  }
};

// The value area of the fp8 layout: 4-bit values, D/2 bytes per token.
// D = 64 and 128: 128 / (D/2) tokens per 128-byte row, 16-byte unit u of
// the row stored at u ^ 2 (row & 3); D = 256: one token per row, chunk
// ^ (token & 7). Either way the lanes' value loads (tokens 2c + x, bytes of
// lane g) never share a bank.
template <int HeadDim>
struct ValueArea {
  static constexpr int kTokenBytes = HeadDim / 2;
  static constexpr int kTokensPerRow = 128 / std::min(kTokenBytes, 128);
  static constexpr int kLaneBytes = HeadDim / 16;
  /// Unit `chunk` (bytes 16 chunk .. 16 chunk + 15) of `token`'s values.
  __device__ static int chunk_offset(int token, int chunk) {
    if constexpr (HeadDim == 256) return token * kTokenBytes + ((chunk ^ (token & 7)) << 4);
    const int row = token / kTokensPerRow;
    return row * 128 + ((((token % kTokensPerRow) * (kTokenBytes / 16) + chunk) ^ (2 * (row & 3))) << 4);
  }
  /// The lane's value bytes (dims (D/8)g ..) of `token`, from the area start.
  __device__ static int offset(int token, int g) {
    const int byte = kLaneBytes * g;
    return chunk_offset(token, byte >> 4) + (byte & 15);
  }
  /// The values' copy plan of a layout whose value area starts at `area`.
  template <int Area>
  __device__ static TokenRunCopy<kTokenBytes / 16> copy_plan(int slot_stride, int value_offset, int lane) {
    return TokenRunCopy<kTokenBytes / 16>::make(slot_stride, value_offset, lane,
                                                [](int token, int chunk) { return Area + chunk_offset(token, chunk); });
  }
};

// 3-bit MSE keys (turboquant_k3v4_nc): one 128-byte row per token holding
// the window of the cache from the 32-byte sector boundary at or below the
// token's 112-byte record (48 key bytes, 64 value bytes): exactly the four
// sectors the record touches, so each sector is one request of one copy
// instruction (the 4-bit layout's TokenRunCopy<8>). The record starts
// lead(head) = 0 or 16 bytes into its row. The row's 16-byte chunks are
// XOR-swizzled by token & 7: a lane's key word w of token t (byte
// lead + 12c + 4w) lands in bank 4 (chunk ^ t) + word, and the words 3c + w
// mod 4 of the four lanes of a token differ, so the 32 lanes' loads are
// conflict-free, as are the values' 8-byte loads. Then the 3 fp16 fields.
// (A dense 48-byte key area and a value area of two tokens per row cost
// excess shared wavefronts and L2 sectors: docs/PERFORMANCE.md.)
template <>
struct TileLayout<CacheFormat::mse3, 128> {
  static constexpr int kKeyBytes = 48;
  static constexpr int kRecordBytes = kKeyBytes + 64;  // 112
  static constexpr int kRowBytes = 128;                // the window of one token
  static constexpr int kFields = 3;                    // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * kRowBytes;  // 2048
  static constexpr int kStageBytes = kMetaOffset + 96;         // 2144

  /// Bytes from the window's start to the record of kv head `head`.
  __device__ static int lead(int head) { return (head * kRecordBytes) & 31; }
  /// Byte `byte` of `token`'s window in a stage.
  __device__ static int row_offset(int token, int byte) {
    return token * kRowBytes + ((((byte >> 4) ^ token) & 7) << 4) + (byte & 15);
  }
  /// Key word w (of 3) of the lane's 12 key bytes (dims 32c..32c+31, 3 bits each) of `token`.
  __device__ static int key_word_offset(int token, int c, int w, int head, int /*num_kv_heads*/) {
    return row_offset(token, lead(head) + 12 * c + 4 * w);
  }
  /// From a token's key words to those of the token 8 later (the same swizzle).
  static constexpr int kOffset8Tokens = 8 * kRowBytes;
  static constexpr int kKeyLoads = 1;  // key_word_offset instead
  static constexpr int kKeyWords = 3, kKeyWordLoads = 3, kKeyLoadBytes = 4;  // three 4-byte loads
  /// The lane's 8 value bytes of `token`.
  __device__ static int value_offset(int token, int g, int head, int /*num_kv_heads*/) {
    return row_offset(token, lead(head) + kKeyBytes + 8 * g);
  }

  using IssuePlan = RecordIssuePlan<TokenRunCopy<kRowBytes / 16>, kFields, kMetaOffset>;

  // The row's chunks from the window start, lead(head) bytes before the record.
  static constexpr int kRecordChunks = kRowBytes / 16;
  __device__ static RecordChunk record_chunk(int token, int k, int head, int /*num_kv_heads*/) {
    return {16 * k - lead(head), row_offset(token, 16 * k)};
  }

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    const int slot_stride = p.layout.num_kv_heads * kRecordBytes;
    const auto destination = [](int token, int chunk) { return row_offset(token, 16 * chunk); };
    const auto records =
        TokenRunCopy<kRowBytes / 16>::make(slot_stride, head * kRecordBytes - lead(head), lane, destination);
    return IssuePlan::make(p, head, lane, slot_stride, records);
  }
};

// 3-bit MSE keys and 3-bit values (turboquant_3bit_nc): one 128-byte row per
// token holding its 96-byte record (48 key bytes, 48 value bytes: three whole
// sectors, as Hk * 96 and head * 96 are multiples of 32), copied by
// PackedRunCopy<6>. Chunk k of token t sits at 16-byte position
// k + rotation(t) mod 8 of its row. rotation(t) = 6 t + ((t >> 2) & 1) mod 8
// takes 8 distinct values over t = 0..7, so the key loads of the 8 tokens g
// are conflict-free (the 4 lanes of a token read distinct words 3c + w mod
// 4), and each quarter-warp of a copy writes 8 consecutive chunks to 8
// distinct positions. Lane g's values (dims 16g..16g+15) are the 6 bytes at
// 48 + 6g: the two 4-byte words from byte 48 + (6g & ~3) (bit 16 (g & 1)
// onwards), which may lie in two chunks; the four tokens' words share a bank
// at most pairwise (as in any row layout of whole chunks). Then the 3 fp16
// fields. (Dense 48-byte key and value areas take four copies a tile; this
// layout three.)
template <>
struct TileLayout<CacheFormat::mse3_v3, 128> {
  static constexpr int kKeyBytes = 48;
  static constexpr int kValueBytes = 48;
  static constexpr int kRecordBytes = kKeyBytes + kValueBytes;  // 96
  static constexpr int kRowBytes = 128;
  static constexpr int kFields = 3;  // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * kRowBytes;  // 2048
  static constexpr int kStageBytes = kMetaOffset + 96;         // 2144

  __device__ static int rotation(int token) { return (6 * token + ((token >> 2) & 1)) & 7; }
  /// Byte `byte` of `token`'s record in a stage.
  __device__ static int row_offset(int token, int byte) {
    return token * kRowBytes + ((((byte >> 4) + rotation(token)) & 7) << 4) + (byte & 15);
  }
  /// Key word w (of 3) of the lane's 12 key bytes (dims 32c..32c+31) of `token`.
  __device__ static int key_word_offset(int token, int c, int w, int /*head*/, int /*num_kv_heads*/) {
    return row_offset(token, 12 * c + 4 * w);
  }
  /// From a token's words to those of the token 8 later (rotation(t + 8) = rotation(t)).
  static constexpr int kOffset8Tokens = 8 * kRowBytes;
  static constexpr int kKeyLoads = 1;  // key_word_offset instead
  static constexpr int kKeyWords = 3, kKeyWordLoads = 3, kKeyLoadBytes = 4;  // three 4-byte loads
  static constexpr int kValueWordLoads = 2;
  /// Value word w (of 2) of lane g for `token`.
  __device__ static int value_word_offset(int token, int g, int w, int /*head*/, int /*num_kv_heads*/) {
    return row_offset(token, kKeyBytes + ((6 * g) & ~3) + 4 * w);
  }

  using IssuePlan = RecordIssuePlan<PackedRunCopy<kRecordBytes / 16>, kFields, kMetaOffset>;

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    return packed_record_plan<TileLayout>(p, head, lane);
  }

  static constexpr int kRecordChunks = kRecordBytes / 16;
  __device__ static RecordChunk record_chunk(int token, int k, int /*head*/, int /*num_kv_heads*/) {
    return {16 * k, row_offset(token, 16 * k)};
  }
};

// 3-bit keys at D = 64: a lane's 6 key bytes (dims 16c..16c+15) start at
// record byte 6c, 2 (c & 1) bytes into the word at 6c & ~3. It loads that
// word and the next, the next first where c is odd: the first loads of the
// four lanes of a token then take words 0, 2, 3, 5 (from the record's start)
// and the second loads words 1, 1, 4, 4, one word of each bank residue mod 4
// a token, where the words in order took residue 0 twice. The kernel's byte
// permutes put the 48 bits in order (key_low_selector).
__device__ __forceinline__ int three_bit_key_word_byte_d64(int c, int w) { return ((6 * c) & ~3) + 4 * (w ^ (c & 1)); }

// 3-bit MSE keys, 4-bit values at D = 64 (turboquant_k3v4_nc): 56-byte
// records (24 key bytes, 32 value bytes), 8-byte aligned, so a record starts
// lead = 0, 8, 16 or 24 bytes after the sector boundary at or below it,
// depending on the token as well as the kv head where Hk is odd (the tile's
// first record starts on one: 16 x 56 Hk is a multiple of 32, and so are the
// 8 tokens' 8 x 56 Hk between tokens i and i + 8). Each token's window of 6
// chunks (three sectors: lead + 56 <= 80) from that boundary is one run of a
// PackedRunCopy<6>, whose instructions never split a sector. Token t's row
// is 128 bytes; window chunk k sits at 16-byte position (k - lead / 16 + t)
// mod 8, which puts the record's byte b at ((lead mod 16) + b) from position
// t: the lanes' value words (tokens 2c + x, record bytes 24 + 4g) are then
// free of bank conflicts, as are the key loads where Hk is even (a record
// lead mod 16 the same for every token); where Hk is odd the tokens' leads
// alternate between 0 and 8 mod 16 and one key load of the two pairs up.
template <>
struct TileLayout<CacheFormat::mse3, 64> {
  static constexpr int kKeyBytes = 24;
  static constexpr int kRecordBytes = kKeyBytes + 32;
  static constexpr int kWindowChunks = 6;
  static constexpr int kRowBytes = 128;
  static constexpr int kFields = 3;  // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * kRowBytes;  // 2048
  static constexpr int kStageBytes = kMetaOffset + 96;         // 2144
  static constexpr int kOffset8Tokens = 8 * kRowBytes;         // the same lead and position
  static constexpr int kKeyLoads = 1;                          // key_word_offset instead
  static constexpr int kKeyWords = 2, kKeyWordLoads = 2, kKeyLoadBytes = 4;  // 48 bits in two 4-byte loads

  /// Bytes from the sector boundary at or below the record of (token of the tile, head) to the record.
  __device__ static int lead(int token, int head, int num_kv_heads) {
    return (kRecordBytes * (token * num_kv_heads + head)) & 31;
  }
  /// Byte `byte` of the record of `token` in a stage.
  __device__ static int record_offset(int token, int lead, int byte) {
    const int from_chunk = (lead & 15) + byte;  // from the start of the window chunk holding the record's start
    return token * kRowBytes + ((((from_chunk >> 4) + token) & 7) << 4) + (from_chunk & 15);
  }
  /// The lane's key word load w (of 2) of `token` (three_bit_key_word_byte_d64).
  __device__ static int key_word_offset(int token, int c, int w, int head, int num_kv_heads) {
    return record_offset(token, lead(token, head, num_kv_heads), three_bit_key_word_byte_d64(c, w));
  }
  /// The lane's 4 value bytes (dims 8g..8g+7) of `token`.
  __device__ static int value_offset(int token, int g, int head, int num_kv_heads) {
    return record_offset(token, lead(token, head, num_kv_heads), kKeyBytes + 4 * g);
  }

  using IssuePlan = RecordIssuePlan<PackedRunCopy<kWindowChunks>, kFields, kMetaOffset>;

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    const int num_kv_heads = p.layout.num_kv_heads;
    const int slot_stride = num_kv_heads * kRecordBytes;
    const auto token_lead = [=](int token) { return lead(token, head, num_kv_heads); };
    const auto destination = [=](int token, int chunk) {
      return token * kRowBytes + (((chunk - (token_lead(token) >> 4) + token) & 7) << 4);
    };
    const auto records =
        PackedRunCopy<kWindowChunks>::make(slot_stride, head * kRecordBytes, lane, destination, token_lead);
    return IssuePlan::make(p, head, lane, slot_stride, records);
  }

  // Chunk j of the row from the record's start less lead mod 16 (record_offset).
  static constexpr int kRecordChunks = 4;
  __device__ static RecordChunk record_chunk(int token, int j, int head, int num_kv_heads) {
    return {16 * j - (lead(token, head, num_kv_heads) & 15), token * kRowBytes + (((j + token) & 7) << 4)};
  }
};

// 3-bit MSE keys, 3-bit values at D = 64 (turboquant_3bit_nc): 48-byte
// records (24 key bytes, 24 value bytes), so a record starts lead = 0 or 16
// bytes after the sector boundary at or below it (per token and kv head, as
// for k3v4 at D = 64). Each token's window of 4 chunks (two sectors: lead +
// 48 <= 64) from that boundary is one run of a TokenRunCopy<4>. Two tokens a
// 128-byte row: record chunk j (window chunk j + lead / 16, the chunk left
// over at j = 3) is unit u = 4 (t & 1) + j, stored at u ^ swizzle(t / 2),
// swizzle(r) = 2 (r & 3) + ((r >> 1) & 1). The key loads (words 0, 2, 3, 5,
// then 1 and 4, of tokens g: three_bit_key_word_byte_d64) and the value
// loads (tokens 2c + x, the two words from record byte 24 + (3g & ~3)) are
// then free of bank conflicts, whatever the leads.
template <>
struct TileLayout<CacheFormat::mse3_v3, 64> {
  static constexpr int kKeyBytes = 24;
  static constexpr int kValueBytes = 24;
  static constexpr int kRecordBytes = kKeyBytes + kValueBytes;
  static constexpr int kFields = 3;  // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * 64;  // 1024
  static constexpr int kStageBytes = kMetaOffset + 96;  // 1120
  static constexpr int kOffset8Tokens = 8 * 64;         // four rows: the same swizzle and lead
  static constexpr int kKeyLoads = 1;                   // key_word_offset instead
  static constexpr int kKeyWords = 2, kKeyWordLoads = 2, kKeyLoadBytes = 4;  // 48 bits in two 4-byte loads
  static constexpr int kValueWordLoads = 2;

  __device__ static int lead(int token, int head, int num_kv_heads) {
    return (kRecordBytes * (token * num_kv_heads + head)) & 31;
  }
  __device__ static int swizzle(int row) { return 2 * (row & 3) + ((row >> 1) & 1); }
  /// Byte `byte` (below 64) of the record of `token` in a stage.
  __device__ static int record_offset(int token, int byte) {
    const int row = token >> 1;
    return row * 128 + (((4 * (token & 1) + (byte >> 4)) ^ swizzle(row)) << 4) + (byte & 15);
  }
  /// The lane's key word load w (of 2) of `token` (three_bit_key_word_byte_d64).
  __device__ static int key_word_offset(int token, int c, int w, int /*head*/, int /*num_kv_heads*/) {
    return record_offset(token, three_bit_key_word_byte_d64(c, w));
  }
  /// Value word w (of 2) of lane g for `token`: its 3 bytes (dims 8g..8g+7)
  /// start (3g) mod 4 bytes into word 0.
  __device__ static int value_word_offset(int token, int g, int w, int /*head*/, int /*num_kv_heads*/) {
    return record_offset(token, kKeyBytes + ((3 * g) & ~3) + 4 * w);
  }

  using IssuePlan = RecordIssuePlan<TokenRunCopy<4, 1>, kFields, kMetaOffset>;

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    const int num_kv_heads = p.layout.num_kv_heads;
    const int slot_stride = num_kv_heads * kRecordBytes;
    // The lane's tokens lane / 4 and lane / 4 + 8 have one lead.
    const int window_start = head * kRecordBytes - lead(lane / 4, head, num_kv_heads);
    const auto destination = [=](int token, int chunk) {
      const int row = token >> 1;
      const int j = (chunk - (lead(token, head, num_kv_heads) >> 4)) & 3;
      return row * 128 + (((4 * (token & 1) + j) ^ swizzle(row)) << 4);
    };
    const auto records = TokenRunCopy<4, 1>::make(slot_stride, window_start, lane, destination);
    return IssuePlan::make(p, head, lane, slot_stride, records);
  }

  static constexpr int kRecordChunks = kRecordBytes / 16;
  __device__ static RecordChunk record_chunk(int token, int j, int /*head*/, int /*num_kv_heads*/) {
    return {16 * j, record_offset(token, 16 * j)};
  }
};

// 3-bit MSE keys at D = 256: records of whole sectors (96 key bytes, then
// 128 bytes of 4-bit values (k3v4) or 96 of 3-bit values (3bit); Hk * 224 or
// Hk * 192 and head * 224 or head * 192 are multiples of 32), packed by a
// PackedRunCopy. Token t's row is 256 bytes; record chunk k sits at position
// k + rotation(t) mod 16, rotation(t) = 6 t + 2 ((t >> 2) & 1) mod 16. Lane
// c's 24 key bytes (dims 64c..64c+63) are three 8-byte loads, and a half
// warp's (tokens g of one half, four lanes each) cover the 32 banks once;
// the values' loads (tokens 2c + x: 16 bytes at 96 + 16g, or three words
// from 96 + 12g) and each quarter warp's copy writes fall on distinct banks
// too. Then the 3 fp16 fields.
template <CacheFormat Format>
struct PackedRecordsD256 {
  static constexpr int kKeyBytes = 96;
  static constexpr int kValueBytes = Format == CacheFormat::mse3 ? 128 : 96;
  static constexpr int kRecordBytes = kKeyBytes + kValueBytes;
  static constexpr int kRowBytes = 256;
  static constexpr int kFields = 3;  // key norm, value scale, value zero
  static constexpr int kNormField = 0, kValueScaleField = 1, kValueZeroField = 2;
  static constexpr int kMetaOffset = kTileTokens * kRowBytes;  // 4096
  static constexpr int kStageBytes = kMetaOffset + 96;         // 4192
  static constexpr int kOffset8Tokens = 8 * kRowBytes;         // rotation(t + 8) = rotation(t)
  static constexpr int kKeyLoads = 1;                          // key_word_offset instead
  static constexpr int kKeyWords = 6, kKeyWordLoads = 3, kKeyLoadBytes = 8;  // 192 bits in three 8-byte loads

  __device__ static int rotation(int token) { return (6 * token + 2 * ((token >> 2) & 1)) & 15; }
  /// Byte `byte` of `token`'s record in a stage.
  __device__ static int record_offset(int token, int byte) {
    return token * kRowBytes + ((((byte >> 4) + rotation(token)) & 15) << 4) + (byte & 15);
  }
  /// The lane's key load w (of 3, 8 bytes each) of `token`.
  __device__ static int key_word_offset(int token, int c, int w, int /*head*/, int /*num_kv_heads*/) {
    return record_offset(token, 24 * c + 8 * w);
  }

  using IssuePlan = RecordIssuePlan<PackedRunCopy<kRecordBytes / 16>, kFields, kMetaOffset>;

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    return packed_record_plan<PackedRecordsD256>(p, head, lane);
  }

  static constexpr int kRecordChunks = kRecordBytes / 16;
  __device__ static RecordChunk record_chunk(int token, int k, int /*head*/, int /*num_kv_heads*/) {
    return {16 * k, record_offset(token, 16 * k)};
  }
};

template <>
struct TileLayout<CacheFormat::mse3, 256> : PackedRecordsD256<CacheFormat::mse3> {
  /// The lane's 16 value bytes (dims 32g..32g+31) of `token`.
  __device__ static int value_offset(int token, int g, int /*head*/, int /*num_kv_heads*/) {
    return record_offset(token, kKeyBytes + 16 * g);
  }
};

template <>
struct TileLayout<CacheFormat::mse3_v3, 256> : PackedRecordsD256<CacheFormat::mse3_v3> {
  static constexpr int kValueWordLoads = 3;
  /// Value word w (of 3) of the lane's 12 bytes (dims 32g..32g+31) of `token`.
  __device__ static int value_word_offset(int token, int g, int w, int /*head*/, int /*num_kv_heads*/) {
    return record_offset(token, kKeyBytes + 12 * g + 4 * w);
  }
};

// fp8 keys (turboquant_k8v4): a key area of one D-byte row per token, the
// value area (ValueArea), then the 2 fp16 fields. Key chunk j of a token is
// stored at j ^ swizzle: none at D = 64 (two tokens per 128 bytes), token & 1
// at D = 128, 2 (j >> 3) + (token & 1) at D = 256, so the lanes' 16-byte key
// loads (tokens g, chunks of c) are free of bank conflicts.
template <int HeadDim>
struct TileLayout<CacheFormat::fp8, HeadDim> {
  static_assert(HeadDim == 64 || HeadDim == 128 || HeadDim == 256);
  using Values = ValueArea<HeadDim>;
  static constexpr int kKeyBytes = HeadDim;                  // one fp8 byte per dim
  static constexpr int kRecordBytes = kKeyBytes + HeadDim / 2;  // then the 4-bit values
  static constexpr int kFields = 2;                          // value scale, value zero
  static constexpr int kValueScaleField = 0, kValueZeroField = 1;
  static constexpr int kValueArea = kTileTokens * kKeyBytes;
  static constexpr int kMetaOffset = kValueArea + kTileTokens * HeadDim / 2;
  static constexpr int kStageBytes = kMetaOffset + 64;
  static constexpr int kKeyLoads = HeadDim / 64;  // 16-byte loads of a lane's D/4 key bytes per token

  __device__ static int key_chunk_offset(int token, int chunk) {
    const int swizzle = HeadDim == 64 ? 0 : HeadDim == 128 ? token & 1 : 2 * ((chunk >> 3) & 1) + (token & 1);
    return token * kKeyBytes + ((chunk ^ swizzle) << 4);
  }
  /// The lane's D/4 key bytes of `token` are kKeyLoads 16-byte loads, parts 0, 1, ...
  __device__ static int key_offset(int token, int c, int part) { return key_chunk_offset(token, kKeyLoads * c + part); }
  __device__ static int value_offset(int token, int g, int /*head*/, int /*num_kv_heads*/) {
    return kValueArea + Values::offset(token, g);
  }

  struct alignas(16) IssuePlan {
    std::uint32_t slot_stride;  // Hk * 3D/2 bytes
    TokenRunCopy<kKeyBytes / 16> keys;
    TokenRunCopy<HeadDim / 32> values;
    FieldChunk<kFields, kMetaOffset> fields;  // lanes 0..3

    __device__ void issue(std::uint32_t stage, const std::uint8_t* block, std::uint32_t slot0, int lane) const {
      const std::uint8_t* tile = block + slot0 * slot_stride;
      keys.issue(stage, tile);
      values.issue(stage, tile);
      fields.issue(stage, block, slot0, lane);
    }
  };

  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    const int slot_stride = p.layout.num_kv_heads * kRecordBytes;
    return {static_cast<std::uint32_t>(slot_stride),
            TokenRunCopy<kKeyBytes / 16>::make(slot_stride, head * kRecordBytes, lane, key_chunk_offset),
            Values::template copy_plan<kValueArea>(slot_stride, head * kRecordBytes + kKeyBytes, lane),
            FieldChunk<kFields, kMetaOffset>::make(p, head, lane)};
  }

  // The key chunks, then the value chunks.
  static constexpr int kRecordChunks = kKeyBytes / 16 + HeadDim / 32;
  __device__ static RecordChunk record_chunk(int token, int k, int /*head*/, int /*num_kv_heads*/) {
    constexpr int kKeyChunks = kKeyBytes / 16;
    if (k < kKeyChunks) return {16 * k, key_chunk_offset(token, k)};
    return {kKeyBytes + 16 * (k - kKeyChunks), kValueArea + Values::chunk_offset(token, k - kKeyChunks)};
  }
};

// Copies one tile into a stage: block and first slot from the tile index.
// `last_block`: the cache's last (token_slots plans copy whole windows in
// the others, SlotTile::IssuePlan).
template <class IssuePlan>
__device__ __forceinline__ void issue_tile(std::uint32_t stage, const std::uint8_t* cache, std::int64_t block_stride,
                                           int physical, int tile, int block_mask, const IssuePlan& plan, int lane,
                                           int last_block) {
  // block_stride < 2^31 (hopper_unsupported_reason) and entries are
  // non-negative: one 32 x 32 -> 64-bit multiply-add.
  const std::uint8_t* block = cache + static_cast<std::uint64_t>(static_cast<std::uint32_t>(physical)) *
                                          static_cast<std::uint32_t>(block_stride);
  const auto slot0 = static_cast<std::uint32_t>((tile * kTileTokens) & block_mask);
  if constexpr (requires { plan.issue(stage, block, slot0, lane, true); }) {  // token_slots (slot_tile.cuh)
    plan.issue(stage, block, slot0, lane, physical < last_block);
  } else {
    plan.issue(stage, block, slot0, lane);
  }
}

// fp16 field `field` of token `token` of a tile's fields (at kMetaOffset in
// a stage, or in the fields area of the bulk-copy rings).
__device__ __forceinline__ __half tile_field(const std::uint8_t* fields, int field, int token) {
  return load_shared<__half>(fields + 32 * field + 2 * token);
}

}  // namespace tqdecode::cuda::tensor_core
