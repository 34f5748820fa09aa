// Helpers for the GPU tests: skip without a device, an RAII device buffer
// with host upload / download, and the GPU-against-reference tolerance.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "random.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {

/// True when a CUDA device is usable (checked once per process).
inline bool gpu_available() {
  static const bool available = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();  // a missing driver or device must not leave an error for later checks
    return ok;
  }();
  return available;
}

/// Throws std::runtime_error (a test failure) when a CUDA call fails.
inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

/// Device memory for `count` elements of T, freed on destruction. Move-only.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count_ > 0) check_cuda(cudaMalloc(&data_, bytes()), "cudaMalloc");
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
    other.count_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = other.data_;
      count_ = other.count_;
      other.data_ = nullptr;
      other.count_ = 0;
    }
    return *this;
  }
  ~DeviceBuffer() { release(); }

  T* get() const { return data_; }
  std::size_t size() const { return count_; }
  std::size_t bytes() const { return count_ * sizeof(T); }

  /// Copies host.size() elements (at most size()) to the start of the buffer.
  void upload(const std::vector<T>& host) {
    if (host.size() > count_) throw std::runtime_error("DeviceBuffer::upload: more elements than the buffer holds");
    if (!host.empty())
      check_cuda(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }

  /// The whole buffer, copied to the host (synchronous).
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) check_cuda(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  void release() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
};

/// Number of elements whose bit patterns differ (a NaN equals only the same NaN).
inline std::size_t bitwise_mismatches(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < a.size(); ++i) mismatches += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return mismatches;
}

/// Why a GPU output is not close enough to the CPU reference on the same
/// cache bytes, or empty when it is. GPU and reference differ by bf16 operand
/// rounding (centroids, P' in the tensor-core kernel), summation order and
/// the bf16/fp16 output rounding. Every element must be finite (outputs are
/// poisoned with NaN first, so this also catches an element not written).
inline std::string closeness_failure(const std::vector<float>& actual, const std::vector<float>& expected,
                                     ErrorStats* measured = nullptr) {
  if (actual.size() != expected.size()) {
    return "size " + std::to_string(actual.size()) + ", expected " + std::to_string(expected.size());
  }
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!std::isfinite(actual[i])) return "element " + std::to_string(i) + " not written or not finite";
  }
  const ErrorStats error = compare_outputs(actual, expected);
  if (measured != nullptr) *measured = error;
  double peak = 0;
  for (float value : expected) peak = std::max(peak, static_cast<double>(std::abs(value)));
  if (!(error.cosine > 0.9999)) return "cosine " + std::to_string(error.cosine) + " <= 0.9999";
  if (!(error.relative_l2 < 1e-2)) return "relative L2 " + std::to_string(error.relative_l2) + " >= 1e-2";
  if (!(error.max_abs < 2e-2 * std::max(1.0, peak))) {
    return "max abs error " + std::to_string(error.max_abs) + " >= 2e-2 * max(1, peak " + std::to_string(peak) + ")";
  }
  return {};
}

/// closeness_failure as a test expectation, printing the measured error.
inline void expect_close(const std::vector<float>& actual, const std::vector<float>& expected, const std::string& what) {
  ErrorStats error{};
  const std::string failure = closeness_failure(actual, expected, &error);
  std::printf("[ measure  ] %-40s cosine %.7f  rel_l2 %.2e  max_abs %.2e\n", what.c_str(), error.cosine,
              error.relative_l2, error.max_abs);
  EXPECT_TRUE(failure.empty()) << what << ": " << failure;
}

/// One decode call captured in a CUDA graph on a non-blocking stream of its
/// own, after an eager warm-up call (the pool allocates there, not during
/// the capture). The arguments' pointers are the graph's: change what they
/// point to, then replay.
class DecodeGraph {
 public:
  DecodeGraph(const DecodeArgs& args, DecodeWorkspace& workspace, PathRequest request = PathRequest::automatic)
      : args_(args), workspace_(workspace), request_(request) {
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    eager();
    check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    decode(args_, workspace_, stream_, request_);
    check_cuda(cudaStreamEndCapture(stream_, &graph_), "cudaStreamEndCapture");
    check_cuda(cudaGraphInstantiate(&exec_, graph_, 0), "cudaGraphInstantiate");
  }
  ~DecodeGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
    cudaStreamDestroy(stream_);
  }
  DecodeGraph(const DecodeGraph&) = delete;
  DecodeGraph& operator=(const DecodeGraph&) = delete;

  /// Replays the graph and waits for it.
  void replay() const {
    check_cuda(cudaGraphLaunch(exec_, stream_), "cudaGraphLaunch");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }
  /// The same call, eager, on the same stream; waits for it.
  void eager() const {
    decode(args_, workspace_, stream_, request_);
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  DecodeArgs args_;
  DecodeWorkspace& workspace_;
  PathRequest request_;
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};


/// A random order of the scenario's sequences, and its block table with row
/// i taken from row order[i] (graph replays move sequences onto other blocks).
struct ReorderedSequences {
  std::vector<int> order;
  std::vector<std::int32_t> block_table;
};
inline ReorderedSequences reorder_sequences(const Scenario& scenario, Rng& rng) {
  const int batch = scenario.batch();
  const std::size_t columns = scenario.max_blocks_per_seq;
  ReorderedSequences reordered{std::vector<int>(batch), std::vector<std::int32_t>(scenario.block_table.size())};
  for (int i = 0; i < batch; ++i) reordered.order[i] = i;
  for (int i = batch - 1; i > 0; --i) std::swap(reordered.order[i], reordered.order[rng.below(i + 1)]);
  for (int i = 0; i < batch; ++i) {
    std::copy_n(scenario.block_table.begin() + reordered.order[i] * columns, columns,
                reordered.block_table.begin() + i * columns);
  }
  return reordered;
}

/// Replays `graph`, then runs its call eagerly, each into `device`'s output
/// poisoned first: the two are equal bit for bit, every element finite, and
/// close to the CPU reference of `host` (the scenario's host arguments with
/// the inputs the replay saw).
inline void expect_replay_matches_eager_and_reference(const DecodeGraph& graph, DeviceScenario& device,
                                                      const DecodeArgs& host, const std::string& what) {
  device.poison_output();
  graph.replay();
  const std::vector<float> replayed = device.output();
  device.poison_output();
  graph.eager();
  const std::vector<float> eager = device.output();
  ASSERT_EQ(replayed.size(), eager.size());
  for (std::size_t i = 0; i < eager.size(); ++i) {
    ASSERT_TRUE(std::isfinite(replayed[i])) << what << " element " << i;
    ASSERT_EQ(replayed[i], eager[i]) << what << " element " << i;
  }
  std::vector<float> expected(eager.size());
  decode_reference(host, expected.data());
  expect_close(eager, expected, what);
}

/// The first element that is not zero of a row of `output` ([B, Hq, D])
/// whose length in `seq_lens` is 0, described, or empty when all those rows
/// are zero.
inline std::string zero_row_failure(const std::vector<float>& output, const Scenario& scenario,
                                    const std::vector<std::int32_t>& seq_lens) {
  const std::size_t row = std::size_t(scenario.config.num_q_heads) * scenario.config.head_dim;
  for (int b = 0; b < scenario.batch(); ++b) {
    if (seq_lens[b] != 0) continue;
    for (std::size_t i = 0; i < row; ++i) {
      if (output[b * row + i] != 0.0f) {
        return "sequence " + std::to_string(b) + " has length 0 but element " + std::to_string(i) + " is " +
               std::to_string(output[b * row + i]);
      }
    }
  }
  return {};
}

/// zero_row_failure for the scenario's own lengths.
inline std::string zero_row_failure(const std::vector<float>& output, const Scenario& scenario) {
  return zero_row_failure(output, scenario, scenario.seq_lens);
}

}  // namespace tqdecode::test

/// First statement of every GPU test: skips it, visibly, without a device.
#define TQ_SKIP_WITHOUT_GPU()                                     \
  do {                                                            \
    if (!::tqdecode::test::gpu_available()) {                     \
      GTEST_SKIP() << "no CUDA device present: GPU test skipped"; \
    }                                                             \
  } while (0)
