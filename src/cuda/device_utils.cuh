// Small device helpers shared by the CUDA kernels (internal): warp
// reductions, query bits to fp32, asynchronous global->shared copies, named
// barriers and the arrival counter of a fused reduction.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace tqdecode::cuda {

inline constexpr unsigned kFullMask = 0xffffffffu;

/// The maximum (sum) over each group of `Lanes` consecutive lanes, a power
/// of two; the whole warp by default. Every lane of the warp takes part.
template <int Lanes = 32>
__device__ __forceinline__ float warp_max(float value) {
  static_assert(Lanes >= 1 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "groups of a power of two lanes");
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

template <int Lanes = 32>
__device__ __forceinline__ float warp_sum(float value) {
  static_assert(Lanes >= 1 && Lanes <= 32 && (Lanes & (Lanes - 1)) == 0, "groups of a power of two lanes");
#pragma unroll
  for (int offset = Lanes / 2; offset > 0; offset >>= 1) value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}

/// The quiet NaN every kernel writes for a NaN result.
__device__ __forceinline__ float quiet_nan() { return __uint_as_float(0x7fc00000u); }

/// A query element's bits (fp16 when `f16`, else bf16) as fp32, exactly.
__device__ __forceinline__ float query_bits_to_float(bool f16, std::uint16_t bits) {
  return f16 ? __half2float(__ushort_as_half(bits)) : __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}

/// Copies `Bytes` (1, 2, 4, 8 or 16) bytes from global to shared memory; both
/// addresses are aligned to `Bytes`. On sm_80 and newer 4- to 16-byte copies
/// are asynchronous (cp.async, completed by cp_async_wait); elsewhere the
/// copy is an ordinary load and store.
template <int Bytes>
__device__ __forceinline__ void copy_to_shared(void* shared, const void* global) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bytes >= 4) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
    if constexpr (Bytes == 16) {
      // .cg: the cache bytes are streamed once per CTA; keep them out of L1.
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(address), "l"(global), "n"(Bytes) : "memory");
    }
    return;
  }
#endif
  if constexpr (Bytes == 16) {
    *static_cast<uint4*>(shared) = *static_cast<const uint4*>(global);
  } else if constexpr (Bytes == 8) {
    *static_cast<uint2*>(shared) = *static_cast<const uint2*>(global);
  } else if constexpr (Bytes == 4) {
    *static_cast<unsigned*>(shared) = *static_cast<const unsigned*>(global);
  } else if constexpr (Bytes == 2) {
    *static_cast<unsigned short*>(shared) = *static_cast<const unsigned short*>(global);
  } else {
    static_assert(Bytes == 1, "copy_to_shared: 1, 2, 4, 8 or 16 bytes");
    *static_cast<unsigned char*>(shared) = *static_cast<const unsigned char*>(global);
  }
}

/// Closes the group of asynchronous copies issued by this thread so far.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/// Waits until at most `Pending` of this thread's committed groups are still
/// in flight. The data is visible to other threads after a barrier.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

/// Adds 1 to `counter` at GPU scope with acquire-release semantics and
/// returns the value before. Called by one thread between two CTA barriers,
/// the release publishes every global write the CTA made before the first
/// barrier (release is cumulative in the PTX memory model) and the acquire
/// makes the writes published by earlier arrivals visible to the whole CTA
/// after the second: one fence by one thread instead of a sequentially
/// consistent fence (__threadfence) in every warp.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* counter) {
  unsigned before;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
  return before;
}

/// Calls body.template operator()<I>() for I = 0 .. Count - 1: loops whose
/// index must be a compile-time constant (an asm immediate, a template argument).
template <int Count, class Body>
__device__ __forceinline__ void static_for(Body&& body) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (body.template operator()<I>(), ...); }(std::make_integer_sequence<int, Count>{});
}

template <int Id>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  static_assert(Id >= 1 && Id < 16, "barrier 0 is __syncthreads; there are 16");
  asm volatile("bar.sync %0, %1;\n" ::"n"(Id), "r"(threads) : "memory");
}

/// Barrier over `threads` threads (a multiple of 32) that use barrier
/// 1 + `index` (index < Count <= 15). Also orders their shared-memory
/// accesses. The barrier id is an immediate of each branch: racecheck reports
/// false hazards across a __syncthreads that follows bar.sync of unequal
/// trip counts, 2136 on a scalar-kernel test with a register id, 40 with
/// immediates (docs/RELIABILITY.md, resolved findings).
template <int Count>
__device__ __forceinline__ void named_barrier_sync(int index, int threads) {
  static_for<Count>([&]<int I>() {
    if (index == I) named_barrier_sync<1 + I>(threads);
  });
}

}  // namespace tqdecode::cuda
