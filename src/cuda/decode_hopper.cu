// Tensor-core partition kernel for turboquant_4bit_nc, D = 128 (the headline
// profile), built for sm_90a. One CTA = (partition, kv head, sequence); its
// 4 warps take 16-token tiles round robin and merge at the end.
//
// Per tile a warp runs S = Q K^T and O += P V with mma.sync m16n8k16 bf16:
// the query group (up to 16 heads) is the M dimension, so every loaded key
// and value serves all heads of the group. Dequantization is arranged so it
// costs less than the memory time:
// - Keys: one shared-memory lookup turns a packed byte (two 4-bit indices)
//   into a bf16 pair of centroids. The table is replicated once per lane
//   (32 KB) so lookups never conflict on banks. The key norm is folded into
//   the score: s = scale * norm * (q . c).
// - Head-dim order inside a k-step is permuted (queries use the same
//   permutation) so each lane's key operand is 16 contiguous bytes: one
//   16-byte load per lane per 8 tokens.
// - Values: nibble c becomes bf16(1 + c/16) with a byte permute and one
//   mask/shift/or (bf16 1.0 = 0x3f80, c lands in mantissa bits 6..3).
//   Value scale and zero fold into the probabilities:
//     sum_t p_t (c_t s_t + z_t) = sum_t P'_t (1 + c_t/16) - sum_t P'_t + sum_t p_t z_t
//   with P'_t = bf16(16 p_t s_t); the two sums are per-row scalars.
// - Output dims are permuted the same way (dim = 16 * n + n_tile) and
//   un-permuted when the warps merge through shared memory.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_check.hpp"
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
constexpr int kRows = 16;             // mma M: query heads of a group, zero-padded
constexpr int kKeyBytes = 64;         // 128 x 4 bits
constexpr int kRecordBytes = 128;     // key + value data
constexpr int kLutEntries = 256 * 32; // byte value x lane
constexpr int kFields = 3;            // key norm, value scale, value zero

static_assert(kPartitionAlign == kTileTokens, "partition ranges must be whole tiles");

// Registers one lane loads for one 16-token tile.
struct TileData {
  uint4 key[2];             // n-tile j: token 8j + lane/4, key bytes [16 (lane%4), +16)
  uint2 value[4];           // tokens 2c, 2c+1, 2c+8, 2c+9: value bytes [8 (lane/4), +8)
  std::uint32_t norm[2];    // fp16 pairs: tokens (2c, 2c+1) and (2c+8, 2c+9)
  std::uint32_t vscale[2];
  std::uint32_t vzero[2];
};

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  return static_cast<std::uint32_t>(float_to_bf16_bits(lo)) | (static_cast<std::uint32_t>(float_to_bf16_bits(hi)) << 16);
}

__device__ __forceinline__ float half_lo(std::uint32_t pair) { return __half2float(__ushort_as_half(static_cast<unsigned short>(pair & 0xffffu))); }
__device__ __forceinline__ float half_hi(std::uint32_t pair) { return __half2float(__ushort_as_half(static_cast<unsigned short>(pair >> 16))); }

__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ T load_stream(const std::uint8_t* address) {
  return __ldg(reinterpret_cast<const T*>(address));
}

__device__ __forceinline__ void load_tile(TileData& tile, const std::uint8_t* block, std::int64_t meta_base,
                                          int slot0, int head, int num_kv_heads, int block_size, int lane) {
  const int c = lane & 3;
  const int r = lane >> 2;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const std::int64_t record = (static_cast<std::int64_t>(slot0 + 8 * j + r) * num_kv_heads + head) * kRecordBytes;
    tile.key[j] = load_stream<uint4>(block + record + 16 * c);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int token = 2 * c + (k & 1) + 8 * (k >> 1);
    const std::int64_t record = (static_cast<std::int64_t>(slot0 + token) * num_kv_heads + head) * kRecordBytes;
    tile.value[k] = load_stream<uint2>(block + record + kKeyBytes + 8 * r);
  }
  // Field f of (slot, head) sits at meta_base + 2 * ((head * 3 + f) * block_size + slot).
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const std::int64_t slot = slot0 + 8 * j + 2 * c;
    const std::int64_t field0 = meta_base + 2 * (static_cast<std::int64_t>(head) * kFields * block_size + slot);
    tile.norm[j] = load_stream<std::uint32_t>(block + field0);
    tile.vscale[j] = load_stream<std::uint32_t>(block + field0 + 2 * block_size);
    tile.vzero[j] = load_stream<std::uint32_t>(block + field0 + 4 * block_size);
  }
}

// bf16 pair (1 + c0/16, 1 + c1/16) for nibble `n_tile` of two tokens' 8 value bytes.
__device__ __forceinline__ std::uint32_t value_operand(uint2 first, uint2 second, int n_tile) {
  const std::uint32_t a = n_tile < 8 ? first.x : first.y;
  const std::uint32_t b = n_tile < 8 ? second.x : second.y;
  const std::uint32_t byte = (n_tile >> 1) & 3;
  const std::uint32_t selector = byte | (byte << 4) | ((4 + byte) << 8) | ((4 + byte) << 12);
  const std::uint32_t pair = __byte_perm(a, b, selector);
  const std::uint32_t codes = (n_tile & 1) ? ((pair & 0x00f000f0u) >> 1) : ((pair & 0x000f000fu) << 3);
  return codes | 0x3f803f80u;
}

struct SharedStorage {
  union {
    std::uint32_t lut[kLutEntries];  // byte -> bf16 centroid pair, one copy per lane
    struct {
      float out[kWarps][kRows][kHeadDim];
      float max[kWarps][kRows];
      float sum[kWarps][kRows];
    } merge;
  };
};

__global__ void __launch_bounds__(kThreads) partitions_kernel(const __grid_constant__ PartitionParams params) {
  __shared__ SharedStorage shared;
  const int partition = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int num_kv_heads = params.layout.num_kv_heads;
  const int group = params.num_q_heads / num_kv_heads;
  const int num_partitions = params.num_partitions;
  const std::int64_t row_base = static_cast<std::int64_t>(batch) * params.num_q_heads + std::int64_t(head) * group;

  const TokenRange range = partition_range(params.seq_lens[batch], num_partitions, params.partition_align, partition);
  if (range.begin >= range.end) {
    // NOTE: empty partitions write the empty values and read nothing else.
    for (int row = warp; row < group; row += kWarps) {
      const std::int64_t index = (row_base + row) * num_partitions + partition;
      for (int d = lane; d < kHeadDim; d += 32) params.part_out[index * kHeadDim + d] = 0.0f;
      if (lane == 0) {
        params.part_max[index] = -INFINITY;
        params.part_sum[index] = 0.0f;
      }
    }
    return;
  }

  for (int i = threadIdx.x; i < kLutEntries; i += kThreads) {
    const int byte = i >> 5;
    shared.lut[i] = pack_bf16(params.centroids[byte & 15], params.centroids[byte >> 4]);
  }

  const int c = lane & 3;
  const int g = lane >> 2;
  // Query operand, permuted: k-step ks, lane (g, c) holds dims 32c + 4ks + {0,1} and {2,3}.
  std::uint32_t qa[8][4];
  {
    const float* q0 = params.q_rot + (row_base + g) * kHeadDim;
    const float* q1 = params.q_rot + (row_base + g + 8) * kHeadDim;
    const bool has0 = g < group;
    const bool has1 = g + 8 < group;
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      const int d = 32 * c + 4 * ks;
      qa[ks][0] = has0 ? pack_bf16(q0[d], q0[d + 1]) : 0u;
      qa[ks][1] = has1 ? pack_bf16(q1[d], q1[d + 1]) : 0u;
      qa[ks][2] = has0 ? pack_bf16(q0[d + 2], q0[d + 3]) : 0u;
      qa[ks][3] = has1 ? pack_bf16(q1[d + 2], q1[d + 3]) : 0u;
    }
  }
  __syncthreads();

  float acc[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float scaled_sum[2] = {0.0f, 0.0f};  // sum of P' (bf16-rounded), to remove the +1 of the value operand
  float zero_sum[2] = {0.0f, 0.0f};    // sum of p * value zero

  const int block_size = params.layout.block_size;
  const std::int64_t meta_base = params.layout.metadata_region_offset();
  const std::int32_t* table = params.block_table + static_cast<std::int64_t>(batch) * params.block_table_stride;
  const int first_tile = range.begin / kTileTokens;
  const int end_tile = (range.end + kTileTokens - 1) / kTileTokens;
  const std::uint32_t* lut = shared.lut + lane;

  auto tile_block = [&](int tile, int& slot0) {
    const int token = tile * kTileTokens;
    slot0 = token % block_size;
    const std::int64_t physical = table[token / block_size];
    return params.cache + physical * params.layout.block_stride;
  };

  TileData current;
  int tile = first_tile + warp;
  if (tile < end_tile) {
    int slot0;
    const std::uint8_t* block = tile_block(tile, slot0);
    load_tile(current, block, meta_base, slot0, head, num_kv_heads, block_size, lane);
  }
  for (; tile < end_tile; tile += kWarps) {
    TileData next;
    if (tile + kWarps < end_tile) {
      int slot0;
      const std::uint8_t* block = tile_block(tile + kWarps, slot0);
      load_tile(next, block, meta_base, slot0, head, num_kv_heads, block_size, lane);
    }

    // S = Q K^T for tokens 8j + (0..7).
    float score[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      score[j][0] = score[j][1] = score[j][2] = score[j][3] = 0.0f;
      const std::uint32_t words[4] = {current.key[j].x, current.key[j].y, current.key[j].z, current.key[j].w};
#pragma unroll
      for (int ks = 0; ks < 8; ++ks) {
        const std::uint32_t word = words[ks >> 1] >> (16 * (ks & 1));
        mma_bf16(score[j], qa[ks], lut[(word & 0xffu) << 5], lut[((word >> 8) & 0xffu) << 5]);
      }
    }

    // Online softmax; lane holds rows g (e = 0, 1) and g + 8 (e = 2, 3), tokens 8j + 2c + (e & 1).
    const int tile_token = tile * kTileTokens;
    std::uint32_t pv_operand[4];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float tile_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = tile_token + 8 * j + 2 * c + e;
          const float norm = e ? half_hi(current.norm[j]) : half_lo(current.norm[j]);
          const float s = params.scale * norm * score[j][2 * half + e];
          score[j][2 * half + e] = token < range.end ? s : -INFINITY;
          tile_max = fmaxf(tile_max, score[j][2 * half + e]);
        }
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[half], tile_max);
      const float alpha = __expf(row_max[half] - new_max);
      row_max[half] = new_max;
      float sum = 0.0f, scaled = 0.0f, zeros = 0.0f;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float scaled_pair[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = tile_token + 8 * j + 2 * c + e;
          const bool valid = token < range.end;
          const float p = valid ? __expf(score[j][2 * half + e] - new_max) : 0.0f;
          const float vscale = e ? half_hi(current.vscale[j]) : half_lo(current.vscale[j]);
          const float vzero = e ? half_hi(current.vzero[j]) : half_lo(current.vzero[j]);
          scaled_pair[e] = valid ? round_to_bf16(16.0f * p * vscale) : 0.0f;
          sum += p;
          scaled += scaled_pair[e];
          zeros += valid ? p * vzero : 0.0f;
        }
        // A operand of P V: a0 = (row g, tokens 2c..), a1 = (row g+8, ...), a2/a3 the same for tokens 8+2c...
        pv_operand[2 * j + half] = pack_bf16(scaled_pair[0], scaled_pair[1]);
      }
      row_sum[half] = row_sum[half] * alpha + sum;
      scaled_sum[half] = scaled_sum[half] * alpha + scaled;
      zero_sum[half] = zero_sum[half] * alpha + zeros;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        acc[n][2 * half] *= alpha;
        acc[n][2 * half + 1] *= alpha;
      }
    }

    // O += P' V', n-tile n covers dims 16 * (0..7) + n.
    const std::uint32_t a[4] = {pv_operand[0], pv_operand[1], pv_operand[2], pv_operand[3]};
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      mma_bf16(acc[n], a, value_operand(current.value[0], current.value[1], n),
               value_operand(current.value[2], current.value[3], n));
    }
    current = next;
  }

  // Row statistics are partial per lane (each lane saw 4 of 16 tokens): reduce over the 4 lanes of a row.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int offset = 1; offset <= 2; offset <<= 1) {
      row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], offset);
      scaled_sum[half] += __shfl_xor_sync(0xffffffffu, scaled_sum[half], offset);
      zero_sum[half] += __shfl_xor_sync(0xffffffffu, zero_sum[half], offset);
    }
  }
  __syncthreads();  // the lookup table is dead; its storage becomes the merge buffer
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    const float correction = zero_sum[half] - scaled_sum[half];
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      shared.merge.out[warp][row][16 * (2 * c) + n] = acc[n][2 * half] + correction;
      shared.merge.out[warp][row][16 * (2 * c + 1) + n] = acc[n][2 * half + 1] + correction;
    }
    if (c == 0) {
      shared.merge.max[warp][row] = row_max[half];
      shared.merge.sum[warp][row] = row_sum[half];
    }
  }
  __syncthreads();

  const int d = threadIdx.x;  // kThreads == kHeadDim
  for (int row = 0; row < group; ++row) {
    float merged_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) merged_max = fmaxf(merged_max, shared.merge.max[w][row]);
    float merged_sum = 0.0f, merged_out = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float weight = shared.merge.max[w][row] == -INFINITY ? 0.0f : __expf(shared.merge.max[w][row] - merged_max);
      merged_sum += weight * shared.merge.sum[w][row];
      merged_out += weight * shared.merge.out[w][row][d];
    }
    const std::int64_t index = (row_base + row) * num_partitions + partition;
    params.part_out[index * kHeadDim + d] = merged_out / merged_sum;
    if (d == 0) {
      params.part_max[index] = merged_max;
      params.part_sum[index] = merged_sum;
    }
  }
}

static_assert(kThreads == kHeadDim, "the merge maps one thread to one output dim");

}  // namespace hopper

void launch_partitions_hopper(const PartitionParams& params, CUstream_st* stream) {
  const dim3 grid(params.num_partitions, params.layout.num_kv_heads, params.batch);
  hopper::partitions_kernel<<<grid, hopper::kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

bool hopper_kernel_runnable() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, hopper::partitions_kernel) == cudaSuccess;
}

}  // namespace tqdecode::cuda
