// Warp-specialized warpgroup-MMA decode loops for several query tokens per
// sequence (issue 30; docs/PERFORMANCE.md, "What is open"), timed without
// memory traffic as scripts/wgmma_decode_loop.cu times its two forms: an
// SM's time per 64-token tile of one kv head, issue, latency and the tensor
// cores only, with 4-bit keys through the wide 256-byte-row table and 4-bit
// values read from fixed shared-memory stages (synthetic data; the
// products' values are not checked, their layouts are:
// scripts/mma_throughput.cu; no block table, prologue or merge); then some
// of them again with every tile streamed from global memory by bulk copies.
//
// The roles are split as FlashAttention-3 splits them, in the rows
// orientation (M = 64 query rows, the group x q_len rows of one kv head):
// - producer warpgroups at few registers (setmaxnreg.dec) dequantize each
//   64-token tile once into a ring of shared-memory slots: K [token][dim]
//   (centroid pairs from the table), V'^T [column][token] and each token's
//   score factor (norm x scale x log2 e, fp32); a full barrier per slot.
//   V'^T in one of two forms (ScaledProbabilities):
//   - false: columns 0-127 code x scale by one fp16 FMA (exact before its
//     one rounding), 128 the tokens' zeros, 129 ones, so the product also
//     sums p x zero and p;
//   - true: columns 0-127 the codes plus the fp16 exponent's offset (1024
//     or 64, one LOP3 per pair, no FMA), 128 zero / scale, 129 1 / scale,
//     130 ones, and the consumers multiply p by the token's scale (P' = p
//     scale), so the product sums P' (code + offset), p x zero, p and P'
//     (the offsets' share, taken off once at the end). The producers' work
//     per code halves; 1 / scale in fp16 needs scales above 2^-16 (a real
//     kernel would scale those two columns);
// - two consumer warpgroups at many registers (setmaxnreg.inc) take
//   alternate tiles, so one's softmax overlaps the other's products:
//   S = Q K^T (m64n64k16 x 8, A: the query rows from registers), the
//   scores times their token's factor less the row's reference (the lazy
//   rescale: the reference moves only when a score passes it by the
//   threshold), p on the SFU, P from the accumulators into the A operand
//   of O = P V' (m64n136k16 x 4), the slot released after that product's
//   wait (at once, or after the next tile's S = Q K^T: Deferred).
// Rows past `Rows` (q_len 4 at group 8: 32 of the 64) skip the softmax and
// multiply zeros: the products run at M = 64 either way.
// The tokens form (tokens_loop) keeps the producers and takes both
// operands from shared memory in the S^T orientation (M = 64 tokens, N =
// the real rows, so q_len 4 pays for 32 rows): S^T = K Q^T, the softmax of
// wgmma_decode_loop.cu's tokens form (tokens_softmax), O^T = V'^T P'^T.
//
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -o /tmp/wgmma_specialized_loop \
//     scripts/wgmma_specialized_loop.cu && /tmp/wgmma_specialized_loop
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "../src/cuda/tensor_core/bulk_copy.cuh"
#include "decode_loop_tile.cuh"

namespace {


constexpr int kInputBytes = kTileTokens * kSlotBytes;
constexpr int kKeyTileBytes = kTileTokens * 128 * 2;           // 16 KB
constexpr int kValueTileBytes = kValueRows * kTileTokens * 2;  // 17 KB
// 64 x (factor, scale), then 64 zeros, fp32; slots stay on 1024-byte boundaries.
constexpr int kFactorBytes = 1024;
constexpr int kRingSlotBytes = kKeyTileBytes + kValueTileBytes + kFactorBytes;
constexpr float kScoreFactor = 0.08838835f * 1.44269504f;  // 1/sqrt(128) x log2 e

// Shared memory: the table, the ring's slots, the packed input tiles
// (InputStages 0: two fixed ones read alternately; else tiles streamed from
// global memory, the stages of their copies); for the tokens form
// (TokensRows > 0) also Q^T [row][dim] (both consumers read it), each
// consumer's P'^T [row][token] and its maxima exchange; the full, empty and
// input barriers.
template <int Slots, int TokensRows = 0, int InputStages = 0>
struct SharedLayout {
  static constexpr bool kStreamed = InputStages > 0;
  static constexpr int kInputStages = kStreamed ? InputStages : 2;
  static constexpr int kRing = kLutBytes;
  static constexpr int kInput = kRing + Slots * kRingSlotBytes;
  static constexpr int kQuery = kInput + kInputStages * kInputBytes;
  static constexpr int kProbBytes = TokensRows * kTileTokens * 2;
  static constexpr int kProb = kQuery + TokensRows * 128 * 2;
  static constexpr int kExchange = kProb + 2 * kProbBytes;
  static constexpr int kBarriers = kExchange + 2 * 4 * TokensRows * 4;  // full[Slots], empty[Slots], input[InputStages]
  static constexpr int kBytes = kBarriers + (2 * Slots + kInputStages) * 8;
  static_assert(kInput % 1024 == 0 && kQuery % 1024 == 0 && kProb % 1024 == 0 && kProbBytes % 1024 == 0);
};

// Registers of a producer thread and of a consumer thread, together filling
// the 64 K of a CTA of 1 or 2 producer warpgroups and 2 consumer ones.
constexpr int kProducerRegisters = 72;
template <int Producers>
constexpr int kConsumerRegisters = Producers == 1 ? 216 : 184;
static_assert(128 * (kProducerRegisters + 2 * kConsumerRegisters<1>) <= 65536);
static_assert(128 * (2 * kProducerRegisters + 2 * kConsumerRegisters<2>) <= 65536);

template <int Registers>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

// One producer warp's share of a tile: its Tokens tokens (Tokens x `warp`
// .., of the producers' 4 x Producers warps) dequantized into the slot at
// `keys` (K, then V'^T, then each token's factor, scale and zero).
template <bool ScaledProbabilities, int Tokens>
__device__ __forceinline__ void dequantize(const std::uint8_t* shared, const std::uint8_t* stage, std::uint8_t* keys,
                                           int warp, int lane) {
  const int first = Tokens * warp;
  std::uint8_t* const values = keys + kKeyTileBytes;
  float2* const factors = reinterpret_cast<float2*>(values + kValueTileBytes);
  write_keys<false, Tokens>(shared, stage + first * kSlotBytes, keys, first, lane);
  if (lane < Tokens) {  // token first + lane's fields
    const std::uint8_t* record = stage + (first + lane) * kSlotBytes;
    const float norm = __half2float(*reinterpret_cast<const __half*>(record + 64));
    const float scale = __half2float(*reinterpret_cast<const __half*>(record + 66));
    const float zero = __half2float(*reinterpret_cast<const __half*>(record + 68));
    factors[first + lane] = make_float2(norm * kScoreFactor, scale);
    reinterpret_cast<float*>(factors + kTileTokens)[first + lane] = zero;
    if constexpr (ScaledProbabilities) {  // rows 128 and 129: zero / scale, 1 / scale
      const float inverse = 1.0f / scale;
      *reinterpret_cast<__half*>(values + swizzled_offset(kValueRows, 128, first + lane)) =
          __float2half(zero * inverse);
      *reinterpret_cast<__half*>(values + swizzled_offset(kValueRows, 129, first + lane)) = __float2half(inverse);
    }
  }
  write_values<ScaledProbabilities, Tokens>(stage + first * kSlotBytes, values, first, lane);
}

// The ring's barriers: full[slot] (every producer thread's arrival), then
// empty[slot] (a consumer warpgroup's 128). Every producer warp takes its
// share of every tile, so each slot is filled in tile order: the parity
// waits need that (a waiter at most one phase behind).
template <class Layout, int Slots>
struct Ring {
  std::uint32_t base;
  __device__ __forceinline__ std::uint32_t full(int slot) const { return base + Layout::kBarriers + 8 * slot; }
  __device__ __forceinline__ std::uint32_t empty(int slot) const {
    return base + Layout::kBarriers + 8 * (Slots + slot);
  }
  __device__ __forceinline__ std::uint32_t input(int stage) const {
    return base + Layout::kBarriers + 8 * (2 * Slots + stage);
  }
  __device__ __forceinline__ std::uint32_t slot_address(int slot) const {
    return base + Layout::kRing + slot * kRingSlotBytes;
  }

  /// A consumer's view of tile `tile`'s slot once it is full: its K and V'^T descriptors and its factors.
  struct Operands {
    int slot;
    std::uint64_t keys, values;
    const std::uint8_t* factors;
  };
  __device__ __forceinline__ Operands wait_full(const std::uint8_t* shared, int tile) const {
    const int slot = tile % Slots;
    mbarrier_wait_parity(full(slot), (tile / Slots) & 1);
    return {slot, descriptor(slot_address(slot)), descriptor(slot_address(slot) + kKeyTileBytes),
            shared + Layout::kRing + slot * kRingSlotBytes + kKeyTileBytes + kValueTileBytes};
  }
};

// Synthetic table, inputs and query; V'^T's ones row (129, or 130 with
// ScaledProbabilities) and the zero rows after it in every slot, once; the
// barriers.
template <class Layout, int Slots, int Producers, bool ScaledProbabilities>
__device__ __forceinline__ Ring<Layout, Slots> prepare(std::uint8_t* shared) {
  for (int i = threadIdx.x; i < Layout::kBarriers / 4; i += blockDim.x) {
    const std::uint32_t x = (i * 2654435761u) >> 7;
    reinterpret_cast<std::uint32_t*>(shared)[i] = (x & 0x03ff03ffu) | 0x30003000u;  // fp16 in [0.125, 0.25)
  }
  __syncthreads();
  constexpr int kOnesRow = ScaledProbabilities ? 130 : 129;
  for (int i = threadIdx.x; i < Slots * (kValueRows - kOnesRow) * kTileTokens; i += blockDim.x) {
    const int slot = i / ((kValueRows - kOnesRow) * kTileTokens);
    const int row = kOnesRow + i / kTileTokens % (kValueRows - kOnesRow), token = i % kTileTokens;
    std::uint8_t* values = shared + Layout::kRing + slot * kRingSlotBytes + kKeyTileBytes;
    *reinterpret_cast<__half*>(values + swizzled_offset(kValueRows, row, token)) =
        __float2half(row == kOnesRow ? 1.0f : 0.0f);
  }
  const Ring<Layout, Slots> ring{static_cast<std::uint32_t>(__cvta_generic_to_shared(shared))};
  if (threadIdx.x == 0) {
    for (int slot = 0; slot < Slots; ++slot) {
      mbarrier_init(ring.full(slot), 128 * Producers);
      mbarrier_init(ring.empty(slot), 128);
    }
    for (int stage = 0; stage < Layout::kInputStages && Layout::kStreamed; ++stage) mbarrier_init(ring.input(stage), 1);
    fence_barrier_init();
  }
  fence_proxy_async_shared();
  __syncthreads();
  return ring;
}

// A producer warp's loop: its share of every tile (warp: 0 .. 4 x Producers
// - 1). Streamed layouts copy each tile from `tiles_in` (the CTA's packed
// tiles in global memory) into the next input stage by one bulk copy,
// issued by warp 0 kInputStages tiles ahead once every producer has read
// the stage (a named barrier of the producers); else the two fixed stages
// alternate.
template <class Layout, int Slots, int Producers, bool ScaledProbabilities>
__device__ __forceinline__ void produce(std::uint8_t* shared, const Ring<Layout, Slots>& ring, int warp, int tiles,
                                        int lane, const std::uint8_t* tiles_in) {
  constexpr int kStages = Layout::kInputStages;
  release_registers<kProducerRegisters>();
  const auto issue = [&](int tile) {
    if (warp == 0 && tile < tiles && elect_one_lane()) {
      const int stage = tile % kStages;
      mbarrier_arrive_expect_tx(ring.input(stage), kInputBytes);
      bulk_load(ring.base + Layout::kInput + stage * kInputBytes,
                tiles_in + static_cast<std::size_t>(tile) * kInputBytes, kInputBytes, ring.input(stage));
    }
  };
  if constexpr (Layout::kStreamed) {
    for (int tile = 0; tile < kStages; ++tile) issue(tile);
  }
  for (int tile = 0; tile < tiles; ++tile) {
    const int slot = tile % Slots, round = tile / Slots;
    const int stage = tile % kStages;
    if constexpr (Layout::kStreamed) mbarrier_wait_parity(ring.input(stage), (tile / kStages) & 1);
    mbarrier_wait_parity(ring.empty(slot), (round & 1) ^ 1);
    dequantize<ScaledProbabilities, kTileTokens / (4 * Producers)>(
        shared, shared + Layout::kInput + stage * kInputBytes, shared + Layout::kRing + slot * kRingSlotBytes, warp,
        lane);
    fence_proxy_async_shared();  // the generic-proxy stores before the products' reads
    mbarrier_arrive(ring.full(slot));
    if constexpr (Layout::kStreamed) {
      asm volatile("bar.sync 3, %0;\n" ::"n"(128 * Producers) : "memory");  // the stage is read by every producer
      issue(tile + kStages);
    }
  }
}

// A k-step's offset in a descriptor (16-byte units; no carry past the
// 14-bit address field: shared memory is under 256 KB): `rows` rows, K-major.
__device__ __forceinline__ std::uint64_t k_step(int rows, int ks) {
  return static_cast<std::uint64_t>(k_step_offset(rows, ks) >> 4);
}

// The CTA's packed tiles in global memory (each CTA streams its own), or none.
__device__ __forceinline__ const std::uint8_t* cta_tiles(const std::uint8_t* tiles_in, int tiles) {
  return tiles_in == nullptr ? nullptr : tiles_in + static_cast<std::size_t>(blockIdx.x) * tiles * kInputBytes;
}

// The role and the warp from lane 0, so the compiler knows them uniform (a
// divergent path near the products serializes them).
__device__ __forceinline__ int uniform_warp() { return __shfl_sync(0xffffffffu, threadIdx.x / 32, 0); }

// The rows form. Rows: the real query rows of the 64 (q_len x group);
// Producers: producer warpgroups (1 or 2); Slots: the ring's depth;
// Deferred: each slot released after the next tile's S = Q K^T instead of
// right after its own O = P V'; ScaledProbabilities: where the values'
// scales are applied (above).
template <int Rows, int Producers, int Slots, bool Deferred, bool ScaledProbabilities, int InputStages = 0>
__global__ void __launch_bounds__(128 * (Producers + 2), 1)
    specialized_loop(int tiles, float* sink, const std::uint8_t* tiles_in) {
  extern __shared__ __align__(1024) std::uint8_t shared[];
  using L = SharedLayout<Slots, 0, InputStages>;
  const int warp = uniform_warp(), lane = threadIdx.x % 32, c = lane % 4;
  const int role = warp / 4, wg_warp = warp % 4;
  const Ring<L, Slots> ring = prepare<L, Slots, Producers, ScaledProbabilities>(shared);
  // The roles' branches in the kernel itself: ptxas allocates each side's registers by its setmaxnreg only so.
  if (role < Producers) {
    produce<L, Slots, Producers, ScaledProbabilities>(shared, ring, warp, tiles, lane, cta_tiles(tiles_in, tiles));
    return;
  }
  claim_registers<kConsumerRegisters<Producers>>();
  const int consumer = role - Producers;
  const bool real_rows = 16 * wg_warp < Rows;  // the warp's rows 16 w .. 16 w + 15: warp-uniform
  // The query (A of S = Q K^T), synthetic: rows 16 w + g (+ 8), dims 16 ks + 2c (+ 1, + 8, + 9).
  std::uint32_t query[8][4];
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int j = 0; j < 4; ++j) query[ks][j] = ((lane * 977u + ks * 131u + j * 37u) & 0x01ff01ffu) | 0x2c002c00u;
  keep_words(query);  // held in registers, as loaded ones would be, not recomputed beside the products
  float acc_o[kValueRows / 2] = {};
  float reference[2] = {-8.0f, -8.0f};  // rows g and g + 8; the first tile moves them
  std::uint32_t probability[4][4];
  int held = -1;  // Deferred: the slot whose O = P V' is still in flight
  for (int tile = consumer; tile < tiles; tile += 2) {
    const auto [slot, keys, values, factor_bytes] = ring.wait_full(shared, tile);
    const float4* factors = reinterpret_cast<const float4*>(factor_bytes);
    // S = Q K^T: rows 16 w + g (+ 8), tokens 8i + 2c (+ 1).
    float score[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) wgmma_rs<64>(score, query[ks], keys + k_step(kTileTokens, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();  // with Deferred, also the previous tile's O = P V'
    keep(score);
    if constexpr (Deferred) {
      keep(acc_o);
      keep_words(probability);
      if (held >= 0) mbarrier_arrive(ring.empty(held));
    }
    if (real_rows) {
      // Scores x their token's factor, less the row's reference; the rows' maxima over the lane quad.
      float local[2] = {-1.0e30f, -1.0e30f};
      [[maybe_unused]] float scale[16];  // ScaledProbabilities: the scales of tokens 8i + 2c, + 1
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 factor = factors[4 * i + c];  // (factor, scale) of tokens 8i + 2c and 8i + 2c + 1
        scale[2 * i] = factor.y, scale[2 * i + 1] = factor.w;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          score[4 * i + e] = fmaf(score[4 * i + e], e & 1 ? factor.z : factor.x, -reference[e / 2]);
          local[e / 2] = fmaxf(local[e / 2], score[4 * i + e]);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        local[r] = fmaxf(local[r], __shfl_xor_sync(0xffffffffu, local[r], 1));
        local[r] = fmaxf(local[r], __shfl_xor_sync(0xffffffffu, local[r], 2));
      }
      // Rare past the first tiles; the vote keeps the branch warp-uniform (see the role above).
      if (__any_sync(0xffffffffu, local[0] > kLazyRescaleLog2 || local[1] > kLazyRescaleLog2)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float shift = local[r] > kLazyRescaleLog2 ? local[r] : 0.0f;
          const float alpha = fast_exp2(-shift);
          reference[r] += shift;
#pragma unroll
          for (int i = 0; i < kValueRows / 8; ++i) acc_o[4 * i + 2 * r] *= alpha, acc_o[4 * i + 2 * r + 1] *= alpha;
#pragma unroll
          for (int i = 0; i < 8; ++i) score[4 * i + 2 * r] -= shift, score[4 * i + 2 * r + 1] -= shift;
        }
      }
      probabilities_as_a_operand(probability, [&](int i, int e) {
        return ScaledProbabilities ? fast_exp2(score[4 * i + e]) * scale[2 * i + (e & 1)] : fast_exp2(score[4 * i + e]);
      });
    } else {
      zero_words(probability);
    }
    // O = P V': k-step kt takes tokens 16 kt ..
    wgmma_fence();
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      wgmma_rs<kValueRows>(acc_o, probability[kt], values + k_step(kValueRows, kt), 1);
    }
    wgmma_commit();
    if constexpr (Deferred) {
      held = slot;
    } else {
      wgmma_wait_all();
      keep(acc_o);
      keep_words(probability);
      mbarrier_arrive(ring.empty(slot));
    }
  }
  sink_accumulators(acc_o, sink);
}

// The tokens form (S^T orientation, N = Rows query rows, no padding): the
// same producers (the values' scale in P), and two consumer warpgroups on
// alternate tiles, both operands from shared memory: S^T = K Q^T (m64nNk16
// x 8: A the slot's K, B the resident Q^T), tokens_softmax (the maxima
// exchanged between the warpgroup's warps only when the lazy threshold is
// passed; P'^T through shared memory), O^T = V'^T P'^T (two m64nNk16 x 4:
// A the slot's V'^T rows 0-127), the slot released after its wait. Three
// slots (Q^T, P'^T and the exchange take the fourth's room).
template <int Rows, int Producers, int InputStages = 0>
__global__ void __launch_bounds__(128 * (Producers + 2), 1)
    tokens_loop(int tiles, float* sink, const std::uint8_t* tiles_in) {
  extern __shared__ __align__(1024) std::uint8_t shared[];
  constexpr int kSlots = 3;
  using L = SharedLayout<kSlots, Rows, InputStages>;
  const int warp = uniform_warp(), lane = threadIdx.x % 32, g = lane / 4;
  const int role = warp / 4, wg_warp = warp % 4;
  const Ring<L, kSlots> ring = prepare<L, kSlots, Producers, true>(shared);
  if (role < Producers) {  // as in specialized_loop
    produce<L, kSlots, Producers, true>(shared, ring, warp, tiles, lane, cta_tiles(tiles_in, tiles));
    return;
  }
  claim_registers<kConsumerRegisters<Producers>>();
  const int consumer = role - Producers;
  const std::uint64_t query = descriptor(ring.base + L::kQuery);
  std::uint8_t* const prob_bytes = shared + L::kProb + consumer * L::kProbBytes;
  const std::uint64_t prob = descriptor(ring.base + L::kProb + consumer * L::kProbBytes);
  float* const exchange = reinterpret_cast<float*>(shared + L::kExchange) + consumer * 4 * Rows;
  float acc_o[2][Rows / 2] = {};
  TokensRows<Rows> rows;
  for (int tile = consumer; tile < tiles; tile += 2) {
    const auto [slot, keys, values, factor_bytes] = ring.wait_full(shared, tile);
    const float2* factors = reinterpret_cast<const float2*>(factor_bytes);
    // S^T = K Q^T: tokens 16 w + g (+ 8), rows 8i + 2c (+ 1).
    float score[Rows / 2];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ++ks)
      wgmma_ss<Rows>(score, keys + k_step(kTileTokens, ks), query + k_step(Rows, ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
    keep(score);
    const int token = 16 * wg_warp + g;
    const float2 first = factors[token], second = factors[token + 8];
    const float* zeros = reinterpret_cast<const float*>(factors + kTileTokens);
    const float factor[2] = {first.x, second.x}, scale[2] = {first.y, second.y};
    const float zero[2] = {zeros[token], zeros[token + 8]};
    // Its barrier also orders this tile's P'^T stores after every warp's wait on the previous O^T product.
    tokens_softmax<Rows, true>(score, factor, scale, zero, rows, acc_o, exchange, prob_bytes, 1 + consumer, wg_warp,
                               lane);
    fence_proxy_async_shared();
    named_barrier(1 + consumer);
    // O^T = V'^T P'^T: dims 64 m + 16 w + g (+ 8), k-step kt the tokens 16 kt ..
    wgmma_fence();
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int kt = 0; kt < 4; ++kt) {
        wgmma_ss<Rows>(acc_o[m], values + ((m * 64 * 128) >> 4) + k_step(kValueRows, kt), prob + k_step(Rows, kt), 1);
      }
    }
    wgmma_commit();
    wgmma_wait_all();
    keep(acc_o[0]);
    keep(acc_o[1]);
    mbarrier_arrive(ring.empty(slot));
  }
  sink_accumulators(acc_o[0], sink);
  sink_accumulators(acc_o[1], sink);
}

// Packed tiles with the shared stages' synthetic values (fields in range).
__global__ void fill_tiles(std::uint32_t* words, std::size_t count) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < count;
       i += std::size_t{gridDim.x} * blockDim.x) {
    const std::uint32_t x = (static_cast<std::uint32_t>(i) * 2654435761u) >> 7;
    words[i] = (x & 0x03ff03ffu) | 0x30003000u;
  }
}

constexpr int kTiles = 1024;  // per CTA: 65536 tokens

// Times `kernel` (one CTA per SM of `threads` threads, `bytes` of shared
// memory; `tiles_in`: streamed tiles or none) and prints its line.
template <class Kernel>
void time_loop(Kernel kernel, int threads, int bytes, const char* label, int sms, float* sink,
               const std::uint8_t* tiles_in) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  kernel<<<sms, threads, bytes>>>(kTiles, sink, tiles_in);  // warm-up
  cudaEventRecord(start);
  for (int r = 0; r < 5; ++r) kernel<<<sms, threads, bytes>>>(kTiles, sink, tiles_in);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  const double sm_tile_ns = ms * 1e6 / 5 / kTiles;
  char streamed[96] = "";
  if (tiles_in != nullptr) {
    std::snprintf(streamed, sizeof streamed, ", streamed at %.2f TB/s",
                  double{kInputBytes} * kTiles * sms / (sm_tile_ns * kTiles) / 1e3);
  }
  std::printf("%s: %.1f ns of an SM per 64-token tile%s; (16, 32768) Hk 8 would take %.1f us (%s)\n", label, sm_tile_ns,
              streamed, 65536.0 / sms * sm_tile_ns / 1e3, cudaGetErrorString(cudaGetLastError()));
}

// An SM's time per 64-token tile, one CTA per SM; (16, 32768), Hk 8 is 65536 such tiles.
template <int Rows, int Producers, int Slots, bool Deferred, bool ScaledProbabilities, int InputStages = 0>
void measure(int sms, float* sink, const std::uint8_t* tiles_in = nullptr) {
  char label[192];
  std::snprintf(label, sizeof label,
                "rows form, %d rows (q_len %d), %d producer warpgroup(s), %d slots, release %s, scale in %s%s", Rows,
                Rows / 8, Producers, Slots, Deferred ? "deferred" : "at once", ScaledProbabilities ? "P" : "V",
                tiles_in != nullptr ? ", tiles from global memory" : "");
  time_loop(specialized_loop<Rows, Producers, Slots, Deferred, ScaledProbabilities, InputStages>, 128 * (Producers + 2),
            SharedLayout<Slots, 0, InputStages>::kBytes, label, sms, sink, tiles_in);
}

template <int Rows, int Producers, int InputStages = 0>
void measure_tokens(int sms, float* sink, const std::uint8_t* tiles_in = nullptr) {
  char label[192];
  std::snprintf(label, sizeof label, "tokens form, %d rows (q_len %d), %d producer warpgroup(s), 3 slots, scale in P%s",
                Rows, Rows / 8, Producers, tiles_in != nullptr ? ", tiles from global memory" : "");
  time_loop(tokens_loop<Rows, Producers, InputStages>, 128 * (Producers + 2),
            SharedLayout<3, Rows, InputStages>::kBytes, label, sms, sink, tiles_in);
}

// Every configuration, in the order they print: the synthetic stages at 64
// rows (q_len 8 at group 8) and 32 (q_len 4), then tiles read from global
// memory (bulk copies into input stages, as a decode would stream the
// cache; 144 bytes a token here against the cache's 134): the rows form at
// three slots and six stages, the tokens form at what its shared memory
// leaves (four stages at 32 rows, two at 64).
using Measurement = void (*)(int, float*, const std::uint8_t*);
template <int Rows>
constexpr Measurement kSyntheticForms[] = {
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 3, false, false>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 3, false, true>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 4, false, false>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 4, false, true>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 4, true, false>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 1, 4, true, true>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 2, 4, true, false>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure<Rows, 2, 4, true, true>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure_tokens<Rows, 1>(sms, sink); },
    [](int sms, float* sink, const std::uint8_t*) { measure_tokens<Rows, 2>(sms, sink); },
};
constexpr Measurement kStreamedForms[] = {
    [](int sms, float* sink, const std::uint8_t* tiles) { measure<64, 1, 3, false, true, 6>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure<64, 1, 3, true, true, 6>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure<64, 2, 3, true, true, 6>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure<32, 1, 3, false, true, 6>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure<32, 1, 3, true, true, 6>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure_tokens<32, 1, 4>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure_tokens<32, 2, 4>(sms, sink, tiles); },
    [](int sms, float* sink, const std::uint8_t* tiles) { measure_tokens<64, 1, 2>(sms, sink, tiles); },
};

}  // namespace

// No argument: every configuration; an index (0 .. count - 1): that one alone
// (a process each, so a configuration that hangs under a timeout costs only
// its own line). `--count` prints the count.
int main(int argc, char** argv) {
  std::vector<std::pair<Measurement, bool>> all;  // (measurement, streamed)
  for (const Measurement m : kSyntheticForms<64>) all.emplace_back(m, false);
  for (const Measurement m : kSyntheticForms<32>) all.emplace_back(m, false);
  for (const Measurement m : kStreamedForms) all.emplace_back(m, true);
  if (argc > 1 && std::strcmp(argv[1], "--count") == 0) {
    std::printf("%zu\n", all.size());
    return 0;
  }
  const int only = argc > 1 ? std::atoi(argv[1]) : -1;
  int sms = 0;
  float* const sink = prototype_device(sms);
  std::uint32_t* tiles_in = nullptr;  // allocated and filled for the first streamed configuration
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (only >= 0 && static_cast<std::size_t>(only) != i) continue;
    const auto [measurement, streamed] = all[i];
    if (streamed && tiles_in == nullptr) {
      const std::size_t words = std::size_t{kInputBytes} / 4 * kTiles * sms;
      if (words == 0 || cudaMalloc(&tiles_in, words * 4) != cudaSuccess) {
        std::printf("no memory for the streamed tiles (%zu MB)\n", words * 4 >> 20);
        return 1;
      }
      fill_tiles<<<4 * sms, 256>>>(tiles_in, words);
    }
    measurement(sms, sink, reinterpret_cast<const std::uint8_t*>(tiles_in));
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
