// Encoding of one (token, kv head) vector pair into its cache record
// (docs/FORMAT.md section 3), shared by the CPU store and anything else that
// needs the exact cache bytes of a vector. Inputs are fp32 and finite. Built
// from the scalar pieces of quantize.hpp, which the GPU store kernel uses
// too, so both write the same bytes.
#pragma once

#include <cstdint>

#include "tqdecode/format.hpp"
#include "tqdecode/quantize.hpp"

namespace tqdecode::cpu {

/// Largest supported head dim; sizes the per-vector scratch arrays.
inline constexpr int kMaxHeadDim = kHeadDims.back();

/// Encodes an MSE key: writes packed_bytes(head_dim, bits) bytes of codebook
/// indices to `key_data` and returns the stored key norm as fp16 bits
/// (n / ||c|| with norm correction, else n). `Pi` is row-major D x D.
std::uint16_t encode_key_mse(const float* key, int head_dim, const float* Pi, const float* centroids,
                             int bits, bool norm_correction, std::uint8_t* key_data);

/// Encodes an fp8 key: head_dim bytes of fp8 e4m3 (saturating) to `key_data`.
void encode_key_fp8(const float* key, int head_dim, std::uint8_t* key_data);

/// Encodes a value vector with `bits`-bit uniform codes: writes
/// packed_bytes(head_dim, bits) bytes to `value_data`, returns its scale and
/// zero (fp16 bits in scale_bits / zero_bits).
ValueQuantParams encode_value(const float* value, int head_dim, int bits, std::uint8_t* value_data);

}  // namespace tqdecode::cpu
