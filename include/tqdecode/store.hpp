// The store path: encode new K/V tokens into a paged cache (docs/FORMAT.md
// section 3; a token_slots layout stores as section 4b says: the raw key
// norm, codebook indices bucketed by the centroid midpoints, value codes
// from the fp32 minimum and scale rounded half up).
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

/// Outcome of a GPU store's device-side checks; a store whose tokens fail
/// several checks reports the smallest code.
enum class StoreStatus : int {
  ok = 0,
  slot_out_of_range = 1,    ///< a slot past the cache
  duplicate_slot = 2,       ///< two tokens of the call map to one slot
  non_finite_key = 3,       ///< a NaN or infinite key element, or an fp16 key norm that overflows
  non_finite_value = 4,     ///< a NaN or infinite value element, or an fp16 value scale / zero that overflows
  invalid_centroids = 5,    ///< MSE keys: a NaN or infinite codebook level, or levels not sorted ascending
  non_finite_rotation = 6,  ///< MSE keys: a NaN or infinite element of Pi
};

/// The number of StoreStatus codes, ok included (the last code + 1).
inline constexpr int kStoreStatuses = static_cast<int>(StoreStatus::non_finite_rotation) + 1;

/// How store_cuda reports a failed device-side check. Nothing is written
/// either way.
enum class StoreChecking : std::uint8_t {
  /// No host synchronisation, safe inside CUDA graphs: the failure is counted
  /// in the device's store report (store_check_report). The default: an
  /// engine stores every layer of every step.
  record,
  /// Synchronises `stream` and throws Error naming the argument; refused
  /// while the stream captures a CUDA graph.
  raise,
};

/// What the device-side checks of the GPU stores on one device found since
/// the report was last read (graph replays included).
struct StoreCheckReport {
  std::int64_t checked_calls = 0;  ///< stores whose checks ran (num_tokens > 0)
  std::int64_t failed_calls = 0;   ///< of those, stores that wrote nothing
  /// failed_calls by their StoreStatus (index 0 unused).
  std::int64_t failures[kStoreStatuses] = {};
  /// The status of the first failed store in stream order, ok when none failed.
  StoreStatus first_failure = StoreStatus::ok;
};

/// Encodes on the GPU (CUDA builds only), producing the same bytes as
/// store_cpu. Shapes are checked on the host (Error, nothing launched).
/// Slot range, distinct slots, finiteness and (MSE keys) the model
/// constants, as store_cpu checks them, are checked on the device
/// before any byte is written; when a check fails nothing is written and
/// `checking` says how the failure is reported. The first store on a device
/// allocates its report and must not run while `stream` captures a CUDA
/// graph (Error naming `stream`). Distinct slots are checked by comparing
/// every pair of tokens (work quadratic in num_tokens, spread over the GPU).
/// `call_status` (an int in device memory, optional) receives the call's
/// StoreStatus; without one the device's own word is used, so stores on
/// several streams of one device at once must each pass their own.
void store_cuda(const StoreArgs& args, CUstream_st* stream, StoreChecking checking = StoreChecking::record,
                int* call_status = nullptr);

/// Reads and clears the store report of the current device, in the order of
/// `stream` (stores enqueued on it before the call are counted); waits for
/// `stream`. Throws Error while `stream` captures a CUDA graph. Empty when no
/// store ran on the device.
StoreCheckReport store_check_report(CUstream_st* stream = nullptr);

}  // namespace tqdecode
