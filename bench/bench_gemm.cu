#include "bench_gemm.hpp"

#include <stdexcept>
#include <string>

#include "bench_instances.hpp"

namespace tqbench {

namespace {

constexpr std::int64_t kCublasWorkspaceBytes = std::int64_t{32} << 20;  // cuBLAS's recommendation for Hopper
constexpr std::uint64_t kWeightSeed = 0x3e1647ULL;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLAS error ") + cublasGetStatusName(status) + " (" + cublasGetStatusString(status) +
                             ") in " + what);
  }
}

}  // namespace

WeightGemms::WeightGemms(int layers, int max_batch, cudaStream_t stream, int sm_count)
    : layers_(layers),
      max_batch_(max_batch),
      workspace_(kCublasWorkspaceBytes),
      weights_(std::int64_t(layers) * kGemmDim * kGemmDim),
      inputs_(std::int64_t(layers) * max_batch * kGemmDim),
      outputs_(std::int64_t(layers) * max_batch * kGemmDim) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetWorkspace(handle_, workspace_.get(), static_cast<std::size_t>(workspace_.bytes())), "cublasSetWorkspace");
  // Small weights, so the products stay finite; the GEMM's speed does not depend on them.
  fill_random_bf16(weights_.get(), weights_.count(), kWeightSeed, stream, sm_count);
  fill_random_bf16(inputs_.get(), inputs_.count(), kWeightSeed + 1, stream, sm_count);
  BENCH_SYNC(stream, "the fills of the GEMMs' weights and activations");
}

WeightGemms::~WeightGemms() {
  if (handle_ != nullptr) cublasDestroy(handle_);
}

void WeightGemms::enqueue(int layer, int batch, cudaStream_t stream) const {
  if (layer < 0 || layer >= layers_ || batch < 1 || batch > max_batch_) {
    throw std::logic_error("WeightGemms::enqueue: layer " + std::to_string(layer) + " or batch " + std::to_string(batch) +
                           " out of range");
  }
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  const float one = 1.0f, zero = 0.0f;
  // Row-major y [B, K] = x [B, K] W [K, K] is column-major y^T = W^T x^T:
  // W read as a K x K column-major matrix (its transpose), x^T as K x B.
  const std::uint16_t* weights = weights_.get() + std::int64_t(layer) * kGemmDim * kGemmDim;
  const std::uint16_t* inputs = inputs_.get() + std::int64_t(layer) * max_batch_ * kGemmDim;
  std::uint16_t* outputs = outputs_.get() + std::int64_t(layer) * max_batch_ * kGemmDim;
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, kGemmDim, batch, kGemmDim, &one, weights, CUDA_R_16BF, kGemmDim,
                            inputs, CUDA_R_16BF, kGemmDim, &zero, outputs, CUDA_R_16BF, kGemmDim, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (the engine-like step's weight GEMM)");
}

}  // namespace tqbench
