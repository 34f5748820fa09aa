// Shapes of the tensor-core decode kernel (internal): per instance (head
// size, head tiles, key format, wide table, kv heads per CTA) its warps,
// resident CTAs and the arrangement of its shared memory, and the
// swizzles of the query rows and the merge buffer. The policy reads the
// shared-memory sizes through narrow_footprint (dispatch.cu).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../kernel_params.hpp"
#include "../policy.hpp"
#include "rotation.cuh"
#include "slot_tile.cuh"
#include "tile_layout.cuh"

namespace tqdecode::cuda::tensor_core {

constexpr int kRingStages = 4;  // a warp's ring: tiles in flight while it computes one
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kPartitionAlign == kTileTokens, "partition ranges must be whole tiles");

/// Per-warp partial results of a CTA, merged before the partition's are
/// written: first each row's maximum, sum and warp weights, once per row,
/// then the weighted outputs, one head dim per thread.
template <int Warps, int Rows, int HeadDim>
struct MergeStorage {
  static_assert(Warps <= 32, "one lane per warp in the row merge");
  float out[Warps][Rows][HeadDim];
  float max[Warps][Rows];
  float sum[Warps][Rows];
  alignas(16) float weight[Rows][Warps];  // exp2(max - the row's merged max), 0 for a warp without tiles
  float scale[Rows];  // the factor on the row's weighted outputs (RowTargets::finish)
};

/// Where a CTA's query rows go, computed once per row before the main loop
/// (kernel.cuh), in elements: the merge's and the reduction's loops per row
/// are then loads, products and stores.
template <int CtaRows>
struct RowTable {
  std::int64_t element[CtaRows];  // the row's first: in the output (one partition) or the partition buffers; -1: padding
  std::int64_t output[CtaRows];   // the row's first in the output (the reduction's, several partitions)
  float sink[CtaRows];            // -inf without sinks
};

// The online softmax moves a row's reference maximum only when a score
// exceeds it by more than this (base-2 units), as FlashAttention-4 does: a
// maximum that creeps up in small steps (a new record in about 1 of k tiles
// at tile k) no longer costs a rescale of the 40 accumulators each time.
// The sums and outputs are exact for any reference.
constexpr float kLazyRescaleLog2 = 4.0f;
// A position past a row's causal limit (several query tokens per sequence)
// scores this, not -inf: a row may have no position in a warp's tiles, and
// a finite maximum keeps its exponentials finite (exp2(0) there, weighed 0
// in the merge against the row's real maximum from another warp). A warp's
// tiles rise in position, so once a row is masked in them it stays masked:
// its masked maximum never becomes a reference for real scores.
constexpr float kMaskedScore = -1.0e30f;
// P' = p * value scale is an fp16 mma operand; with p <= 2^kLazyRescaleLog2 it
// stays finite for scales up to this (value ranges up to about 61000).
constexpr float kMaxLazyValueScale = 65504.0f / 16.0f;
static_assert(kLazyRescaleLog2 == 4.0f, "kMaxLazyValueScale assumes p <= 16");

// Slot of (row, dim) in the query rows, which hold the mma operand's 16-bit
// fp16 values: the 8-byte units u (4 dims) are XOR-swizzled by the row mod 4
// (and at D = 128 the half row, at D = 256 the lane's quarter u >> 4), so the
// operand build's 8-byte reads (lane (g, c): row g, dims (D/4)c + 4ks..+3)
// are free of bank conflicts per half warp.
template <int HeadDim>
__device__ __forceinline__ int query_slot(int row, int dim) {
  if constexpr (HeadDim == 64) return row * HeadDim + (dim ^ ((row & 3) << 2));
  if constexpr (HeadDim == 256) return row * HeadDim + (dim ^ (((4 * (row & 3) + (dim >> 6)) & 15) << 2));
  return row * HeadDim + (dim ^ ((2 * (row & 3) + ((dim >> 6) & 1)) << 2));
}

// Position of `dim` in a merge row: dim pairs XOR-swizzled within each
// 32-dim chunk by the row pair (and at D = 128 and 256 the lane's dim run),
// so the merge's 8-byte stores (lane (g, c): dims (D/8)g + 2m, + 1 of rows
// 2c + e) are free of bank conflicts per half warp (unswizzled they were
// 16-way), and the reads of whole rows stay so.
template <int HeadDim>
__device__ __forceinline__ int merge_dim(int row, int dim) {
  if constexpr (HeadDim == 64) return dim ^ (2 * ((row >> 1) & 3));
  if constexpr (HeadDim == 256) return dim ^ (2 * ((4 * ((dim >> 5) & 3) + ((row >> 1) & 3)) & 15));
  return dim ^ ((4 * ((row >> 1) & 3) + 2 * (dim >> 5)) & 15);
}

/// How an instance reads a token_slots cache (docs/FORMAT.md section 4b;
/// none: the blocks order): each slot where it lands (SlotReadLayout: the
/// wide shape's bulk copies, and at D = 128 the narrow configuration's
/// cp.async windows where the blocks start on 16-byte boundaries; rotated:
/// the narrow configuration's windows of fp8 keys where every slot of a kv
/// head has the same lead, read with aligned loads as the bulk copies are), or repacked
/// into the blocks order's tile arrangement once landed (SlotTile).
/// Whole rows: the slots of 4 or 8 kv heads of each token by one bulk copy
/// per tile into a ring that a CTA's 16 warps share (SlotReadLayout's
/// RowHeads; fp8 keys read rotated), for the presets without the wide shape,
/// and for 4-bit keys (read rotated) in the wide shape's eight-kv-head CTAs.
/// Token runs: the whole rows of 2 or 4 kv heads (every kv head of the
/// cache: tensor-parallel shards, whose rows are not 16-byte multiples) by
/// one bulk copy per tile of the tile's contiguous run of rows, the same
/// ring, every preset (SlotReadLayout's Runs); fp8 keys also of one kv head,
/// in CTAs of 8 warps, two per SM, so one CTA's prologue and merge overlap
/// the other's stream.
enum class SlotAccess { none, in_place, rotated, repacked, rows, runs };

/// Shape of a kernel instance. Wide: 4-bit keys, one CTA per SM sharing a
/// 64 KB lookup table whose 256-byte rows make each lookup's address one
/// byte permute (entry byte in bits 8..15, lane in bits 2..6). At two head
/// tiles (groups over 8) always, 12 warps; at four (the blocks order's
/// query rows of several tokens, policy.hpp's tensor_core_four_head_tiles),
/// 8 warps at up to 255 registers holding every row's accumulators, the
/// query operand read from shared memory at each use; at one, 16 warps, chosen for
/// grids of few waves (policy.cpp, choose_grid), and with two, four or eight
/// kv heads per CTA for larger grids: kv heads hy .. hy + h - 1 of one
/// sequence, 16 / h warps each, sharing the table, the block table and the
/// rotation, so an SM streams h work items at once with the wide table's
/// shorter loop. Otherwise the narrow configuration, a table of 128-byte rows
/// (a shift and a LOP3 per 4-bit lookup): two CTAs of 8 warps per SM, or at
/// two head tiles one CTA of 12 warps at 168 registers (the other presets,
/// and 4-bit keys on sm_80); on sm_90 the other presets also have one CTA of
/// 16 warps per SM serving two kv heads, 8 warps each (HeadsPerCta 2), as two
/// 8-warp CTAs would but with the SM's issue slots shared evenly: two CTAs on
/// one SM do not end together, and the one left streams with half the warps.
/// Head sizes 64 and 256 have the narrow configuration with one kv head per
/// CTA: two CTAs of 8 warps per SM at D = 64 (one or two head tiles), one of
/// 8 warps at D = 256 (one head tile; its accumulators take as many
/// registers as two head tiles at D = 128, about 205 a thread).
/// Slots: the token_slots order (slot_tile.cuh): in the wide shape (4-bit
/// keys at D = 128 where the token stride is a multiple of 16 bytes) by bulk
/// tensor copies, per kv head at one, two or four kv heads per CTA, of whole
/// rows at eight (one box per tile for the CTA: the warps of a token row's
/// kv heads stay together, so the L2 lines their slots share are fetched
/// once, and one copy replaces eight), else in the narrow
/// configuration with one kv head per CTA by cp.async; where the larger
/// stages would not fit (the wide shape at one head tile, and for two CTAs
/// per SM the narrow configuration's 4-bit and fp8 keys at D = 128, one
/// head tile), rings of three stages.
template <int HeadDim, int HeadTiles, CacheFormat Format, bool Wide, int HeadsPerCta = 1,
          SlotAccess Slots = SlotAccess::none>
struct KernelShape {
  static_assert(HeadDim == 128 || (!Wide && HeadsPerCta == 1 && (HeadDim == 64 || HeadTiles == 1)),
                "D = 64: the narrow configuration; D = 256: also one head tile");
  static_assert(HeadTiles != 4 || (Wide && HeadsPerCta == 1 && Slots == SlotAccess::none),
                "four head tiles: the wide shape in the blocks order, one kv head per CTA");
  static_assert(!Wide || Format == CacheFormat::mse4, "the wide table serves 4-bit keys");
  static constexpr bool kRuns = Slots == SlotAccess::runs;
  static constexpr bool kRowCopies = Slots == SlotAccess::rows || kRuns;
  static_assert(HeadsPerCta == 1 ||
                    (HeadTiles == 1 && (Wide || kRowCopies ? HeadsPerCta == 2 || HeadsPerCta == 4 || HeadsPerCta == 8
                                                           : HeadsPerCta == 2 && Format != CacheFormat::mse4)),
                "two, four or eight kv heads per CTA in the wide shape and the whole-row reads, two in the narrow "
                "one (not 4-bit keys, which have the wide shape), with one head tile only");
  static_assert(!kRowCopies || kRuns ||
                    (HeadDim == 128 && HeadsPerCta >= 4 &&
                     (Wide ? Format == CacheFormat::mse4 : Format != CacheFormat::mse4)),
                "whole-row reads at D = 128: four or eight kv heads per CTA, 4-bit keys in the wide shape");
  static_assert(!kRuns || (HeadDim == 128 && !Wide && HeadTiles == 1 &&
                           (HeadsPerCta == 2 || HeadsPerCta == 4 || (HeadsPerCta == 1 && Format == CacheFormat::fp8))),
                "token runs: every preset at D = 128, one head tile, two or four kv heads per CTA (fp8 keys: also one)");
  static constexpr bool kSlots = Slots != SlotAccess::none;
  static_assert(!kSlots || Wide || kRowCopies || HeadsPerCta == 1,
                "token_slots: one kv head per CTA in the narrow configuration");
  static_assert(!Wide || Slots != SlotAccess::repacked, "token_slots: the wide shape reads the slots in place");
  static_assert(Slots != SlotAccess::in_place || HeadDim == 128, "token_slots read in place at D = 128");
  static_assert(Slots != SlotAccess::rotated || (HeadDim == 128 && !Wide && Format == CacheFormat::fp8),
                "rotated slot reads in the narrow configuration: fp8 keys at D = 128");
  static constexpr bool kWideTable = Wide;
  static constexpr bool kSlotsInPlace = Slots == SlotAccess::in_place || Slots == SlotAccess::rotated || kRowCopies;
  // Aligned loads of rotated slot data: the bulk copies, SlotAccess::rotated and the whole rows.
  static constexpr bool kSlotsRotated =
      Slots == SlotAccess::rotated || (Slots == SlotAccess::rows && Format == CacheFormat::fp8) || (kSlotsInPlace && Wide);
  // Two head tiles need about 168 registers a thread, so one CTA per SM: 12
  // warps fill the register file (8 leave a third of it idle, and two warps
  // per scheduler to cover the loop's latencies); 16 warps at 128 registers
  // need the query operand in shared memory and one S^T chain per head tile,
  // which is slower (docs/PERFORMANCE.md). Four head tiles take 254
  // registers: 8 warps, one CTA per SM.
  static constexpr int kWarps =
      HeadDim != 128 ? 8 : HeadTiles == 4 ? 8 : HeadTiles == 2 ? 12 : kWideTable || HeadsPerCta > 1 ? 16 : 8;
  static constexpr int kHeadsPerCta = HeadsPerCta;
  static constexpr int kWarpsPerHead = kWarps / HeadsPerCta;  // the warps streaming one kv head
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kResidentCtas = kWarps > 8 || HeadDim == 256 || HeadTiles == 4 ? 1 : 2;
  static constexpr int kStages =
      kSlots && !kRowCopies && HeadDim == 128 && HeadTiles == 1 &&
              (Wide || Format == CacheFormat::mse4 || Format == CacheFormat::fp8)
          ? kRingStages - 1
          : kRingStages;
  static constexpr int kHeadDim = HeadDim;
  static constexpr int kHeadTiles = HeadTiles;
  // The S^T product's k-steps and the O^T product's dim tiles (16 dims each).
  static constexpr int kDimTiles = HeadDim / 16;
  // MSE keys: PiT's operands are loaded before the wait for the previous
  // kernel instead of after the first tiles are issued, so the rotation
  // overlaps that kernel's tail, or the table's build. In the 12- and
  // 16-warp shapes, and in the token_slots reads in place, whose short
  // partitions (the one-kv-head shards) wait on the rotation; the others
  // keep PiT's operand registers free across the tile issue.
  static constexpr bool kPiTBeforeWait = kWarps >= 12 || Slots == SlotAccess::in_place;
  // The wide shape's tiles come by bulk tensor copies (bulk_copy.cuh):
  // one instruction by one lane per tile and tensor map, where cp.async took
  // a copy plan read back from shared memory and five 16-byte copies per
  // lane, and its stream is unrolled by the ring's stages, so every stage
  // and barrier address is an immediate: fewer instructions a tile, which
  // matters most where the loop is bound by issue (group 16).
  static constexpr bool kBulkCopy = kWideTable || kRowCopies;
  // Tensor maps: the bulk copies but the token runs (plain bulk copies of contiguous bytes).
  static constexpr bool kTensorMaps = kBulkCopy && !kRuns;
  // The softmax takes each score less its row's maximum as one FFMA (score
  // sum x norm - max) instead of a multiply and, for the exponent, a
  // subtraction: fewer instructions a tile at two head tiles and in whole
  // token rows, whose loops are bound by their instruction count; the
  // rescale, which then recovers the scores, costs more, so the other
  // shapes are slower with it.
  static constexpr bool kScoresLessMax = kBulkCopy && (HeadTiles >= 2 || Slots == SlotAccess::rows);
  // P' = fp16(p) x value scale, one HMUL2 per token and head pair, instead of
  // two FMULs and a pack. In the bulk-copy shapes only, like the fields'
  // one-offset addressing and the host's score scale: in the narrow 3-bit
  // loops the compiler schedules them worse at the same instruction count.
  static constexpr bool kHalfScaledProbabilities = kWideTable;
  static constexpr int kRows = HeadTiles * kHeadsPerTile;  // query rows per kv head
  // Each lane quad's rows' query-token offsets from the CTA's first row
  // (kernel.cuh's row_deltas), kDeltaBits each for its 2 kHeadTiles rows: up
  // to kRows - 1 at group 1.
  static constexpr int kDeltaBits = kRows > 16 ? 8 : 4;
  using RowDeltas = std::conditional_t<(kRows > 16), unsigned long long, unsigned>;
  static constexpr int kCtaRows = kRows * HeadsPerCta;     // of the CTA: row r is row r % kRows of kv head r / kRows
  // Rotation and merge: one head dim per thread, rows first_row + kRowStep r.
  static constexpr int kRowStep = kThreads / HeadDim;
  static_assert(kThreads % HeadDim == 0, "whole rows per thread group");
  static constexpr int kRowsPerThread = (kCtaRows + kRowStep - 1) / kRowStep;
  /// The thread's head dim and first row there (rows first_row, + kRowStep, ...).
  __device__ __forceinline__ static int thread_dim() { return threadIdx.x & (HeadDim - 1); }
  __device__ __forceinline__ static int thread_first_row() { return threadIdx.x / HeadDim; }
  /// Warp `warp` streams the CTA's kv head head_slot(warp) as warp head_warp(warp) of kWarpsPerHead.
  __device__ __forceinline__ static int head_slot(int warp) { return HeadsPerCta == 1 ? 0 : warp / kWarpsPerHead; }
  __device__ __forceinline__ static int head_warp(int warp) { return HeadsPerCta == 1 ? warp : warp % kWarpsPerHead; }
};

/// Shared memory of a CTA: [lookup table (MSE keys) | rings][query rows][query bits][issue plans]
/// (the wide shape keeps the query bits in the rings before the main loop).
/// The table maps a key byte (4-bit: two codes) or 6 bits (3-bit: two codes)
/// to an fp16 pair, one copy per lane.
template <int HeadDim, int HeadTiles, CacheFormat Format, bool Wide, int HeadsPerCta = 1,
          SlotAccess Slots = SlotAccess::none>
struct SharedLayout {
  using Shape = KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  static constexpr int kStages = Shape::kStages;
  static constexpr int kCodebookSize = Format == CacheFormat::mse4 ? 16 : three_bit_keys(Format) ? 8 : 0;
  static constexpr int kLutEntries = kCodebookSize * kCodebookSize;
  static constexpr int kLutRowBytes = Shape::kWideTable ? 256 : 128;
  static constexpr int kLutBytes = kLutEntries * kLutRowBytes;
  using Blocks = TileLayout<Format, HeadDim>;
  // token_slots: a stage holds the slots as they land (slot_tile.cuh), read
  // there (SlotReadLayout) or repacked in place into the blocks order's
  // arrangement.
  static constexpr bool kSlots = Shape::kSlots;
  using Layout =
      std::conditional_t<Shape::kSlotsInPlace,
                         SlotReadLayout<Format, Shape::kBulkCopy, Shape::kSlotsRotated, Shape::kRowCopies ? HeadsPerCta : 0,
                                        Shape::kRuns>,
                         Blocks>;
  using Slot = SlotTile<Blocks, Format, Shape::kSlotsRotated>;
  using IssuePlan =
      std::conditional_t<kSlots, typename Slot::template IssuePlan<Shape::kSlotsInPlace>, typename Blocks::IssuePlan>;
  static constexpr int kStageBytes = kSlots ? Slot::kStageBytes : Blocks::kStageBytes;
  /// The lane's copy plan for kv head `head` (cp.async rings).
  __device__ static IssuePlan make_plan(const PartitionParams& p, int head, int lane) {
    if constexpr (kSlots) {
      return Slot::template make_plan<Shape::kSlotsInPlace>(p, head, lane);
    } else {
      return Blocks::make_plan(p, head, lane);
    }
  }
  // The rings. With cp.async, warp w's stage s at kLutBytes + (w kStages + s)
  // kStageBytes, fields included. With bulk tensor copies (the wide shape),
  // the tiles' fields first, (w kStages + s) kFieldsStride from kFieldsOffset,
  // then the records, stage s of warp w at records + (s kWarps + w) 2048
  // with `records` rounded up to 1024 bytes at run time (the copy engine's
  // 128-byte swizzle repeats every 1024 bytes; the dynamic shared memory
  // follows the static), so the last stages of all warps are one area.
  static constexpr bool kBulkCopy = Shape::kBulkCopy;
  static constexpr int kFieldBytes = Layout::kFields * kTileTokens * 2;  // of a tile
  static constexpr int kFieldsStride = 128;  // a bulk tensor copy's destination is 128-byte aligned
  static constexpr int kFieldsOffset = kLutBytes;
  // token_slots: the fields come with the slots, no fields area.
  static constexpr bool kFieldsArea = kBulkCopy && !kSlots;
  static constexpr int kRecordsOffset = kFieldsArea ? kFieldsOffset + Shape::kWarps * kStages * kFieldsStride : kLutBytes;
  static constexpr int kRecordsAlign = 1024;
  // Whole rows (kRowCopies): one ring for the CTA, stage s at records + s
  // kStageStride holding the tiles of warps head_warp 0 .. kWarpsPerHead - 1
  // (Layout::kStageBytes each), then 128 bytes the rotated reads' wrapped
  // loads may touch past the last row.
  static constexpr bool kRowCopies = Shape::kRowCopies;
  /// Whole rows: the tensor map's box width (encode_cache_tensor_maps); else 0.
  static constexpr int row_box_bytes() {
    if constexpr (kRowCopies && !Shape::kRuns) return Layout::kPitch;
    return 0;
  }
  static constexpr int kStageStride = kRowCopies   ? Shape::kWarpsPerHead * Layout::kStageBytes + 128
                                      : kBulkCopy ? Shape::kWarps * Layout::kMetaOffset
                                                  : kStageBytes;  // a warp's stage s to s + 1
  static constexpr int kWarpRingStride = kRowCopies  ? 0
                                         : kBulkCopy ? Layout::kMetaOffset
                                                     : kStages * kStageBytes;  // warp w's ring to w + 1's
  static constexpr int kRingEnd =
      kBulkCopy ? kRecordsOffset + kRecordsAlign + kStages * kStageStride : kLutBytes + Shape::kWarps * kStages * kStageBytes;
  using Merge = MergeStorage<Shape::kWarpsPerHead, Shape::kCtaRows, HeadDim>;
  // The merge reuses the table and the rings once the stream is done.
  static constexpr int kMainBytes = std::max(kRingEnd, static_cast<int>(sizeof(Merge)));
  // The query rows as the mma operand's 16-bit values (query_slot).
  static constexpr int kQueryOffset = kMainBytes;
  static constexpr int kQueryBytes = Shape::kCtaRows * HeadDim * 2;
  // MSE keys: the query's bits, the rotation's input (rotation.cuh),
  // in head tiles of 8 rows. The bulk-copy shapes keep them in the rings'
  // last stages, which nothing uses before the main loop issues its first
  // tiles there; the others after the query rows.
  static constexpr int kQueryBitsStride = query_bits_stride(HeadDim);
  static constexpr int kQueryBitsTileBytes = kHeadsPerTile * kQueryBitsStride * 2;
  static constexpr bool kQueryBitsInRings = kBulkCopy;
  static_assert(!kQueryBitsInRings || Shape::kCtaRows / kHeadsPerTile * kQueryBitsTileBytes <= kStageStride,
                "the query bits fit the last stages of the bulk-copy rings");
  /// Elements from one head tile of query bits to the next.
  static constexpr int kQueryBitsTileStride = kQueryBitsTileBytes / 2;
  static constexpr int kQueryBitsBytes = kCodebookSize && !kQueryBitsInRings ? Shape::kCtaRows * kQueryBitsStride * 2 : 0;
  // One copy plan per lane, the same for every warp of the CTA: read back
  // from here for each tile, since recomputing it in the loop (what the
  // compiler does at 128 registers) costs about 70 instructions per tile.
  // Bulk copies need none; they have one barrier per stage.
  static constexpr int kPlanOffset = kQueryOffset + kQueryBytes + kQueryBitsBytes;
  static constexpr int kPlanBytes = kBulkCopy ? 0 : HeadsPerCta * 32 * static_cast<int>(sizeof(IssuePlan));
  static constexpr int kBarrierOffset = kPlanOffset + kPlanBytes;
  // D = 128: 208544 (4-bit, wide), 210752, 215168 and 224000 (two, four
  // and eight kv heads), 175808 (4-bit, wide, two head tiles), each with up
  // to 1 KB of alignment, 107808 (4-bit), 82208 (k3v4), 82720 (3bit), 104096
  // (fp8); two kv heads (16 warps): 156224 (k3v4), 157248 (3bit), 208192
  // (fp8); two head tiles (12 warps): 147008, 120896, 121408, 156480
  // The rows' table (RowTable) last, where it moves no other region.
  static constexpr int kRowTableOffset = kBarrierOffset + (kBulkCopy ? Shape::kWarps * kStages * 8 : 0);
  static constexpr int kBytes = kRowTableOffset + static_cast<int>(sizeof(RowTable<Shape::kCtaRows>));
  static_assert(kRowTableOffset % alignof(RowTable<Shape::kCtaRows>) == 0, "the rows' table's alignment");
  // 227 KB of dynamic shared memory per CTA; 228 KB per SM, 1 KB reserved
  // per CTA, 128 bytes static.
  static_assert(kBytes <= 227 * 1024, "dynamic shared memory per CTA");
  static_assert(Shape::kResidentCtas * (kBytes + 1024 + 128) <= 228 * 1024, "resident CTAs per SM must fit");
};

}  // namespace tqdecode::cuda::tensor_core
