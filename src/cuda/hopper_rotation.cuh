// Query rotation of the Hopper kernel (internal): q_rot = fp32(q) @ PiT on
// the tensor cores.
//
// FORMAT.md asks for an fp32 product. A bf16 operand carries 8 significant
// bits, so PiT and the query are each split into a bf16 high part and a
// bf16 low part (x = hi + lo to about 2^-17 relative; an fp16 query splits
// exactly, a bf16 query is its own high part) and the products accumulate
// in fp32: hi*hi, then lo*hi + hi*lo in a second chain. The dropped lo*lo
// term is under 2^-16 of each product, far below the bf16 rounding of q_rot
// (2^-9). This replaces a loop of 256-512 FMAs per thread over PiT staged in
// shared memory (64 KB per CTA, in two passes for the 32 KB table region)
// by 16-24 mma per warp and head tile.
//
// The query rows come through shared memory (each thread loads one element
// per row, coalesced, as the kernel's other paths do); warp w (w < 8) then
// computes output dims 16w..16w+15 of every query row as 16x8 tiles of the
// transposed product, one per head tile:
//   q_rot^T[dims, rows] = PiT^T[dims, :] Q^T[:, rows]
// (M = output dims, K = input dims in 8 k-steps, N = 8 query rows).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "hopper_fragments.cuh"
#include "hopper_tile_layout.cuh"

namespace tqdecode::cuda::hopper {

constexpr int kRotationWarps = kHeadDim / 16;  // one 16-dim output tile each
// The query's bits in shared memory, row r at r * kQueryBitsStride: the
// 8-element pad makes the B-fragment reads (lane (g, c): row g, elements
// 16ks + 2c, + 1) free of bank conflicts.
constexpr int kQueryBitsStride = kHeadDim + 8;

/// PiT's part of output-dim tile `dim_tile` as A fragments (row g / g + 8 =
/// output dim, column 2c + {0, 1} / 2c + 8 + {0, 1} = input dim; pair by pair,
/// low column first), from row-major fp32 PiT (PiT[i][j] = Pi[j][i]). Every
/// CTA reads PiT, so these are L2 hits, issued early for their latency to
/// overlap the prologue.
struct RotationOperands {
  float pit[8][8];  // [k-step][element]
};

__device__ __forceinline__ void load_rotation_operands(RotationOperands& operands, const float* pit, int dim_tile, int lane) {
  const int g = lane >> 2;
  const int c = lane & 3;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
    for (int reg = 0; reg < 4; ++reg) {
      const int input_dim = 16 * ks + 2 * c + 8 * (reg >> 1);
      const int output_dim = 16 * dim_tile + g + 8 * (reg & 1);
      operands.pit[ks][2 * reg] = __ldg(pit + input_dim * kHeadDim + output_dim);
      operands.pit[ks][2 * reg + 1] = __ldg(pit + (input_dim + 1) * kHeadDim + output_dim);
    }
  }
}

// x0, x1 as bf16 pairs hi and lo with x = hi + lo (to about 2^-17 relative).
__device__ __forceinline__ void split_bf16(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  hi = pack_bf16(x0, x1);
  lo = pack_bf16(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
}

/// Computes the warp's tile of q_rot for HeadTiles x 8 query rows whose bf16
/// or fp16 bits are in shared memory (`query_bits`, kQueryBitsStride per row)
/// and hands each element to store(row, dim, value) (fp32, not yet rounded to bf16).
template <int HeadTiles, typename Store>
__device__ __forceinline__ void rotate_queries(const RotationOperands& operands, const std::uint16_t* query_bits,
                                               bool f16_query, int dim_tile, int lane, Store&& store) {
  const int g = lane >> 2;
  const int c = lane & 3;
  float high[HeadTiles][4], low[HeadTiles][4];
#pragma unroll
  for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) high[nt][r] = low[nt][r] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    std::uint32_t a_hi[4], a_lo[4];
#pragma unroll
    for (int reg = 0; reg < 4; ++reg) split_bf16(operands.pit[ks][2 * reg], operands.pit[ks][2 * reg + 1], a_hi[reg], a_lo[reg]);
#pragma unroll
    for (int nt = 0; nt < HeadTiles; ++nt) {
      // Elements 16ks + 2c + {0, 1} and + 8 of query row 8nt + g.
      const std::uint16_t* row = query_bits + (8 * nt + g) * kQueryBitsStride + 16 * ks + 2 * c;
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
      mma_bf16(high[nt], a_hi, b_hi[0], b_hi[1]);
      mma_bf16(low[nt], a_lo, b_hi[0], b_hi[1]);
      if (f16_query) mma_bf16(low[nt], a_hi, b_lo[0], b_lo[1]);
    }
  }
  // C fragment: rows g / g + 8 = output dims, columns 2c, 2c + 1 = query rows.
#pragma unroll
  for (int nt = 0; nt < HeadTiles; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) store(8 * nt + 2 * c + (r & 1), 16 * dim_tile + g + 8 * (r >> 1), high[nt][r] + low[nt][r]);
  }
}

}  // namespace tqdecode::cuda::hopper
