// Helpers for the GPU tests: skip without a device, and an RAII device
// buffer with host upload / download.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

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

}  // namespace tqdecode::test

/// First statement of every GPU test: skips it, visibly, without a device.
#define TQ_SKIP_WITHOUT_GPU()                                     \
  do {                                                            \
    if (!::tqdecode::test::gpu_available()) {                     \
      GTEST_SKIP() << "no CUDA device present: GPU test skipped"; \
    }                                                             \
  } while (0)
