#include "workspace.hpp"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cuda_check.hpp"
#include "policy.hpp"
#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr int kDefaultMaxBatch = 512;
constexpr std::int64_t kAlignment = 256;

int max_batch_from_environment() {
  const char* text = std::getenv("TQDECODE_MAX_BATCH");
  if (text == nullptr || *text == '\0') return kDefaultMaxBatch;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TQ_REQUIRE(*end == '\0' && value >= 1 && value <= (1 << 20), "TQDECODE_MAX_BATCH",
          "'" + std::string(text) + "' is not an integer in 1..1048576");
  return static_cast<int>(value);
}

std::int64_t aligned(std::int64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

PooledBuffers allocate_buffers(const PoolSignature& signature, int bucket, int sm_count) {
  const auto [device, num_kv_heads, num_q_heads, head_dim, dtype] = signature;
  PooledBuffers buffers;
  buffers.bucket_batch = bucket;
  buffers.partition_rows = cuda::max_partition_rows(bucket, num_kv_heads, sm_count);
  const std::int64_t rows = std::int64_t(bucket) * num_q_heads;
  const std::int64_t part_rows = std::int64_t(buffers.partition_rows) * num_q_heads;
  const std::int64_t q_rot_bytes = aligned(rows * head_dim * 4);
  const std::int64_t output_bytes = aligned(rows * head_dim * dtype_size(static_cast<DType>(dtype)));
  const std::int64_t stat_bytes = aligned(part_rows * 4);
  const std::int64_t part_out_bytes = aligned(part_rows * head_dim * 4);
  const std::int64_t arrival_bytes = aligned(std::int64_t(bucket) * num_kv_heads * 4);
  buffers.bytes = q_rot_bytes + output_bytes + 2 * stat_bytes + part_out_bytes + arrival_bytes;
  TQ_CUDA_CHECK(cudaMalloc(&buffers.allocation, buffers.bytes));
  auto* base = static_cast<std::uint8_t*>(buffers.allocation);
  buffers.q_rot = reinterpret_cast<float*>(base);
  buffers.output = base + q_rot_bytes;
  buffers.part_max = reinterpret_cast<float*>(base + q_rot_bytes + output_bytes);
  buffers.part_sum = reinterpret_cast<float*>(base + q_rot_bytes + output_bytes + stat_bytes);
  buffers.part_out = reinterpret_cast<float*>(base + q_rot_bytes + output_bytes + 2 * stat_bytes);
  buffers.arrivals = reinterpret_cast<unsigned*>(base + q_rot_bytes + output_bytes + 2 * stat_bytes + part_out_bytes);
  // Zeroed once here; afterwards the kernel leaves every counter at zero.
  TQ_CUDA_CHECK(cudaMemset(buffers.arrivals, 0, arrival_bytes));
  return buffers;
}

}  // namespace

const PooledBuffers& DecodeWorkspace::Impl::acquire(const PoolSignature& signature, int batch, int sm_count) {
  std::lock_guard<std::mutex> lock(mutex);
  auto found = pools.find(signature);
  if (found != pools.end() && batch <= found->second.bucket_batch) return found->second;
  int bucket = max_batch;
  if (found != pools.end()) {
    bucket = batch;
    std::fprintf(stderr,
                 "tqdecode: warning: batch %d exceeds the pool bucket of %d rows; the pool grows to %d "
                 "and CUDA graphs captured earlier now hold stale buffer pointers (raise max_batch or "
                 "TQDECODE_MAX_BATCH)\n",
                 batch, found->second.bucket_batch, bucket);
    // cudaFree waits for the device, so work still using the old buffers finishes first.
    TQ_CUDA_CHECK(cudaFree(found->second.allocation));
    pools.erase(found);
  } else if (batch > bucket) {
    bucket = batch;
  }
  return pools.emplace(signature, allocate_buffers(signature, bucket, sm_count)).first->second;
}

DecodeWorkspace::Impl::~Impl() {
  for (auto& [signature, buffers] : pools) cudaFree(buffers.allocation);
}

DecodeWorkspace::DecodeWorkspace(int max_batch)
    : impl_(std::make_unique<Impl>()) {
  TQ_REQUIRE(max_batch >= 0, "max_batch", std::to_string(max_batch) + " is negative; accepted: 0 (default) or >= 1");
  impl_->max_batch = max_batch > 0 ? max_batch : max_batch_from_environment();
}

DecodeWorkspace::~DecodeWorkspace() = default;

int DecodeWorkspace::max_batch() const { return impl_->max_batch; }

DecodeWorkspace::Stats DecodeWorkspace::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  Stats stats;
  for (const auto& [signature, buffers] : impl_->pools) {
    const auto [device, num_kv_heads, num_q_heads, head_dim, dtype] = signature;
    stats.entries.push_back({"Hk=" + std::to_string(num_kv_heads) + " Hq=" + std::to_string(num_q_heads) +
                                 " D=" + std::to_string(head_dim) + " dtype=" + dtype_name(static_cast<DType>(dtype)) +
                                 " device=" + std::to_string(device),
                             buffers.bucket_batch, buffers.partition_rows,
                             buffers.bytes});
    stats.total_bytes += buffers.bytes;
  }
  return stats;
}

}  // namespace tqdecode
