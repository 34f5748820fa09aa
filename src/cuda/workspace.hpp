// The buffer pool behind DecodeWorkspace (internal).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "kernel_params.hpp"
#include "tqdecode/decode.hpp"

namespace tqdecode {

/// Pooled device buffers of one shape signature. A call with batch B uses
/// the first B rows (q_rot, output) or the first B * N partition rows; a
/// varlen call (several query tokens per sequence) the first T query rows
/// and B * max_query_len * N partition rows.
struct PooledBuffers {
  float* q_rot = nullptr;     ///< [bucket, Hq, D] fp32
  void* output = nullptr;     ///< [bucket, Hq, D] in the query dtype
  float* part_max = nullptr;  ///< [partition_rows, Hq]
  float* part_sum = nullptr;  ///< [partition_rows, Hq]
  float* part_out = nullptr;  ///< [partition_rows, Hq, D]
  unsigned* arrivals = nullptr;  ///< [2 bucket, Hk] partition counters of the fused kernel, zero between launches
  cuda::DeviceCheckState* check_state = nullptr;  ///< device-side check report of the calls using this pool
  std::int32_t* checked_seq_lens = nullptr;       ///< [bucket] lengths after the device-side checks
  int bucket_batch = 0;
  int partition_rows = 0;
  std::int64_t bytes = 0;
  void* allocation = nullptr;
};

/// (device, Hk, Hq, D, query dtype)
using PoolSignature = std::tuple<int, int, int, int, int>;

/// What one call needs of a pool: query rows (B, or B * max_query_len query
/// slots for a varlen call) and partition rows (rows of Hq partition
/// entries: B * N, or B * max_query_len * N).
struct PoolDemand {
  int query_rows;
  std::int64_t partition_rows;
};

struct DecodeWorkspace::Impl {
  int max_batch;
  std::atomic<bool> device_checks{false};
  std::atomic<bool> programmatic_launch{true};
  mutable std::mutex mutex;
  std::map<PoolSignature, PooledBuffers> pools;
  /// Allocations a growth replaced: a call of another thread that acquired
  /// them before, or a graph captured on them, may still use them, so they
  /// are freed with the workspace, not at the growth.
  std::vector<void*> retired;
  std::int64_t retired_bytes = 0;

  /// Buffers for a call needing `demand` on `stream` (a copy: the map may
  /// change once the mutex is released); allocates on the first call of a
  /// signature and grows (with a warning) when the demand exceeds the pool:
  /// the bucket to the next power of two of the query rows, the partition
  /// rows to at least what the call needs. Throws Error naming max_batch
  /// when either would happen while `stream` captures a CUDA graph.
  PooledBuffers acquire(const PoolSignature& signature, const PoolDemand& demand, int sm_count, CUstream_st* stream);
  /// Bytes held by every pool and the allocations growths replaced; the caller holds `mutex`.
  std::int64_t total_bytes() const;
  ~Impl();
};

}  // namespace tqdecode
