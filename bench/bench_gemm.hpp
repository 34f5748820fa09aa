// The weight-streaming GEMMs of the engine-like step: each layer's own bf16
// weights [kGemmDim, kGemmDim] (128 MiB, more than twice the L2) times that
// layer's activations [B, kGemmDim], by cuBLAS, as a model's projection runs
// between two attention calls.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bench_cuda.hpp"

namespace tqbench {

inline constexpr int kGemmDim = 8192;

class WeightGemms {
 public:
  /// Weights for `layers` layers and activations for batches up to `max_batch`.
  WeightGemms(int layers, int max_batch, cudaStream_t stream, int sm_count);
  ~WeightGemms();
  WeightGemms(const WeightGemms&) = delete;
  WeightGemms& operator=(const WeightGemms&) = delete;

  int layers() const { return layers_; }
  int max_batch() const { return max_batch_; }
  std::int64_t weight_bytes() const { return std::int64_t(kGemmDim) * kGemmDim * 2; }

  /// Enqueues layer `layer`'s y = x W for `batch` rows on `stream` (graph-capturable).
  void enqueue(int layer, int batch, cudaStream_t stream) const;

 private:
  int layers_;
  int max_batch_;
  cublasHandle_t handle_ = nullptr;
  DeviceArray<std::uint8_t> workspace_;  // cuBLAS's, so a capture never allocates
  DeviceArray<std::uint16_t> weights_;
  DeviceArray<std::uint16_t> inputs_;
  DeviceArray<std::uint16_t> outputs_;
};

}  // namespace tqbench
