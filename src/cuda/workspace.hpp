// The buffer pool behind DecodeWorkspace (internal).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "kernel_params.hpp"
#include "tqdecode/decode.hpp"

namespace tqdecode {

/// Pooled device buffers of one shape signature. A call with batch B uses
/// the first B rows (q_rot, output) or the first B * N partition rows.
struct PooledBuffers {
  float* q_rot = nullptr;     ///< [bucket, Hq, D] fp32
  void* output = nullptr;     ///< [bucket, Hq, D] in the query dtype
  float* part_max = nullptr;  ///< [partition_rows, Hq]
  float* part_sum = nullptr;  ///< [partition_rows, Hq]
  float* part_out = nullptr;  ///< [partition_rows, Hq, D]
  unsigned* arrivals = nullptr;  ///< [bucket, Hk] partition counters of the fused kernel, zero between launches
  cuda::DeviceCheckState* check_state = nullptr;  ///< device-side check report of the calls using this pool
  std::int32_t* checked_seq_lens = nullptr;       ///< [bucket] lengths after the device-side checks
  int bucket_batch = 0;
  int partition_rows = 0;
  std::int64_t bytes = 0;
  void* allocation = nullptr;
};

/// (device, Hk, Hq, D, query dtype)
using PoolSignature = std::tuple<int, int, int, int, int>;

struct DecodeWorkspace::Impl {
  int max_batch;
  std::atomic<bool> device_checks{false};
  std::atomic<bool> programmatic_launch{true};
  mutable std::mutex mutex;
  std::map<PoolSignature, PooledBuffers> pools;

  /// Buffers for a call of `batch` rows on `stream`; allocates on the first
  /// call of a signature and grows (with a warning) to the next power of two
  /// when batch exceeds the bucket. Throws Error naming max_batch when either
  /// would happen while `stream` captures a CUDA graph.
  const PooledBuffers& acquire(const PoolSignature& signature, int batch, int sm_count, CUstream_st* stream);
  /// Bytes held by every pool; the caller holds `mutex`.
  std::int64_t total_bytes() const;
  ~Impl();
};

}  // namespace tqdecode
