// Stage 2's online softmax of the tensor-core decode kernel (internal): a
// warp's running state per query row over the tiles it streams, and the
// probabilities P' = p * value scale that the O^T product takes. Base-2
// scores (log2 e folded into the score scale).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <bit>
#include <cstdint>
#include <type_traits>

#include "../device_utils.cuh"
#include "fragments.cuh"
#include "shape.cuh"

namespace tqdecode::cuda::tensor_core {

/// A warp's softmax state for the rows of its head tiles: lane (g, c) holds
/// heads 2c + e of each tile. `Shape` is the kernel's (shape.cuh).
template <class Shape>
struct OnlineSoftmax {
  static constexpr int kHeadTiles = Shape::kHeadTiles;
  static constexpr bool kLessMax = Shape::kScoresLessMax;
  static constexpr bool kHalfScaled = Shape::kHalfScaledProbabilities;
  /// A tile's value scales: fp16 as stored where kHalfScaled.
  using ValueScale = std::conditional_t<kHalfScaled, __half, float>;
  /// Base-2 scores of a tile, [head tile][head 2c + e][token g / g + 8],
  /// less the row's maximum where kLessMax (then the reference is neg_reference).
  using Scores = float[kHeadTiles][2][2];

  // O^T accumulators: dim tile m, rows g (dim 16g + 2m) and g + 8 (dim 16g + 2m + 1), heads 2c, 2c + 1.
  float acc[kHeadTiles][Shape::kDimTiles][4];
  float pv_sum[kHeadTiles][4];  // sum_t P'_t per head (columns 2c, 2c + 1; every row)
  float row_max[kHeadTiles][2], row_sum[kHeadTiles][2], zero_sum[kHeadTiles][2];  // heads 2c + e; max in base-2 units
  // kLessMax: -row_max while that is finite, 0 before.
  float neg_reference[kHeadTiles][2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int nt = 0; nt < kHeadTiles; ++nt) {
#pragma unroll
      for (int m = 0; m < Shape::kDimTiles; ++m) acc[nt][m][0] = acc[nt][m][1] = acc[nt][m][2] = acc[nt][m][3] = 0.0f;
      pv_sum[nt][0] = pv_sum[nt][1] = pv_sum[nt][2] = pv_sum[nt][3] = 0.0f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        row_max[nt][e] = -INFINITY;
        neg_reference[nt][e] = 0.0f;
        row_sum[nt][e] = zero_sum[nt][e] = 0.0f;
      }
    }
  }

  /// A tile's scores from the S^T product's two chains (columns heads 2c,
  /// 2c + 1; rows tokens g and g + 8) times each token's norm and the base-2
  /// score scale (`norm_scale`), less the reference where kLessMax.
  __device__ __forceinline__ void base2_scores(const float (&score)[kHeadTiles][4], const float (&score_odd)[kHeadTiles][4],
                                               const float (&norm_scale)[2], Scores& d) const {
#pragma unroll
    for (int nt = 0; nt < kHeadTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float sum = score[nt][2 * j + e] + score_odd[nt][2 * j + e];
          d[nt][e][j] = kLessMax ? fmaf(sum, norm_scale[j], neg_reference[nt][e]) : sum * norm_scale[j];
        }
      }
    }
  }

  /// Masks a tile that reaches past the CTA's first masked position: slots
  /// past the range's `end` hold junk (fp8 key bytes or fp16 fields that may
  /// be NaN or inf), excluded by selection, never by arithmetic (score -inf,
  /// value fields 0); a position at or past a row's causal limit scores
  /// kMaskedScore for that row. Lane quad c's rows 2c + e of head tile nt
  /// see positions below first_limit + bits kDeltaBits (2 nt + e) of `deltas`;
  /// position(j) is token g + 8 j's.
  template <class Position>
  __device__ __forceinline__ void mask_tile(Scores& d, ValueScale (&value_scale)[2], float (&value_zero)[2], int end,
                                            int first_limit, typename Shape::RowDeltas deltas, const Position& position) const {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int at = position(j);
      if (at >= end) {
        value_scale[j] = 0.0f;
        value_zero[j] = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kHeadTiles; ++nt) d[nt][0][j] = d[nt][1][j] = -INFINITY;
      } else if (at >= first_limit) {
        const unsigned past = at - first_limit;
#pragma unroll
        for (int nt = 0; nt < kHeadTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            constexpr unsigned kDeltaMask = (1u << Shape::kDeltaBits) - 1;
            if (past >= (static_cast<unsigned>(deltas >> (Shape::kDeltaBits * (2 * nt + e))) & kDeltaMask)) {
              d[nt][e][j] = kMaskedScore;
            }
          }
        }
      }
    }
  }

  /// The maxima are references, moved only when a score exceeds one by more
  /// than kLazyRescaleLog2 (so p <= 2^kLazyRescaleLog2): one vote, and only
  /// then the shuffles for the tile maxima and the rescale of the
  /// accumulators. A tile with a value scale too large for p * scale to stay
  /// finite in fp16 takes the exact path (p <= 1). The warp's first tile
  /// always takes it (the maxima start at -inf; `first_tile` where kLessMax).
  __device__ __forceinline__ void move_references(Scores& d, const ValueScale (&value_scale)[2], bool first_tile) {
    bool large_scale;
    if constexpr (kHalfScaled) {
      large_scale = __hgt(__hmax(__habs(value_scale[0]), __habs(value_scale[1])), __float2half_rn(kMaxLazyValueScale));
    } else {
      large_scale = fmaxf(fabsf(value_scale[0]), fabsf(value_scale[1])) > kMaxLazyValueScale;
    }
    bool grows = large_scale || (kLessMax && first_tile);
    if constexpr (kLessMax) {
      // One threshold for every score: their maximum as a tree, a chain of
      // 4 instead of 8 dependent comparisons.
      constexpr int kScores = kHeadTiles * 4;
      float largest[kScores];
#pragma unroll
      for (int i = 0; i < kScores; ++i) largest[i] = d[i / 4][(i / 2) % 2][i % 2];
      static_for<std::bit_width(static_cast<unsigned>(kScores)) - 1>([&]<int Level>() {
        constexpr int kWidth = kScores >> (Level + 1);
#pragma unroll
        for (int i = 0; i < kWidth; ++i) largest[i] = fmaxf(largest[i], largest[i + kWidth]);
      });
      grows |= largest[0] > kLazyRescaleLog2;
    } else {
#pragma unroll
      for (int nt = 0; nt < kHeadTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int j = 0; j < 2; ++j) grows |= d[nt][e][j] > row_max[nt][e] + kLazyRescaleLog2;
        }
      }
    }
    if (!__any_sync(kFullMask, grows)) return;
    // Each row moves its reference by its own scores and the tile's value
    // scales only, never because another row of the warp did: a head's
    // output does not depend on the other heads' queries.
    const float threshold = __any_sync(kFullMask, large_scale) ? 0.0f : kLazyRescaleLog2;
#pragma unroll
    for (int nt = 0; nt < kHeadTiles; ++nt) {
      float alpha[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float s0 = kLessMax ? d[nt][e][0] - neg_reference[nt][e] : d[nt][e][0];
        const float s1 = kLessMax ? d[nt][e][1] - neg_reference[nt][e] : d[nt][e][1];
        float tile_max = fmaxf(s0, s1);
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 4));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 8));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 16));
        const float new_max = tile_max > row_max[nt][e] + threshold ? tile_max : row_max[nt][e];
        alpha[e] = fast_exp2(row_max[nt][e] - new_max);
        row_max[nt][e] = new_max;
        if (kLessMax) {
          if (fabsf(new_max) < INFINITY) neg_reference[nt][e] = -new_max;
          d[nt][e][0] = s0 + neg_reference[nt][e];
          d[nt][e][1] = s1 + neg_reference[nt][e];
        }
        row_sum[nt][e] *= alpha[e];
        zero_sum[nt][e] *= alpha[e];
      }
#pragma unroll
      for (int m = 0; m < Shape::kDimTiles; ++m) {
        acc[nt][m][0] *= alpha[0];
        acc[nt][m][1] *= alpha[1];
        acc[nt][m][2] *= alpha[0];
        acc[nt][m][3] *= alpha[1];
      }
      pv_sum[nt][0] *= alpha[0];
      pv_sum[nt][1] *= alpha[1];
      pv_sum[nt][2] *= alpha[0];
      pv_sum[nt][3] *= alpha[1];
    }
  }

  /// The tile's probabilities against the references, added to the sums,
  /// as the O^T product's B operand: P' = p * value scale, for each head
  /// tile the (head, token) fragments of tokens 0..7 and 8..15.
  __device__ __forceinline__ void probabilities(const Scores& d, const ValueScale (&value_scale)[2],
                                                const float (&value_zero)[2], std::uint32_t (&pb)[kHeadTiles][2]) {
#pragma unroll
    for (int nt = 0; nt < kHeadTiles; ++nt) {
      float p_token[2][2];  // [token g / g + 8][head 2c + e]
      // P' of a token for heads 2c, 2c + 1: fp16(p x scale), or where
      // kHalfScaled fp16(p) x scale (rounded twice: at most 2^-10 relative,
      // far below the 4-bit codes' resolution).
      const auto scaled_pair = [](const float (&p_heads)[2], auto scale) {
        if constexpr (kHalfScaled) {
          const __half2 pair = __hmul2(__floats2half2_rn(p_heads[0], p_heads[1]), __half2half2(scale));
          return *reinterpret_cast<const std::uint32_t*>(&pair);
        } else {
          return pack_f16(p_heads[0] * scale, p_heads[1] * scale);
        }
      };
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p0 = fast_exp2(kLessMax ? d[nt][e][0] : d[nt][e][0] - row_max[nt][e]);
        const float p1 = fast_exp2(kLessMax ? d[nt][e][1] : d[nt][e][1] - row_max[nt][e]);
        row_sum[nt][e] += p0 + p1;
        zero_sum[nt][e] = fmaf(p0, value_zero[0], fmaf(p1, value_zero[1], zero_sum[nt][e]));
        p_token[0][e] = p0;
        p_token[1][e] = p1;
      }
      // (token, head) fragments of tokens 0..7 and 8..15 -> (head, token): the B operand halves.
      pb[nt][0] = transpose_8x8(scaled_pair(p_token[0], value_scale[0]));
      pb[nt][1] = transpose_8x8(scaled_pair(p_token[1], value_scale[1]));
    }
  }

  /// sum_t P'_t per head, from one more mma with an all-ones operand (the
  /// value codes' offset, value_code_position).
  __device__ __forceinline__ void add_probability_sums(const std::uint32_t (&pb)[kHeadTiles][2]) {
    const std::uint32_t ones[4] = {kHalfOnes, kHalfOnes, kHalfOnes, kHalfOnes};
#pragma unroll
    for (int nt = 0; nt < kHeadTiles; ++nt) mma_f16(pv_sum[nt], ones, pb[nt][0], pb[nt][1]);
  }
};

}  // namespace tqdecode::cuda::tensor_core
