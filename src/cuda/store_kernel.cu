// GPU store path (docs/FORMAT.md section 3, and 4b for the token_slots
// order): encodes new K/V tokens into the paged cache with the same bytes as
// store_cpu.
//
// Nothing may be written when any token fails a check, and the checks that
// store_cpu makes include results of the encoding itself (an fp16 key norm
// or value scale that overflows). So the encode kernel runs twice, stream
// ordered, with no host synchronisation unless asked:
//  1. memset of the call's status word;
//  2. distinct slots: every pair of the call's tokens compared;
//  3. dry run: encodes everything, writes nothing, and records a StoreStatus
//     for a slot outside the cache, a non-finite key or value element, an
//     fp16 key norm / value scale / value zero that overflows, or (MSE keys)
//     a codebook or rotation store_cpu refuses (every CTA stages both whole,
//     so checking them there reads nothing more);
//  4. write run: its first thread adds the call to the device's report; it
//     returns at once unless the status word is 0, else encodes again and
//     writes the bytes.
// Bit-exactness with the CPU: every fp32 operation that feeds a stored byte
// is a round-to-nearest operation from quantize.hpp (no FMA contraction),
// and every sum is accumulated in the CPU's order (index 0 upwards).

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "cuda_check.hpp"
#include "device_utils.cuh"
#include "tqdecode/error.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/quantize.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode {
namespace {

/// The device-side record of one device's stores: the report
/// store_check_report() reads and clears, and a status word for calls that
/// bring none (stores on one stream at a time).
struct StoreDeviceState {
  int call_status;
  int first_failure;
  unsigned long long checked_calls;
  unsigned long long failed_calls;
  unsigned long long failures[kStoreStatuses];
};

/// Device-side view of StoreArgs plus the device's store record.
struct StoreKernelParams {
  CacheLayout layout;
  std::int64_t num_blocks;
  std::uint8_t* cache;
  const void* key;
  const void* value;
  DType kv_dtype;
  std::int64_t num_tokens;
  const std::int64_t* slot_mapping;
  const float* Pi;
  const float* centroids;
  int* status;  ///< the call's status word
  StoreDeviceState* state;
};

/// Records `code` in the status word, keeping the smallest non-zero code, so
/// the reported failure does not depend on thread scheduling: a bad slot wins
/// over a bad key, which wins over a bad value.
__device__ void report_status(int* status, StoreStatus code) {
  const int wanted = static_cast<int>(code);
  int expected = 0;
  while (true) {
    const int seen = atomicCAS(status, expected, wanted);
    if (seen == expected || seen <= wanted) return;  // written, or an equal or smaller code is there
    expected = seen;                                 // replace the larger code
  }
}

/// Adds the call whose checks are done to the device's report (one thread;
/// atomics: stores on several streams share the report).
__device__ void record_call(StoreDeviceState* state, int status) {
  atomicAdd(&state->checked_calls, 1ull);
  if (status == 0) return;
  atomicAdd(&state->failed_calls, 1ull);
  atomicAdd(&state->failures[status], 1ull);
  atomicCAS(&state->first_failure, 0, status);
}

constexpr int kDuplicateTile = 256;

/// Distinct slots: CTA i compares its tile of tokens with every token of
/// tiles 0..i (each pair once; negative slots are skipped tokens).
__global__ void __launch_bounds__(kDuplicateTile)
    check_distinct_slots_kernel(const std::int64_t* slot_mapping, std::int64_t num_tokens, int* status) {
  __shared__ std::int64_t tile_slots[kDuplicateTile];
  const std::int64_t token = static_cast<std::int64_t>(blockIdx.x) * kDuplicateTile + threadIdx.x;
  const std::int64_t slot = token < num_tokens ? slot_mapping[token] : -1;
  bool duplicate = false;
  for (std::int64_t first = 0; first <= static_cast<std::int64_t>(blockIdx.x) * kDuplicateTile; first += kDuplicateTile) {
    __syncthreads();
    const std::int64_t other = first + threadIdx.x;
    tile_slots[threadIdx.x] = other < num_tokens ? slot_mapping[other] : -1;
    __syncthreads();
    if (slot < 0) continue;
    const std::int64_t before = token - first;  // tokens of this tile before this one
    const int count = before < kDuplicateTile ? static_cast<int>(before) : kDuplicateTile;
    for (int j = 0; j < count; ++j) duplicate |= tile_slots[j] == slot;
  }
  if (duplicate) report_status(status, StoreStatus::duplicate_slot);
}

__device__ __forceinline__ bool half_bits_finite(std::uint16_t bits) { return (bits & 0x7c00u) != 0x7c00u; }

/// Packed byte `byte` of `count` codes of `bits` bits each (docs/FORMAT.md section
/// 4: code d occupies bits [bits*d, bits*d + bits), LSB first), the same bytes
/// pack_codes() writes.
__device__ __forceinline__ std::uint8_t packed_byte(const std::uint8_t* codes, int count, int bits, int byte) {
  unsigned value = 0;
  for (int d = 8 * byte / bits; d < count && d * bits < 8 * byte + 8; ++d) {
    const int shift = d * bits - 8 * byte;  // may be negative for a code that started in the previous byte
    value |= shift >= 0 ? static_cast<unsigned>(codes[d]) << shift : static_cast<unsigned>(codes[d]) >> -shift;
  }
  return static_cast<std::uint8_t>(value & 0xffu);
}

/// An element and its index, for reductions with an index tie rule.
struct Ranked {
  float value;
  int index;
};

__device__ __forceinline__ Ranked shuffle_xor(const Ranked& r, int offset) {
  return {__shfl_xor_sync(cuda::kFullMask, r.value, offset), __shfl_xor_sync(cuda::kFullMask, r.index, offset)};
}

/// Warp-wide value_range(): the first of equal minima, the last of equal
/// maxima. Every lane gets the result (the tie rule makes a total order, so
/// the butterfly is symmetric).
__device__ __forceinline__ ValueRange warp_value_range(Ranked lo, Ranked hi) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Ranked other_lo = shuffle_xor(lo, offset);
    const Ranked other_hi = shuffle_xor(hi, offset);
    if (other_lo.value < lo.value || (other_lo.value == lo.value && other_lo.index < lo.index)) lo = other_lo;
    if (other_hi.value > hi.value || (other_hi.value == hi.value && other_hi.index > hi.index)) hi = other_hi;
  }
  return {lo.value, hi.value};
}

/// One CTA encodes kVectors consecutive (token, kv head) vectors; each warp
/// owns kVectorsPerWarp of them and each lane the coordinates lane + 32 m.
template <Preset P, int D>
struct StoreShape {
  static constexpr PresetInfo kInfo = preset_info(P);
  static constexpr bool kMse = !kInfo.key_fp8;
  static constexpr int kKeyBits = kInfo.key_bits;
  static constexpr int kValueBits = kInfo.value_bits;
  static constexpr int kKeyBytes = packed_bytes(D, kKeyBits);
  static constexpr int kValueBytes = packed_bytes(D, kValueBits);
  static constexpr int kCentroids = kMse ? 1 << kKeyBits : 1;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kVectorsPerWarp = 4;
  static constexpr int kVectors = kWarps * kVectorsPerWarp;
  static constexpr int kPerLane = D / 32;  ///< coordinates per lane
  /// Columns of Pi staged in shared memory per step of the rotation.
  static constexpr int kPiColumns = 16;
};

/// Byte addresses of (slot, kv head)'s key data, value data and fp16
/// fields (indices as CacheLayout's), in either cache order.
struct EntryAddress {
  std::uint8_t* key;
  std::uint8_t* value;
  std::uint8_t* field[3];
};

__device__ __forceinline__ EntryAddress entry_address(const StoreKernelParams& p, std::int64_t slot_index, int head) {
  const CacheLayout& layout = p.layout;
  const std::int64_t block = slot_index / layout.block_size;
  const int slot = static_cast<int>(slot_index % layout.block_size);
  std::uint8_t* base = p.cache + block * layout.block_stride;
  EntryAddress address{base + layout.key_offset(slot, head), base + layout.value_offset(slot, head), {}};
  for (int f = 0; f < layout.fields(); ++f) address.field[f] = base + layout.field_offset(slot, head, f);
  return address;
}

/// Codebook index of rotated coordinate `rotated` of a key of norm `norm`:
/// the nearest centroid to rotated / norm (blocks order; 0 for a zero key),
/// or the midpoint bucket of rotated / norm (token_slots order; 0 / 0 is 0).
template <class S>
__device__ __forceinline__ std::uint8_t mse_key_code(bool token_slots, const float* centroids, const float* midpoints,
                                                     float rotated, float norm) {
  if (token_slots) {
    const float unit = norm == 0.0f ? 0.0f : div_rn(rotated, norm);
    return static_cast<std::uint8_t>(midpoint_bucket(midpoints, S::kCentroids - 1, unit));
  }
  return static_cast<std::uint8_t>(norm == 0.0f ? 0 : nearest_centroid_index(centroids, S::kCentroids, div_rn(rotated, norm)));
}

/// The value quantization of one vector by its cache order's rule:
/// docs/FORMAT.md section 3 (codes from the fp16 scale and zero, half to
/// even) or 4b (codes from the fp32 minimum and scale, half up).
struct ValueEncoder {
  bool token_slots;
  ValueQuantParams blocks;
  SlotValueQuant slots;

  __device__ static ValueEncoder make(bool token_slots, ValueRange range, int bits) {
    ValueEncoder encoder{token_slots, {}, {}};
    if (token_slots) encoder.slots = slot_value_quant(range.lo, range.hi, bits);
    else encoder.blocks = value_quant_params(range.lo, range.hi, bits);
    return encoder;
  }
  __device__ std::uint16_t scale_bits() const { return token_slots ? slots.scale_bits : blocks.scale_bits; }
  __device__ std::uint16_t zero_bits() const { return token_slots ? slots.zero_bits : blocks.zero_bits; }
  __device__ int code(float v, int bits) const {
    return token_slots ? slot_value_code(v, slots, bits) : value_code(v, blocks, bits);
  }
};

/// Writes fp16 `bits` little-endian, byte by byte: a blocks-order cache may
/// be padded to any block stride, so a field need not be 2-byte aligned.
__device__ __forceinline__ void write_half(std::uint8_t* address, std::uint16_t bits) {
  address[0] = static_cast<std::uint8_t>(bits & 0xffu);
  address[1] = static_cast<std::uint8_t>(bits >> 8);
}

/// The encoding of the CTA's vectors. Write = false: the dry run, which only
/// records failures in the status word. Write = true: writes the cache bytes,
/// unless the dry run recorded a failure.
template <Preset P, int D, bool Write>
__device__ __forceinline__ void store_encode_body(const StoreKernelParams& p) {
  using S = StoreShape<P, D>;
  if constexpr (Write) {
    if (blockIdx.x == 0 && threadIdx.x == 0) record_call(p.state, *p.status);
    // NOTE: the checks ran before in stream order; any failure means that
    // nothing may be written.
    if (*p.status != 0) return;
  }

  __shared__ __align__(16) float key_s[S::kVectors][D];
  __shared__ float pi_s[S::kPiColumns][D + 1];  // Pi[j][i0 + c] at [c][j]; +1 spreads the transposed writes
  __shared__ std::uint8_t codes_s[S::kVectors][D];
  __shared__ float centroid_s[S::kCentroids];
  __shared__ float centroid_square_s[S::kCentroids];
  __shared__ float midpoint_s[S::kCentroids];  // token_slots: the kCentroids - 1 midpoints

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_heads = p.layout.num_kv_heads;
  const std::int64_t num_vectors = p.num_tokens * num_heads;
  const std::int64_t first_vector = static_cast<std::int64_t>(blockIdx.x) * S::kVectors;
  const std::int64_t num_slots = p.num_blocks * p.layout.block_size;
  const bool token_slots = p.layout.token_slots();

  // Stage the keys of the CTA's vectors as fp32 (zeros for vectors past the
  // end or not stored: they are computed on but never written).
  for (int i = threadIdx.x; i < S::kVectors * D; i += S::kThreads) {
    const std::int64_t vector = first_vector + i / D;
    float k = 0.0f;
    if (vector < num_vectors && p.slot_mapping[vector / num_heads] >= 0) {
      k = load_as_float(p.key, p.kv_dtype, vector * D + i % D);
    }
    key_s[i / D][i % D] = k;
  }
  if constexpr (S::kMse) {
    if (threadIdx.x < S::kCentroids) {
      const float c = p.centroids[threadIdx.x];
      if constexpr (!Write) {
        if (!isfinite(c) || (threadIdx.x > 0 && !(c >= p.centroids[threadIdx.x - 1]))) {
          report_status(p.status, StoreStatus::invalid_centroids);
        }
      }
      centroid_s[threadIdx.x] = c;
      centroid_square_s[threadIdx.x] = mul_rn(c, c);
      if (threadIdx.x + 1 < S::kCentroids) {
        midpoint_s[threadIdx.x] = centroid_midpoint(c, p.centroids[threadIdx.x + 1]);
      }
    }
  }
  __syncthreads();

  // Rotation r[j] = sum_i Pi[j][i] k[i], i ascending, for the warp's vectors.
  float rotated[S::kVectorsPerWarp][S::kPerLane] = {};
  if constexpr (S::kMse) {
    bool pi_finite = true;
    for (int column0 = 0; column0 < D; column0 += S::kPiColumns) {
      for (int i = threadIdx.x; i < D * S::kPiColumns; i += S::kThreads) {
        const int j = i / S::kPiColumns;
        const int c = i % S::kPiColumns;
        const float element = p.Pi[j * D + column0 + c];  // 64 contiguous bytes per row j
        if constexpr (!Write) pi_finite &= isfinite(element);
        pi_s[c][j] = element;
      }
      __syncthreads();
#pragma unroll 4
      for (int c = 0; c < S::kPiColumns; ++c) {
#pragma unroll
        for (int v = 0; v < S::kVectorsPerWarp; ++v) {
          const float k = key_s[warp * S::kVectorsPerWarp + v][column0 + c];
#pragma unroll
          for (int m = 0; m < S::kPerLane; ++m) {
            rotated[v][m] = add_rn(rotated[v][m], mul_rn(pi_s[c][lane + 32 * m], k));
          }
        }
      }
      __syncthreads();
    }
    if (!Write && !pi_finite) report_status(p.status, StoreStatus::non_finite_rotation);
  }

  // Key norms: lane v < kVectorsPerWarp runs the sequential sum of vector v.
  const int chain_vector = warp * S::kVectorsPerWarp + (lane < S::kVectorsPerWarp ? lane : 0);
  float key_norm = 0.0f;
  if constexpr (S::kMse) {
    if (lane < S::kVectorsPerWarp) {
      key_norm = sqrt_rn(dot_sequential(key_s[chain_vector], key_s[chain_vector], D));
    }
  }

  // Key codes of the warp's vectors into codes_s (fp8 keys: the fp8 bytes).
#pragma unroll
  for (int v = 0; v < S::kVectorsPerWarp; ++v) {
    const int local = warp * S::kVectorsPerWarp + v;
    if constexpr (S::kMse) {
      const float n = __shfl_sync(cuda::kFullMask, key_norm, v);
#pragma unroll
      for (int m = 0; m < S::kPerLane; ++m) {
        codes_s[local][lane + 32 * m] = mse_key_code<S>(token_slots, centroid_s, midpoint_s, rotated[v][m], n);
      }
    } else {
#pragma unroll
      for (int m = 0; m < S::kPerLane; ++m) {
        codes_s[local][lane + 32 * m] = float_to_fp8_e4m3_bits(key_s[local][lane + 32 * m]);
      }
    }
  }
  __syncwarp();

  // Stored key norms: the raw norm (token_slots), else folded with the norm
  // of each centroid vector, d ascending.
  std::uint16_t norm_bits = 0;
  if constexpr (S::kMse) {
    if (lane < S::kVectorsPerWarp) {
      if (token_slots) {
        norm_bits = float_to_half_bits(key_norm);
      } else {
        float sum = 0.0f;
        for (int d = 0; d < D; ++d) sum = add_rn(sum, centroid_square_s[codes_s[chain_vector][d]]);
        norm_bits = stored_key_norm_bits(key_norm, sqrt_rn(sum), S::kInfo.norm_correction);
      }
    }
  }

  for (int v = 0; v < S::kVectorsPerWarp; ++v) {
    const int local = warp * S::kVectorsPerWarp + v;
    const std::int64_t vector = first_vector + local;
    const std::uint16_t key_norm_bits = static_cast<std::uint16_t>(__shfl_sync(cuda::kFullMask, norm_bits, v));
    if (vector >= num_vectors) break;  // uniform across the warp
    const std::int64_t slot = p.slot_mapping[vector / num_heads];
    if (slot < 0) continue;  // skipped: neither checked nor written

    float values[S::kPerLane];
#pragma unroll
    for (int m = 0; m < S::kPerLane; ++m) values[m] = load_as_float(p.value, p.kv_dtype, vector * D + lane + 32 * m);

    if constexpr (!Write) {
      bool key_finite = true;
      bool value_finite = true;
#pragma unroll
      for (int m = 0; m < S::kPerLane; ++m) {
        key_finite &= isfinite(key_s[local][lane + 32 * m]);
        value_finite &= isfinite(values[m]);
      }
      key_finite = __all_sync(cuda::kFullMask, key_finite) && half_bits_finite(key_norm_bits);
      value_finite = __all_sync(cuda::kFullMask, value_finite);
      if (lane == 0) {
        if (slot >= num_slots) report_status(p.status, StoreStatus::slot_out_of_range);
        if (!key_finite) report_status(p.status, StoreStatus::non_finite_key);
        if (!value_finite) report_status(p.status, StoreStatus::non_finite_value);
      }
      if (!value_finite) continue;  // the value parameters below need finite values
    }

    // Value range with the CPU's tie rule, then the codes.
    Ranked lo{values[0], lane};
    Ranked hi{values[0], lane};
#pragma unroll
    for (int m = 1; m < S::kPerLane; ++m) {  // this lane's indices ascend with m
      if (values[m] < lo.value) lo = {values[m], lane + 32 * m};
      if (!(values[m] < hi.value)) hi = {values[m], lane + 32 * m};
    }
    const ValueRange range = warp_value_range(lo, hi);
    const ValueEncoder encoder = ValueEncoder::make(token_slots, range, S::kValueBits);

    if constexpr (!Write) {
      // fp16 overflow of the scale or zero (|values| or range past 65504).
      if (lane == 0 && !(half_bits_finite(encoder.scale_bits()) && half_bits_finite(encoder.zero_bits()))) {
        report_status(p.status, StoreStatus::non_finite_value);
      }
    } else {
      const EntryAddress address = entry_address(p, slot, static_cast<int>(vector % num_heads));
      for (int byte = lane; byte < S::kKeyBytes; byte += 32) {
        address.key[byte] = S::kMse ? packed_byte(codes_s[local], D, S::kKeyBits, byte) : codes_s[local][byte];
      }
      __syncwarp();  // codes_s[local] is reused for the value codes
#pragma unroll
      for (int m = 0; m < S::kPerLane; ++m) {
        codes_s[local][lane + 32 * m] = static_cast<std::uint8_t>(encoder.code(values[m], S::kValueBits));
      }
      __syncwarp();
      for (int byte = lane; byte < S::kValueBytes; byte += 32) {
        address.value[byte] = packed_byte(codes_s[local], D, S::kValueBits, byte);
      }
      if (lane == 0) {
        int field = 0;
        if constexpr (S::kMse) write_half(address.field[field++], key_norm_bits);
        write_half(address.field[field++], encoder.scale_bits());
        write_half(address.field[field], encoder.zero_bits());
      }
    }
  }
}

template <Preset P, int D, bool Write>
__global__ void __launch_bounds__(StoreShape<P, D>::kThreads)
    store_encode_kernel(const __grid_constant__ StoreKernelParams params) {
  store_encode_body<P, D, Write>(params);
}

template <Preset P, int D>
void launch_encode(const StoreKernelParams& params, cudaStream_t stream) {
  using S = StoreShape<P, D>;
  const std::int64_t vectors = params.num_tokens * params.layout.num_kv_heads;
  const std::int64_t blocks = (vectors + S::kVectors - 1) / S::kVectors;
  TQ_REQUIRE(blocks <= 0x7fffffff, "num_tokens",
             std::to_string(params.num_tokens) + " tokens of " + std::to_string(params.layout.num_kv_heads) +
                 " kv heads need more than 2^31 - 1 CTAs; accepted: at most " +
                 std::to_string(std::int64_t{0x7fffffff} * S::kVectors / params.layout.num_kv_heads) +
                 " tokens per call");
  const std::int64_t token_tiles = (params.num_tokens + kDuplicateTile - 1) / kDuplicateTile;
  check_distinct_slots_kernel<<<static_cast<unsigned>(token_tiles), kDuplicateTile, 0, stream>>>(
      params.slot_mapping, params.num_tokens, params.status);
  TQ_CUDA_CHECK_LAUNCH();
  store_encode_kernel<P, D, false><<<static_cast<unsigned>(blocks), S::kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
  store_encode_kernel<P, D, true><<<static_cast<unsigned>(blocks), S::kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

template <Preset P>
void launch_encode_head_dim(const StoreKernelParams& params, cudaStream_t stream) {
  switch (params.layout.head_dim) {
    case 64: return launch_encode<P, 64>(params, stream);
    case 128: return launch_encode<P, 128>(params, stream);
    case 256: return launch_encode<P, 256>(params, stream);
    default: break;
  }
  fail("head_dim", std::to_string(params.layout.head_dim) + " is not supported; accepted: " + accepted_list(kHeadDims));
}

void launch_encode_any(const StoreKernelParams& params, cudaStream_t stream) {
  switch (params.layout.preset) {
    case Preset::turboquant_4bit_nc: return launch_encode_head_dim<Preset::turboquant_4bit_nc>(params, stream);
    case Preset::turboquant_k3v4_nc: return launch_encode_head_dim<Preset::turboquant_k3v4_nc>(params, stream);
    case Preset::turboquant_3bit_nc: return launch_encode_head_dim<Preset::turboquant_3bit_nc>(params, stream);
    case Preset::turboquant_k8v4: return launch_encode_head_dim<Preset::turboquant_k8v4>(params, stream);
  }
  fail("preset", "unknown preset value");
}

/// The store record of the current device: allocated and zeroed by the
/// first store on it, kept for the life of the process.
StoreDeviceState* device_state(CUstream_st* stream) {
  constexpr int kMaxDevices = 64;
  static std::mutex mutex;
  static std::array<StoreDeviceState*, kMaxDevices> states{};
  int device = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&device));
  TQ_REQUIRE(device < kMaxDevices, "device", std::to_string(device) + " is past the " + std::to_string(kMaxDevices) +
                                                 " devices the store supports");
  const std::lock_guard<std::mutex> lock(mutex);
  if (states[device] == nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    TQ_REQUIRE(capture == cudaStreamCaptureStatusNone, "stream",
               "is capturing a CUDA graph, and the first store on device " + std::to_string(device) +
                   " allocates its check record; run one store on the device before capture (warm-up)");
    StoreDeviceState* state = nullptr;
    TQ_CUDA_CHECK(cudaMalloc(&state, sizeof(StoreDeviceState)));
    TQ_CUDA_CHECK(cudaMemset(state, 0, sizeof(StoreDeviceState)));
    TQ_CUDA_CHECK(cudaDeviceSynchronize());  // the memset ran on the legacy stream, which other streams do not wait for
    states[device] = state;
  }
  return states[device];
}

bool capturing(CUstream_st* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture != cudaStreamCaptureStatusNone;
}

/// The Error of a failed store's status.
[[noreturn]] void fail_with_status(StoreStatus status, const StoreArgs& args) {
  switch (status) {
    case StoreStatus::slot_out_of_range:
      fail("slot_mapping",
           "an entry is out of range; accepted: negative (skip) or 0 to num_blocks * block_size - 1 = " +
               std::to_string(args.num_blocks * args.layout.block_size - 1) + "; nothing was written");
    case StoreStatus::duplicate_slot:
      fail("slot_mapping", "two tokens map to the same slot; accepted: each slot at most once per call; nothing was written");
    case StoreStatus::non_finite_key:
      fail("key",
           "a stored token holds a NaN or infinite element, or a norm whose fp16 key norm overflows; "
           "accepted: finite values with stored norm <= 65504; nothing was written");
    case StoreStatus::non_finite_value:
      fail("value",
           "a stored token holds a NaN or infinite element, or a range whose fp16 scale or zero "
           "overflows; accepted: finite values within fp16 range (65504); nothing was written");
    case StoreStatus::invalid_centroids:
      fail("centroids",
           "a level is NaN or infinite, or the levels are not sorted ascending; accepted: finite levels "
           "sorted ascending; nothing was written");
    case StoreStatus::non_finite_rotation:
      fail("Pi", "an element is NaN or infinite; accepted: finite values; nothing was written");
    case StoreStatus::ok: break;
  }
  fail("status", "unexpected store status " + std::to_string(static_cast<int>(status)));
}

}  // namespace

void store_cuda(const StoreArgs& args, CUstream_st* stream, StoreChecking checking, int* call_status) {
  validate_store_shapes(args);
  if (args.num_tokens == 0) return;
  TQ_REQUIRE(checking == StoreChecking::record || !capturing(stream), "check",
             "raising on a failed check synchronises the stream, which is capturing a CUDA graph; use the "
             "recording mode there and read store_check_report() after replays");
  StoreDeviceState* state = device_state(stream);
  int* status = call_status != nullptr ? call_status : &state->call_status;
  TQ_CUDA_CHECK(cudaMemsetAsync(status, 0, sizeof(int), stream));

  const StoreKernelParams params{args.layout, args.num_blocks, args.cache,      args.key,
                                 args.value,  args.kv_dtype,   args.num_tokens, args.slot_mapping,
                                 args.Pi,     args.centroids,  status,          state};
  launch_encode_any(params, stream);
  if (checking == StoreChecking::record) return;

  int result = 0;
  TQ_CUDA_CHECK(cudaMemcpyAsync(&result, status, sizeof(int), cudaMemcpyDeviceToHost, stream));
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (result != 0) fail_with_status(static_cast<StoreStatus>(result), args);
}

StoreCheckReport store_check_report(CUstream_st* stream) {
  TQ_REQUIRE(!capturing(stream), "stream", "is capturing a CUDA graph; read the store check report outside capture");
  StoreDeviceState* state = device_state(stream);
  StoreDeviceState copy{};
  TQ_CUDA_CHECK(cudaMemcpyAsync(&copy, state, sizeof copy, cudaMemcpyDeviceToHost, stream));
  // The report only: the device's own status word may belong to a call in flight on another stream.
  TQ_CUDA_CHECK(cudaMemsetAsync(&state->first_failure, 0, sizeof copy - offsetof(StoreDeviceState, first_failure), stream));
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  StoreCheckReport report;
  report.checked_calls = static_cast<std::int64_t>(copy.checked_calls);
  report.failed_calls = static_cast<std::int64_t>(copy.failed_calls);
  for (int i = 0; i < kStoreStatuses; ++i) report.failures[i] = static_cast<std::int64_t>(copy.failures[i]);
  report.first_failure = static_cast<StoreStatus>(copy.first_failure);
  return report;
}

}  // namespace tqdecode
