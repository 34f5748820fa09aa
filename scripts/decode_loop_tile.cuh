// What the wgmma decode-loop prototypes (wgmma_decode_loop.cu,
// wgmma_specialized_loop.cu) share: their synthetic tiles, the
// dequantization of a warp's tokens into the products' shared-memory
// operands, the tokens form's softmax, and the loops' ends. A token's
// staged record: 64 key bytes (4-bit codes, two a byte), its norm at byte
// 64, value scale at 66, zero at 68, and 64 value bytes at 80.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../src/cuda/tensor_core/fragments.cuh"
#include "../src/cuda/tensor_core/bulk_copy.cuh"
#include "../src/cuda/tensor_core/wgmma.cuh"

// The decode kernels' register helpers and wgmma (the same instructions).
using namespace tqdecode::cuda::tensor_core;

constexpr int kTileTokens = 64;  // per warpgroup tile: 16 per warp
constexpr int kSlotBytes = 144;
constexpr int kValueOffset = 80;
// The wide table, as the 16-warp decode shapes read 4-bit keys: 256 rows of
// 256 bytes (32 lanes' fp16 centroid pairs and padding), so a lookup's
// address is one byte permute: the key byte in bits 8..15, the lane in 2..6.
constexpr int kLutBytes = 256 * 256;
constexpr float kLazyRescaleLog2 = 4.0f;
// V'^T's rows in the rows form (the B operand of O = P V'): the 128 dims,
// then the zeros' and ones' rows, padded to N = 136.
constexpr int kValueRows = 136;

/// K [token][dim] (swizzled_offset, 64 token rows) of a warp's Tokens (16
/// or 8) tokens, tile rows first .., from their records at `records`: lane
/// (g, c) takes key bytes 16c .. of tokens g (and g + 8) through the table
/// at `lut`. NormInKeys: centroids x norm in fp16, else the centroids.
template <bool NormInKeys, int Tokens = 16>
__device__ __forceinline__ void write_keys(const std::uint8_t* lut, const std::uint8_t* records, std::uint8_t* keys,
                                           int first, int lane) {
  const int g = lane / 4, c = lane % 4;
  const std::uint32_t lane_lut = lane << 2;
#pragma unroll
  for (int j = 0; j < Tokens / 8; ++j) {
    const int token = g + 8 * j;
    const uint4 bytes = *reinterpret_cast<const uint4*>(records + token * kSlotBytes + 16 * c);
    const std::uint32_t words[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
    const __half2 norm2 = __half2half2(*reinterpret_cast<const __half*>(records + token * kSlotBytes + 64));
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      std::uint32_t pairs[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const std::uint32_t offset = __byte_perm(words[w], lane_lut, 0x5504u | (b << 4));
        __half2 pair = *reinterpret_cast<const __half2*>(lut + offset);
        if constexpr (NormInKeys) pair = __hmul2(pair, norm2);
        pairs[b] = *reinterpret_cast<const std::uint32_t*>(&pair);
      }
      *reinterpret_cast<uint4*>(keys + swizzled_offset(kTileTokens, first + token, 32 * c + 8 * w)) =
          make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
    }
  }
}

/// V'^T [column][token] (swizzled_offset, kValueRows rows) of a warp's
/// Tokens (16 or 8) tokens, tile columns first .., from their records: lane l
/// takes dims 4l .. 4l + 3 (value bytes 2l, 2l + 1). ScaledProbabilities
/// false: rows 0-127 code x scale by one fp16 FMA ((2^p + code 2^(p-10)) x
/// scale - 2^p x scale, exact before its one rounding) and row 128 the
/// zeros; true: rows 0-127 the code plus the fp16 exponent's offset (1024
/// for low nibbles, 64 for high ones), the scale left to P.
template <bool ScaledProbabilities, int Tokens = 16>
__device__ __forceinline__ void write_values(const std::uint8_t* records, std::uint8_t* values, int first, int lane) {
  const auto field = [&](int token, int offset) {
    return *reinterpret_cast<const __half*>(records + token * kSlotBytes + offset);
  };
#pragma unroll
  for (int half = 0; half < Tokens / 8; ++half) {
    std::uint32_t code[8];
    [[maybe_unused]] std::uint32_t scale_pair[4], offset_low[4], offset_high[4];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      code[t] =
          *reinterpret_cast<const std::uint16_t*>(records + (8 * half + t) * kSlotBytes + kValueOffset + 2 * lane);
    }
    if constexpr (!ScaledProbabilities) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const __half2 scale = __halves2half2(field(8 * half + 2 * p, 66), field(8 * half + 2 * p + 1, 66));
        const __half2 low = __hmul2(scale, __float2half2_rn(-1024.0f)), high = __hmul2(scale, __float2half2_rn(-64.0f));
        scale_pair[p] = *reinterpret_cast<const std::uint32_t*>(&scale);
        offset_low[p] = *reinterpret_cast<const std::uint32_t*>(&low);
        offset_high[p] = *reinterpret_cast<const std::uint32_t*>(&high);
      }
    }
#pragma unroll
    for (int step = 0; step < 4; ++step) {
      // Dim 4 lane + k, nibble k % 2 of byte k / 2; k rotated by the lane pair so a store's 32 rows
      // cover every residue mod 8 (the swizzle's 16-byte chunks spread over all banks).
      const int k = (step + (lane >> 1)) & 3;
      const std::uint32_t selector = k & 2 ? 0x7571u : 0x7470u;
      const std::uint32_t mask = k & 1 ? 0x00f000f0u : 0x000f000fu, exponent = k & 1 ? 0x54005400u : 0x64006400u;
      std::uint32_t row[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const std::uint32_t x = (__byte_perm(code[2 * p], code[2 * p + 1], selector) & mask) | exponent;
        if constexpr (ScaledProbabilities) {
          row[p] = x;
        } else {
          const std::uint32_t offset = k & 1 ? offset_high[p] : offset_low[p];
          const __half2 v =
              __hfma2(*reinterpret_cast<const __half2*>(&x), *reinterpret_cast<const __half2*>(&scale_pair[p]),
                      *reinterpret_cast<const __half2*>(&offset));
          row[p] = *reinterpret_cast<const std::uint32_t*>(&v);
        }
      }
      *reinterpret_cast<uint4*>(values + swizzled_offset(kValueRows, 4 * lane + k, first + 8 * half)) =
          make_uint4(row[0], row[1], row[2], row[3]);
    }
    if (!ScaledProbabilities && lane == 0) {  // row 128: the zeros of the 8 tokens
      std::uint32_t zero[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const __half2 z = __halves2half2(field(8 * half + 2 * p, 68), field(8 * half + 2 * p + 1, 68));
        zero[p] = *reinterpret_cast<const std::uint32_t*>(&z);
      }
      *reinterpret_cast<uint4*>(values + swizzled_offset(kValueRows, 128, first + 8 * half)) =
          make_uint4(zero[0], zero[1], zero[2], zero[3]);
    }
  }
}

__device__ __forceinline__ void named_barrier(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }
// A barrier of the warpgroup that also returns whether `predicate` held for any of its threads.
__device__ __forceinline__ bool barrier_any(int id, bool predicate) {
  std::uint32_t any;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %1, 0;\nbar.red.or.pred p, %2, 128, q;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(any)
               : "r"(static_cast<std::uint32_t>(predicate)), "r"(id)
               : "memory");
  return any != 0;
}

/// The tokens form's per-thread row state: rows 8i + 2c and 8i + 2c + 1 of
/// the N query rows (i < N / 8), the S^T and O^T accumulators' columns.
template <int N>
struct TokensRows {
  float reference[N / 4];   // base 2; the first tile moves them
  float row_sum[N / 4];     // sum of p
  float zero_sum[N / 4];    // sum of p x zero
  float scaled_sum[N / 4];  // sum of P' = p x scale (SumScaled: the value codes' offset, taken off at the end)
  __device__ __forceinline__ TokensRows() {
#pragma unroll
    for (int r = 0; r < N / 4; ++r) reference[r] = -8.0f, row_sum[r] = 0.0f, zero_sum[r] = 0.0f, scaled_sum[r] = 0.0f;
  }
};

/// The tokens form's softmax of one 64-token tile of a warpgroup. `score`:
/// S^T, tokens 16 w + g (+ 8) x rows 8i + 2c (+ 1); factor, scale, zero:
/// tokens g and g + 8's. Scores x factor less the rows' references (base
/// 2), and whether any exceeds its reference by more than the lazy
/// threshold anywhere in the warpgroup: one predicate reduced by the
/// barrier `barrier`, almost never true past the first tiles. Only then the
/// rows' tile maxima are exchanged through `exchange` (4 x N floats) and
/// the references move (the accumulators and sums rescaled). Then p,
/// P' = p x scale and the sums, and P'^T into shared memory at `prob`
/// (rows 8i + g, tokens 16 w + 8 j + 2c, + 1; swizzled).
template <int N, bool SumScaled>
__device__ __forceinline__ void tokens_softmax(float (&score)[N / 2], const float (&factor)[2], const float (&scale)[2],
                                               const float (&zero)[2], TokensRows<N>& rows, float (&acc_o)[2][N / 2],
                                               float* exchange, std::uint8_t* prob, int barrier, int wg_warp,
                                               int lane) {
  const int g = lane / 4, c = lane % 4;
  float local = -1.0e30f;
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      score[4 * i + e] = fmaf(score[4 * i + e], factor[e / 2], -rows.reference[2 * i + (e & 1)]);
      local = fmaxf(local, score[4 * i + e]);
    }
  }
  // The vote tells the compiler the branch is warp-uniform.
  if (__any_sync(0xffffffffu, barrier_any(barrier, local > kLazyRescaleLog2))) {
    float tile_max[N / 4];
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
#pragma unroll
      for (int e = 0; e < 2; ++e) tile_max[2 * i + e] = fmaxf(score[4 * i + e], score[4 * i + 2 + e]);
    }
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
#pragma unroll
      for (int x = 4; x < 32; x *= 2) tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], x));
    }
    // Lane (g, c) publishes rows 8g + 2c, + 1 and reads them back from the four warps.
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      if (g == i) {
        *reinterpret_cast<float2*>(exchange + wg_warp * N + 8 * i + 2 * c) =
            make_float2(tile_max[2 * i], tile_max[2 * i + 1]);
      }
    }
    named_barrier(barrier);
    float2 merged = make_float2(-1.0e30f, -1.0e30f);
    if (g < N / 8) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 m = *reinterpret_cast<const float2*>(exchange + w * N + 8 * g + 2 * c);
        merged.x = fmaxf(merged.x, m.x), merged.y = fmaxf(merged.y, m.y);
      }
    }
    named_barrier(barrier);  // the exchange is rewritten at the next move
    float shift[N / 4];
#pragma unroll
    for (int i = 0; i < N / 8; ++i) {
      const float m[2] = {__shfl_sync(0xffffffffu, merged.x, 4 * i + c), __shfl_sync(0xffffffffu, merged.y, 4 * i + c)};
#pragma unroll
      for (int e = 0; e < 2; ++e) shift[2 * i + e] = fmaxf(m[e], 0.0f);  // scores are already less the reference
    }
#pragma unroll
    for (int r = 0; r < N / 4; ++r) {
      const float alpha = fast_exp2(-shift[r]);
      rows.reference[r] += shift[r];
      rows.row_sum[r] *= alpha, rows.zero_sum[r] *= alpha;
      if constexpr (SumScaled) rows.scaled_sum[r] *= alpha;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc_o[h][4 * (r / 2) + (r & 1)] *= alpha;
        acc_o[h][4 * (r / 2) + 2 + (r & 1)] *= alpha;
      }
    }
#pragma unroll
    for (int i = 0; i < N / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) score[4 * i + e] -= shift[2 * i + (e & 1)];
  }
#pragma unroll
  for (int i = 0; i < N / 8; ++i) {
    std::uint32_t pair[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float scaled[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float p = fast_exp2(score[4 * i + 2 * j + e]);
        rows.row_sum[2 * i + e] += p;
        rows.zero_sum[2 * i + e] += p * zero[j];
        scaled[e] = p * scale[j];
        if constexpr (SumScaled) rows.scaled_sum[2 * i + e] += scaled[e];
      }
      pair[j] = transpose_8x8(pack_f16(scaled[0], scaled[1]));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = 8 * i + g, token = 16 * wg_warp + 8 * j + 2 * c;
      *reinterpret_cast<std::uint32_t*>(prob + swizzled_offset(N, row, token)) = pair[j];
    }
  }
}

/// After a loop: its last products' wait, and a store that keeps the
/// accumulators live but never happens for these data.
template <int R>
__device__ __forceinline__ void sink_accumulators(float (&acc)[R], float* sink) {
  wgmma_wait_all();
  keep(acc);
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < R; ++i) total += acc[i];
  if (total == 1.2345f) sink[threadIdx.x] = total;
}

/// The local GPU's SM count into `sms`, and a sink for the loops' results (never written for the synthetic data).
inline float* prototype_device(int& sms) {
  int device = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  float* sink = nullptr;
  cudaMalloc(&sink, 1024 * sizeof(float));
  return sink;
}
