// The Hopper kernel: the whole decode step for turboquant_4bit_nc, D = 128
// (the headline profile) in one launch, built for sm_90a.
//
// Grid (partition, kv head, sequence), 4 warps per CTA. A CTA
// 1. rotates the query heads of its group (q_rot = bf16(q @ PiT), PiT staged
//    in shared memory with cp.async);
// 2. streams its token range in 16-token tiles, warps taking tiles round
//    robin, each warp keeping kStages tiles in flight with cp.async into its
//    own shared-memory ring, and runs S = Q K^T and O += P V on the tensor
//    cores (mma.sync m16n8k16 bf16; the query group, up to 16 heads, is M,
//    so every loaded key and value serves the whole group);
// 3. merges its warps and writes the partition's (max, sum, normalized out);
// 4. if it is the last CTA of its (sequence, kv head) to finish, reduces the
//    N partitions with the sink and writes the output (then resets the
//    arrival counter, so CUDA-graph replays need no memset).
//
// Dequantization is arranged to cost less than the memory time:
// - Keys: one shared-memory lookup turns a packed byte (two 4-bit indices)
//   into a bf16 pair of centroids; the 256-entry table is replicated per lane
//   (32 KB) so lookups never conflict. The key norm is folded into the score.
// - The head-dim order inside a k-step is permuted (the query uses the same
//   permutation) so each lane's key operand is 16 contiguous bytes.
// - Values: nibble c becomes bf16(1 + c/16) by shift-and-mask (bf16 1.0 is
//   0x3f80; c lands in mantissa bits 6..3); one byte permute serves four
//   n-tiles. Scale and zero fold into the probabilities:
//     sum_t p_t (c_t s_t + z_t) = sum_t P'_t (1 + c_t/16) - sum_t P'_t + sum_t p_t z_t
//   with P'_t = bf16(16 p_t s_t). sum_t P'_t comes from one extra mma with
//   an all-ones operand; sum_t p_t z_t is a per-row scalar.
// - Output dims are permuted (dim = 16 n + n_tile) and restored in the merge.
// - Softmax runs in base 2 (log2 e folded into the score scale) and rescales
//   the accumulators only when some row's maximum grew.
// Shared-memory tiles are XOR-swizzled by token so the 16- and 8-byte
// operand loads are free of bank conflicts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "cuda_check.hpp"
#include "device_utils.cuh"
#include "kernel_params.hpp"
#include "policy.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/partition.hpp"

namespace tqdecode::cuda {

namespace hopper {

constexpr int kHeadDim = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTileTokens = 16;
constexpr int kRows = 16;           // mma M: query heads of a group, zero-padded
constexpr int kRecordBytes = 128;   // key + value data of one (slot, head)
constexpr int kFields = 3;          // key norm, value scale, value zero
constexpr int kStages = 4;          // tiles in flight per warp
constexpr int kMetaOffset = kTileTokens * kRecordBytes;        // 2048
constexpr int kStageBytes = kMetaOffset + 128;                 // records + 3 x 32 B of fp16 fields, padded
constexpr int kLutBytes = 256 * 32 * 4;                        // byte -> bf16 pair, one copy per lane
constexpr int kRingBytes = kWarps * kStages * kStageBytes;     // 34816
constexpr int kMainBytes = kLutBytes + kRingBytes;             // 67584
constexpr int kPiTBytes = kHeadDim * kHeadDim * 4;             // 65536, staged in the main region first
constexpr int kQueryBytes = kRows * kHeadDim * 4;              // 8192
constexpr int kSharedBytes = kMainBytes + kQueryBytes;         // 75776: three CTAs per SM
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kPartitionAlign == kTileTokens, "partition ranges must be whole tiles");
static_assert(kPiTBytes <= kMainBytes, "PiT staging must fit the main region");
static_assert(kThreads == kHeadDim, "one thread per head dim in rotation and merge");

struct MergeStorage {
  float out[kWarps][kRows][kHeadDim];
  float max[kWarps][kRows];
  float sum[kWarps][kRows];
};
static_assert(sizeof(MergeStorage) <= kMainBytes, "merge buffer must fit the main region");

// Swizzle of a 16-byte chunk within a token's 128-byte record (see header).
__device__ __forceinline__ int swizzle(int token) { return ((token & 1) << 2) ^ (token & 6); }

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}

__device__ __forceinline__ float2 half_pair(std::uint32_t bits) {
  return __half22float2(*reinterpret_cast<const __half2*>(&bits));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ T load_shared(const std::uint8_t* address) {
  return *reinterpret_cast<const T*>(address);
}

// Value operand for the four n-tiles whose nibbles sit in bytes (b, b+1) of
// two tokens' words: (x >> shift) & mask puts nibble q at mantissa bits 6..3.
template <int Quarter>
__device__ __forceinline__ std::uint32_t value_operand(std::uint32_t pair) {
  constexpr std::uint32_t kMask = 0x00780078u, kOne = 0x3f803f80u;
  if constexpr (Quarter == 0) return ((pair << 3) & kMask) | kOne;
  if constexpr (Quarter == 1) return ((pair >> 1) & kMask) | kOne;
  if constexpr (Quarter == 2) return ((pair >> 5) & kMask) | kOne;
  return ((pair >> 9) & kMask) | kOne;
}

// Per-lane cp.async plan for one tile. Lane l copies chunk (l & 7) of tokens
// (l >> 3) + 4k, k = 0..3, whose sources are `token_stride` bytes apart and
// whose destinations repeat every two k with a 1024-byte step (the swizzle
// depends on token & 7); lanes 0..5 also copy one 16-byte metadata chunk.
struct IssuePlan {
  int source;            // byte offset of chunk k = 0 from the tile's first record
  int token_stride;      // 4 tokens of records: 4 * Hk * 128 bytes
  std::uint32_t destination[2];  // shared offsets within a stage of chunks k = 0 and 1
  int meta_source;       // byte offset of the field chunk from the field start of slot 0
  std::uint32_t meta_destination;
};

// copy_to_shared<16> (device_utils.cuh) takes a generic pointer; the ring
// keeps precomputed 32-bit shared addresses, which save its conversion per copy.
__device__ __forceinline__ void cp_async_16(std::uint32_t shared_address, const std::uint8_t* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address), "l"(global) : "memory");
}

// Physical block of a tile; loaded one tile before its copies are issued so the
// copies never wait on this load.
__device__ __forceinline__ std::int64_t tile_block(const std::int32_t* table, int tile, int block_shift) {
  return __ldg(table + ((tile * kTileTokens) >> block_shift));
}

__device__ __forceinline__ void issue_tile(std::uint32_t stage, const PartitionParams& p, std::int64_t physical,
                                           int tile, int block_shift, std::int64_t meta_base, const IssuePlan& plan,
                                           int lane) {
  const int slot0 = (tile * kTileTokens) & ((1 << block_shift) - 1);
  const std::uint8_t* block = p.cache + physical * p.layout.block_stride;
  const std::uint8_t* source = block + (static_cast<std::int64_t>(slot0) * p.layout.num_kv_heads * kRecordBytes + plan.source);
  cp_async_16(stage + plan.destination[0], source);
  cp_async_16(stage + plan.destination[1], source + plan.token_stride);
  cp_async_16(stage + plan.destination[0] + 1024, source + 2 * plan.token_stride);
  cp_async_16(stage + plan.destination[1] + 1024, source + 3 * plan.token_stride);
  if (lane < 2 * kFields) cp_async_16(stage + plan.meta_destination, block + meta_base + 2 * slot0 + plan.meta_source);
}

__global__ void __launch_bounds__(kThreads, 3) decode_kernel(const __grid_constant__ FusedDecodeParams params) {
  extern __shared__ __align__(128) std::uint8_t shared[];
  float (*query_rows)[kHeadDim] = reinterpret_cast<float (*)[kHeadDim]>(shared + kMainBytes);
  const PartitionParams& p = params.partitions;
  const int partition = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int num_kv_heads = p.layout.num_kv_heads;
  const int group = p.num_q_heads / num_kv_heads;
  const int num_partitions = p.num_partitions;
  const std::int64_t row_base = static_cast<std::int64_t>(batch) * p.num_q_heads + std::int64_t(head) * group;
  const TokenRange range = partition_range(__ldg(p.seq_lens + batch), num_partitions, p.partition_align, partition);

  if (range.begin >= range.end) {
    // NOTE: an empty partition writes the empty values and reads nothing else.
    for (int row = 0; row < group; ++row) {
      const std::int64_t index = (row_base + row) * num_partitions + partition;
      p.part_out[index * kHeadDim + threadIdx.x] = 0.0f;
      if (threadIdx.x == 0) {
        p.part_max[index] = -INFINITY;
        p.part_sum[index] = 0.0f;
      }
    }
  } else {
    // ---- 1. query rotation -------------------------------------------------
    const RotateParams& rq = params.rotate;
    for (int i = threadIdx.x; i < kPiTBytes / 16; i += kThreads) copy_to_shared<16>(shared + 16 * i, reinterpret_cast<const std::uint8_t*>(rq.PiT) + 16 * i);
    cp_async_commit();
    for (int row = 0; row < kRows; ++row) {
      float value = 0.0f;
      if (row < group) {
        const std::int64_t hq = std::int64_t(head) * group + row;
        value = load_as_float(rq.query, rq.query_dtype, batch * rq.query_stride_batch + hq * rq.query_stride_head + threadIdx.x);
      }
      query_rows[row][threadIdx.x] = value;
    }
    cp_async_wait<0>();
    __syncthreads();
    {
      const float* pit = reinterpret_cast<const float*>(shared);
      float rotated[kRows];
#pragma unroll
      for (int row = 0; row < kRows; ++row) rotated[row] = 0.0f;
      for (int i = 0; i < kHeadDim; i += 4) {
        float column[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) column[e] = pit[(i + e) * kHeadDim + threadIdx.x];
#pragma unroll
        for (int row = 0; row < kRows; ++row) {
          if (row < group) {
            const float4 q = *reinterpret_cast<const float4*>(&query_rows[row][i]);
            rotated[row] = fmaf(q.x, column[0], rotated[row]);
            rotated[row] = fmaf(q.y, column[1], rotated[row]);
            rotated[row] = fmaf(q.z, column[2], rotated[row]);
            rotated[row] = fmaf(q.w, column[3], rotated[row]);
          }
        }
      }
      __syncthreads();  // every thread has read query_rows and PiT
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
        if (row < group) query_rows[row][threadIdx.x] = round_to_bf16(rotated[row]);
      }
    }
    // Lookup table over the dead PiT staging; each thread writes whole 32-lane rows' worth of one entry.
    {
      const int lane_copy = threadIdx.x & 31;
      for (int byte = threadIdx.x >> 5; byte < 256; byte += kWarps) {
        reinterpret_cast<std::uint32_t*>(shared)[byte * 32 + lane_copy] =
            pack_bf16(__ldg(p.centroids + (byte & 15)), __ldg(p.centroids + (byte >> 4)));
      }
    }
    __syncthreads();

    const int c = lane & 3;
    const int g = lane >> 2;
    // Query operand, permuted: k-step ks, lane (g, c) holds dims 32c + 4ks + {0,1} and {2,3}.
    std::uint32_t qa[8][4];
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const int d = 32 * c + 4 * ks;
      qa[ks][0] = pack_bf16(query_rows[g][d], query_rows[g][d + 1]);
      qa[ks][1] = pack_bf16(query_rows[g + 8][d], query_rows[g + 8][d + 1]);
      qa[ks][2] = pack_bf16(query_rows[g][d + 2], query_rows[g][d + 3]);
      qa[ks][3] = pack_bf16(query_rows[g + 8][d + 2], query_rows[g + 8][d + 3]);
    }

    // ---- 2. stream the token range ------------------------------------------
    const int block_shift = 31 - __clz(p.layout.block_size);
    const std::int64_t meta_base = p.layout.metadata_region_offset();
    const std::int32_t* table = p.block_table + static_cast<std::int64_t>(batch) * p.block_table_stride;
    const std::uint8_t* ring = shared + kLutBytes + warp * kStages * kStageBytes;
    const std::uint32_t ring_address =
        static_cast<std::uint32_t>(__cvta_generic_to_shared(ring));
    // Opaque to the compiler, so (offset & 0x7f80) | lane_lut stays one LOP3.
    std::uint32_t lane_lut;
    asm("mov.b32 %0, %1;" : "=r"(lane_lut) : "r"(static_cast<std::uint32_t>(lane) << 2));
    const std::uint8_t* lut = shared;

    IssuePlan plan;
    {
      const int chunk = lane & 7;
      plan.source = ((lane >> 3) * num_kv_heads + head) * kRecordBytes + 16 * chunk;
      plan.token_stride = 4 * num_kv_heads * kRecordBytes;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int token = 4 * k + (lane >> 3);
        plan.destination[k] = token * kRecordBytes + ((chunk ^ swizzle(token)) << 4);
      }
    }
    {
      const int field = lane >> 1;
      plan.meta_source = 2 * (head * kFields + field) * p.layout.block_size + 16 * (lane & 1);
      plan.meta_destination = kMetaOffset + 32 * field + 16 * (lane & 1);
    }
    int key_offset[2], value_offset[4], meta_offset[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int token = 8 * j + g;
      key_offset[j] = token * kRecordBytes + ((c ^ swizzle(token)) << 4);
      meta_offset[j] = kMetaOffset + 2 * (8 * j + 2 * c);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int token = 2 * c + (k & 1) + 8 * (k >> 1);
      value_offset[k] = token * kRecordBytes + (((4 + (g >> 1)) ^ swizzle(token)) << 4) + 8 * (g & 1);
    }

    float acc[17][4];
#pragma unroll
    for (int n = 0; n < 17; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float row_max[2] = {-INFINITY, -INFINITY};  // base-2 units
    float row_sum[2] = {0.0f, 0.0f};
    float zero_sum[2] = {0.0f, 0.0f};
    const float score_scale = p.scale * kLog2e;

    const int first_tile = range.begin / kTileTokens + warp;
    const int end_tile = (range.end + kTileTokens - 1) / kTileTokens;
    const int count = first_tile < end_tile ? (end_tile - first_tile + kWarps - 1) / kWarps : 0;
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < count) {
        const int tile = first_tile + s * kWarps;
        issue_tile(ring_address + s * kStageBytes, p, tile_block(table, tile, block_shift), tile, block_shift, meta_base, plan, lane);
      }
      cp_async_commit();
    }
    const int first_ahead = first_tile + (kStages - 1) * kWarps;
    std::int64_t next_block = kStages - 1 < count ? tile_block(table, first_ahead, block_shift) : 0;
    for (int k = 0; k < count; ++k) {
      const int ahead = k + kStages - 1;
      if (ahead < count) {
        const int tile = first_tile + ahead * kWarps;
        const std::int64_t physical = next_block;
        if (ahead + 1 < count) next_block = tile_block(table, tile + kWarps, block_shift);
        issue_tile(ring_address + (ahead % kStages) * kStageBytes, p, physical, tile, block_shift, meta_base, plan, lane);
      }
      cp_async_commit();
      cp_async_wait<kStages - 1>();
      __syncwarp();
      const std::uint8_t* stage = ring + (k % kStages) * kStageBytes;
      const int tile_token = (first_tile + k * kWarps) * kTileTokens;
      const bool partial = tile_token + kTileTokens > range.end;

      // S = Q K^T for tokens 8j + (0..7).
      // Two accumulator chains per n-tile (even and odd k-steps) halve the mma dependency chain.
      float score[2][4], score_odd[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.0f;
        score_odd[j][0] = score_odd[j][1] = score_odd[j][2] = score_odd[j][3] = 0.0f;
        const uint4 key = load_shared<uint4>(stage + key_offset[j]);
        const std::uint32_t words[4] = {key.x, key.y, key.z, key.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const std::uint32_t word = words[w];
          const std::uint32_t b0 = load_shared<std::uint32_t>(lut + (((word << 7) & 0x7f80u) | lane_lut));
          const std::uint32_t b1 = load_shared<std::uint32_t>(lut + (((word >> 1) & 0x7f80u) | lane_lut));
          const std::uint32_t b2 = load_shared<std::uint32_t>(lut + (((word >> 9) & 0x7f80u) | lane_lut));
          const std::uint32_t b3 = load_shared<std::uint32_t>(lut + (((word >> 17) & 0x7f80u) | lane_lut));
          mma_bf16(score[j], qa[2 * w], b0, b1);
          mma_bf16(score_odd[j], qa[2 * w + 1], b2, b3);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) score[j][e] += score_odd[j][e];
      }

      // Online softmax; lane holds rows g (e = 0, 1) and g + 8 (e = 2, 3) for tokens 8j + 2c + (e & 1).
      float scaled_value[2][2], value_zero[2][2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float2 norm = half_pair(load_shared<std::uint32_t>(stage + meta_offset[j]));
        const float2 vscale = half_pair(load_shared<std::uint32_t>(stage + meta_offset[j] + 32));
        const float2 vzero = half_pair(load_shared<std::uint32_t>(stage + meta_offset[j] + 64));
        const float ns0 = norm.x * score_scale, ns1 = norm.y * score_scale;
        score[j][0] *= ns0;
        score[j][2] *= ns0;
        score[j][1] *= ns1;
        score[j][3] *= ns1;
        scaled_value[j][0] = 16.0f * vscale.x;
        scaled_value[j][1] = 16.0f * vscale.y;
        value_zero[j][0] = vzero.x;
        value_zero[j][1] = vzero.y;
        if (partial) {
          // Slots past the sequence end hold junk: exclude them by selection, never by multiplication.
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (tile_token + 8 * j + 2 * c + e >= range.end) {
              score[j][e] = score[j][e + 2] = -INFINITY;
              scaled_value[j][e] = value_zero[j][e] = 0.0f;
            }
          }
        }
      }
      float alpha[2];
      std::uint32_t pv[4];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float tile_max = fmaxf(fmaxf(score[0][2 * half], score[0][2 * half + 1]), fmaxf(score[1][2 * half], score[1][2 * half + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 2));
        const float new_max = fmaxf(row_max[half], tile_max);
        alpha[half] = fast_exp2(row_max[half] - new_max);
        row_max[half] = new_max;
        float sum = 0.0f, zeros = 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float p0 = fast_exp2(score[j][2 * half] - new_max);
          const float p1 = fast_exp2(score[j][2 * half + 1] - new_max);
          sum += p0 + p1;
          zeros = fmaf(p0, value_zero[j][0], fmaf(p1, value_zero[j][1], zeros));
          // A operand of P V: a0 = (row g, tokens 2c..), a1 = (row g+8, ...), a2/a3 the same for tokens 8+2c...
          pv[2 * j + half] = pack_bf16(p0 * scaled_value[j][0], p1 * scaled_value[j][1]);
        }
        row_sum[half] = fmaf(row_sum[half], alpha[half], sum);
        zero_sum[half] = fmaf(zero_sum[half], alpha[half], zeros);
      }
      if (__any_sync(kFullMask, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < 17; ++n) {
          acc[n][0] *= alpha[0];
          acc[n][1] *= alpha[0];
          acc[n][2] *= alpha[1];
          acc[n][3] *= alpha[1];
        }
      }

      // O += P' V'. Tokens (2c, 2c+1) and (2c+8, 2c+9); n-tile n covers dims 16 * (0..7) + n.
      const std::uint32_t a[4] = {pv[0], pv[1], pv[2], pv[3]};
      const uint2 v0 = load_shared<uint2>(stage + value_offset[0]);
      const uint2 v1 = load_shared<uint2>(stage + value_offset[1]);
      const uint2 v2 = load_shared<uint2>(stage + value_offset[2]);
      const uint2 v3 = load_shared<uint2>(stage + value_offset[3]);
#pragma unroll
      for (int hw = 0; hw < 2; ++hw) {
        const std::uint32_t low_a = hw ? v0.y : v0.x, low_b = hw ? v1.y : v1.x;
        const std::uint32_t high_a = hw ? v2.y : v2.x, high_b = hw ? v3.y : v3.x;
#pragma unroll
        for (int bp = 0; bp < 2; ++bp) {
          const std::uint32_t selector = bp ? 0x7632u : 0x5410u;
          const std::uint32_t low = __byte_perm(low_a, low_b, selector);
          const std::uint32_t high = __byte_perm(high_a, high_b, selector);
          const int n = 8 * hw + 4 * bp;
          mma_bf16(acc[n + 0], a, value_operand<0>(low), value_operand<0>(high));
          mma_bf16(acc[n + 1], a, value_operand<1>(low), value_operand<1>(high));
          mma_bf16(acc[n + 2], a, value_operand<2>(low), value_operand<2>(high));
          mma_bf16(acc[n + 3], a, value_operand<3>(low), value_operand<3>(high));
        }
      }
      mma_bf16(acc[16], a, 0x3f803f80u, 0x3f803f80u);  // sum_t P'_t in every column
      __syncwarp();  // the stage is refilled by the next iteration's issue
    }
    cp_async_wait<0>();

    // ---- 3. merge the warps -----------------------------------------------------
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row_sum[half] += __shfl_xor_sync(kFullMask, row_sum[half], 1);
      row_sum[half] += __shfl_xor_sync(kFullMask, row_sum[half], 2);
      zero_sum[half] += __shfl_xor_sync(kFullMask, zero_sum[half], 1);
      zero_sum[half] += __shfl_xor_sync(kFullMask, zero_sum[half], 2);
    }
    __syncthreads();  // lookup table and rings are dead; the region becomes the merge buffer
    MergeStorage& merge = *reinterpret_cast<MergeStorage*>(shared);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = g + 8 * half;
      const float correction = zero_sum[half] - acc[16][2 * half];
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        merge.out[warp][row][16 * (2 * c) + n] = acc[n][2 * half] + correction;
        merge.out[warp][row][16 * (2 * c + 1) + n] = acc[n][2 * half + 1] + correction;
      }
      if (c == 0) {
        merge.max[warp][row] = row_max[half];
        merge.sum[warp][row] = row_sum[half];
      }
    }
    __syncthreads();
    const int d = threadIdx.x;
    for (int row = 0; row < group; ++row) {
      float merged_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) merged_max = fmaxf(merged_max, merge.max[w][row]);
      float merged_sum = 0.0f, merged_out = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = merge.max[w][row] == -INFINITY ? 0.0f : fast_exp2(merge.max[w][row] - merged_max);
        merged_sum = fmaf(weight, merge.sum[w][row], merged_sum);
        merged_out = fmaf(weight, merge.out[w][row][d], merged_out);
      }
      const std::int64_t index = (row_base + row) * num_partitions + partition;
      p.part_out[index * kHeadDim + d] = merged_out / merged_sum;
      if (d == 0) {
        p.part_max[index] = merged_max * kLn2;  // natural-log units, as the spec's reducer expects
        p.part_sum[index] = merged_sum;
      }
    }
  }

  // ---- 4. the last CTA of (sequence, kv head) reduces the partitions ---------
  __shared__ bool is_last;
  __threadfence();  // this CTA's partition results are visible before it arrives
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* arrival = params.arrivals + static_cast<std::int64_t>(batch) * num_kv_heads + head;
    is_last = atomicAdd(arrival, 1u) == static_cast<unsigned>(num_partitions - 1);
    if (is_last) *arrival = 0u;  // ready for the next launch (graph replay)
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // All loads of a phase are independent, so each phase costs one round trip
  // to L2 however many partitions there are.
  const ReduceParams& r = params.reduce;
  float* weights = reinterpret_cast<float*>(shared);              // [group][N]: w_q / (sum w + sink)
  float* maxima = weights + kRows * kMaxPartitions;               // [group][N]
  for (int i = threadIdx.x; i < group * num_partitions; i += kThreads) {
    const std::int64_t index = row_base * num_partitions + i;
    maxima[i] = __ldcg(p.part_sum + index) == 0.0f ? -INFINITY : __ldcg(p.part_max + index);  // empty: (-inf, 0)
    weights[i] = __ldcg(p.part_sum + index);
  }
  __syncthreads();
  if (threadIdx.x < group) {
    const int row = threadIdx.x;
    const float sink = r.sinks ? __ldg(r.sinks + std::int64_t(head) * group + row) : -INFINITY;
    float merged_max = sink;
    for (int q = 0; q < num_partitions; ++q) merged_max = fmaxf(merged_max, maxima[row * num_partitions + q]);
    float denominator = 0.0f;
    for (int q = 0; q < num_partitions; ++q) {
      const float m = maxima[row * num_partitions + q];
      const float w = m == -INFINITY ? 0.0f : weights[row * num_partitions + q] * __expf(m - merged_max);
      weights[row * num_partitions + q] = w;
      denominator += w;
    }
    // No tokens: an all-zero row, sink or not (seq_len 0 gives zeros).
    const float total = denominator + (r.sinks ? __expf(sink - merged_max) : 0.0f);
    const float inverse = denominator == 0.0f ? 0.0f : 1.0f / total;
    for (int q = 0; q < num_partitions; ++q) weights[row * num_partitions + q] *= inverse;
  }
  __syncthreads();
  const int d = threadIdx.x;
  for (int row = 0; row < group; ++row) {
    const std::int64_t base = (row_base + row) * num_partitions;
    float value = 0.0f;
#pragma unroll 8
    for (int q = 0; q < num_partitions; ++q) {
      const float w = weights[row * num_partitions + q];
      if (w != 0.0f) value = fmaf(w, __ldcg(p.part_out + (base + q) * kHeadDim + d), value);
    }
    const std::int64_t hq = std::int64_t(head) * group + row;
    store_from_float(r.output, r.output_dtype, batch * r.output_stride_batch + hq * r.output_stride_head + d, value);
  }
}

}  // namespace hopper

void launch_decode_hopper(const FusedDecodeParams& params, CUstream_st* stream) {
  static std::once_flag configured;
  std::call_once(configured, [] {
    TQ_CUDA_CHECK(cudaFuncSetAttribute(hopper::decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hopper::kSharedBytes));
  });
  const dim3 grid(params.partitions.num_partitions, params.partitions.layout.num_kv_heads, params.partitions.batch);
  hopper::decode_kernel<<<grid, hopper::kThreads, hopper::kSharedBytes, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

bool hopper_kernel_runnable() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, hopper::decode_kernel) == cudaSuccess;
}

}  // namespace tqdecode::cuda
