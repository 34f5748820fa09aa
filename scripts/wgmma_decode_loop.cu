// Prototypes of a warpgroup-MMA decode loop for several query tokens per
// sequence (issue 30; docs/PERFORMANCE.md), timed without memory traffic:
// an SM's time per 64-token tile of one kv head, issue and latency only,
// with 4-bit keys through the wide 256-byte-row table and 4-bit values
// read from fixed shared-memory stages (synthetic data; the products'
// values are not checked, their layouts are: scripts/mma_throughput.cu; no
// cp.async, block table, prologue or merge). Two forms:
// - tokens form (decode_loop), the present kernel's S^T orientation with
//   M = 64 tokens: each warp's table lookups are the A operand of
//     S^T = K Q^T    (m64nNk16 x 8, Q^T from shared memory, N query rows),
//   a barrier's predicate reduction tells whether any score exceeds its
//   row's reference by the lazy threshold (only then the rows' maxima are
//   exchanged between the warps and the accumulators rescaled), then p,
//   P' = p x scale and the per-thread sums of p and p x zero, P'^T into
//   shared memory (movmatrix, 32-bit stores), and
//     O^T += V^T P'^T (m64nNk16 x 8, V^T codes from every warp's stage);
//   with the second product's wait at once or deferred to the next tile's.
// - rows form (rows_loop), FlashAttention-3's orientation with M = 64 query
//   rows: the warps write dequantized K and V'^T tiles to shared memory,
//   S = Q K^T (A: the query from registers), the softmax within each
//   thread's two rows, P straight from the accumulators into the A operand
//   of O = P V' (m64n136k16 x 4: the dims, the zeros and ones, so one chain
//   also sums p x zero and p).
// Each configuration runs at every CTA count per SM its registers allow.
//
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_decode_loop scripts/wgmma_decode_loop.cu && /tmp/wgmma_decode_loop
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "decode_loop_tile.cuh"

namespace {

constexpr int kStageBytes = 16 * kSlotBytes;  // a warp's 16 tokens

template <int N>
struct Layout {
  static constexpr int kQueryBytes = N * 128 * 2;     // Q^T: N rows of 128 dims
  static constexpr int kProbBytes = N * kTileTokens * 2;  // P'^T per warpgroup: N rows of 64 tokens
  static constexpr int kQuery = kLutBytes;
  static constexpr int kProb = kQuery + kQueryBytes;  // two warpgroups
  static constexpr int kStages = kProb + 2 * kProbBytes;  // 8 warps x 2 stages
  static constexpr int kExchange = kStages + 8 * 2 * kStageBytes;  // two warpgroups x 4 warps x N floats
  static constexpr int kBytes = kExchange + 2 * 4 * N * 4;
};

// Deferred: the O^T product's wait moves to the next tile's S^T wait, so it
// overlaps the next tile's lookups (its value operands kept live until then).
template <int N, bool Deferred>
__global__ void __launch_bounds__(256, 1) decode_loop(int tiles, float* sink) {
  extern __shared__ __align__(1024) std::uint8_t shared[];
  using L = Layout<N>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int group = warp / 4, wg_warp = warp % 4;
  // Synthetic constants: table, query, stages (keys, fields in range, values).
  for (int i = threadIdx.x; i < L::kExchange / 4; i += blockDim.x) {
    std::uint32_t x = (i * 2654435761u) >> 7;
    reinterpret_cast<std::uint32_t*>(shared)[i] = (x & 0x03ff03ffu) | 0x30003000u;  // fp16 in [0.125, 0.25)
  }
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  const std::uint32_t lane_lut = lane << 2;
  const std::uint32_t query = base + L::kQuery;
  const std::uint32_t prob = base + L::kProb + group * L::kProbBytes;
  std::uint8_t* const prob_ptr = shared + L::kProb + group * L::kProbBytes;
  float* const exchange = reinterpret_cast<float*>(shared + L::kExchange) + group * 4 * N;
  float acc_o[2][N / 2] = {};
  TokensRows<N> rows;

  std::uint32_t value[4][2][4] = {};
  for (int tile = 0; tile < tiles; ++tile) {
    const std::uint8_t* stage = shared + L::kStages + (warp * 2 + (tile & 1)) * kStageBytes;
    // Keys of tokens g and g + 8: 16 bytes each (dims 32c ..), 64 table lookups.
    const uint4 kg = *reinterpret_cast<const uint4*>(stage + g * kSlotBytes + 16 * c);
    const uint4 kg8 = *reinterpret_cast<const uint4*>(stage + (g + 8) * kSlotBytes + 16 * c);
    const std::uint32_t words_g[4] = {kg.x, kg.y, kg.z, kg.w}, words_g8[4] = {kg8.x, kg8.y, kg8.z, kg8.w};
    const auto lookup = [&](std::uint32_t word, int byte) {
      const std::uint32_t offset = __byte_perm(word, lane_lut, 0x5504u | (byte << 4));
      return *reinterpret_cast<const std::uint32_t*>(shared + offset);
    };
    std::uint32_t key[8][4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      key[2 * w][0] = lookup(words_g[w], 0), key[2 * w][1] = lookup(words_g8[w], 0);
      key[2 * w][2] = lookup(words_g[w], 1), key[2 * w][3] = lookup(words_g8[w], 1);
      key[2 * w + 1][0] = lookup(words_g[w], 2), key[2 * w + 1][1] = lookup(words_g8[w], 2);
      key[2 * w + 1][2] = lookup(words_g[w], 3), key[2 * w + 1][3] = lookup(words_g8[w], 3);
    }
    float score[N / 2];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma_rs<N>(score, key[ks], k_step_descriptor(query, N, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
    keep(score);
    keep_words(key);
    if constexpr (Deferred) {
      keep(acc_o[0]);
      keep(acc_o[1]);
      keep_words(reinterpret_cast<std::uint32_t(&)[8][4]>(value));
    }
    // Fields of tokens g and g + 8.
    const auto field = [&](int token, int which) {
      return __half2float(*reinterpret_cast<const __half*>(stage + token * kSlotBytes + 64 + 2 * which));
    };
    const float norm[2] = {field(g, 0), field(g + 8, 0)};
    const float scale[2] = {field(g, 1), field(g + 8, 1)};
    const float zero[2] = {field(g, 2), field(g + 8, 2)};
    tokens_softmax<N, false>(score, norm, scale, zero, rows, acc_o, exchange, prob_ptr, 1 + group, wg_warp, lane);
    fence_proxy_async_shared();
    named_barrier(1 + group);
    // V^T codes: warp w, half h: dims 64 h + 16 w + g (+ 8) as the low and high nibbles of byte 32 h + 8 w + g
    // of tokens 16 ks + 2c, + 1, + 8, + 9, from warp ks's stage.
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const std::uint8_t* other = shared + L::kStages + ((4 * group + ks) * 2 + (tile & 1)) * kStageBytes;
      std::uint32_t bytes[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int token = 2 * c + (t & 1) + 8 * (t >> 1);
        bytes[t] = *reinterpret_cast<const std::uint16_t*>(other + token * kSlotBytes + kValueOffset + 16 * wg_warp + 2 * g);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        // Byte h of two tokens into the low bytes of the two halves (bytes 3 and 7 are zero).
        const std::uint32_t first = __byte_perm(bytes[0], bytes[1], h ? 0x7571u : 0x7470u);
        const std::uint32_t second = __byte_perm(bytes[2], bytes[3], h ? 0x7571u : 0x7470u);
        value[ks][h][0] = (first & 0x000f000fu) | 0x64006400u;  // fp16 1024 + code
        value[ks][h][1] = ((first >> 4) & 0x000f000fu) | 0x64006400u;
        value[ks][h][2] = (second & 0x000f000fu) | 0x64006400u;
        value[ks][h][3] = ((second >> 4) & 0x000f000fu) | 0x64006400u;
      }
    }
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) wgmma_rs<N>(acc_o[h], value[ks][h], descriptor(prob + ks * 32), 1);
    }
    wgmma_commit();
    if constexpr (!Deferred) {
      wgmma_wait_all();
      keep(acc_o[0]);
      keep(acc_o[1]);
    }
  }
  wgmma_wait_all();
  keep(acc_o[0]);
  keep(acc_o[1]);
  float total = 0.0f;
#pragma unroll
  for (int r = 0; r < N / 4; ++r) total += rows.row_sum[r] + rows.zero_sum[r];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) total += acc_o[h][i];
  if (total == 1.2345f) sink[threadIdx.x] = total;  // keeps the loop; never true for these data
}


// The rows form: S = Q K^T with the 64 query rows as wgmma's M (A: the
// query from registers), so each thread's rows are its own and the softmax
// needs no exchange between warps; P goes from the accumulators straight to
// the A operand of O = P V'. Each warp first writes its 16 tokens'
// dequantized keys (centroids x norm, fp16) and values into shared memory
// as the B operands: K [token][dim], and V'^T [column][token] with columns
// 0-127 the dims (code x scale: an fp16 FMA of (2^p + code 2^(p-10)) x scale
// - 2^p x scale, exact before its one rounding), 128 the zero and 129 ones,
// so one m64n136k16 chain also sums p x zero and p.
__global__ void __launch_bounds__(256, 1) rows_loop(int tiles, float* sink) {
  extern __shared__ __align__(1024) std::uint8_t shared[];
  constexpr int kKeyTile = kTileTokens * 128 * 2;           // 16 KB
  constexpr int kValueTile = kValueRows * kTileTokens * 2;  // 17 KB
  constexpr int kTiles0 = kLutBytes;                          // per warpgroup: K, V'^T
  constexpr int kStages0 = kTiles0 + 2 * (kKeyTile + kValueTile);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / 4, wg_warp = warp % 4;
  for (int i = threadIdx.x; i < (kStages0 + 8 * 2 * kStageBytes) / 4; i += blockDim.x) {
    std::uint32_t x = (i * 2654435761u) >> 7;
    reinterpret_cast<std::uint32_t*>(shared)[i] = (x & 0x03ff03ffu) | 0x30003000u;  // fp16 in [0.125, 0.25)
  }
  __syncthreads();
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  std::uint8_t* const keys = shared + kTiles0 + group * (kKeyTile + kValueTile);
  std::uint8_t* const values = keys + kKeyTile;
  const std::uint32_t keys_address = base + kTiles0 + group * (kKeyTile + kValueTile);
  const std::uint32_t values_address = keys_address + kKeyTile;
  // Rows 129 (ones) and 130-135 (zeros) of V'^T, once.
  for (int i = threadIdx.x % 128; i < 7 * kTileTokens; i += 128) {
    const int row = 129 + i / kTileTokens, token = i % kTileTokens;
    *reinterpret_cast<__half*>(values + swizzled_offset(kValueRows, row, token)) = __float2half(row == 129 ? 1.0f : 0.0f);
  }
  // The query (A of S = Q K^T), synthetic: rows 16 w + g (+ 8), dims 16 ks + 2c (+ 1, + 8, + 9).
  std::uint32_t query[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j) query[ks][j] = ((lane * 977u + ks * 131u + j * 37u) & 0x01ff01ffu) | 0x2c002c00u;
  // Held in registers, as loaded ones would be (recomputed beside the products, ptxas put arrives between them).
  keep_words(query);
  float acc_o[kValueRows / 2] = {};
  float reference[2] = {-8.0f, -8.0f};  // rows g and g + 8; the first tile moves them
  std::uint32_t probability[4][4];
  fence_proxy_async_shared();
  named_barrier(1 + group);

  for (int tile = 0; tile < tiles; ++tile) {
    const std::uint8_t* stage = shared + kStages0 + (warp * 2 + (tile & 1)) * kStageBytes;
    const int first = 16 * wg_warp;  // the warp's tokens in the tile
    write_keys<true>(shared, stage, keys, first, lane);  // centroid pairs x norm
    write_values<false>(stage, values, first, lane);
    fence_proxy_async_shared();
    named_barrier(1 + group);
    // S = Q K^T: rows 16 w + g (+ 8), tokens 8i + 2c (+ 1).
    float score[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      wgmma_rs<64>(score, query[ks], k_step_descriptor(keys_address, kTileTokens, ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    keep(score);
    // The rows' maxima (over the thread's 16 tokens, then the lane quad), the lazy rescale, p.
    float row_max[2] = {-1.0e30f, -1.0e30f};
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) row_max[e / 2] = fmaxf(row_max[e / 2], score[4 * i + e]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
      row_max[r] = fmaxf(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
    }
    if (row_max[0] > reference[0] + kLazyRescaleLog2 || row_max[1] > reference[1] + kLazyRescaleLog2) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float moved = fmaxf(row_max[r], reference[r]);
        alpha[r] = fast_exp2(reference[r] - moved);
        reference[r] = moved;
      }
#pragma unroll
      for (int i = 0; i < kValueRows / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[4 * i + e] *= alpha[e / 2];
    }
    probabilities_as_a_operand(probability, [&](int i, int e) { return fast_exp2(score[4 * i + e] - reference[e / 2]); });
    // O = P V'^T^T: k-step kt takes tokens 16 kt ..
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) wgmma_rs<kValueRows>(acc_o, probability[kt], k_step_descriptor(values_address, kValueRows, kt), 1);
    wgmma_commit();
    // Its completion needs every warp's issue: past it the tiles may be rewritten.
    wgmma_wait_all();
    keep(acc_o);
    keep_words(probability);
  }
  sink_accumulators(acc_o, sink);
}

// An SM's time per 64-token tile with every resident CTA of two warpgroups
// streaming; (16, 32768), Hk 8 is 65536 such tiles.
template <class Kernel>
void measure(Kernel kernel, int bytes, const char* label, int sms, float* sink) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  int resident = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, 256, bytes);
  constexpr int kTiles = 512;  // 32768 tokens per warpgroup
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int per_sm = 1; per_sm <= resident; ++per_sm) {
    kernel<<<sms * per_sm, 256, bytes>>>(kTiles, sink);  // warm-up
    cudaEventRecord(start);
    for (int r = 0; r < 5; ++r) kernel<<<sms * per_sm, 256, bytes>>>(kTiles, sink);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    const double sm_tile_ns = ms * 1e6 / 5 / (kTiles * 2.0 * per_sm);
    std::printf("%s, %d CTA(s) of two warpgroups per SM: %.1f ns of an SM per 64-token tile; (16, 32768) Hk 8 would take %.1f us (%s)\n",
                label, per_sm, sm_tile_ns, 65536.0 / sms * sm_tile_ns / 1e3, cudaGetErrorString(cudaGetLastError()));
  }
}

}  // namespace

int main() {
  int sms = 0;
  float* const sink = prototype_device(sms);
  measure(decode_loop<8, false>, Layout<8>::kBytes, "tokens form, N =  8, O^T wait at once  ", sms, sink);
  measure(decode_loop<8, true>, Layout<8>::kBytes, "tokens form, N =  8, O^T wait deferred", sms, sink);
  measure(decode_loop<32, false>, Layout<32>::kBytes, "tokens form, N = 32, O^T wait at once  ", sms, sink);
  measure(decode_loop<32, true>, Layout<32>::kBytes, "tokens form, N = 32, O^T wait deferred", sms, sink);
  measure(decode_loop<64, false>, Layout<64>::kBytes, "tokens form, N = 64, O^T wait at once  ", sms, sink);
  measure(decode_loop<64, true>, Layout<64>::kBytes, "tokens form, N = 64, O^T wait deferred", sms, sink);
  constexpr int kRowsBytes = kLutBytes + 2 * (kTileTokens * 128 * 2 + kValueRows * kTileTokens * 2) + 8 * 2 * kStageBytes;
  measure(rows_loop, kRowsBytes, "rows form, M = 64 rows                ", sms, sink);
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
