// The bulk tensor copy engine (TMA) and its shared-memory barriers, as the
// wide shape's tile copies use them (internal; sm_90 only, used by
// tensor_core/kernel.cuh): one instruction by one lane per tile and tensor map
// (or per contiguous run of bytes) instead of one cp.async per 16 bytes and
// lane, and no per-lane copy plan.
#pragma once

#include <cstdint>

namespace tqdecode::cuda::tensor_core {

/// True in one lane of the (converged) warp.
__device__ __forceinline__ bool elect_one_lane() {
  std::uint32_t elected;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(elected));
  return elected != 0;
}

__device__ __forceinline__ void mbarrier_init(std::uint32_t barrier, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(arrivals) : "memory");
}

/// Makes initialized barriers visible to the copy engine.
__device__ __forceinline__ void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

/// Orders this thread's ordinary shared-memory accesses before later writes
/// of the copy engine (the query bits share the rings' last stages).
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/// One arrival that also expects `bytes` from the copies completing on `barrier`.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(std::uint32_t barrier, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(barrier), "r"(bytes) : "memory");
}

/// One arrival on `barrier`.
__device__ __forceinline__ void mbarrier_arrive(std::uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}

/// Waits until the phase of `barrier` with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(std::uint32_t barrier, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_again;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}

/// `bytes` (a multiple of 16) from `source` (16-byte aligned) into shared
/// memory at `destination` (16-byte aligned), completing on `barrier`.
__device__ __forceinline__ void bulk_load(std::uint32_t destination, const void* source, unsigned bytes,
                                          std::uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(destination),
      "l"(reinterpret_cast<std::uint64_t>(source)), "r"(bytes), "r"(barrier)
      : "memory");
}

/// The box of `map` at coordinates (c0 .. c3) into shared memory at `destination`, completing on `barrier`.
__device__ __forceinline__ void bulk_tensor_load(std::uint32_t destination, const void* map, int c0, int c1, int c2,
                                                 int c3, std::uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
          destination),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(barrier)
      : "memory");
}

/// The same for a three-dimensional map.
__device__ __forceinline__ void bulk_tensor_load(std::uint32_t destination, const void* map, int c0, int c1, int c2,
                                                 std::uint32_t barrier) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          destination),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(barrier)
      : "memory");
}

}  // namespace tqdecode::cuda::tensor_core
