// CUDA error checking (internal): every runtime call and launch is checked
// and turned into tqdecode::CudaError with the call site.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode {

inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status != cudaSuccess) {
    throw CudaError(std::string("tqdecode: CUDA error in ") + what + " at " + file + ":" +
                    std::to_string(line) + ": " + cudaGetErrorString(status));
  }
}

}  // namespace tqdecode

#define TQ_CUDA_CHECK(call) ::tqdecode::check_cuda((call), #call, __FILE__, __LINE__)
#define TQ_CUDA_CHECK_LAUNCH() ::tqdecode::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
