// Orthogonal rotations Pi (docs/FORMAT.md section 2), row-major D x D fp32.
#pragma once

#include <cstdint>
#include <vector>

namespace tqdecode {

enum class RotationKind : std::uint8_t {
  hadamard,  ///< H * diag(signs) / sqrt(D); D a power of two
  dense,     ///< QR of a Gaussian matrix, sign-fixed so diag(R) > 0
};

/// Deterministic D x D orthogonal matrix from `seed`. Throws Error on bad input.
std::vector<float> make_rotation(RotationKind kind, int head_dim, std::uint64_t seed);

/// Transpose of a row-major n x n matrix.
std::vector<float> transpose_square(const std::vector<float>& matrix, int n);

}  // namespace tqdecode
