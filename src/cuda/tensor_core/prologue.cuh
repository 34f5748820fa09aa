// Prologue stages of the tensor-core decode kernel (internal): the key
// lookup table built from the centroids, and the CTA's rotated query rows
// (its products on the tensor cores are rotation.cuh's).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fragments.cuh"
#include "rotation.cuh"
#include "shape.cuh"
#include "tqdecode/numeric.hpp"  // round_to_bf16

namespace tqdecode::cuda::tensor_core {

// 2^exponent for exponents in [-126, 127].
__device__ __forceinline__ float power_of_two(int exponent) { return __uint_as_float(static_cast<unsigned>(127 + exponent) << 23); }

// The key lookup table, each warp writing whole 32-lane rows: entry (high
// code, low code) -> fp16 (centroid[low], centroid[high]) x 2^e. fp16 keeps
// 11 significant bits of each centroid where bf16 kept 8, and the scores'
// error on sharply peaked attention drops with it; e (returned) brings the
// largest centroid into [1, 2) (codebooks of unit vectors hold values under
// 1), never below: the rotated query is scaled by 2^-e, so the product needs
// no correction. 0 for a zero or non-finite largest centroid.
template <class Shared, int Warps>
__device__ __forceinline__ int build_lookup_table(std::uint8_t* shared, const float* centroids, int warp, int lane) {
  constexpr int kCodes = Shared::kCodebookSize;
  float codebook[kCodes];
  float largest = 0.0f;
#pragma unroll
  for (int i = 0; i < kCodes; ++i) {
    codebook[i] = __ldg(centroids + i);
    largest = fmaxf(largest, fabsf(codebook[i]));
  }
  const int floor_log2 = static_cast<int>((__float_as_uint(largest) >> 23) & 0xffu) - 127;
  const int exponent = largest > 0.0f && largest < INFINITY ? max(0, min(60, -floor_log2)) : 0;
  const float scale = power_of_two(exponent);
  for (int low_code = warp; low_code < kCodes; low_code += Warps) {
    const float low = __ldg(centroids + low_code);  // not codebook[low_code]: a runtime index puts the array on the stack
#pragma unroll
    for (int high_code = 0; high_code < kCodes; ++high_code) {
      reinterpret_cast<std::uint32_t*>(shared)[(high_code * kCodes + low_code) * (Shared::kLutRowBytes / 4) + lane] =
          pack_f16(low * scale, codebook[high_code] * scale);
    }
  }
  return exponent;
}

/// Stage 1 of the MSE presets: warp w writes output-dim tiles w, w +
/// kWarps, ... of the CTA's rotated query rows into `query_rows` (the mma
/// operand's fp16 values, query_slot) from the query's bits (head tiles of
/// kHeadsPerTile rows at Shared's strides): q_rot = bf16(q @ PiT)
/// (docs/FORMAT.md), then times `query_scale` (2^-table_exponent) into fp16.
/// `rotation` holds PiT's operands where one tile and one pass per warp
/// (D = 64, 128) let them load once; D = 256 loads them per tile and pass.
template <class Shape, class Shared, int KSteps>
__device__ __forceinline__ void rotate_query_rows(RotationOperands<KSteps>& rotation, const std::uint16_t* query_bits,
                                                  std::uint16_t* query_rows, const float* PiT, bool f16_query,
                                                  float query_scale, int warp, int lane) {
  constexpr int HeadDim = Shape::kHeadDim;
  constexpr int kWarps = Shape::kWarps;
  constexpr int kCtaRows = Shape::kCtaRows;
  constexpr int kRotationTiles = HeadDim / 16;
  constexpr int kRotationKSteps = KSteps;
  constexpr bool kRotationLoads = kRotationTiles > kWarps || kRotationKSteps < HeadDim / 16;
  // At most two head tiles per pass: four (four kv heads per CTA) in one
  // pass would spill PiT's operands.
  constexpr int kTilesPerPass = std::min(kCtaRows / kHeadsPerTile, 2);
  constexpr int kTileStride = Shared::kQueryBitsTileStride;
  constexpr int kRowStride = Shared::kQueryBitsStride;
  // q_rot = bf16(q @ PiT) (docs/FORMAT.md), then times 2^-table_exponent
  // into fp16: exact from 2^-14 (times the table's scale) up to 65504
  // times it; below, fp16 subnormals keep the absolute error under
  // 2^-25 times that scale.
  const auto store_rows = [&](int first, int dim_tile, const RotationSums<kTilesPerPass>& sums) {
    store_rotation(sums, dim_tile, lane, [&](int row, int dim_out, float2 pair) {
      *reinterpret_cast<std::uint32_t*>(query_rows + query_slot<HeadDim>(first + row, dim_out)) =
          pack_f16(round_to_bf16(pair.x) * query_scale, round_to_bf16(pair.y) * query_scale);
    });
  };
  if constexpr (kRotationLoads) {
    // D = 256: each tile's operands in passes over the input dims.
    for (int dim_tile = warp; dim_tile < kRotationTiles; dim_tile += kWarps) {
#pragma unroll
      for (int first = 0; first < kCtaRows; first += kTilesPerPass * kHeadsPerTile) {
        RotationSums<kTilesPerPass> sums;
#pragma unroll 1
        for (int step = 0; step < HeadDim / 16; step += kRotationKSteps) {
          load_rotation_operands<HeadDim>(rotation, PiT, dim_tile, lane, step);
          accumulate_rotation<kTilesPerPass, kTileStride, kRowStride>(
              sums, split_rotation_operands(rotation), query_bits + (first / kHeadsPerTile) * kTileStride + 16 * step,
              f16_query, lane);
        }
        store_rows(first, dim_tile, sums);
      }
    }
  } else {
    const SplitRotationOperands<kRotationKSteps> split = split_rotation_operands(rotation);
#pragma unroll
    for (int first = 0; first < kCtaRows; first += kTilesPerPass * kHeadsPerTile) {
      RotationSums<kTilesPerPass> sums;
      accumulate_rotation<kTilesPerPass, kTileStride, kRowStride>(
          sums, split, query_bits + (first / kHeadsPerTile) * kTileStride, f16_query, lane);
      store_rows(first, warp, sums);
    }
  }
}

}  // namespace tqdecode::cuda::tensor_core
