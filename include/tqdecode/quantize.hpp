// Scalar pieces of the store-path encoding (docs/FORMAT.md section 3) shared by
// the CPU store and the GPU store kernel, so that both produce the same cache
// bytes. Every fp32 operation that feeds a stored byte goes through the
// *_rn helpers below: on the device they are the round-to-nearest intrinsics,
// which the compiler never fuses into an FMA; on the host they are plain
// IEEE operations (host builds must not contract a*b+c either: the library
// is compiled without -ffast-math, and x86-64 without -mfma never contracts).
#pragma once

#include <cmath>
#include <cstdint>

#include "tqdecode/common.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode {

TQ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

TQ_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

TQ_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

TQ_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

TQ_HOST_DEVICE float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

TQ_HOST_DEVICE float abs_f(float a) {
#if defined(__CUDA_ARCH__)
  return fabsf(a);
#else
  return std::fabs(a);
#endif
}

/// Rounds to the nearest integer value, ties to even (the default rounding mode).
TQ_HOST_DEVICE float round_even(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);
#endif
}

/// sum_i a[i] * b[i] accumulated in index order from 0, every product and
/// sum rounded separately (no FMA): the rotation r[j] = dot(Pi[j][:], k) and
/// the squared norms of the key and of its centroid vector.
TQ_HOST_DEVICE float dot_sequential(const float* a, const float* b, int count) {
  float sum = 0.0f;
  for (int i = 0; i < count; ++i) sum = add_rn(sum, mul_rn(a[i], b[i]));
  return sum;
}

/// Index of the centroid nearest to `x`: a linear scan with strict '<' on the
/// fp32 distance |x - c|, so a tie keeps the lower index. Same rule as
/// nearest_centroid() in codebook.hpp (which also validates its arguments).
TQ_HOST_DEVICE int nearest_centroid_index(const float* centroids, int count, float x) {
  int best = 0;
  float best_distance = abs_f(sub_rn(x, centroids[0]));
  for (int i = 1; i < count; ++i) {
    const float distance = abs_f(sub_rn(x, centroids[i]));
    if (distance < best_distance) {
      best = i;
      best_distance = distance;
    }
  }
  return best;
}

/// Stored key norm (fp16 bits) of an MSE key with norm `norm` whose chosen
/// centroids have norm `centroid_norm`: n / ||c|| with norm correction (0
/// when ||c|| is 0), else n.
TQ_HOST_DEVICE std::uint16_t stored_key_norm_bits(float norm, float centroid_norm, bool norm_correction) {
  if (!norm_correction) return float_to_half_bits(norm);
  return centroid_norm == 0.0f ? float_to_half_bits(0.0f) : float_to_half_bits(div_rn(norm, centroid_norm));
}

/// Quantization parameters of one value vector with range [lo, hi].
struct ValueQuantParams {
  std::uint16_t scale_bits;  ///< fp16((hi - lo) / (2^bits - 1))
  std::uint16_t zero_bits;   ///< fp16(lo)
  float scale;               ///< the fp16 scale as fp32: what codes are computed with
  float zero;                ///< the fp16 zero as fp32
};

TQ_HOST_DEVICE ValueQuantParams value_quant_params(float lo, float hi, int bits) {
  ValueQuantParams params;
  params.scale_bits = float_to_half_bits(div_rn(sub_rn(hi, lo), static_cast<float>((1 << bits) - 1)));
  params.zero_bits = float_to_half_bits(lo);
  params.scale = half_bits_to_float(params.scale_bits);
  params.zero = half_bits_to_float(params.zero_bits);
  return params;
}

/// Code of value `v`: clamp(round_half_even((v - zero) / scale), 0, 2^bits - 1),
/// 0 when the scale is 0. Clamped in fp32 before the integer conversion so an
/// out-of-range quotient never overflows it.
TQ_HOST_DEVICE int value_code(float v, const ValueQuantParams& params, int bits) {
  if (params.scale == 0.0f) return 0;
  const float max_code = static_cast<float>((1 << bits) - 1);
  float code = round_even(div_rn(sub_rn(v, params.zero), params.scale));
  code = code < 0.0f ? 0.0f : code;
  code = code > max_code ? max_code : code;
  return static_cast<int>(code);
}

/// Range of a value vector, picked as std::minmax_element picks it: lo is
/// the first smallest element, hi the last largest. The choice among equal
/// extremes only shows for +0 / -0, whose sign reaches the stored zero and
/// scale. The GPU reduces in a tree with the same tie rule (lower index for
/// lo, higher index for hi), which gives the same result.
struct ValueRange {
  float lo;
  float hi;
};

TQ_HOST_DEVICE ValueRange value_range(const float* v, int count) {
  ValueRange range{v[0], v[0]};
  for (int i = 1; i < count; ++i) {
    if (v[i] < range.lo) range.lo = v[i];
    if (!(v[i] < range.hi)) range.hi = v[i];
  }
  return range;
}

}  // namespace tqdecode
