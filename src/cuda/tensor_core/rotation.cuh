// Query rotation of the Hopper kernel (internal): q_rot = fp32(q) @ PiT on
// the tensor cores.
//
// docs/FORMAT.md asks for an fp32 product. A bf16 operand carries 8 significant
// bits, so PiT and the query are each split into a bf16 high part and a
// bf16 low part (x = hi + lo to about 2^-17 relative; an fp16 query splits
// exactly, a bf16 query is its own high part) and the products accumulate
// in fp32: hi*hi, then lo*hi + hi*lo in a second chain. The dropped lo*lo
// term is under 2^-16 of each product, far below the bf16 rounding of q_rot
// (2^-9). This replaces a loop of 256-512 FMAs per thread over PiT staged in
// shared memory (64 KB per CTA, in two passes for the 32 KB table region)
// by 2-3 mma per k-step, warp and head tile.
//
// The query rows come through shared memory (each thread loads one element
// per row, coalesced, as the kernel's other paths do); the warp computing
// output-dim tile t (16 dims, D/16 tiles) computes it for every query row as
// 16x8 tiles of the transposed product, one per head tile:
//   q_rot^T[dims, rows] = PiT^T[dims, :] Q^T[:, rows]
// (M = output dims, K = input dims in k-steps of 16, N = 8 query rows), in
// passes of at most 8 k-steps (D = 256: two), so PiT's operands of one pass
// fit the registers.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fragments.cuh"
#include "tile_layout.cuh"

namespace tqdecode::cuda::tensor_core {

/// The query's bits in shared memory, row r of a head tile at
/// r * query_bits_stride(D): the 8-element pad makes the B-fragment reads
/// (lane (g, c): row g, elements 16ks + 2c, + 1) free of bank conflicts.
constexpr int query_bits_stride(int head_dim) { return head_dim + 8; }
/// k-steps of one pass of the product (input dims 16 ks ..): PiT's operands
/// of up to 128 input dims stay in registers at once.
constexpr int rotation_k_steps(int head_dim) { return head_dim < 128 ? head_dim / 16 : 8; }

/// PiT's part of output-dim tile `dim_tile` for input dims 16 first_step ..
/// from row-major fp32 D x D PiT (PiT[i][j] = Pi[j][i]). The tile's rows g
/// and g + 8 are output dims 16 dim_tile + 2g and + 1 (any order of a tile's
/// rows gives the same product), so each lane reads both from one 8-byte
/// load per PiT row: rows 16ks + 2c + {0, 1, 8, 9} of k-step ks. Every CTA
/// reads PiT, so these are L2 hits, issued early for their latency to
/// overlap the prologue.
template <int KSteps>
struct RotationOperands {
  float2 pit[KSteps][4];  // [k-step][input dim 16ks + 2c + {0, 1, 8, 9}]: (output dim 2g, 2g + 1)
};

template <int HeadDim, int KSteps>
__device__ __forceinline__ void load_rotation_operands(RotationOperands<KSteps>& operands, const float* pit, int dim_tile,
                                                       int lane, int first_step = 0) {
  const float* lane_pit = pit + (16 * first_step + 2 * (lane & 3)) * HeadDim + 16 * dim_tile + 2 * (lane >> 2);
#pragma unroll
  for (int ks = 0; ks < KSteps; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      operands.pit[ks][r] = __ldg(reinterpret_cast<const float2*>(lane_pit + (16 * ks + (r & 1) + 8 * (r >> 1)) * HeadDim));
    }
  }
}

// x0, x1 as bf16 pairs hi and lo with x = hi + lo (to about 2^-17 relative).
__device__ __forceinline__ void split_bf16(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  hi = pack_bf16(x0, x1);
  lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

/// PiT's operands as the A fragments of every k-step, split into bf16 high
/// and low parts once for all the passes over the query rows.
template <int KSteps>
struct SplitRotationOperands {
  std::uint32_t hi[KSteps][4], lo[KSteps][4];  // [k-step][a0..a3]: a0 / a1 rows g / g + 8, columns 2c, 2c + 1; a2 / a3 columns + 8
};

template <int KSteps>
__device__ __forceinline__ SplitRotationOperands<KSteps> split_rotation_operands(const RotationOperands<KSteps>& operands) {
  SplitRotationOperands<KSteps> split;
#pragma unroll
  for (int ks = 0; ks < KSteps; ++ks) {
    const float2(&pit_rows)[4] = operands.pit[ks];
    split_bf16(pit_rows[0].x, pit_rows[1].x, split.hi[ks][0], split.lo[ks][0]);
    split_bf16(pit_rows[0].y, pit_rows[1].y, split.hi[ks][1], split.lo[ks][1]);
    split_bf16(pit_rows[2].x, pit_rows[3].x, split.hi[ks][2], split.lo[ks][2]);
    split_bf16(pit_rows[2].y, pit_rows[3].y, split.hi[ks][3], split.lo[ks][3]);
  }
  return split;
}

/// The fp32 accumulators of a warp's tile of q_rot^T for HeadTiles x 8 query
/// rows, as the hi*hi chain and the chain of the low parts' products.
template <int HeadTiles>
struct RotationSums {
  float high[HeadTiles][4] = {};
  float low[HeadTiles][4] = {};
};

/// Adds KSteps k-steps of the warp's tile of q_rot^T for HeadTiles x 8 query
/// rows whose bf16 or fp16 bits are in shared memory (`query_bits` at the
/// pass's first input dim, RowStride elements per row, TileStride from one
/// head tile to the next).
template <int HeadTiles, int TileStride, int RowStride, int KSteps>
__device__ __forceinline__ void accumulate_rotation(RotationSums<HeadTiles>& sums,
                                                    const SplitRotationOperands<KSteps>& operands,
                                                    const std::uint16_t* query_bits, bool f16_query, int lane) {
  const int g = lane >> 2;
  const int c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < KSteps; ++ks) {
    // a0 / a1: rows g / g + 8 (output dims 2g / 2g + 1), columns 2c, 2c + 1;
    // a2 / a3: the same rows, columns 2c + 8, 2c + 9.
    const std::uint32_t(&a_hi)[4] = operands.hi[ks];
    const std::uint32_t(&a_lo)[4] = operands.lo[ks];
#pragma unroll
    for (int nt = 0; nt < HeadTiles; ++nt) {
      // Elements 16ks + 2c + {0, 1} and + 8 of query row 8nt + g.
      const std::uint16_t* row = query_bits + nt * TileStride + g * RowStride + 16 * ks + 2 * c;
      std::uint32_t b_hi[2], b_lo[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const std::uint32_t bits = *reinterpret_cast<const std::uint32_t*>(row + 8 * half);
        if (f16_query) {
          const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&bits));
          split_bf16(pair.x, pair.y, b_hi[half], b_lo[half]);
        } else {
          b_hi[half] = bits;  // bf16 queries are their own high part
          b_lo[half] = 0u;
        }
      }
      mma_bf16(sums.high[nt], a_hi, b_hi[0], b_hi[1]);
      mma_bf16(sums.low[nt], a_lo, b_hi[0], b_hi[1]);
      if (f16_query) mma_bf16(sums.low[nt], a_hi, b_lo[0], b_lo[1]);
    }
  }
}

/// Hands each pair of dims of the warp's finished tile to store(row, dim,
/// float2 of dims dim, dim + 1) (fp32, not yet rounded to bf16).
template <int HeadTiles, typename Store>
__device__ __forceinline__ void store_rotation(const RotationSums<HeadTiles>& sums, int dim_tile, int lane, Store&& store) {
  const int g = lane >> 2;
  const int c = lane & 3;
  // C fragment: c0 / c1 = output dim 2g of query rows 2c / 2c + 1, c2 / c3 = output dim 2g + 1.
#pragma unroll
  for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float2 pair = make_float2(sums.high[nt][e] + sums.low[nt][e], sums.high[nt][2 + e] + sums.low[nt][2 + e]);
      store(8 * nt + 2 * c + e, 16 * dim_tile + 2 * g, pair);
    }
  }
}

}  // namespace tqdecode::cuda::tensor_core
