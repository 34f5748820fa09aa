// Stage 2's tile ring of the tensor-core decode kernel (internal): which
// 16-token tiles a warp streams, their physical blocks, and the copies that
// bring each into one of the warp's kStages ring stages: cp.async through a
// copy plan (tile_layout.cuh), or in the wide shape bulk tensor copies
// completing on one barrier per stage (bulk_copy.cuh); in the token_slots
// order bulk copies or cp.async of each slot's aligned windows, read where
// they land or repacked once landed (slot_tile.cuh), or whole token rows
// (by tensor-map boxes, or as contiguous runs of a tile's rows) into one
// ring the CTA's warps share.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../device_utils.cuh"
#include "../kernel_params.hpp"
#include "../policy.hpp"
#include "bulk_copy.cuh"
#include "shape.cuh"
#include "tile_layout.cuh"
#include "tqdecode/partition.hpp"

namespace tqdecode::cuda::tensor_core {

/// A warp's ring: its tiles first_tile, first_tile + kWarpsPerHead, ... of
/// kv head `head` (count of them), and where each one lands.
template <class Shape, class Shared>
struct TileRing {
  using Layout = typename Shared::Layout;
  static constexpr bool kBulkCopy = Shape::kBulkCopy;
  // Whole rows: one ring for the CTA (SharedLayout), each stage the tiles of
  // one round of the kv heads' warps; the refill of a stage waits until every
  // thread has released it (an empty barrier per stage), two rounds behind
  // the issue so the issuing warp rarely waits. Warp 0 issues every round
  // of the rows; in the token runs the kv heads' first warps (head_warp 0,
  // every round's tile) take turns, so no one warp carries every issue and
  // its waits (the rows of eight kv heads measured slower so).
  static constexpr bool kRowCopies = Shape::kRowCopies;
  static constexpr int kWarpsPerHead = Shape::kWarpsPerHead;
  static constexpr int kIssuers = Shape::kRuns ? Shape::kHeadsPerCta : 1;  // warps taking turns to issue (token runs; whole rows: warp 0)
  static constexpr int kStages = Shape::kStages;
  using IssuePlan = typename Shared::IssuePlan;

  const std::uint8_t* cache;
  std::int64_t block_stride;
  const std::int32_t* table;  // the sequence's block-table row
  int block_shift, block_mask;
  int last_block;  // the cache's last block (issue_tile)
  std::uint32_t records_offset;  // the rings' start (stage 0 of warp 0)
  std::uint32_t ring_offset, ring_address;
  // Bulk copies: the warp's stage s has its fields at fields_address + s
  // kFieldsStride and its barrier at barrier_address + 8 s; the copies of
  // its n-th tile complete phase n / kStages of barrier n % kStages.
  std::uint32_t fields_offset, fields_address, barrier_address;
  IssuePlan plan;    // cp.async: the lane's copy plan
  IssuePlan* plans;  // cp.async: the plans of the CTA's kv heads, one per lane
  const void* records_map;                 // bulk copies: the tensor maps
  const void* fields_map;
  int head, lane, first_tile, count;
  int num_kv_heads;            // token_slots: the repack's 3-bit leads (TileLayout)
  std::uint32_t token_stride;  // token_slots: the slots' leads
  // token_slots: the 16-byte boundary at or below head * head_stride (bulk
  // copies: the box's first byte in a token's row) and the lead past it of
  // a tile's first slot (SlotReadLayout::slot_row).
  int box_column, slot_lead;
  // Whole rows: the CTA's first tile and end, whether this warp fills the
  // ring, and whether it is warp 0 (kept from the broadcast warp index, which
  // the compiler knows is warp-uniform: told from the thread index, the
  // first rounds' issue gets divergent-path code).
  int cta_first_tile, end_tile;
  bool fills_ring, warp_issues_first;
  std::uint32_t records_address;
  // Physical blocks of the warp's tiles, 32 at a time: lane j of `blocks`
  // holds the block of the warp's tile i + j for the window i (a multiple of
  // 32) being issued, `blocks_next` those of the next window, loaded a
  // window ahead; one shuffle per tile instead of a dependent table load.
  int blocks, blocks_next;

  /// The warp's tiles of `range` (whole tiles, kv head `head`, warp
  /// head_warp of kWarpsPerHead), and its ring in `shared`; publishes the
  /// copy plan (head_slot's, by its first warp) or initialises the barriers.
  __device__ __forceinline__ TileRing(const PartitionParams& p, const CacheTensorMaps& maps, std::uint8_t* shared,
                                      TokenRange range, int batch, int head, int head_slot, int warp, int head_warp,
                                      int lane)
      : head(head), lane(lane), num_kv_heads(p.layout.num_kv_heads),
        token_stride(static_cast<std::uint32_t>(p.layout.token_stride)),
        box_column(static_cast<int>(head * p.layout.head_stride) & ~15),
        slot_lead(static_cast<int>(head * p.layout.head_stride) & 15) {
    block_shift = 31 - __clz(p.layout.block_size);
    block_mask = p.layout.block_size - 1;
    cache = p.cache;
    block_stride = p.layout.block_stride;
    last_block = static_cast<int>(min(p.num_blocks - 1, static_cast<std::int64_t>(INT_MAX)));
    table = p.block_table + static_cast<std::int64_t>(batch) * p.block_table_stride;
    const std::uint32_t shared_address = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
    records_offset = Shared::kRecordsOffset;
    if constexpr (kBulkCopy) {
      records_offset = ((shared_address + records_offset + Shared::kRecordsAlign - 1) & ~(Shared::kRecordsAlign - 1u)) -
                       shared_address;
    }
    ring_offset = opaque(records_offset + warp * Shared::kWarpRingStride);
    records_address = shared_address + records_offset;
    if constexpr (kRowCopies) {
      // The box starts at the 16-byte boundary at or below the CTA's first
      // kv head's slot (a bulk tensor copy's start in its row is 16-byte
      // aligned; four kv heads' slots start 8 bytes past one in every other
      // group), and the warp's view of a stage is its round's tile from the
      // 16-byte boundary at or below its kv head's slot in the box.
      const int head_byte = head * static_cast<int>(p.layout.head_stride);
      box_column = (head_byte - head_slot * static_cast<int>(p.layout.head_stride)) & ~15;
      ring_offset = records_offset + head_warp * Layout::kStageBytes + ((head_byte - box_column) & ~15);
    }
    ring_address = shared_address + ring_offset;
    fields_offset = Shared::kFieldsOffset + warp * kStages * Shared::kFieldsStride;
    fields_address = shared_address + fields_offset;
    barrier_address = shared_address + Shared::kBarrierOffset + warp * kStages * 8;
    // One plan per kv head of the CTA, published by the __syncthreads before the main loop.
    plan = kBulkCopy ? IssuePlan{} : Shared::make_plan(p, head, lane);
    plans = reinterpret_cast<IssuePlan*>(shared + Shared::kPlanOffset) + 32 * head_slot;
    fills_ring = !kRowCopies || (kIssuers > 1 ? head_warp == 0 : warp == 0);
    warp_issues_first = warp == 0;
    if constexpr (kRowCopies) {
      // Full barriers at barrier_address + 8 s, empty ones kStages further.
      barrier_address = shared_address + Shared::kBarrierOffset;
      if (warp == 0 && lane == 0) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
          mbarrier_init(barrier_address + 8 * s, 1);
          mbarrier_init(barrier_address + 8 * (kStages + s), Shape::kThreads);
        }
        fence_barrier_init();
      }
      __syncwarp();
    } else if constexpr (kBulkCopy) {
      if (lane == 0) {
#pragma unroll
        for (int s = 0; s < kStages; ++s) mbarrier_init(barrier_address + 8 * s, 1);
        fence_barrier_init();
      }
      __syncwarp();
    } else {
      if (head_warp == 0) plans[lane] = plan;
    }
    cta_first_tile = range.begin / kTileTokens;
    first_tile = cta_first_tile + head_warp;
    end_tile = (range.end + kTileTokens - 1) / kTileTokens;
    count = first_tile < end_tile ? (end_tile - first_tile + kWarpsPerHead - 1) / kWarpsPerHead : 0;
    // The tensor maps' addresses, broadcast so they stay in uniform registers
    // across the loop instead of being recomputed from the parameters per tile.
    const auto uniform_address = [](const void* pointer) {
      const auto address = reinterpret_cast<std::uint64_t>(pointer);
      const std::uint32_t low = __shfl_sync(kFullMask, static_cast<std::uint32_t>(address), 0);
      const std::uint32_t high = __shfl_sync(kFullMask, static_cast<std::uint32_t>(address >> 32), 0);
      return reinterpret_cast<const void*>((static_cast<std::uint64_t>(high) << 32) | low);
    };
    records_map = kBulkCopy ? uniform_address(&maps.records) : nullptr;
    fields_map = kBulkCopy ? uniform_address(&maps.fields) : nullptr;
  }

  __device__ __forceinline__ int load_blocks(int window) const {
    const int index = window + lane;
    if constexpr (kRowCopies) {  // the CTA's tiles, in order
      return cta_first_tile + index < end_tile ? tile_block(table, cta_first_tile + index, block_shift) : 0;
    }
    return index < count ? tile_block(table, first_tile + index * kWarpsPerHead, block_shift) : 0;
  }

  /// Whole rows: round `round`'s tiles (the CTA's tiles kWarpsPerHead round
  /// .., one per warp of a kv head) into stage `stage`; `blocks`
  /// holds the window of 32 tiles with them (kWarpsPerHead divides 32).
  __device__ __forceinline__ void issue_round(int round, int stage) const {
    const int round_tile = kWarpsPerHead * round;
    int physical[kWarpsPerHead];
#pragma unroll
    for (int j = 0; j < kWarpsPerHead; ++j) physical[j] = __shfl_sync(kFullMask, blocks, (round_tile + j) & 31);
    if (elect_one_lane()) {
      const int tiles = min(kWarpsPerHead, end_tile - cta_first_tile - round_tile);
      const std::uint32_t barrier = barrier_address + 8 * stage;
      mbarrier_arrive_expect_tx(barrier, tiles * Layout::kStageBytes);
#pragma unroll
      for (int j = 0; j < kWarpsPerHead; ++j) {
        if (j < tiles) {
          const int slot = ((cta_first_tile + round_tile + j) * kTileTokens) & block_mask;
          const std::uint32_t destination = records_address + stage * Shared::kStageStride + j * Layout::kStageBytes;
          if constexpr (Shape::kRuns) {  // the tile's 16 whole rows, contiguous in its block
            bulk_load(destination, cache + physical[j] * block_stride + slot * static_cast<std::int64_t>(token_stride),
                      Layout::kStageBytes, barrier);
          } else {
            bulk_tensor_load(destination, records_map, box_column / 8, slot, physical[j], barrier);
          }
        }
      }
    }
  }

  /// The warp's n-th tile (in physical block `physical`) into stage n % kStages.
  template <class StageIndex>
  __device__ __forceinline__ void issue_bulk(int n, int physical, StageIndex stage_index) const {
    if (elect_one_lane()) {
      const int stage = stage_index;
      const std::uint32_t barrier = barrier_address + 8 * stage;
      const int slot = ((first_tile + n * kWarpsPerHead) * kTileTokens) & block_mask;
      if constexpr (Shape::kSlots) {
        // The box of the tile's 16 slots of kv head `head` (from byte box_column of each token's row).
        mbarrier_arrive_expect_tx(barrier, Layout::kStageBytes);
        bulk_tensor_load(ring_address + stage * Shared::kStageStride, records_map, box_column, slot, physical, barrier);
      } else {
        mbarrier_arrive_expect_tx(barrier, Layout::kMetaOffset + Shared::kFieldBytes);
        bulk_tensor_load(ring_address + stage * Shared::kStageStride, records_map, 0, head, slot, physical, barrier);
        bulk_tensor_load(fields_address + stage * Shared::kFieldsStride, fields_map, slot, Layout::kFields * head,
                         physical, barrier);
      }
    }
  }

  /// The ring's first kStages - 1 tiles, issued before anything else is
  /// computed so their HBM latency overlaps the prologue.
  __device__ __forceinline__ void issue_first_tiles() {
    if constexpr (kRowCopies) {  // the first kStages - 2 rounds (advance)
      if (fills_ring) {
        blocks = load_blocks(0);
#pragma unroll
        for (int s = 0; s < kStages - 2; ++s) {
          // By warp 0, which initialised the barriers: the others use them after the prologue's barrier.
          if (s < count && warp_issues_first) issue_round(s, s);
        }
      }
      return;
    }
    blocks = load_blocks(0);
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if constexpr (kBulkCopy) {
        const int physical = __shfl_sync(kFullMask, blocks, s);
        if (s < count) issue_bulk(s, physical, s);
      } else {
        if (s < count) {
          issue_tile(ring_address + s * Shared::kStageStride, cache, block_stride, __shfl_sync(kFullMask, blocks, s),
                             first_tile + s * kWarpsPerHead, block_mask, plan, lane, last_block);
        }
        cp_async_commit();
      }
    }
  }

  /// The second window's blocks (after the prologue: the rotation needs the registers).
  __device__ __forceinline__ void load_second_window() {
    if (fills_ring) blocks_next = load_blocks(32);
  }

  /// Before the warp's k-th tile, in stage `stage_index` = k % kStages (a
  /// compile-time constant where the loop is unrolled by kStages): issues
  /// tile k + kStages - 1, then waits for tile k (barrier phase `phase`).
  template <class StageIndex>
  __device__ __forceinline__ void advance(int k, StageIndex stage_index, unsigned phase) {
    if constexpr (kRowCopies) {
      // The issuing warp (a kv head's first: its count is the rounds) issues
      // round k + kStages - 2, where it is its turn, into the stage of round
      // k - 2 once every warp has released that; each keeps the window of
      // blocks.
      const int ahead = k + kStages - 2;
      if (fills_ring && ahead < count) {
        if (((kWarpsPerHead * ahead) & 31) == 0) {
          blocks = blocks_next;
          blocks_next = load_blocks(kWarpsPerHead * ahead + 32);
        }
        // Its turn: rounds equal to its kv head's slot modulo kIssuers (from
        // the thread index: a register held across the loop spilled).
        if (kIssuers == 1 || ahead % kIssuers == Shape::head_slot(static_cast<int>(threadIdx.x >> 5))) {
          const int ahead_stage = (static_cast<int>(stage_index) + kStages - 2) % kStages;
          if (k >= 2) mbarrier_wait_parity(barrier_address + 8 * (kStages + ahead_stage), ((k - 2) / kStages) & 1);
          issue_round(ahead, ahead_stage);
        }
      }
      mbarrier_wait_parity(barrier_address + 8 * static_cast<int>(stage_index), phase);
    } else {
      const int ahead = k + kStages - 1;
      if (ahead < count) {
        if ((ahead & 31) == 0) {
          blocks = blocks_next;
          blocks_next = load_blocks(ahead + 32);
        }
        if constexpr (kBulkCopy) {
          issue_bulk(ahead, __shfl_sync(kFullMask, blocks, ahead & 31),
                     std::integral_constant<int, (StageIndex::value + kStages - 1) % kStages>{});
        } else {
          const int tile = first_tile + ahead * kWarpsPerHead;
          issue_tile(ring_address + (ahead % kStages) * Shared::kStageStride, cache, block_stride,
                     __shfl_sync(kFullMask, blocks, ahead & 31), tile, block_mask, IssuePlan(plans[lane]), lane,
                     last_block);
        }
      }
      if constexpr (kBulkCopy) {
        mbarrier_wait_parity(barrier_address + 8 * static_cast<int>(stage_index), phase);
      } else {
        cp_async_commit();
        cp_async_wait<kStages - 1>();
        __syncwarp();
      }
    }
  }

  /// Whole rows: the warp is done with the stage of its k-th tile. Every
  /// lane arrives, each releasing its own reads of the stage before warp 0
  /// refills it.
  template <class StageIndex>
  __device__ __forceinline__ void release(StageIndex stage_index) const {
    if constexpr (kRowCopies) mbarrier_arrive(barrier_address + 8 * (kStages + static_cast<int>(stage_index)));
  }

  /// token_slots: the landed tile in `stage` into the layout's arrangement
  /// (after advance), visible to the warp on return.
  __device__ __forceinline__ void repack(std::uint8_t* stage) const {
    if constexpr (Shape::kSlots && !Shape::kSlotsInPlace) {
      Shared::Slot::repack(stage, head, num_kv_heads, token_stride, lane);
      __syncwarp();
    }
  }

  /// The first position of the warp's k-th tile.
  __device__ __forceinline__ int tile_token(int k) const { return (first_tile + k * kWarpsPerHead) * kTileTokens; }
};

}  // namespace tqdecode::cuda::tensor_core
