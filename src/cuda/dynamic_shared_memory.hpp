// Opting a kernel in to more than 48 KiB of dynamic shared memory (internal).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "cuda_check.hpp"

namespace tqdecode::cuda {

/// Lets `Kernel` launch with `bytes` of dynamic shared memory on the current
/// device. The attribute belongs to the kernel in one device's context, so
/// each device needs its own call: made once per kernel and device (every
/// time on devices past the 64th), so that a process driving several GPUs
/// can launch on all of them.
template <auto Kernel>
void allow_dynamic_shared_memory(int bytes) {
  static std::atomic<std::uint64_t> configured_devices{0};
  int device = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&device));
  const std::uint64_t bit = device < 64 ? std::uint64_t{1} << device : 0;
  if (bit != 0 && (configured_devices.load(std::memory_order_relaxed) & bit) != 0) return;
  TQ_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  configured_devices.fetch_or(bit, std::memory_order_relaxed);
}

}  // namespace tqdecode::cuda
