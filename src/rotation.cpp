#include "tqdecode/rotation.hpp"

#include <bit>
#include <cmath>
#include <cstddef>
#include <string>

#include "random.hpp"
#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr int kMaxRotationDim = 1024;

// Pi[i][j] = H[i][j] * sign[j] / sqrt(D), with the Sylvester Hadamard matrix
// H[i][j] = (-1)^popcount(i & j). sign[j] is the top bit of the j-th draw of
// Rng(seed): +1 when clear, -1 when set.
std::vector<float> randomized_hadamard(int dim, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<double> column_scale(dim);
  const double inverse_sqrt_dim = 1.0 / std::sqrt(static_cast<double>(dim));
  for (double& scale : column_scale) scale = (rng.next_u64() >> 63) ? -inverse_sqrt_dim : inverse_sqrt_dim;

  std::vector<float> pi(static_cast<std::size_t>(dim) * dim);
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) {
      const bool negative = std::popcount(static_cast<unsigned>(i & j)) % 2 != 0;
      pi[static_cast<std::size_t>(i) * dim + j] = static_cast<float>(negative ? -column_scale[j] : column_scale[j]);
    }
  }
  return pi;
}

// Q of the QR factorization G = QR of a Gaussian matrix G, filled row-major
// from Rng(seed).normal(), with diag(R) > 0: the unique such Q, Haar
// distributed. Modified Gram-Schmidt over the columns of G in double, with a
// second (reorthogonalization) pass per column, gives orthogonality to
// rounding level; each R[j][j] is a norm, so positive with no sign fix.
std::vector<float> dense_orthogonal(int dim, std::uint64_t seed) {
  Rng rng(seed);
  const auto n = static_cast<std::size_t>(dim);
  // columns[j * n + i] = G[i][j]: each column contiguous.
  std::vector<double> columns(n * n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) columns[j * n + i] = rng.normal();
  }

  for (std::size_t j = 0; j < n; ++j) {
    double* column = &columns[j * n];
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t k = 0; k < j; ++k) {
        const double* basis = &columns[k * n];
        double dot = 0.0;
        for (std::size_t i = 0; i < n; ++i) dot += basis[i] * column[i];
        for (std::size_t i = 0; i < n; ++i) column[i] -= dot * basis[i];
      }
    }
    double norm_squared = 0.0;
    for (std::size_t i = 0; i < n; ++i) norm_squared += column[i] * column[i];
    const double inverse_norm = 1.0 / std::sqrt(norm_squared);
    for (std::size_t i = 0; i < n; ++i) column[i] *= inverse_norm;
  }

  std::vector<float> pi(n * n);
  for (std::size_t i = 0; i < n; ++i) {
    for (std::size_t j = 0; j < n; ++j) pi[i * n + j] = static_cast<float>(columns[j * n + i]);
  }
  return pi;
}

}  // namespace

std::vector<float> make_rotation(RotationKind kind, int head_dim, std::uint64_t seed) {
  TQ_REQUIRE(head_dim >= 1 && head_dim <= kMaxRotationDim, "head_dim",
          std::to_string(head_dim) + " is out of range; accepted: 1 to " + std::to_string(kMaxRotationDim));
  switch (kind) {
    case RotationKind::hadamard:
      TQ_REQUIRE(std::has_single_bit(static_cast<unsigned>(head_dim)), "head_dim",
              std::to_string(head_dim) + " is not a power of two, which the Hadamard rotation needs; "
                                         "accepted: 1, 2, 4, ..., 1024 (or use the dense rotation)");
      return randomized_hadamard(head_dim, seed);
    case RotationKind::dense:
      return dense_orthogonal(head_dim, seed);
  }
  fail("kind", "unknown rotation kind " + std::to_string(static_cast<int>(kind)) + "; accepted: hadamard, dense");
}

std::vector<float> transpose_square(const std::vector<float>& matrix, int n) {
  TQ_REQUIRE(n >= 0 && matrix.size() == static_cast<std::size_t>(n) * static_cast<std::size_t>(n), "matrix",
          "has " + std::to_string(matrix.size()) + " elements; accepted: n * n for n = " + std::to_string(n));
  const auto size = static_cast<std::size_t>(n);
  std::vector<float> transposed(matrix.size());
  for (std::size_t i = 0; i < size; ++i) {
    for (std::size_t j = 0; j < size; ++j) transposed[j * size + i] = matrix[i * size + j];
  }
  return transposed;
}

}  // namespace tqdecode
