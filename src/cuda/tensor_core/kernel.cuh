// The tensor-core ("Hopper") kernel: the whole decode step for every preset —
// turboquant_4bit_nc (the headline profile), turboquant_k3v4_nc,
// turboquant_3bit_nc and turboquant_k8v4 — at D = 64, 128 and 256
// (shape.cuh), in one launch, built for sm_90a
// (the Hopper path) and sm_80 (its narrow configuration, 128-byte table
// rows, also serves the generic path on sm_80 and newer: GenericKernel::tensor_core).
// The presets share everything after the scores; they differ in how keys
// reach the S^T mma: 4-bit codes look up a byte (two codes), 3-bit codes six
// bits (two codes, brought into place by a funnel shift) in a per-lane table
// of fp16 centroid pairs scaled by a power of two, against the rotated query
// (bf16 per docs/FORMAT.md) scaled by the inverse power of two into fp16; fp8 keys
// skip the rotation and the table: each key byte pair converts to an fp16
// pair (exact) and S^T = K Q^T runs in fp16 with the query rounded to fp16
// (exact for fp16 queries and for bf16 values of magnitude 2^-14 to 65504);
// and in how value codes reach the O^T mma
// (4-bit: one byte permute per two tokens; 3-bit: six byte windows per two
// tokens, value_code_position).
//
// Grid (partition slot, kv head, sequence slot). Two CTAs of 8 warps per SM, or for
// 4-bit keys up to group 8 one CTA of 16 warps (the wide table), which on
// grids of more than two waves serves two, four or eight kv heads, 8, 4 or 2
// warps each (grid (partition, kv head group, sequence); token_slots: eight
// from whole token rows, as below); for the other presets up to group 8 on
// grids of at most two waves, one CTA of 16 warps
// serving two kv heads, and in the token_slots order on grids that fill the
// GPU one of 16 warps serving eight (or four) kv heads from whole token rows
// in a ring its warps share (or every kv head of a shard of two or four,
// from each tile's contiguous token run); one CTA of 12 warps for groups over 8, with the
// wide table for 4-bit keys (KernelShape). On
// the Hopper path the kernel is launched as a programmatic dependent
// (launch_decode_tensor_core): its CTAs may start while the previous kernel of
// the stream drains. A CTA
// 0. builds the key lookup table from the centroids (and in the 16-warp
//    shapes loads PiT's operands), model constants that no kernel writes
//    just before a decode (decode.hpp), then waits for the previous kernel
//    and finds the sequence and partition its slot of the grid's B x N is
//    dealt by length (balanced_partitions.cuh);
// 1. puts its first tiles in flight, then rotates the query heads of its
//    group (q_rot = bf16(q @ PiT) on the tensor cores, rotation.cuh);
// 2. streams its token range in 16-token tiles, warps taking tiles round
//    robin, each warp keeping kStages tiles in flight in its own ring of
//    shared-memory stages (cp.async; in the wide shape bulk tensor copies,
//    one per tile and tensor map, completing on one barrier per stage), and
//    runs the two products on the tensor cores
//    (mma.sync m16n8k16) with the query heads as the 8-wide N side, so a
//    group of 8 fills every mma and nothing is padded:
//      S^T = K Q^T   (M = 16 tokens, K = head dims; fp16)
//      O^T += V^T P'^T (M = 16 head dims, K = 16 tokens; fp16)
//    The probabilities come out of the first product as an 8x8 (token, head)
//    fragment per 8 tokens; one movmatrix transposes each into the second
//    product's B operand;
// 3. merges its warps (each row's maximum, warp weights and sum once, one
//    warp per row; then the weighted outputs, one head dim per thread) and
//    writes the partition's (max, sum, normalized out);
// 4. if it is the last CTA of its (sequence, kv head) to finish, reduces the
//    sequence's partitions with the sink (one warp per query head, or per half of
//    one where the CTA has twice as many warps as rows; one lane per
//    partition) and writes the output (then resets the arrival counter, so
//    CUDA-graph replays need no memset).
//
// Dequantization is arranged to cost less than the memory time:
// - Keys: one shared-memory lookup turns a packed byte (two 4-bit indices)
//   into an fp16 pair of centroids; the 256-entry table is replicated per lane
//   so lookups never conflict (128-byte rows, 32 KB shared by 8 warps; the
//   wide shape's 256-byte rows, 64 KB shared by 16 warps, let one byte
//   permute form the address). The key norm is folded into the score.
// - The head-dim order inside a k-step is permuted (the query uses the same
//   permutation) so each lane's key operand is 16 contiguous bytes.
// - Values: one byte permute pairs the same byte of two tokens; one
//   mask-and-or makes its low nibbles fp16 (1 + c/1024) ((x & 0xf) | 0x3c00)
//   and its high nibbles fp16 (1 + c/64) (c in mantissa bits 7..4). Scale and
//   zero fold into the probabilities:
//     sum_t p_t (c_t s_t + z_t) = sum_t P'_t c_t + sum_t p_t z_t,  P'_t = fp16(p_t s_t)
//   (fp16(p_t) s_t in fp16 in the bulk-copy shapes)
//   and sum_t P'_t c_t = 2^(10-p) (sum_t P'_t (1 + c_t 2^(p-10)) - sum_t P'_t)
//   for a code at mantissa bit p, sum_t P'_t coming from one extra mma with
//   an all-ones operand.
// - Output dims are permuted (dims 16 g + 2 m + {0, 1} in m-tile m, rows g
//   and g + 8) and restored in the merge.
// - Softmax runs in base 2 (log2 e folded into the score scale) and rescales
//   the accumulators only when some head's maximum grew.
// Shared-memory tiles are XOR-swizzled by token so the 16- and 8-byte
// operand loads are free of bank conflicts.
//
// Files (src/cuda/tensor_core/), by stage:
//   shape.cuh        instance shapes (warps, resident CTAs) and shared-memory layouts
//   balanced_partitions.cuh  the sequence and partition a CTA's slot of the grid is dealt (length-balanced)
//   cta_rows.cuh     the query rows a CTA serves (group x query tokens, row tiles) and their causal limits
//   tile_layout.cuh  where a tile lives in a ring stage, per key format and head size; its cp.async copies
//   bulk_copy.cuh    the wide shape's bulk tensor copies and barriers (tensor maps: ../cache_tensor_maps.cpp)
//   slot_tile.cuh    the token_slots order: slots read where they land (bulk copies or cp.async windows), or repacked
//   prologue.cuh     stages 0-1: the key lookup table, the rotated query rows
//   rotation.cuh     the query rotation's products on the tensor cores
//   fragments.cuh    register-level operations (packing, mma, transpose)
//   mainloop.cuh     stage 2's products per key format: key scores, value accumulation
//   stream.cuh       stage 2's tile ring per warp: its tiles, their blocks, the copies into its stages
//   softmax.cuh      stage 2's online softmax per row, the masks past the range and the causal limits, P'
//   kernel.cuh       this file: decode_cta (the stages in order, the tile stream), the kernel, its launch
//   epilogue.cuh     writing outputs, stage 3 (the warps' merge), stage 4 (the partitions' reduction)
//   launch.hpp       the instances; instances/<format>_d<D>.cu compile one each
//   dispatch.cu      the one dispatch of a call to its instance (../dispatch.hpp), the policy's footprints
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "../cuda_check.hpp"
#include "../device_utils.cuh"
#include "../dynamic_shared_memory.hpp"
#include "../kernel_params.hpp"
#include "../partition_merge.cuh"
#include "../policy.hpp"
#include "balanced_partitions.cuh"
#include "bulk_copy.cuh"
#include "cta_rows.cuh"
#include "epilogue.cuh"
#include "fragments.cuh"
#include "launch.hpp"
#include "mainloop.cuh"
#include "prologue.cuh"
#include "rotation.cuh"
#include "shape.cuh"
#include "softmax.cuh"
#include "stream.cuh"
#include "tile_layout.cuh"
#include "tqdecode/numeric.hpp"
#include "tqdecode/partition.hpp"

namespace tqdecode::cuda::tensor_core {

// HeadTiles: 8-head tiles of the query group (1 for groups up to 8, else 2).
// Keys: 4-bit (turboquant_4bit_nc) or 3-bit (turboquant_k3v4_nc) MSE keys
// through the lookup table, or fp8 keys (turboquant_k8v4, unrotated queries).
// HeadsPerCta: kv heads per CTA (2, 4 or 8: the wide shape for large grids;
// 2: the other presets' 16-warp CTA).
template <int HeadDim, int HeadTiles, CacheFormat Format, bool Wide, int HeadsPerCta, SlotAccess Slots>
__device__ __forceinline__ void decode_cta(const FusedDecodeParams& params, const CacheTensorMaps& maps) {
  constexpr bool kFp8 = Format == CacheFormat::fp8;
  using Shared = SharedLayout<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  using Layout = typename Shared::Layout;
  using Shape = KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  constexpr int kStages = Shape::kStages;
  constexpr int kDimTiles = Shape::kDimTiles;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kRows = Shape::kRows;
  constexpr int kCtaRows = Shape::kCtaRows;
  constexpr int kRowStep = Shape::kRowStep;
  extern __shared__ __align__(128) std::uint8_t shared[];
  auto* query_rows = reinterpret_cast<std::uint16_t*>(shared + Shared::kQueryOffset);  // [kCtaRows][HeadDim], query_slot
  const PartitionParams& p = params.partitions;
  const RotateParams& rq = params.rotate;
  constexpr bool kBulkCopy = Shape::kBulkCopy;
  // Bulk copies: broadcast, so the compiler knows it is the same across the
  // warp and keeps the copies' operands in uniform registers.
  const int warp = kBulkCopy ? __shfl_sync(kFullMask, static_cast<int>(threadIdx.x >> 5), 0) : threadIdx.x >> 5;
  // MSE keys: kept in a register rather than recomputed per tile (fewer
  // instructions in their loops; the fp8 loop comes out longer).
  const int lane = Format == CacheFormat::fp8 ? static_cast<int>(threadIdx.x & 31) : static_cast<int>(opaque(threadIdx.x & 31));
  // The token of a tile's S^T row or O^T k index `index` (TileLayout<mse4>).
  const auto token_at = [](int index) { return LaneOperands<Shape, Layout, Format>::token_at(index); };

  // ---- 0. constants, then wait for the previous kernel of the stream ----------
  // PiT and the centroids only (decode.hpp: they are not written by the
  // kernel just before the decode); every other input may be. PiT's loads
  // (KernelShape::kPiTBeforeWait) are in flight until the rotation uses them.
  // MSE keys: warp w computes output-dim tiles w, w + kWarps, ... of the
  // rotated query (rotation.cuh) in passes of kRotationKSteps k-steps;
  // with one tile and one pass per warp (D = 64, 128) PiT's operands load once.
  constexpr int kRotationTiles = HeadDim / 16;
  constexpr int kRotationKSteps = rotation_k_steps(HeadDim);
  constexpr bool kRotationLoads = kRotationTiles > kWarps || kRotationKSteps < HeadDim / 16;  // per tile and pass
  const bool rotates = !kFp8 && warp < kRotationTiles;
  RotationOperands<kRotationKSteps> rotation;
  // MSE keys: the key scores' fp16 operands are the table's centroids times
  // 2^table_exponent and the rotated query times 2^-table_exponent.
  int table_exponent = 0;
  if constexpr (!kFp8) {
    // The table first: its centroid loads issued behind PiT's 64 KB delayed
    // it, and the CTAs that start last, on the SMs the previous call's
    // reductions held, pay their prologue on the call's critical path.
    table_exponent = build_lookup_table<Shared, kWarps>(shared, p.centroids, warp, lane);
    if (Shape::kPiTBeforeWait && !kRotationLoads && rotates) load_rotation_operands<HeadDim>(rotation, rq.PiT, warp, lane);
  }
#if __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();           // no-op unless launched as a programmatic dependent
  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel's CTAs may take SMs as this grid's free up
#endif

  // Grid x: the row tiles of partition slot s side by side (cta_rows.cuh), so
  // the CTAs reading the same tokens run together and share them in L2. Slot
  // (z, s) is dealt a sequence and a partition of it by length
  // (balanced_partitions.cuh).
  const int grid_partition = blockIdx.x / params.row_tiles;
  const SequencePartition assigned = deal_partition(p, static_cast<int>(blockIdx.z), grid_partition);
  if (assigned.idle()) return;  // past its sequence's kMaxPartitions: writes nothing
  const int partition = assigned.partition;
  const int first_head = blockIdx.y * HeadsPerCta;  // the CTA's kv heads: first_head .. + HeadsPerCta - 1
  const int batch = assigned.sequence;
  // The warp streams kv head first_head + head_slot as warp head_warp of kWarpsPerHead.
  const int head_slot = Shape::head_slot(warp);
  const int head_warp = Shape::head_warp(warp);
  const int head = first_head + head_slot;
  // Rotation, merge and reduction: one head dim per thread, rows first_row, first_row + kRowStep, ...
  const int dim = Shape::thread_dim();
  const int first_row = Shape::thread_first_row();
  const int num_kv_heads = p.layout.num_kv_heads;
  const int group = p.num_q_heads / num_kv_heads;
  const int num_partitions = assigned.count;
  // The CTA's query rows, and what the tiles from cta_mask_from on compare
  // their positions with, in shared memory rather than registers across the
  // main loop (the two-head-tile loops hold 168 a thread); visible from the
  // next barrier on. Lane quad c's rows 2c + e of head tile nt are query
  // token first + delta, delta in bits kDeltaBits (2 nt + e) of row_deltas[c]
  // (the same for every kv head of the CTA); position first_limit + delta on
  // is masked for such a row.
  __shared__ CtaRows<kRows> cta_rows;
  __shared__ TokenRange cta_range;
  __shared__ int cta_mask_from;  // the first masked position of any row: the range's end or the first row's limit
  __shared__ int cta_first_limit;
  __shared__ typename Shape::RowDeltas row_deltas[4];
  auto& row_table = *reinterpret_cast<RowTable<kCtaRows>*>(shared + Shared::kRowTableOffset);
  const ReduceParams& r = params.reduce;
  const bool has_sink = r.sinks != nullptr;
  // The query tile in chunks of 8 dims (16 bytes) of one row: chunk c is row
  // c / kRowChunks, dims 8 (c % kRowChunks) on, thread t holds chunks t,
  // t + kThreads, ... (two at 64 rows): one address computation a chunk,
  // where an element a row and thread took 16 in the eight-kv-head CTAs.
  constexpr int kRowChunks = HeadDim / 8;
  constexpr int kQueryChunks = (kCtaRows * kRowChunks + Shape::kThreads - 1) / Shape::kThreads;
  uint4 query_chunks[kQueryChunks];
  // The row of the thread's chunk v, and the chunk's first dim.
  const auto chunk_row = [](int v) { return (static_cast<int>(threadIdx.x) + Shape::kThreads * v) / kRowChunks; };
  const auto chunk_dim = [](int v) { return 8 * ((static_cast<int>(threadIdx.x) + Shape::kThreads * v) % kRowChunks); };
  // Element k of a chunk (query bits).
  const auto chunk_element = [](const uint4& chunk, int k) {
    const unsigned word = k < 2 ? chunk.x : k < 4 ? chunk.y : k < 6 ? chunk.z : chunk.w;
    return static_cast<std::uint16_t>(k % 2 ? word >> 16 : word & 0xffffu);
  };
  float sink = -INFINITY;  // of row threadIdx.x, stored once its load has landed
  TokenRange range;
  {
    const CtaRows<kRows> rows{first_head,
                              group,
                              static_cast<int>(blockIdx.x) - grid_partition * params.row_tiles,
                              batch,
                              params.rows.max_query_len,
                              params.rows.span(batch),
                              assigned.seq_len};
    // NOTE: only entries of this sequence's block-table row are ever read.
    // The range stops at the limit of the CTA's last row; tokens from the
    // first row's limit on are masked per row (one token per sequence: at
    // the range's end, as the sequence's).
    range = partition_range(rows.seq_len, num_partitions, p.partition_align, partition);
    range.end = rows.any_valid() ? min(range.end, rows.last_limit()) : range.begin;
    if (threadIdx.x == 0) {
      cta_rows = rows;
      cta_range = range;
      cta_mask_from = min(range.end, rows.first_limit());
      cta_first_limit = rows.first_limit();
    }
    if (threadIdx.x < 4) {
      typename Shape::RowDeltas deltas = 0;
      for (int nt = 0; nt < HeadTiles; ++nt) {
        for (int e = 0; e < 2; ++e) {
          const int row = kHeadsPerTile * nt + 2 * threadIdx.x + e;
          deltas |= static_cast<typename Shape::RowDeltas>(rows.token(row) - rows.token(0))
                    << (Shape::kDeltaBits * (2 * nt + e));
        }
      }
      row_deltas[threadIdx.x] = deltas;
    }
    if (threadIdx.x < kCtaRows) {
      const int row = threadIdx.x;
      std::int64_t element = -1, output = -1;
      if (rows.valid(row)) {
        const std::int64_t hq = rows.query_head(row);
        output = rows.output_row(row) * r.output_stride_batch + hq * r.output_stride_head;
        element = num_partitions == 1
                      ? output
                      : rows.partition_entry(row, hq, p.num_q_heads, assigned.first_slot, num_partitions, partition) *
                            HeadDim;
        if (has_sink) sink = __ldg(r.sinks + hq);
      }
      row_table.element[row] = element;
      row_table.output[row] = output;
    }
    // The query first (as bits): under a saturated memory system its load
    // waits behind the cache tiles if issued after them. A chunk in one
    // 16-byte load where the pointer and strides keep it aligned, else
    // element by element. An empty partition reads nothing.
    const auto* query = static_cast<const std::uint16_t*>(rq.query);
    const bool aligned_chunks =
        (reinterpret_cast<std::uintptr_t>(query) | static_cast<std::uintptr_t>(rq.query_stride_batch | rq.query_stride_head) * 2) %
            16 == 0;
#pragma unroll
    for (int v = 0; v < kQueryChunks; ++v) {
      const int row = chunk_row(v);
      query_chunks[v] = make_uint4(0u, 0u, 0u, 0u);
      if (range.begin < range.end && row < kCtaRows && rows.valid(row)) {
        const std::uint16_t* source = query + rows.output_row(row) * rq.query_stride_batch +
                                      rows.query_head(row) * rq.query_stride_head + chunk_dim(v);
        if (aligned_chunks) {
          query_chunks[v] = __ldg(reinterpret_cast<const uint4*>(source));
        } else {
          unsigned words[4];
#pragma unroll
          for (int w = 0; w < 4; ++w) words[w] = __ldg(source + 2 * w) | static_cast<unsigned>(__ldg(source + 2 * w + 1)) << 16;
          query_chunks[v] = make_uint4(words[0], words[1], words[2], words[3]);
        }
      }
    }
  }
  const CtaRows<kRows>& rows = cta_rows;
  // The partition's result for query row `row` (max in natural-log units, as
  // the spec's reducer expects), once per row: with one partition the row is
  // the output row, so the reduction's rule runs here and nothing goes
  // through the partition buffers; else its max and sum are stored. Returns
  // the factor that turns the row's merged output (the warps' weighted sum)
  // into the element to store, 0 for an all-zero row.
  const auto finish_row_statistics = [&](int row, float max, float sum) {
    if (num_partitions == 1) return single_partition_scale(max, sum, has_sink, row_table.sink[row]);
    const std::int64_t index = row_table.element[row] / HeadDim;
    p.part_max[index] = max;
    p.part_sum[index] = sum;
    return partition_is_nan(max, sum) || sum != 0.0f ? 1.0f / sum : 0.0f;
  };
  // Element `dim` of the row whose first element is `element` (RowTable::element).
  const auto store_row_element = [&](std::int64_t element, int dim, float value) {
    if (num_partitions == 1) {
      store_from_float(r.output, r.output_dtype, element + dim, value);
    } else {
      p.part_out[element + dim] = value;
    }
  };
  const RowTargets<kCtaRows, decltype(finish_row_statistics), decltype(store_row_element)> targets{
      row_table, finish_row_statistics, store_row_element};

  if (range.begin >= range.end) {
    // NOTE: an empty partition writes the empty values and reads nothing else.
    if (threadIdx.x < kCtaRows) row_table.sink[threadIdx.x] = sink;
    __syncthreads();  // row_table
    for (int row = first_row; row < kCtaRows; row += kRowStep) targets.write_empty(row, dim);
  } else {
    // ---- 1. first tiles in flight, query rotation, lookup table -------------
    // The ring's first kStages - 1 tiles are issued before anything else is
    // computed so their HBM latency overlaps the prologue.
    TileRing<Shape, Shared> ring(p, maps, shared, range, batch, head, head_slot, warp, head_warp, lane);
    ring.issue_first_tiles();
    if constexpr (kFp8) {
      // fp8 keys: the query as it is, in fp16 (exact for fp16 queries and
      // for bf16 values of magnitude 2^-14 to 65504).
#pragma unroll
      for (int v = 0; v < kQueryChunks; ++v) {
        const int row = chunk_row(v);
        if (row < kCtaRows) {
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            query_rows[query_slot<HeadDim>(row, chunk_dim(v) + k)] = __half_as_ushort(
                __float2half_rn(query_bits_to_float(rq.query_dtype == DType::f16, chunk_element(query_chunks[v], k))));
          }
        }
      }
    } else {
      // MSE keys: the rotation on the tensor cores (rotation.cuh).
      // The wide shape: in the rings' last stages (SharedLayout).
      auto* query_bits = reinterpret_cast<std::uint16_t*>(
          shared + (Shared::kQueryBitsInRings ? ring.records_offset + (kStages - 1) * Shared::kStageStride
                                              : Shared::kQueryOffset + Shared::kQueryBytes));
#pragma unroll
      for (int v = 0; v < kQueryChunks; ++v) {
        const int row = chunk_row(v);
        if (row < kCtaRows) {
          std::uint16_t* destination = query_bits + (row / kHeadsPerTile) * Shared::kQueryBitsTileStride +
                                       (row % kHeadsPerTile) * Shared::kQueryBitsStride + chunk_dim(v);
#pragma unroll
          for (int k = 0; k < 8; ++k) destination[k] = chunk_element(query_chunks[v], k);
        }
      }
      if (!Shape::kPiTBeforeWait && !kRotationLoads && rotates) load_rotation_operands<HeadDim>(rotation, rq.PiT, warp, lane);
      __syncthreads();  // the query bits are in place
      if (rotates) {
        rotate_query_rows<Shape, Shared>(rotation, query_bits, query_rows, rq.PiT, rq.query_dtype == DType::f16,
                                         power_of_two(-table_exponent), warp, lane);
      }
    }
    // The sinks stored here, not where they were loaded: their loads' latency
    // passes behind the first tiles' issue and the rotation.
    if (threadIdx.x < kCtaRows) row_table.sink[threadIdx.x] = sink;
    ring.load_second_window();
    if constexpr (kBulkCopy) fence_proxy_async_shared();  // the copy engine overwrites the query bits next
    __syncthreads();

    const int c = lane & 3;
    const int g = lane >> 2;
    // Query operand (B of S^T = K Q^T), permuted: k-step ks, lane (g, c)
    // holds head g of the tile, dims (D/4)c + 4ks + {0, 1} and {2, 3}
    // (rotated slot reads: those of its key bytes, SlotReadLayout::query_dims).
    // Four head tiles: the query operand read from shared memory at each use
    // (held in registers, its 64 a thread spill the loop); else held in registers.
    struct RegisterQuery {
      std::uint32_t qb[HeadTiles][kDimTiles][2];
      __device__ __forceinline__ uint2 operator()(int nt, int ks) const {
        return make_uint2(qb[nt][ks][0], qb[nt][ks][1]);
      }
    };
    struct SharedQuery {
      const std::uint8_t* base;
      int offset[kDimTiles];
      __device__ __forceinline__ uint2 operator()(int nt, int ks) const {
        return load_shared<uint2>(base + offset[ks] + nt * kHeadsPerTile * HeadDim * 2);
      }
    };
    constexpr bool kQueryInShared = HeadTiles == 4;
    std::conditional_t<kQueryInShared, SharedQuery, RegisterQuery> query;
    if constexpr (kQueryInShared) {
      static_assert(!kReadsRotatedSlots<Layout>);
      query.base = reinterpret_cast<const std::uint8_t*>(query_rows);
#pragma unroll
      for (int ks = 0; ks < kDimTiles; ++ks) {
        const int row = kRows * head_slot + g;
        query.offset[ks] = static_cast<int>(opaque(2 * query_slot<HeadDim>(row, HeadDim / 4 * c + 4 * ks)));
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
        for (int ks = 0; ks < kDimTiles; ++ks) {
          const int row = kRows * head_slot + kHeadsPerTile * nt + g;
          // fp16: against fp8 keys (exact: e4m3 values are fp16 values) and against the table's scaled centroids.
          if constexpr (kReadsRotatedSlots<Layout>) {
            const int dims = Layout::query_dims(c, ks, ring.slot_lead);
            const auto pair = [&](int first) {
              return *reinterpret_cast<const std::uint32_t*>(query_rows + query_slot<HeadDim>(row, first));
            };
            query.qb[nt][ks][0] = pair(dims);
            query.qb[nt][ks][1] = pair((dims + 2) & (HeadDim - 1));
          } else {
            const int dims = HeadDim / 4 * c + 4 * ks;
            const uint2 q = *reinterpret_cast<const uint2*>(query_rows + query_slot<HeadDim>(row, dims));
            query.qb[nt][ks][0] = q.x;
            query.qb[nt][ks][1] = q.y;
          }
        }
      }
    }

    // ---- 2. stream the token range ------------------------------------------
    // Opaque to the compiler, so (offset & 0x7f80) | lane_lut stays one LOP3;
    // for 256-byte table rows it is byte 0 of each lookup's byte permute.
    [[maybe_unused]] std::uint32_t lane_lut;
    asm("mov.b32 %0, %1;" : "=r"(lane_lut) : "r"(static_cast<std::uint32_t>(lane) << 2));
    [[maybe_unused]] const std::uint8_t* lut = shared;

    const LaneOperands<Shape, Layout, Format> operands(g, c, head, num_kv_heads, ring.slot_lead, ring.token_stride);

    OnlineSoftmax<Shape> softmax;
    softmax.init();

    // The bulk-copy shapes take the host's product; the narrow ones keep
    // their loops (KernelShape::kHalfScaledProbabilities).
    const float score_scale = kBulkCopy ? params.scale_log2 : p.scale * kLog2e;
    // token_slots with norm correction (docs/FORMAT.md section 4b): keys over their centroid vectors' norms.
    constexpr bool kRenormalizes = Shape::kSlots && !kFp8;
    const bool renormalize = kRenormalizes && p.layout.renormalize_keys;
    // The stored norm is ||k||: over ||c|| = sqrt(square) 2^-table_exponent.
    [[maybe_unused]] const float renormalized_scale = score_scale * power_of_two(table_exponent);
    const int mask_from = cta_mask_from;

    // The warp's k-th tile, in ring stage stage_index = k % kStages (a
    // compile-time constant where the loop is unrolled by kStages).
    const auto stream_tile = [&](int k, auto stage_index, unsigned phase) {
      ring.advance(k, stage_index, phase);
      const int stage_id = stage_index;
      std::uint8_t* stage = shared + ring.ring_offset + stage_id * Shared::kStageStride;
      ring.repack(stage);
      const std::uint8_t* data = stage;
      const std::uint8_t* fields =
          kBulkCopy ? shared + ring.fields_offset + stage_id * Shared::kFieldsStride : stage + Layout::kMetaOffset;
      const int tile_token = ring.tile_token(k);

      // S^T = K Q^T: rows are tokens g and g + 8, columns heads 2c, 2c + 1.
      // Two accumulator chains (even and odd k-steps) halve the mma dependency chain.
      float score[HeadTiles][4], score_odd[HeadTiles][4];
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) {
        score[nt][0] = score[nt][1] = score[nt][2] = score[nt][3] = 0.0f;
        score_odd[nt][0] = score_odd[nt][1] = score_odd[nt][2] = score_odd[nt][3] = 0.0f;
      }
      // token_slots keys renormalized at decode: with the sums of their squared centroids.
      float square[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      // Rotated slot reads: lane quad 0 takes wrapped key bytes. Told from
      // the opaque lane offset, which stays in a register: a predicate held
      // from before the loop is recomputed from the thread index every tile.
      const bool key_wraps = (lane_lut & 0xcu) == 0u;
      const auto scores = [&]<bool SquareSums>() {
        key_scores<Shape, Layout, Format, SquareSums>(data, operands.key_offset, operands.key_word,
                                                      operands.key_low_selector, operands.key_high_selector,
                                                      operands.key_skew, key_wraps,
                                                      operands.key_mask, query, lane_lut, lut, score, score_odd, square);
      };
      if (kRenormalizes && renormalize) {
        scores.template operator()<kRenormalizes>();
      } else {
        scores.template operator()<false>();
      }

      // Per-token fields of tokens g and g + 8: field `field` of token index
      // 8 j + g. The bulk-copy shapes take it as token token_at(g) + 8 j
      // (token_at(i + 8) = token_at(i) + 8), one offset for both tokens; the
      // narrow shapes keep their loops (KernelShape::kHalfScaledProbabilities).
      const auto token_field = [&](int field, int j) {
        if constexpr (Shape::kSlotsInPlace) {
          return load_shared<__half>(data + operands.slot_row + j * Layout::kOffset8Tokens + Layout::field_offset(field));
        }
        return kBulkCopy ? tile_field(fields + 2 * token_at(g), field, 8 * j)
                         : tile_field(fields, field, token_at(8 * j + g));
      };
      constexpr bool kHalfScaled = Shape::kHalfScaledProbabilities;
      float norm_scale[2], value_zero[2];
      typename OnlineSoftmax<Shape>::ValueScale value_scale[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if constexpr (kFp8) {
          norm_scale[j] = score_scale;  // fp8 keys carry no norm
        } else {
          const float norm = __half2float(token_field(Layout::kNormField, j));
          if (kRenormalizes && renormalize) {  // 0 for a zero centroid vector
            norm_scale[j] = square[2 * j] > 0.0f ? norm * renormalized_scale * fast_rsqrt(square[2 * j]) : 0.0f;
          } else {
            norm_scale[j] = norm * score_scale;
          }
        }
        if constexpr (kHalfScaled) {
          value_scale[j] = token_field(Layout::kValueScaleField, j);
        } else {
          value_scale[j] = __half2float(token_field(Layout::kValueScaleField, j));
        }
        value_zero[j] = __half2float(token_field(Layout::kValueZeroField, j));
      }
      typename OnlineSoftmax<Shape>::Scores d;
      softmax.base2_scores(score, score_odd, norm_scale, d);
      if (tile_token + kTileTokens > mask_from) {
        softmax.mask_tile(d, value_scale, value_zero, cta_range.end, cta_first_limit, row_deltas[c],
                          [&](int j) { return tile_token + token_at(8 * j + g); });
      }

      // Online softmax per head (softmax.cuh), then P' = p * value scale as
      // the B operand of O^T += V^T P'^T.
      softmax.move_references(d, value_scale, k == 0);
      std::uint32_t pb[HeadTiles][2];
      softmax.probabilities(d, value_scale, value_zero, pb);
      accumulate_values<Shape, Layout, Format>(data, operands.value_offset, operands.value_word, operands.low_selector,
                                               operands.high_selector, operands.value_skew, operands.value_wraps,
                                               operands.value_mask, pb,
                                               softmax.acc);
      softmax.add_probability_sums(pb);
      __syncwarp();  // the warp's own ring: the stage is refilled by the next iteration's issue
      ring.release(stage_index);
    };
    if constexpr (kBulkCopy && !Shape::kRowCopies) {
      // Unrolled by kStages: every stage and barrier address is an immediate.
      unsigned phase = 0;  // of the barriers' current use: (k / kStages) & 1
      for (int k0 = 0; k0 < ring.count; k0 += kStages, phase ^= 1u) {
        static_for<kStages>([&]<int S>() {
          if (k0 + S < ring.count) stream_tile(k0 + S, std::integral_constant<int, S>{}, phase);
        });
      }
    } else {
      // The whole-row ring rolled: unrolled, its loop spills at 128 registers.
      for (int k = 0; k < ring.count; ++k) {
        stream_tile(k, k % kStages, Shape::kRowCopies ? static_cast<unsigned>(k / kStages) & 1u : 0u);
      }
    }
    if constexpr (!kBulkCopy) cp_async_wait<0>();

    // ---- 3. merge the warps (epilogue.cuh) --------------------------------------
    // Rotated slot reads: the accumulators' dims lag by twice the value bytes' rotation.
    int output_dim_rotation = 0;
    if constexpr (kReadsRotatedSlots<Layout>) output_dim_rotation = 2 * Layout::value_byte_rotation(ring.slot_lead);
    merge_warps<Shape, Shared, Format>(softmax, shared, rows, cta_range.begin, warp, lane, output_dim_rotation,
                                       targets);
  }
  if (num_partitions == 1) return;  // the merge wrote the output

  // ---- 4. the last CTA of (sequence, kv heads) reduces the partitions --------
  reduce_partitions_in_cta<Shape>(params, rows, row_table, partition, num_partitions, warp, lane);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kBelowSm90 = true;
#else
constexpr bool kBelowSm90 = false;
#endif

// The wide-table and several-kv-head configurations need sm_90's shared
// memory per CTA (155 KB and more), the token runs its bulk copies; they are
// never launched below it (policy.cpp), so their sm_80 code is a trap.
template <int HeadDim, int HeadTiles, CacheFormat Format, bool Wide, int HeadsPerCta, SlotAccess Slots>
__global__ void __launch_bounds__(KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>::kThreads,
                                  KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>::kResidentCtas)
    decode_kernel(const __grid_constant__ FusedDecodeParams params, const __grid_constant__ CacheTensorMaps maps) {
  if constexpr ((Wide || HeadsPerCta > 1 || Slots == SlotAccess::runs) && kBelowSm90) {
    __trap();
  } else {
    decode_cta<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>(params, maps);
  }
}

template <int HeadDim, int HeadTiles, CacheFormat Format, bool Wide = false, int HeadsPerCta = 1,
          SlotAccess Slots = SlotAccess::none>
void launch(const FusedDecodeParams& params, CUstream_st* stream) {
  using Shape = KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  constexpr auto kernel = decode_kernel<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  constexpr int kBytes = SharedLayout<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>::kBytes;
  allow_dynamic_shared_memory<kernel>(kBytes);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(params.partitions.num_partitions * params.row_tiles,
                        params.partitions.layout.num_kv_heads / HeadsPerCta, params.partitions.batch);
  config.blockDim = dim3(Shape::kThreads);
  config.dynamicSmemBytes = kBytes;
  config.stream = stream;
  cudaLaunchAttribute programmatic{};
  programmatic.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  programmatic.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &programmatic;
  config.numAttrs = params.programmatic_launch ? 1 : 0;
  // Only the bulk tensor copies read the maps.
  using Shared = SharedLayout<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>;
  const CacheTensorMaps maps =
      Shape::kTensorMaps ? encode_cache_tensor_maps(params.partitions, Shared::row_box_bytes()) : CacheTensorMaps{};
  TQ_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, params, maps));
}

// The instance of a (head size, key format) for the call's query rows per
// kv head (group x query tokens) and the plan's shape (wide table, kv heads
// per CTA): launch.hpp declares it, instances/ define one per file.
template <int HeadDim, CacheFormat Format>
void launch_for_group(const FusedDecodeParams& params, CUstream_st* stream) {
  const int head_tiles = params.head_tiles;
  if (head_tiles == 4 && (Format != CacheFormat::mse4 || HeadDim != 128 || !params.wide_table ||
                          params.partitions.layout.token_slots())) {
    throw std::logic_error("tqdecode: four head tiles outside the wide shape's 4-bit blocks order");
  }
  if (params.partitions.layout.token_slots()) {  // one kv head per CTA but in the wide shape
    constexpr SlotAccess kInPlace = SlotAccess::in_place, kRotated = SlotAccess::rotated,
                         kRepacked = SlotAccess::repacked;
    if constexpr (HeadDim == 128) {
      if (params.token_runs) {  // every kv head's whole rows (the plan's kv heads per CTA: Hk)
        constexpr SlotAccess kRuns = SlotAccess::runs;
        if (params.kv_heads_per_cta == 4) return launch<HeadDim, 1, Format, false, 4, kRuns>(params, stream);
        if constexpr (Format == CacheFormat::fp8) {  // one kv head: fp8 keys only (token_slots_read_runs)
          if (params.kv_heads_per_cta == 1) return launch<HeadDim, 1, Format, false, 1, kRuns>(params, stream);
        }
        return launch<HeadDim, 1, Format, false, 2, kRuns>(params, stream);
      }
      if constexpr (Format == CacheFormat::mse4) {
        if (params.wide_table) {
          if (head_tiles == 2) return launch<HeadDim, 2, Format, true, 1, kInPlace>(params, stream);
          if (params.kv_heads_per_cta == 8) {
            if (params.whole_rows) return launch<HeadDim, 1, Format, true, 8, SlotAccess::rows>(params, stream);
            return launch<HeadDim, 1, Format, true, 8, kInPlace>(params, stream);
          }
          if (params.kv_heads_per_cta == 4) {
            if (params.whole_rows) return launch<HeadDim, 1, Format, true, 4, SlotAccess::rows>(params, stream);
            return launch<HeadDim, 1, Format, true, 4, kInPlace>(params, stream);
          }
          if (params.kv_heads_per_cta == 2) return launch<HeadDim, 1, Format, true, 2, kInPlace>(params, stream);
          return launch<HeadDim, 1, Format, true, 1, kInPlace>(params, stream);
        }
      }
      if constexpr (Format != CacheFormat::mse4) {
        // Whole rows (the plan's kv heads per CTA; one kv head per CTA otherwise).
        if (params.kv_heads_per_cta == 8) return launch<HeadDim, 1, Format, false, 8, SlotAccess::rows>(params, stream);
        if constexpr (Format == CacheFormat::fp8) {  // 4 slots of 196 bytes: a 16-byte multiple
          if (params.kv_heads_per_cta == 4) return launch<HeadDim, 1, Format, false, 4, SlotAccess::rows>(params, stream);
        }
      }
      if constexpr (Format == CacheFormat::fp8) {
        if (token_slots_read_rotated(params.partitions.layout)) {
          if (head_tiles == 2) return launch<HeadDim, 2, Format, false, 1, kRotated>(params, stream);
          return launch<HeadDim, 1, Format, false, 1, kRotated>(params, stream);
        }
      }
      if (token_slots_read_in_place(params.partitions.layout)) {
        if (head_tiles == 2) return launch<HeadDim, 2, Format, false, 1, kInPlace>(params, stream);
        return launch<HeadDim, 1, Format, false, 1, kInPlace>(params, stream);
      }
    }
    if constexpr (HeadDim != 256) {
      if (head_tiles == 2) return launch<HeadDim, 2, Format, false, 1, kRepacked>(params, stream);
    }
    return launch<HeadDim, 1, Format, false, 1, kRepacked>(params, stream);
  }
  if constexpr (HeadDim != 128) {
    if constexpr (HeadDim == 64) {
      if (head_tiles == 2) return launch<HeadDim, 2, Format>(params, stream);
    }
    return launch<HeadDim, 1, Format>(params, stream);
  } else {
    if (head_tiles >= 2) {
      if constexpr (Format == CacheFormat::mse4) {
        if (params.wide_table) {
          if (head_tiles == 4) return launch<HeadDim, 4, Format, true>(params, stream);
          return launch<HeadDim, 2, Format, true>(params, stream);
        }
      }
      return launch<HeadDim, 2, Format>(params, stream);
    }
    if constexpr (Format == CacheFormat::mse4) {
      if (params.wide_table) {
        if (params.kv_heads_per_cta == 8) return launch<HeadDim, 1, Format, true, 8>(params, stream);
        if (params.kv_heads_per_cta == 4) return launch<HeadDim, 1, Format, true, 4>(params, stream);
        if (params.kv_heads_per_cta == 2) return launch<HeadDim, 1, Format, true, 2>(params, stream);
        return launch<HeadDim, 1, Format, true>(params, stream);
      }
    }
    if constexpr (Format != CacheFormat::mse4) {  // 4-bit keys serve several kv heads on the wide table
      if (params.kv_heads_per_cta == 2) return launch<HeadDim, 1, Format, false, 2>(params, stream);
    }
    launch<HeadDim, 1, Format>(params, stream);
  }
}

}  // namespace tqdecode::cuda::tensor_core
