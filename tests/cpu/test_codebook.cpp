// Lloyd-Max codebooks (docs/FORMAT.md section 2): optimality conditions
// checked by an independent integration, known Gaussian levels, the
// published unit vector MSE, a Monte-Carlo run of the store-path
// quantization, and errors.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <numbers>
#include <string>
#include <thread>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "tqdecode/codebook.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/rotation.hpp"

namespace {

using tqdecode::test::expect_error_naming;

using tqdecode::CoordinateDensity;

constexpr std::array<int, 3> kTestedHeadDims = {64, 128, 256};
constexpr std::array<CoordinateDensity, 2> kDensities = {CoordinateDensity::sphere, CoordinateDensity::gaussian};
// TurboQuant (arXiv 2504.19874): unit-vector MSE at 1..4 bits per coordinate.
constexpr std::array<double, 4> kPublishedUnitVectorMse = {0.3634, 0.1175, 0.0345, 0.0095};

// Unnormalized density, written directly (no substitution, no log space) so
// the check does not share the library's integration scheme.
double density_at(CoordinateDensity density, int head_dim, double x) {
  if (density == CoordinateDensity::gaussian) return std::exp(-0.5 * head_dim * x * x);
  return std::pow(1.0 - x * x, 0.5 * (head_dim - 3));
}

struct CellMoments {
  double mass = 0.0;
  double first = 0.0;
};

// Composite Simpson over [a, b]. Both densities are negligible beyond
// |x| = 1 for the head dims tested (Gaussian: 8 standard deviations at D = 64).
CellMoments simpson_moments(CoordinateDensity density, int head_dim, double a, double b) {
  constexpr int kIntervals = 4000;
  const double h = (b - a) / kIntervals;
  CellMoments moments;
  for (int i = 0; i <= kIntervals; ++i) {
    const double x = a + i * h;
    const double weight = (i == 0 || i == kIntervals) ? 1.0 : (i % 2 ? 4.0 : 2.0);
    const double f = density_at(density, head_dim, x);
    moments.mass += weight * f;
    moments.first += weight * f * x;
  }
  moments.mass *= h / 3;
  moments.first *= h / 3;
  return moments;
}

TEST(CodebookLloydMax, LevelsAreSortedAndSymmetric) {
  for (CoordinateDensity density : kDensities) {
    for (int head_dim : kTestedHeadDims) {
      for (int bits = 1; bits <= 4; ++bits) {
        SCOPED_TRACE("density " + std::to_string(static_cast<int>(density)) + ", D " + std::to_string(head_dim) +
                     ", bits " + std::to_string(bits));
        const std::vector<float>& levels = tqdecode::lloyd_max_centroids(bits, head_dim, density);
        ASSERT_EQ(levels.size(), std::size_t{1} << bits);
        for (std::size_t i = 0; i < levels.size(); ++i) {
          if (i > 0) {
            EXPECT_LT(levels[i - 1], levels[i]);
          }
          EXPECT_EQ(levels[i], -levels[levels.size() - 1 - i]);
        }
      }
    }
  }
}

// Lloyd-Max optimality: with cells bounded by the midpoints of adjacent
// levels, each level is the conditional mean of its cell.
TEST(CodebookLloydMax, EachLevelIsTheMeanOfItsMidpointCell) {
  for (CoordinateDensity density : kDensities) {
    for (int head_dim : kTestedHeadDims) {
      for (int bits = 1; bits <= 4; ++bits) {
        SCOPED_TRACE("density " + std::to_string(static_cast<int>(density)) + ", D " + std::to_string(head_dim) +
                     ", bits " + std::to_string(bits));
        const std::vector<float>& levels = tqdecode::lloyd_max_centroids(bits, head_dim, density);
        for (std::size_t i = 0; i < levels.size(); ++i) {
          const double lower = i == 0 ? -1.0 : 0.5 * (double{levels[i - 1]} + levels[i]);
          const double upper = i + 1 == levels.size() ? 1.0 : 0.5 * (double{levels[i]} + levels[i + 1]);
          const CellMoments cell = simpson_moments(density, head_dim, lower, upper);
          const double conditional_mean = cell.first / cell.mass;
          EXPECT_NEAR(levels[i], conditional_mean, 1e-6 * std::abs(conditional_mean)) << "level " << i;
        }
      }
    }
  }
}

// The 1-bit sphere level is E|x| = Gamma(D/2) / (sqrt(pi) Gamma((D+1)/2)).
TEST(CodebookLloydMax, OneBitSphereLevelIsMeanAbsoluteCoordinate) {
  for (int head_dim : kTestedHeadDims) {
    const double mean_abs =
        std::exp(std::lgamma(0.5 * head_dim) - std::lgamma(0.5 * (head_dim + 1))) / std::sqrt(std::numbers::pi);
    EXPECT_NEAR(tqdecode::lloyd_max_centroids(1, head_dim)[1], mean_abs, 2e-7 * mean_abs) << "D " << head_dim;
  }
}

// At D = 3 the sphere density is uniform on [-1, 1]: evenly spaced levels
// with MSE 3 * step^2 / 12. This exercises the support edges at x = +-1.
TEST(CodebookLloydMax, HeadDimThreeIsUniform) {
  for (int bits = 1; bits <= 4; ++bits) {
    const std::vector<float>& levels = tqdecode::lloyd_max_centroids(bits, 3);
    const double step = 2.0 / static_cast<double>(levels.size());
    for (std::size_t i = 0; i < levels.size(); ++i) {
      EXPECT_NEAR(levels[i], -1.0 + (static_cast<double>(i) + 0.5) * step, 1e-6);
    }
    EXPECT_NEAR(tqdecode::lloyd_max_unit_vector_mse(levels, 3), 0.25 * step * step, 1e-9) << "bits " << bits;
  }
}

// Gaussian levels times sqrt(D) are the classic Lloyd-Max levels for N(0, 1)
// (Max, 1960), with MSE 0.3634, 0.1175, 0.03455, 0.009497.
TEST(CodebookLloydMax, GaussianLevelsMatchClassicTables) {
  const std::vector<std::vector<double>> positive_levels = {
      {0.7979},
      {0.4528, 1.5104},
      {0.2451, 0.7560, 1.3440, 2.1520},
      {0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326}};
  const std::array<double, 4> mse = {0.3634, 0.1175, 0.03455, 0.009497};
  for (int head_dim : kTestedHeadDims) {
    for (int bits = 1; bits <= 4; ++bits) {
      const std::vector<float>& levels = tqdecode::lloyd_max_centroids(bits, head_dim, CoordinateDensity::gaussian);
      const std::vector<double>& expected = positive_levels[bits - 1];
      for (std::size_t j = 0; j < expected.size(); ++j) {
        EXPECT_NEAR(levels[expected.size() + j] * std::sqrt(head_dim), expected[j], 1e-4)
            << "D " << head_dim << ", bits " << bits << ", level " << j;
      }
      EXPECT_NEAR(tqdecode::lloyd_max_unit_vector_mse(levels, head_dim, CoordinateDensity::gaussian), mse[bits - 1],
                  1e-3 * mse[bits - 1]);
    }
  }
}

TEST(CodebookLloydMax, GaussianLevelsApproximateSphereLevels) {
  for (int bits = 1; bits <= 4; ++bits) {
    const std::vector<float>& sphere = tqdecode::lloyd_max_centroids(bits, 128, CoordinateDensity::sphere);
    const std::vector<float>& gaussian = tqdecode::lloyd_max_centroids(bits, 128, CoordinateDensity::gaussian);
    for (std::size_t i = 0; i < sphere.size(); ++i) {
      EXPECT_NEAR(gaussian[i], sphere[i], 0.03 * std::abs(sphere[i])) << "bits " << bits << ", level " << i;
    }
  }
}

TEST(CodebookLloydMax, UnitVectorMseMatchesPublishedValues) {
  for (int bits = 1; bits <= 4; ++bits) {
    const double mse = tqdecode::lloyd_max_unit_vector_mse(tqdecode::lloyd_max_centroids(bits, 128), 128);
    RecordProperty("sphere_d128_mse_bits" + std::to_string(bits), std::to_string(mse));
    EXPECT_NEAR(mse, kPublishedUnitVectorMse[bits - 1], 0.02 * kPublishedUnitVectorMse[bits - 1]) << "bits " << bits;
  }
}

// The store path of docs/FORMAT.md section 3 on random unit vectors: rotate
// with a Hadamard Pi, quantize each coordinate to its nearest level, and
// measure the mean squared error of the quantized unit vector.
TEST(CodebookLloydMax, MonteCarloUnitVectorMse) {
  constexpr int kHeadDim = 128;
  constexpr int kVectors = 20000;
  const std::vector<float> pi = tqdecode::make_rotation(tqdecode::RotationKind::hadamard, kHeadDim, 7);
  std::array<const std::vector<float>*, 4> codebooks{};
  for (int bits = 1; bits <= 4; ++bits) codebooks[bits - 1] = &tqdecode::lloyd_max_centroids(bits, kHeadDim);

  tqdecode::Rng rng(2024);
  std::array<double, 4> total_error{};
  std::vector<float> key(kHeadDim);
  std::vector<float> unit(kHeadDim);
  for (int vector = 0; vector < kVectors; ++vector) {
    for (float& element : key) element = static_cast<float>(rng.normal());
    float norm_squared = 0.0f;
    for (float element : key) norm_squared += element * element;
    const float norm = std::sqrt(norm_squared);
    for (int row = 0; row < kHeadDim; ++row) {
      float rotated = 0.0f;
      for (int col = 0; col < kHeadDim; ++col) rotated += pi[row * kHeadDim + col] * key[col];
      unit[row] = rotated / norm;
    }
    for (int bits = 1; bits <= 4; ++bits) {
      const std::vector<float>& levels = *codebooks[bits - 1];
      double error = 0.0;
      for (float coordinate : unit) {
        const int index = tqdecode::nearest_centroid(levels.data(), static_cast<int>(levels.size()), coordinate);
        error += (coordinate - levels[index]) * (coordinate - levels[index]);
      }
      total_error[bits - 1] += error;
    }
  }
  for (int bits = 1; bits <= 4; ++bits) {
    const double measured = total_error[bits - 1] / kVectors;
    const double analytic = tqdecode::lloyd_max_unit_vector_mse(*codebooks[bits - 1], kHeadDim);
    RecordProperty("monte_carlo_d128_mse_bits" + std::to_string(bits), std::to_string(measured));
    EXPECT_NEAR(measured, kPublishedUnitVectorMse[bits - 1], 0.05 * kPublishedUnitVectorMse[bits - 1])
        << "bits " << bits;
    EXPECT_NEAR(measured, analytic, 0.01 * analytic) << "bits " << bits;
  }
}

TEST(CodebookLloydMax, ResultsAreCachedAndThreadSafe) {
  EXPECT_EQ(&tqdecode::lloyd_max_centroids(2, 128), &tqdecode::lloyd_max_centroids(2, 128));
  EXPECT_NE(&tqdecode::lloyd_max_centroids(2, 128, CoordinateDensity::sphere),
            &tqdecode::lloyd_max_centroids(2, 128, CoordinateDensity::gaussian));

  // A key no other test uses, so the threads race on its first computation.
  constexpr int kThreads = 8;
  std::array<const std::vector<float>*, kThreads> results{};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&results, t] { results[t] = &tqdecode::lloyd_max_centroids(3, 200); });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::vector<float>* result : results) EXPECT_EQ(result, results[0]);
}

TEST(CodebookNearestCentroid, TiesGoToTheLowerIndex) {
  const std::vector<float> levels = {-0.75f, -0.25f, 0.25f, 0.75f};
  const int count = static_cast<int>(levels.size());
  EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, -0.5f), 0);
  EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, 0.0f), 1);
  EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, 0.5f), 2);
  const std::vector<float> repeated = {0.0f, 0.0f, 1.0f};
  EXPECT_EQ(tqdecode::nearest_centroid(repeated.data(), 3, 0.0f), 0);
}

TEST(CodebookNearestCentroid, DecisionBoundariesAreMidpoints) {
  const std::vector<float>& levels = tqdecode::lloyd_max_centroids(4, 128);
  const int count = static_cast<int>(levels.size());
  EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, -1.0f), 0);
  EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, 1.0f), count - 1);
  for (int i = 0; i < count; ++i) EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, levels[i]), i);
  for (int i = 0; i + 1 < count; ++i) {
    const double midpoint = 0.5 * (double{levels[i]} + levels[i + 1]);
    const double offset = 1e-5 * (levels[i + 1] - levels[i]);
    EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, static_cast<float>(midpoint - offset)), i);
    EXPECT_EQ(tqdecode::nearest_centroid(levels.data(), count, static_cast<float>(midpoint + offset)), i + 1);
  }
}

TEST(CodebookErrors, BadInputsNameTheArgument) {
  const auto bad_density = static_cast<CoordinateDensity>(7);
  expect_error_naming("bits", [] { tqdecode::lloyd_max_centroids(0, 128); });
  expect_error_naming("bits", [] { tqdecode::lloyd_max_centroids(5, 128); });
  expect_error_naming("head_dim", [] { tqdecode::lloyd_max_centroids(2, 2); });
  expect_error_naming("density", [&] { tqdecode::lloyd_max_centroids(2, 128, bad_density); });
  expect_error_naming("centroids", [] { tqdecode::lloyd_max_unit_vector_mse({}, 128); });
  expect_error_naming("centroids", [] { tqdecode::lloyd_max_unit_vector_mse({0.5f, -0.5f}, 128); });
  expect_error_naming("head_dim", [] { tqdecode::lloyd_max_unit_vector_mse({-0.5f, 0.5f}, 2); });
  const float level = 0.0f;
  expect_error_naming("count", [&] { tqdecode::nearest_centroid(&level, 0, 0.0f); });
  expect_error_naming("centroids", [&] { tqdecode::nearest_centroid(nullptr, 1, 0.0f); });
}

}  // namespace
