// Launch policy (internal): which kernel serves a call and how many split-KV
// partitions its grid has. The reasoning is in docs/DESIGN.md; the short form:
//
// - The grid is (N partitions, Hk, B). N depends only on B, Hk, the
//   worst-case context (block_table.shape[1] * block_size) and the SM count,
//   so a CUDA graph captured at one batch replays for any seq_lens.
// - N fills the GPU in whole waves: with S = resident CTAs per SM x SMs
//   slots, the grid of B * Hk * N CTAs runs in ceil(B * Hk * N / S) waves,
//   and N is the smallest count from 1 up to the cap whose utilization
//   B * Hk * N / (S * waves) reaches kGoodWaveUtilization, else the count
//   with the highest utilization. The cap is kMaxPartitions (so capture cost and the reducer's work
//   stay bounded for any max_model_len) and ceil(worst-case context /
//   kMinPartitionTokens) (a partition shorter than that costs more in
//   launch and reduction than it saves).
// - Each sequence splits its actual length into N ranges on the device, so
//   short sequences in a large block table still use all N partitions.
#pragma once

#include <algorithm>
#include <string>

#include "tqdecode/decode.hpp"

namespace tqdecode::cuda {

inline constexpr int kMaxPartitions = 32;
/// Resident CTAs per SM: the Hopper kernel holds 1 CTA of 16 warps in its
/// 64 KB-table shape (turboquant_4bit_nc up to group 8, 203 to 224 KB of
/// shared memory) and in its two-kv-head shape (the other presets), else 2
/// of 8 warps up to group 8 (at most 128 registers, at most 105 KB each) and
/// 1 of 12 warps for groups 9..16; the generic kernel is planned for 2. No
/// path holds more, which bounds the pool.
inline constexpr int kMaxResidentCtasPerSm = 2;
inline constexpr double kGoodWaveUtilization = 0.95;
inline constexpr int kMinPartitionTokens = 256;
/// Partition ranges are multiples of this many tokens (the Hopper kernel's tile).
inline constexpr int kPartitionAlign = 16;

struct DeviceInfo {
  int device;
  int sm_count;
  int cc_major;
  int cc_minor;
  int shared_per_block;  ///< bytes of dynamic shared memory a CTA may opt in to
  int shared_per_sm;     ///< bytes of shared memory per SM
  /// Peak DRAM bytes per SM and SM clock cycle (memory clock x bus width over
  /// SMs x the peak SM clock): about 12.8 on an H100 SXM, 18.8 on an H200; 0
  /// where the device does not report its clocks.
  double memory_bytes_per_sm_cycle;
};

/// Properties of the current device, read once per device.
const DeviceInfo& current_device_info();

/// N for a call (see the rule above).
int choose_num_partitions(int batch, int num_kv_heads, int max_context_tokens, int sm_count, int resident_ctas_per_sm);

/// Query heads per head tile of the tensor-core kernels (the mma's N side):
/// larger groups take two head tiles.
inline constexpr int kHeadsPerTile = 8;

/// Head tiles of the tensor-core kernel's CTA for `rows_per_head` query
/// rows per kv head and sequence (the group x the query tokens of a
/// sequence): two for more than one tile's rows, except at D = 256 (its
/// accumulators take a tile's registers twice over); four for more than two
/// tiles' rows where `four_head_tiles` (tensor_core_four_head_tiles).
constexpr int tensor_core_head_tiles(int rows_per_head, int head_dim, bool four_head_tiles) {
  if (rows_per_head <= kHeadsPerTile || head_dim == 256) return 1;
  return four_head_tiles && rows_per_head > 2 * kHeadsPerTile ? 4 : 2;
}

/// Row tiles per (sequence, kv head) of the tensor-core kernel's grid: CTAs
/// of `head_tiles` head tiles each (tensor_core_head_tiles), reading the same tokens.
constexpr int tensor_core_row_tiles(int rows_per_head, int head_tiles) {
  const int cta_rows = kHeadsPerTile * head_tiles;
  return (rows_per_head + cta_rows - 1) / cta_rows;
}

/// Whether the Hopper kernel serves a call's rows per kv head in CTAs of
/// four head tiles (32 rows; tensor_core/shape.cuh: 8 warps that hold every
/// row's accumulators and read the query operand from shared memory) rather
/// than in row tiles of two: 4-bit keys in the blocks order at D = 128 with
/// more than two tiles' rows, where those CTAs (B Hk row tiles) fill a wave
/// without partitions. Such a CTA issues about 28 % fewer instructions per
/// token than two of two head tiles but at 2 warps per scheduler, not 3;
/// where the grid needs partitions to fill the GPU, the two-head-tile grid's
/// fewer partitions are faster (docs/PERFORMANCE.md).
bool tensor_core_four_head_tiles(DecodePath path, const CacheLayout& layout, int rows_per_head, int batch,
                                 int sm_count);

/// The warp-specialized partition kernel's rows per consumer warpgroup (M
/// of its wgmma products; a CTA has two) and its partitions' alignment (its
/// 64-token tiles).
inline constexpr int kWarpSpecializedRows = 64;
inline constexpr int kWarpSpecializedAlign = 64;
/// Rows per kv head past which the automatic path takes it
/// (warp_specialized_automatic): a four-head-tile CTA's.
inline constexpr int kWarpSpecializedAutomaticPast = 4 * kHeadsPerTile;

/// Whether the warp-specialized partition kernel (PathRequest::
/// hopper_warp_specialized; tensor_core/warp_specialized.cuh: every 64-token
/// tile dequantized once into shared memory for up to 64 query rows, the
/// products on warpgroup MMA) serves a call on `path`: several query tokens
/// per sequence (query_start_loc) of 4-bit keys at D = 128, in the blocks
/// order or in the token_slots order where token_slots_box_copies, with more
/// than two head tiles' rows per kv head, where the tensor-core kernel's
/// four- and two-head-tile loops grow with the rows.
/// Also false where the library was built without sm_90a (warp_specialized_built).
bool warp_specialized_serves(DecodePath path, const CacheLayout& layout, bool varlen, int rows_per_head);

/// Whether the automatic path takes the warp-specialized kernel: where it
/// serves the call with more rows per kv head than one four-head-tile CTA
/// holds (32), so that the row tiles would read each token twice or more
/// (docs/PERFORMANCE.md: 1.3x faster at 64 rows, 1.3-1.7x past). A 64-row
/// CTA costs about the same at any of its rows (the producers' dequantization
/// and the consumers' 64-row products), so at 32 rows and below the row
/// tiles, which do work for 32, keep the call (1.5x faster there), but for
/// the token_slots order with norm correction where the batch's (sequence,
/// kv head) pairs fill a wave (`batch` x Hk CTAs of one partition on
/// `sm_count` SMs): its row tiles hold 16 rows (four head tiles are the
/// blocks order's), so 17-32 rows read each token twice, and the
/// warp-specialized kernel measured faster there; on smaller grids, and
/// without norm correction, it did not (docs/PERFORMANCE.md).
bool warp_specialized_automatic(DecodePath path, const CacheLayout& layout, bool varlen, int rows_per_head, int batch,
                                int sm_count);

/// Whether this build has the warp-specialized kernel's sm_90a code
/// (CMAKE_CUDA_ARCHITECTURES with 90a).
bool warp_specialized_built();

/// Its query tokens per CTA: as many as fit 64 rows, which its two
/// consumer warpgroups serve from alternate tiles; for more rows per kv
/// head as many as fit 128, 64 rows for each consumer from every tile, so
/// each tile is read and dequantized once for twice the rows.
inline int warp_specialized_tokens_per_cta(int group_size, int max_query_len) {
  const int rows = group_size * max_query_len > kWarpSpecializedRows ? 2 * kWarpSpecializedRows : kWarpSpecializedRows;
  return std::max(1, std::min(max_query_len, rows / group_size));
}

/// A call's query rows per kv head and sequence: the group x the most query
/// tokens of a sequence (1 without query_start_loc).
inline int tensor_core_rows_per_head(const DecodeArgs& args) { return args.group_size() * args.query_tokens_bound(); }

/// Grids of the 16-warp Hopper kernel with one kv head per CTA up to this
/// many waves may use it; larger grids use several kv heads per CTA, or two
/// CTAs of 8 warps per SM (docs/PERFORMANCE.md). The other presets'
/// two-kv-head CTA (narrow table) has the same bound.
inline constexpr int kWideTableMaxWaves = 2;

/// kv heads per CTA of the 16-warp kernel besides one.
inline constexpr int kWideKvHeadsPerCta[] = {2, 4, 8};
/// token_slots bulk copies: a CTA streaming more tokens than this takes
/// the most kv heads per CTA (choose_grid); without norm correction, whose
/// shorter loop lets the one-kv-head CTAs drift apart sooner, more than
/// kSlotsLongStreamTokensUnnormalized. Eight kv heads read whole token rows
/// without norm correction, and with it where a CTA streams at least
/// kSlotsLongStreamTokens (shorter ranges measured slower in whole rows at
/// the norm correction's longer loop: docs/PERFORMANCE.md). Where memory
/// bound (kSlotsBoxesMinBytesPerSmCycle), four kv heads in half rows take
/// fewer partitions than eight on streams of at most
/// kSlotsLongStreamTokensUnnormalized tokens a CTA.
inline constexpr int kSlotsLongStreamTokens = 32768;
inline constexpr int kSlotsLongStreamTokensUnnormalized = 8192;
/// token_slots bulk copies with norm correction on devices with less DRAM
/// bandwidth per SM cycle than this (DeviceInfo::memory_bytes_per_sm_cycle):
/// the one-kv-head boxes' loop is memory bound there, not issue bound, and
/// the CTAs of a sequence's kv heads drift apart and fetch their shared L2
/// lines twice, so eight kv heads read whole rows from streams of
/// kSlotsLongStreamTokensUnnormalized tokens, as without norm correction.
/// Between the two devices measured (docs/DESIGN.md): whole rows are the
/// faster on an H100 SXM (12.8), the boxes on an H200 (18.8).
inline constexpr double kSlotsBoxesMinBytesPerSmCycle = 16.0;

/// Whether a device of `memory_bytes_per_sm_cycle` (DeviceInfo; 0: unknown) is
/// below kSlotsBoxesMinBytesPerSmCycle.
inline bool slot_boxes_memory_bound(double memory_bytes_per_sm_cycle) {
  return memory_bytes_per_sm_cycle > 0.0 && memory_bytes_per_sm_cycle < kSlotsBoxesMinBytesPerSmCycle;
}

/// Whether the 64 KB-table Hopper kernel (16 warps, 12 for groups over 8)
/// exists for this preset and head size (4-bit keys, D = 128).
bool wide_table_kernel(Preset preset, int head_dim = 128);

/// Resident CTAs per SM of the kernel that serves `path` for this preset,
/// group size and head size (`wide_table`: the 64 KB-table Hopper kernel).
int resident_ctas_per_sm(DecodePath path, Preset preset, int group_size, bool wide_table, int head_dim = 128);

struct GridChoice {
  int num_partitions;
  bool wide_table;
  int kv_heads_per_cta = 1;
  bool token_runs = false;  ///< every kv head's whole token rows per CTA (SlotRead::runs)
  /// token_slots, 4-bit keys in the wide shape at eight kv heads per CTA:
  /// whole token rows, one bulk copy per tile for the CTA, instead of a box
  /// per kv head and warp (the other presets' CTAs of several kv heads
  /// always read whole rows).
  bool whole_rows = false;
};

/// How the tensor-core kernels read a token_slots cache (none: the blocks
/// order): bulk tensor copies in the wide shape (token_slots_bulk_copy),
/// cp.async windows read where they land (token_slots_read_in_place) with
/// unaligned loads or, where every slot of a kv head has the same lead, with
/// aligned loads of rotated data (token_slots_read_rotated), or cp.async
/// windows repacked into the blocks order's tile arrangement.
/// Token runs: a CTA of 16 warps reads the whole token rows of every kv head
/// (Hk = 2 or 4; fp8 keys also Hk = 1, in CTAs of 8 warps), one bulk copy
/// per tile of its contiguous run of rows.
enum class SlotRead { none, bulk_copies, rows, runs, in_place, rotated, repacked };

/// N and the Hopper kernel shape for a call: where the 16-warp kernel
/// exists, it serves h = 1, 2, 4 or 8 kv heads per CTA (planned for Hk / h
/// heads, one CTA per SM; h divides Hk; h = 1 only for grids of at most
/// kWideTableMaxWaves waves), the h whose grid has the fewest waves, the
/// smallest on a tie; with no such h (Hk odd, larger grids) the narrow
/// configuration's plan. The other presets up to group 8 on the Hopper path
/// take two kv heads per 16-warp CTA (even Hk) where that grid has at most
/// kWideTableMaxWaves waves, else the narrow configuration's two CTAs per
/// SM. Groups over
/// kHeadsPerTile (two head tiles) take the wide table (12 warps, one kv head
/// per CTA) whatever the grid: the narrow one is also one CTA per SM there.
/// Head sizes 64 and 256 have the narrow configuration only. token_slots
/// caches (`slots`: token_slots_read) take the wide shape's choice where
/// bulk tensor copies read them, else the narrow configuration with one kv
/// head per CTA (two kv heads per CTA, the other presets' choice in the
/// blocks order, measured no faster there).
/// `renormalized_keys`: token_slots keys renormalized at decode (CacheLayout::renormalize_keys).
/// `memory_bytes_per_sm_cycle`: the device's (DeviceInfo; 0: unknown, taken as a device of much bandwidth).
GridChoice choose_grid(DecodePath path, Preset preset, int group_size, int batch, int num_kv_heads,
                       int max_context_tokens, int sm_count, int head_dim = 128, SlotRead slots = SlotRead::none,
                       bool renormalized_keys = false, double memory_bytes_per_sm_cycle = 0.0);

/// Whether a token_slots layout's slots can come by bulk tensor copies of a
/// box per kv head (its tensor map, cache_tensor_maps.cpp): token stride and
/// block stride multiples of 16 bytes, and every kv head's slot inside its
/// token's row. (The cache pointer must be 16-byte aligned too, as for any
/// Hopper kernel over token_slots.)
bool token_slots_box_copies(const CacheLayout& layout);

/// Whether the Hopper kernel's wide shape reads this token_slots cache with
/// bulk tensor copies of its token rows: 4-bit keys at D = 128, a 16-byte
/// aligned cache pointer and token_slots_box_copies.
bool token_slots_bulk_copy(const DecodeArgs& args);

/// Whether the tensor-core kernels read this token_slots cache's slots where
/// they land (tensor_core/slot_tile.cuh, SlotReadLayout): D = 128 with every
/// block on a 16-byte boundary (the cache pointer is one for any
/// tensor-core kernel), so a kv head's slots have the same lead in every
/// tile; else the narrow configuration repacks each landed tile into the
/// blocks order's arrangement.
bool token_slots_read_in_place(const CacheLayout& layout);

/// Whether the narrow configuration reads the slots in place with aligned
/// loads of rotated data (SlotReadLayout): read in place, fp8 keys, and
/// token rows of 16-byte multiples (4 kv heads of k8v4's 196-byte slots, or
/// any multiple of 4), so every slot of a kv head has the same lead. (The
/// wide shape's bulk copies read 4-bit keys so; the narrow configuration's
/// 4-bit keys measured slower rotated than with unaligned loads.)
bool token_slots_read_rotated(const CacheLayout& layout);

/// Whether the Hopper kernel may read this token_slots cache in whole token
/// rows of h = 8 kv heads (else 4), one bulk tensor copy per tile for a
/// CTA's 16 warps (SlotRead::rows; choose_grid decides per call): the
/// presets the wide shape does not serve (k8v4, k3v4_nc, 3bit_nc) at D =
/// 128 up to group 8, a cache pointer, token and block strides of 16-byte
/// multiples, the kv heads' slots side by side in the row, h dividing Hk
/// and h slots a 16-byte multiple (so every CTA's part of a row starts on a
/// boundary: 8 slots of any preset, 4 of k8v4's 196 bytes).
bool token_slots_read_rows(const DecodeArgs& args);

/// Whether the Hopper kernel may read this token_slots cache in token runs
/// (SlotRead::runs; choose_grid decides per call): Hk = 2 or 4 kv heads
/// (tensor-parallel shards, whose rows token_slots_read_rows does not
/// take) of any preset at D = 128 up to group 8, the slots side by side in
/// dense rows (token stride Hk slot bytes, so a tile's 16 rows are one
/// contiguous run of a 16-byte multiple), a cache pointer and block stride
/// of 16-byte multiples and blocks of at least 16 tokens. One kv head for
/// fp8 keys only (two 8-warp CTAs per SM): the other presets' narrow
/// configuration measured as fast (docs/DESIGN.md).
bool token_slots_read_runs(const DecodeArgs& args);

/// Whole token rows: the kv heads per CTA, 8 where 8 divides Hk, else 4
/// (the CTAs of four, the two halves of a row, drift apart: slower where
/// both divide Hk).
constexpr int token_slots_row_kv_heads(int num_kv_heads) { return num_kv_heads % 8 == 0 ? 8 : 4; }

/// Whole token rows: the least tokens a CTA streams (shorter partitions
/// spend more on the CTA's prologue, merge of h kv heads and reduction than
/// the shared copies save; the one-kv-head CTAs serve them).
inline constexpr int kRowsMinStreamTokens = 2048;

/// How the Hopper kernel reads the call's cache (SlotRead).
SlotRead token_slots_read(const DecodeArgs& args);

/// Largest batch * N over batch <= max_batch and every grid a path plans
/// (Hk kv heads per grid row, or Hk / h with h per CTA): the partition
/// rows a pool bucket needs so that every batch up to max_batch fits.
int max_partition_rows(int max_batch, int num_kv_heads, int sm_count);

/// Empty when the Hopper kernel serves these arguments on `device`, else why not.
std::string hopper_unsupported_reason(const DecodeArgs& args, const DeviceInfo& device);

/// Resident CTAs per SM of the tensor-core kernel's narrow configuration on
/// `device` (its planned count, or fewer where shared memory holds fewer);
/// 0 where not even one CTA fits.
int narrow_resident_ctas(Preset preset, int group_size, const DeviceInfo& device, int head_dim = 128,
                         bool token_slots = false);

/// Empty when the generic path's tensor-core kernel (GenericKernel) serves
/// these arguments on `device`, else why not.
std::string generic_tensor_core_unsupported_reason(const DecodeArgs& args, const DeviceInfo& device);

/// True when the tensor-core kernel's binary can run on the current device.
bool tensor_core_kernel_runnable();

/// Query rows (query tokens x group) one CTA of the scalar kernel holds: a
/// varlen call's tokens share each loaded key and value up to this many rows.
inline constexpr int kGenericMaxRows = 32;

/// Query tokens per CTA of the scalar kernel for a call of up to
/// `max_query_len` tokens per sequence: the fewest CTAs (query tiles) per
/// (partition, kv head, sequence) whose rows fit kGenericMaxRows, the tokens
/// spread evenly over them.
int generic_query_tokens_per_cta(int group_size, int max_query_len);

}  // namespace tqdecode::cuda
