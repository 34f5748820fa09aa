// Rotations and model constants (docs/FORMAT.md section 2): orthogonality,
// determinism, the documented constructions, and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "tqdecode/constants.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/rotation.hpp"

namespace {

using tqdecode::test::expect_error_naming;

using tqdecode::RotationKind;

constexpr std::array<RotationKind, 2> kKinds = {RotationKind::hadamard, RotationKind::dense};

std::string kind_name(RotationKind kind) { return kind == RotationKind::hadamard ? "hadamard" : "dense"; }

// max |Pi Pi^T - I|, accumulated in double.
double orthogonality_error(const std::vector<float>& pi, int dim) {
  double worst = 0.0;
  for (int i = 0; i < dim; ++i) {
    for (int j = 0; j < dim; ++j) {
      double dot = 0.0;
      for (int k = 0; k < dim; ++k) dot += double{pi[i * dim + k]} * pi[j * dim + k];
      worst = std::max(worst, std::abs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  return worst;
}

TEST(RotationMatrix, IsOrthogonal) {
  for (RotationKind kind : kKinds) {
    for (int dim : {64, 128, 256}) {
      const std::vector<float> pi = tqdecode::make_rotation(kind, dim, 42);
      ASSERT_EQ(pi.size(), static_cast<std::size_t>(dim) * dim);
      EXPECT_LT(orthogonality_error(pi, dim), 1e-5) << kind_name(kind) << ", D " << dim;
    }
  }
}

TEST(RotationMatrix, DenseAcceptsAnyHeadDim) {
  for (int dim : {1, 3, 96}) {
    EXPECT_LT(orthogonality_error(tqdecode::make_rotation(RotationKind::dense, dim, 5), dim), 1e-5) << "D " << dim;
  }
}

TEST(RotationMatrix, IsDeterministicFromTheSeed) {
  for (RotationKind kind : kKinds) {
    EXPECT_EQ(tqdecode::make_rotation(kind, 128, 1), tqdecode::make_rotation(kind, 128, 1)) << kind_name(kind);
    EXPECT_NE(tqdecode::make_rotation(kind, 128, 1), tqdecode::make_rotation(kind, 128, 2)) << kind_name(kind);
  }
}

// Pi = H diag(signs) / sqrt(D): Pi[i][j] / Pi[0][j] is the Sylvester entry
// (-1)^popcount(i & j), and every entry has magnitude 1/sqrt(D).
TEST(RotationMatrix, HadamardHasSylvesterStructure) {
  constexpr int kDim = 64;
  const std::vector<float> pi = tqdecode::make_rotation(RotationKind::hadamard, kDim, 9);
  const auto magnitude = static_cast<float>(1.0 / std::sqrt(double{kDim}));
  int negative_signs = 0;
  for (int j = 0; j < kDim; ++j) negative_signs += pi[j] < 0.0f;
  EXPECT_GT(negative_signs, 0);
  EXPECT_LT(negative_signs, kDim);
  for (int i = 0; i < kDim; ++i) {
    for (int j = 0; j < kDim; ++j) {
      const float sylvester = std::popcount(static_cast<unsigned>(i & j)) % 2 ? -1.0f : 1.0f;
      ASSERT_EQ(pi[i * kDim + j], sylvester * pi[j]) << "(" << i << ", " << j << ")";
      ASSERT_EQ(std::abs(pi[i * kDim + j]), magnitude);
    }
  }
}

// Pi is the Q of G = QR for the Gaussian G drawn row-major from
// Rng(seed).normal(), sign-fixed: R = Pi^T G is upper triangular with a
// positive diagonal.
TEST(RotationMatrix, DenseIsSignFixedQOfGaussianMatrix) {
  constexpr int kDim = 64;
  constexpr std::uint64_t kSeed = 11;
  const std::vector<float> pi = tqdecode::make_rotation(RotationKind::dense, kDim, kSeed);
  tqdecode::Rng rng(kSeed);
  std::vector<double> gaussian(kDim * kDim);
  for (double& element : gaussian) element = rng.normal();
  for (int i = 0; i < kDim; ++i) {
    for (int j = 0; j <= i; ++j) {
      double r = 0.0;
      for (int k = 0; k < kDim; ++k) r += double{pi[k * kDim + i]} * gaussian[k * kDim + j];
      if (i == j) {
        EXPECT_GT(r, 0.1) << "R[" << i << "][" << i << "]";
      } else {
        EXPECT_NEAR(r, 0.0, 1e-4) << "R[" << i << "][" << j << "]";
      }
    }
  }
}

TEST(RotationMatrix, TransposeSquare) {
  const std::vector<float> matrix = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  EXPECT_EQ(tqdecode::transpose_square(matrix, 3), (std::vector<float>{1, 4, 7, 2, 5, 8, 3, 6, 9}));
}

TEST(RotationErrors, BadInputsNameTheArgument) {
  expect_error_naming("head_dim", [] { tqdecode::make_rotation(RotationKind::hadamard, 96, 0); });
  for (RotationKind kind : kKinds) {
    expect_error_naming("head_dim", [kind] { tqdecode::make_rotation(kind, 0, 0); });
    expect_error_naming("head_dim", [kind] { tqdecode::make_rotation(kind, 1025, 0); });
  }
  expect_error_naming("kind", [] { tqdecode::make_rotation(static_cast<RotationKind>(9), 64, 0); });
  expect_error_naming("matrix", [] { tqdecode::transpose_square(std::vector<float>(5), 2); });
}

TEST(ModelConstants, MsePresetsCombineCodebookAndRotation) {
  constexpr std::uint64_t kSeed = 3;
  for (tqdecode::Preset preset : tqdecode::kAllPresets) {
    const tqdecode::PresetInfo info = tqdecode::preset_info(preset);
    if (info.key_fp8) continue;
    for (int dim : tqdecode::kHeadDims) {
      SCOPED_TRACE(std::string(info.name) + ", D " + std::to_string(dim));
      const tqdecode::ModelConstants constants = tqdecode::make_model_constants(preset, dim, kSeed);
      EXPECT_EQ(constants.preset, preset);
      EXPECT_EQ(constants.head_dim, dim);
      EXPECT_EQ(constants.centroids, tqdecode::lloyd_max_centroids(info.key_bits, dim));
      EXPECT_EQ(constants.Pi, tqdecode::make_rotation(RotationKind::hadamard, dim, kSeed));
      EXPECT_EQ(constants.PiT, tqdecode::transpose_square(constants.Pi, dim));
    }
  }
}

TEST(ModelConstants, PassesRotationAndDensityThrough) {
  const tqdecode::ModelConstants constants = tqdecode::make_model_constants(
      tqdecode::Preset::turboquant_k3v4_nc, 64, 8, RotationKind::dense, tqdecode::CoordinateDensity::gaussian);
  EXPECT_EQ(constants.centroids, tqdecode::lloyd_max_centroids(3, 64, tqdecode::CoordinateDensity::gaussian));
  EXPECT_EQ(constants.Pi, tqdecode::make_rotation(RotationKind::dense, 64, 8));
  EXPECT_EQ(constants.PiT, tqdecode::transpose_square(constants.Pi, 64));
}

TEST(ModelConstants, Fp8KeysHaveNoCodebookOrRotation) {
  const tqdecode::ModelConstants constants = tqdecode::make_model_constants(tqdecode::Preset::turboquant_k8v4, 128, 1);
  EXPECT_EQ(constants.preset, tqdecode::Preset::turboquant_k8v4);
  EXPECT_EQ(constants.head_dim, 128);
  EXPECT_TRUE(constants.centroids.empty());
  EXPECT_TRUE(constants.Pi.empty());
  EXPECT_TRUE(constants.PiT.empty());
}

TEST(ModelConstants, BadInputsNameTheArgument) {
  using tqdecode::Preset;
  expect_error_naming("head_dim", [] { tqdecode::make_model_constants(Preset::turboquant_4bit_nc, 96, 0); });
  expect_error_naming("head_dim", [] {
    tqdecode::make_model_constants(Preset::turboquant_4bit_nc, 96, 0, RotationKind::dense);
  });
  expect_error_naming("head_dim", [] { tqdecode::make_model_constants(Preset::turboquant_k8v4, 96, 0); });
  expect_error_naming("preset", [] { tqdecode::make_model_constants(static_cast<Preset>(9), 128, 0); });
  expect_error_naming("rotation", [] {
    tqdecode::make_model_constants(Preset::turboquant_4bit_nc, 128, 0, static_cast<RotationKind>(9));
  });
  expect_error_naming("density", [] {
    tqdecode::make_model_constants(Preset::turboquant_4bit_nc, 128, 0, RotationKind::hadamard,
                                   static_cast<tqdecode::CoordinateDensity>(9));
  });
}

}  // namespace
