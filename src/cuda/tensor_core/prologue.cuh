// Prologue stages of the tensor-core decode kernel (internal): the key
// lookup table built from the centroids. (The query rotation is rotation.cuh.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fragments.cuh"

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

}  // namespace tqdecode::cuda::tensor_core
