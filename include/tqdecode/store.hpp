// The store path: encode new K/V tokens into a paged cache (FORMAT.md
// section 3; a token_slots layout stores as FORMAT.md section 4b says: the
// raw key norm, codebook indices bucketed by the centroid midpoints, value
// codes from the fp32 minimum and scale rounded half up).
#pragma once

#include <cstdint>

#include "tqdecode/common.hpp"
#include "tqdecode/format.hpp"

struct CUstream_st;

namespace tqdecode {

/// Arguments of a store. Pointers are host memory for store_cpu and device
/// memory for store_cuda.
struct StoreArgs {
  CacheLayout layout;  ///< either order; it chooses the encoding rules too
  std::int64_t num_blocks = 0;  ///< blocks in `cache`
  std::uint8_t* cache = nullptr;  ///< num_blocks * layout.block_stride bytes
  const void* key = nullptr;      ///< [num_tokens, Hk, D], contiguous
  const void* value = nullptr;    ///< [num_tokens, Hk, D], contiguous
  DType kv_dtype = DType::bf16;
  std::int64_t num_tokens = 0;
  const std::int64_t* slot_mapping = nullptr;  ///< [num_tokens]: block * block_size + slot; < 0 skips
  const float* Pi = nullptr;         ///< [D, D] rotation (MSE presets)
  const float* centroids = nullptr;  ///< [2^key_bits] sorted levels (MSE presets)
  int num_centroids = 0;
};

/// Checks everything that can be checked without reading device memory:
/// layout, counts, null pointers, codebook size. Throws Error.
void validate_store_shapes(const StoreArgs& args);

/// Encodes on the CPU. Validates every input first (including finiteness of
/// K and V and every slot against the cache size) and writes nothing when any
/// check fails. Uses all cores.
void store_cpu(const StoreArgs& args);

/// Outcome of a GPU store, written to the optional device status word.
enum class StoreStatus : int { ok = 0, slot_out_of_range = 1, non_finite_key = 2, non_finite_value = 3 };

/// Encodes on the GPU (CUDA builds only), producing the same bytes as
/// store_cpu. Shapes are checked on the host (Error, nothing launched). Slot
/// range and finiteness are checked on the device before any byte is
/// written: when a check fails nothing is written and `device_status` (an
/// int in device memory, optional) receives the StoreStatus. With
/// `throw_on_error` the call then synchronises the stream and throws Error
/// naming the argument; pass false inside CUDA-graph capture.
void store_cuda(const StoreArgs& args, CUstream_st* stream, int* device_status = nullptr,
                bool throw_on_error = true);

}  // namespace tqdecode
