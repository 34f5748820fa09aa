// Bit-exact conversions between fp32 and fp16, bf16 and fp8 e4m3 (OCP
// "E4M3FN": bias 7, max 448, no infinities). One implementation serves the
// CPU and the GPU so both produce the same cache bytes.
#pragma once

#include <cstdint>
#include <cstring>

#include "tqdecode/common.hpp"

namespace tqdecode {

TQ_HOST_DEVICE std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

TQ_HOST_DEVICE float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

/// Rounds `mantissa >> shift` to nearest, ties to even.
TQ_HOST_DEVICE std::uint32_t shift_round_even(std::uint32_t mantissa, int shift) {
  const std::uint32_t kept = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}

/// fp32 -> IEEE fp16 bits, round to nearest even; overflow gives infinity.
TQ_HOST_DEVICE std::uint16_t float_to_half_bits(float value) {
  const std::uint32_t x = float_bits(value);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: fp16 subnormal or zero
    if (ax <= 0x33000000u) return static_cast<std::uint16_t>(sign);  // <= 2^-25 rounds to 0
    const int exponent = static_cast<int>(ax >> 23);
    const std::uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    return static_cast<std::uint16_t>(sign | shift_round_even(mantissa, 126 - exponent));
  }
  return static_cast<std::uint16_t>(sign | shift_round_even(ax - 0x38000000u, 13));
}

TQ_HOST_DEVICE float half_bits_to_float(std::uint16_t half) {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fu;
  const std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// fp32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN.
TQ_HOST_DEVICE std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t x = float_bits(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

TQ_HOST_DEVICE float bf16_bits_to_float(std::uint16_t bf16) {
  return bits_float(static_cast<std::uint32_t>(bf16) << 16);
}

/// Rounds through bf16 and back.
TQ_HOST_DEVICE float round_to_bf16(float value) { return bf16_bits_to_float(float_to_bf16_bits(value)); }

/// fp32 -> fp8 e4m3 bits, round to nearest even, saturating at +-448; NaN -> 0x7f.
TQ_HOST_DEVICE std::uint8_t float_to_fp8_e4m3_bits(float value) {
  const std::uint32_t x = float_bits(value);
  const std::uint8_t sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);
  if (ax >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448 saturates
  if (ax < 0x3c800000u) {  // below 2^-6: subnormal (units of 2^-9) or zero
    if (ax <= 0x3a800000u) return sign;  // <= 2^-10 rounds to 0
    const int exponent = static_cast<int>(ax >> 23);
    const std::uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    return static_cast<std::uint8_t>(sign | shift_round_even(mantissa, 141 - exponent));
  }
  const std::uint32_t rounded = shift_round_even(ax - (120u << 23), 20);
  return static_cast<std::uint8_t>(sign | (rounded > 0x7eu ? 0x7eu : rounded));
}

TQ_HOST_DEVICE float fp8_e4m3_bits_to_float(std::uint8_t byte) {
  const std::uint32_t exponent = (byte >> 3) & 0xfu;
  const std::uint32_t mantissa = byte & 0x7u;
  float magnitude;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * 0.001953125f;  // 2^-9
  } else if (exponent == 15 && mantissa == 7) {
    magnitude = bits_float(0x7fc00000u);
  } else {
    magnitude = bits_float(((exponent + 120u) << 23) | (mantissa << 20));
  }
  return (byte & 0x80u) ? -magnitude : magnitude;
}

/// Reads element `index` of a bf16/fp16/fp32 array as fp32.
TQ_HOST_DEVICE float load_as_float(const void* data, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[index];
    case DType::f16: return half_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
    default: return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
  }
}

/// Writes `value` rounded to `dtype` into element `index`.
TQ_HOST_DEVICE void store_from_float(void* data, DType dtype, std::int64_t index, float value) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[index] = value; break;
    case DType::f16: static_cast<std::uint16_t*>(data)[index] = float_to_half_bits(value); break;
    default: static_cast<std::uint16_t*>(data)[index] = float_to_bf16_bits(value); break;
  }
}

}  // namespace tqdecode
