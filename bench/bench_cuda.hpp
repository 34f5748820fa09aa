// CUDA helpers of tqdecode_bench: error checks that name the call and the
// source line, owning wrappers of device memory, streams, events and graphs,
// and the event timing of graph replays with the L2 flushed before each.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace tqbench {

/// Throws with the failed call, its source location and the CUDA error's name and text.
inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error ") + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
                             ") in " + what + " at " + file + ":" + std::to_string(line));
  }
}
#define BENCH_CHECK(call) ::tqbench::check_cuda((call), #call, __FILE__, __LINE__)
#define BENCH_CHECK_LAUNCH(kernel) ::tqbench::check_cuda(cudaGetLastError(), "launch of " kernel, __FILE__, __LINE__)
/// Waits for `stream`; an error then names the work enqueued last (`after`), where a kernel's fault surfaces.
#define BENCH_SYNC(stream, after) \
  ::tqbench::check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize after " after, __FILE__, __LINE__)

/// Device memory for `count` elements; count 0 holds nothing (null).
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::int64_t count) : count_(count) {
    if (count_ > 0) {
      const cudaError_t status = cudaMalloc(&data_, bytes());
      if (status != cudaSuccess) {
        throw std::runtime_error("cudaMalloc of " + std::to_string(bytes()) + " bytes failed: " +
                                 cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
      }
    }
  }
  // Unchecked: this may run while unwinding from a CUDA error.
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& other) noexcept : data_(other.data_), count_(other.count_) {
    other.data_ = nullptr;
    other.count_ = 0;
  }
  DeviceArray& operator=(DeviceArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }

  T* get() const { return data_; }
  std::int64_t count() const { return count_; }
  std::int64_t bytes() const { return count_ * static_cast<std::int64_t>(sizeof(T)); }

 private:
  T* data_ = nullptr;
  std::int64_t count_ = 0;
};

/// Copies `host` into `device` from element `offset` on; nothing for an empty vector.
template <class T>
void upload(const DeviceArray<T>& device, const std::vector<T>& host, cudaStream_t stream, std::int64_t offset = 0) {
  if (host.empty()) return;
  if (offset + static_cast<std::int64_t>(host.size()) > device.count()) throw std::logic_error("upload past the end of a device array");
  BENCH_CHECK(cudaMemcpyAsync(device.get() + offset, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
}

class Stream {
 public:
  // Non-blocking: no implicit ordering with the legacy default stream, which
  // a capture would otherwise reject.
  Stream() { BENCH_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event() { BENCH_CHECK(cudaEventCreate(&event_)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// A graph captured from everything `body` enqueues on `stream`, instantiated.
class CapturedGraph {
 public:
  template <class Body>
  CapturedGraph(cudaStream_t stream, const Body& body) {
    // ThreadLocal: only this thread's CUDA calls are checked against the capture.
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);  // leave the stream usable; the first error is the one reported
      if (partial != nullptr) cudaGraphDestroy(partial);
      throw;
    }
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph_));
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph_, 0);
    if (status != cudaSuccess) {
      cudaGraphDestroy(graph_);
      check_cuda(status, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
  }
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream) const { BENCH_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// Median, minimum and maximum of a set of timings, in microseconds.
struct Spread {
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
  int count = 0;
};

inline Spread spread_of(std::vector<float> milliseconds) {
  if (milliseconds.empty()) throw std::logic_error("spread of no timings");
  std::sort(milliseconds.begin(), milliseconds.end());
  const std::size_t mid = milliseconds.size() / 2;
  const double median = milliseconds.size() % 2 ? milliseconds[mid] : 0.5 * (double(milliseconds[mid - 1]) + milliseconds[mid]);
  return {median * 1e3, milliseconds.front() * 1e3, milliseconds.back() * 1e3, static_cast<int>(milliseconds.size())};
}

/// Milliseconds of each of `reps` runs of `work` (after `warmups` untimed
/// ones), each between its own pair of events on `stream`; `before(i)`
/// enqueues untimed work ahead of rep i (the L2 flush), outside its events.
/// A slow rep (clock ramp, preemption) is one outlier the median ignores.
template <class Before, class Work>
std::vector<float> time_reps(cudaStream_t stream, int warmups, int reps, const Before& before, const Work& work) {
  for (int i = 0; i < warmups; ++i) {
    before(i);
    work(i);
  }
  std::vector<Event> start(reps);
  std::vector<Event> stop(reps);
  for (int i = 0; i < reps; ++i) {
    before(i);
    BENCH_CHECK(cudaEventRecord(start[i].get(), stream));
    work(i);
    BENCH_CHECK(cudaEventRecord(stop[i].get(), stream));
  }
  BENCH_SYNC(stream, "the timed replays");
  std::vector<float> milliseconds(reps);
  for (int i = 0; i < reps; ++i) BENCH_CHECK(cudaEventElapsedTime(&milliseconds[i], start[i].get(), stop[i].get()));
  return milliseconds;
}

}  // namespace tqbench
