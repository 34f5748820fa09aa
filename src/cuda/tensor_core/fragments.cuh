// Register-level operations of the Hopper decode kernel (internal): packing
// fp32 pairs to bf16 / fp16, fp8 pairs to fp16, the m16n8k16 tensor-core
// products, the 8x8 fragment transpose, and two instruction-shaping helpers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tqdecode::cuda::tensor_core {

constexpr std::uint32_t kHalfOnes = 0x3c003c00u;  // fp16 (1, 1)

__device__ __forceinline__ std::uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}

__device__ __forceinline__ std::uint32_t pack_f16(float lo, float hi) {
  const __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&pair);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// 1 / sqrt(x) in one MUFU op: no rescaling of subnormal inputs (rsqrtf's
/// extra instructions), which sums of squared table centroids never are.
__device__ __forceinline__ float fast_rsqrt(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_f16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp8 e4m3 values (half `Half` of `word`, low byte first) as an fp16
// pair; exact, since every e4m3 value is an fp16 value. From sm_89 on the
// half goes to the conversion instruction as a 16-bit operand, so the high
// pair needs no shift; before, the library's conversion emulates it.
template <int Half>
__device__ __forceinline__ std::uint32_t fp8_pair_to_f16(std::uint32_t word) {
  static_assert(Half == 0 || Half == 1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint32_t halves;
  if constexpr (Half == 0) {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(halves) : "r"(word));
  } else {
    asm("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %1;\ncvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(halves) : "r"(word));
  }
  return halves;
#else
  const auto pair = static_cast<__nv_fp8x2_storage_t>((word >> (16 * Half)) & 0xffffu);
  const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3);
  return static_cast<std::uint32_t>(halves.x) | (static_cast<std::uint32_t>(halves.y) << 16);
#endif
}

// Transpose of an 8x8 b16 matrix held as mma fragments (lane (g, c) holds
// row g, columns 2c and 2c + 1).
__device__ __forceinline__ std::uint32_t transpose_8x8(std::uint32_t fragment) {
  std::uint32_t result;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(result) : "r"(fragment));
  return result;
}

template <typename T>
__device__ __forceinline__ T load_shared(const std::uint8_t* address) {
  return *reinterpret_cast<const T*>(address);
}

template <typename T>
__device__ __forceinline__ void store_shared(std::uint8_t* address, T value) {
  *reinterpret_cast<T*>(address) = value;
}

// A 32-bit store at a shared-memory address (the rings' precomputed addresses).
__device__ __forceinline__ void store_shared_u32(std::uint32_t shared_address, std::uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(shared_address), "r"(value) : "memory");
}

// The squares of an fp16 pair.
__device__ __forceinline__ std::uint32_t square_f16x2(std::uint32_t x) {
  std::uint32_t result;
  asm("mul.rn.f16x2 %0, %1, %1;" : "=r"(result) : "r"(x));
  return result;
}

// x & mask, which the compiler cannot turn into a shift and a narrower mask:
// a masked field then shifts into place inside an add (LEA.HI, IMAD).
__device__ __forceinline__ std::uint32_t and_opaque(std::uint32_t x, std::uint32_t mask) {
  std::uint32_t result;
  asm("and.b32 %0, %1, %2;" : "=r"(result) : "r"(x), "r"(mask));
  return result;
}

// A 32-bit load at a shared-memory address.
__device__ __forceinline__ std::uint32_t load_shared_u32(std::uint32_t shared_address) {
  std::uint32_t value;
  asm("ld.shared.b32 %0, [%1];\n" : "=r"(value) : "r"(shared_address));
  return value;
}

// `x` through a move the compiler cannot see into, so it keeps the value in
// a register instead of recomputing it from the thread index in the loop.
__device__ __forceinline__ std::uint32_t opaque(std::uint32_t x) {
  std::uint32_t result;
  asm("mov.b32 %0, %1;" : "=r"(result) : "r"(x));
  return result;
}

// (x & mask) | bits in one LOP3 (the compiler splits it when both are immediates).
template <std::uint32_t Mask, std::uint32_t Bits>
__device__ __forceinline__ std::uint32_t mask_or(std::uint32_t x) {
  std::uint32_t result;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(result) : "r"(x), "n"(Mask), "n"(Bits));
  return result;
}

}  // namespace tqdecode::cuda::tensor_core
