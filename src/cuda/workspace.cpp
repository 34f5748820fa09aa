#include "workspace.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "../workspace_defaults.hpp"
#include "cuda_check.hpp"
#include "policy.hpp"
#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr std::int64_t kAlignment = 256;

std::int64_t aligned(std::int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

/// A pool for `bucket` rows and at least `partition_rows` partition rows
/// whose check report starts as `check_state`.
PooledBuffers allocate_buffers(const PoolSignature& signature, int bucket, std::int64_t partition_rows, int sm_count,
                               const cuda::DeviceCheckState& check_state) {
  const auto [device, num_kv_heads, num_q_heads, head_dim, dtype] = signature;
  PooledBuffers buffers;
  buffers.bucket_batch = bucket;
  buffers.partition_rows = static_cast<int>(
      std::max<std::int64_t>(cuda::max_partition_rows(bucket, num_kv_heads, sm_count), partition_rows));
  const std::int64_t rows = std::int64_t(bucket) * num_q_heads;
  const std::int64_t part_rows = std::int64_t(buffers.partition_rows) * num_q_heads;
  const std::int64_t q_rot_bytes = aligned(rows * head_dim * 4);
  const std::int64_t output_bytes = aligned(rows * head_dim * dtype_size(static_cast<DType>(dtype)));
  const std::int64_t stat_bytes = aligned(part_rows * 4);
  const std::int64_t part_out_bytes = aligned(part_rows * head_dim * 4);
  // The fused kernel's counters per (sequence, kv head, row tile): at most
  // two row tiles per query slot (a tile holds at least half a group).
  const std::int64_t arrival_bytes = aligned(2 * std::int64_t(bucket) * num_kv_heads * 4);
  const std::int64_t check_state_bytes = aligned(sizeof(cuda::DeviceCheckState));
  const std::int64_t checked_seq_len_bytes = aligned(std::int64_t(bucket) * 4);
  buffers.bytes = q_rot_bytes + output_bytes + 2 * stat_bytes + part_out_bytes + arrival_bytes + check_state_bytes +
                  checked_seq_len_bytes;
  TQ_CUDA_CHECK(cudaMalloc(&buffers.allocation, buffers.bytes));
  auto* base = static_cast<std::uint8_t*>(buffers.allocation);
  std::int64_t offset = 0;
  const auto carve = [&](std::int64_t bytes) {
    std::uint8_t* start = base + offset;
    offset += bytes;
    return start;
  };
  buffers.q_rot = reinterpret_cast<float*>(carve(q_rot_bytes));
  buffers.output = carve(output_bytes);
  buffers.part_max = reinterpret_cast<float*>(carve(stat_bytes));
  buffers.part_sum = reinterpret_cast<float*>(carve(stat_bytes));
  buffers.part_out = reinterpret_cast<float*>(carve(part_out_bytes));
  buffers.arrivals = reinterpret_cast<unsigned*>(carve(arrival_bytes));
  buffers.check_state = reinterpret_cast<cuda::DeviceCheckState*>(carve(check_state_bytes));
  buffers.checked_seq_lens = reinterpret_cast<std::int32_t*>(carve(checked_seq_len_bytes));
  // Set once here; afterwards the fused kernel leaves every arrival counter
  // at zero and only device_check_report() clears the report. Both copies run
  // on the legacy stream, which non-blocking streams do not wait for: wait
  // for them here, once per allocation.
  TQ_CUDA_CHECK(cudaMemset(buffers.arrivals, 0, arrival_bytes));
  TQ_CUDA_CHECK(cudaMemcpy(buffers.check_state, &check_state, sizeof check_state, cudaMemcpyHostToDevice));
  TQ_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return buffers;
}

/// "Hk=8 Hq=64 D=128 dtype=bfloat16 device=0"
std::string signature_text(const PoolSignature& signature) {
  const auto [device, num_kv_heads, num_q_heads, head_dim, dtype] = signature;
  return "Hk=" + std::to_string(num_kv_heads) + " Hq=" + std::to_string(num_q_heads) + " D=" + std::to_string(head_dim) +
         " dtype=" + dtype_name(static_cast<DType>(dtype)) + " device=" + std::to_string(device);
}

/// Adds one pool's check record to `report`: counts add up, the lowest failures win.
void add_check_state(DeviceCheckReport& report, const cuda::DeviceCheckState& state) {
  report.checked_calls += static_cast<std::int64_t>(state.checked_calls);
  report.failed_sequences += static_cast<std::int64_t>(state.failed_sequences);
  report.bad_seq_lens += static_cast<std::int64_t>(state.bad_seq_lens);
  report.bad_block_entries += static_cast<std::int64_t>(state.bad_block_entries);
  DeviceCheckReport::BadSeqLen& length = report.first_bad_seq_len;
  if (state.has_bad_seq_len && (length.sequence < 0 || state.bad_seq_len_sequence < length.sequence)) {
    length = {state.bad_seq_len_sequence, state.bad_seq_len_value};
  }
  DeviceCheckReport::BadBlockEntry& entry = report.first_bad_block_entry;
  if (state.has_bad_block_entry &&
      (entry.sequence < 0 || std::pair(state.bad_block_entry_sequence, state.bad_block_entry_column) <
                                 std::pair(entry.sequence, entry.column))) {
    entry = {state.bad_block_entry_sequence, state.bad_block_entry_column, state.bad_block_entry_value};
  }
}

/// The bucket a pool grows to for `batch` rows: the next power of two, so a
/// run of growing batches regrows O(log) times, within kMaxBatchLimit.
int grown_bucket(int batch) {
  int bucket = 1;
  while (bucket < batch && bucket < kMaxBatchLimit) bucket *= 2;
  return std::max(bucket, batch);
}

}  // namespace

PooledBuffers DecodeWorkspace::Impl::acquire(const PoolSignature& signature, const PoolDemand& demand, int sm_count,
                                             CUstream_st* stream) {
  std::lock_guard<std::mutex> lock(mutex);
  auto found = pools.find(signature);
  const auto holds = [&](const PooledBuffers& buffers) {
    return demand.query_rows <= buffers.bucket_batch && demand.partition_rows <= buffers.partition_rows;
  };
  if (found != pools.end() && holds(found->second)) return found->second;
  const int batch = demand.query_rows;
  // Allocating synchronises the device, which a stream capturing a CUDA graph
  // must not do: say what to change instead of failing inside CUDA.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    fail("max_batch",
         found == pools.end()
             ? "the first decode of this shape signature allocates its buffer pool, which cannot happen while the "
               "stream captures a CUDA graph; run one decode of this shape before capture (warm-up)"
             : "batch " + std::to_string(batch) + " (query rows: B, or B * max_query_len) with " +
                   std::to_string(demand.partition_rows) + " partition rows exceeds the pool of " +
                   std::to_string(found->second.bucket_batch) + " rows and " +
                   std::to_string(found->second.partition_rows) +
                   " partition rows, and the pool cannot grow while the stream captures a CUDA graph; set "
                   "max_batch (DecodeWorkspace(max_batch), Python tqdecode.set_max_batch, or TQDECODE_MAX_BATCH) "
                   "to at least the largest batch you capture, or run one call of the captured shapes, before "
                   "capturing");
  }
  int bucket = std::max(max_batch, batch);
  std::int64_t partition_rows = demand.partition_rows;
  cuda::DeviceCheckState carried{};  // the check report survives a growth
  if (found != pools.end()) {
    bucket = std::max(found->second.bucket_batch, grown_bucket(batch));
    partition_rows = std::max<std::int64_t>(partition_rows, found->second.partition_rows);
    // Checks still counting into the old record (on any stream) finish first.
    TQ_CUDA_CHECK(cudaDeviceSynchronize());
    TQ_CUDA_CHECK(cudaMemcpy(&carried, found->second.check_state, sizeof carried, cudaMemcpyDeviceToHost));
    retired.push_back(found->second.allocation);
    retired_bytes += found->second.bytes;
    const int old_bucket = found->second.bucket_batch;
    pools.erase(found);
    const PooledBuffers& grown =
        pools.emplace(signature, allocate_buffers(signature, bucket, partition_rows, sm_count, carried)).first->second;
    std::fprintf(stderr,
                 "tqdecode: warning: batch %d (query rows) exceeds the pool bucket of %d rows of %s, or its "
                 "partition rows; the pool grew to %d rows and %d partition rows (%lld bytes; %lld bytes in %zu "
                 "pools of this workspace and the buffers growths replaced, which CUDA graphs captured earlier keep "
                 "using and which are freed with the workspace; raise max_batch or TQDECODE_MAX_BATCH)\n",
                 batch, old_bucket, signature_text(signature).c_str(), bucket, grown.partition_rows,
                 static_cast<long long>(grown.bytes), static_cast<long long>(total_bytes()), pools.size());
    return grown;
  }
  return pools.emplace(signature, allocate_buffers(signature, bucket, partition_rows, sm_count, carried))
      .first->second;
}

std::int64_t DecodeWorkspace::Impl::total_bytes() const {
  std::int64_t total = retired_bytes;
  for (const auto& [signature, buffers] : pools) total += buffers.bytes;
  return total;
}

DecodeWorkspace::Impl::~Impl() {
  for (auto& [signature, buffers] : pools) cudaFree(buffers.allocation);
  for (void* allocation : retired) cudaFree(allocation);
}

DecodeWorkspace::DecodeWorkspace(int max_batch)
    : impl_(std::make_unique<Impl>()) {
  impl_->max_batch = resolve_max_batch(max_batch);
  impl_->device_checks = switch_from_environment("TQDECODE_DEVICE_CHECKS", false);
  impl_->programmatic_launch = switch_from_environment("TQDECODE_PROGRAMMATIC_LAUNCH", true);
}

DecodeWorkspace::~DecodeWorkspace() = default;

int DecodeWorkspace::max_batch() const { return impl_->max_batch; }

void DecodeWorkspace::set_device_checks(bool enabled) { impl_->device_checks = enabled; }

bool DecodeWorkspace::device_checks() const { return impl_->device_checks; }

void DecodeWorkspace::set_programmatic_launch(bool enabled) { impl_->programmatic_launch = enabled; }

bool DecodeWorkspace::programmatic_launch() const { return impl_->programmatic_launch; }

DeviceCheckReport DecodeWorkspace::device_check_report(CUstream_st* stream) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  DeviceCheckReport report;
  if (impl_->pools.empty()) return report;  // no decode ran on a device: no CUDA call needed
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  TQ_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  TQ_REQUIRE(capture == cudaStreamCaptureStatusNone, "stream",
             "is capturing a CUDA graph; read the device check report outside capture");
  int device = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&device));
  // Read, then clear, in the order of `stream`: checks enqueued on it before
  // this call are counted, and decodes enqueued after it see the cleared record.
  std::vector<cuda::DeviceCheckState> states;
  for (const auto& [signature, buffers] : impl_->pools) {
    if (std::get<0>(signature) != device) continue;
    cuda::DeviceCheckState& state = states.emplace_back();
    TQ_CUDA_CHECK(cudaMemcpyAsync(&state, buffers.check_state, sizeof state, cudaMemcpyDeviceToHost, stream));
    TQ_CUDA_CHECK(cudaMemsetAsync(buffers.check_state, 0, sizeof state, stream));
  }
  TQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (const cuda::DeviceCheckState& state : states) add_check_state(report, state);
  return report;
}

DecodeWorkspace::Stats DecodeWorkspace::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Stats stats;
  for (const auto& [signature, buffers] : impl_->pools) {
    stats.entries.push_back({signature_text(signature), buffers.bucket_batch, buffers.partition_rows, buffers.bytes});
  }
  stats.total_bytes = impl_->total_bytes();
  return stats;
}

}  // namespace tqdecode
