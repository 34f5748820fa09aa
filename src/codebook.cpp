#include "tqdecode/codebook.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <mutex>
#include <numbers>
#include <string>
#include <tuple>

#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

constexpr int kMinBits = 1;
constexpr int kMaxBits = 4;
constexpr int kMinHeadDim = 3;  // the sphere density's exponent (D-3)/2 must be >= 0

// Gauss-Legendre rule on [-1, 1]: exact for polynomials of degree 2N-1, and
// spectrally accurate for the smooth integrands below.
constexpr int kQuadratureOrder = 16;
// Panels per integrated interval: a Lloyd cell, or the outer cell that runs
// out to the support edge many standard deviations away.
constexpr int kPanelsPerCell = 8;

struct QuadratureRule {
  std::array<double, kQuadratureOrder> nodes;
  std::array<double, kQuadratureOrder> weights;
};

// Nodes are the roots of the Legendre polynomial P_N, found by Newton from
// the classic cosine estimates; computed once rather than pasted as constants.
QuadratureRule make_gauss_legendre() {
  QuadratureRule rule{};
  constexpr int n = kQuadratureOrder;
  for (int i = 0; i < n; ++i) {
    double x = std::cos(std::numbers::pi * (i + 0.75) / (n + 0.5));
    double derivative = 0.0;
    for (int step = 0; step < 100; ++step) {
      double p_previous = 1.0;  // P_{k-1}(x)
      double p = x;             // P_k(x)
      for (int k = 2; k <= n; ++k) {
        const double p_next = ((2 * k - 1) * x * p - (k - 1) * p_previous) / k;
        p_previous = p;
        p = p_next;
      }
      derivative = n * (x * p - p_previous) / (x * x - 1.0);
      const double dx = p / derivative;
      x -= dx;
      if (std::abs(dx) < 1e-16) break;
    }
    rule.nodes[i] = x;
    rule.weights[i] = 2.0 / ((1.0 - x * x) * derivative * derivative);
  }
  return rule;
}

const QuadratureRule& gauss_legendre() {
  static const QuadratureRule rule = make_gauss_legendre();
  return rule;
}

// The unnormalized density of one coordinate of a uniformly random unit
// vector in R^D, with a quadrature for integrals g(x) f(x) dx over [a, b].
class CoordinateModel {
 public:
  CoordinateModel(CoordinateDensity density, int head_dim) : density_(density), head_dim_(head_dim) {}

  // Both densities have variance 1/D.
  double standard_deviation() const { return 1.0 / std::sqrt(static_cast<double>(head_dim_)); }

  // Beyond +-support() the density is below e^-70 of its peak, so the
  // quadrature spends no nodes there.
  double support() const {
    constexpr double kLogCutoff = 70.0;
    if (density_ == CoordinateDensity::gaussian) return std::sqrt(2.0 * kLogCutoff / head_dim_);
    // cos(t)^(D-2) = e^-70 with x = sin(t): the whole sphere, 1, for small D.
    return std::sqrt(-std::expm1(-2.0 * kLogCutoff / (head_dim_ - 2)));
  }

  // Calls visit(x, w) for quadrature nodes x in [a, b] (a <= b) with weights
  // w such that the sum of g(x) * w approximates the integral of g(x) f(x).
  template <class Visit>
  void for_each_node(double a, double b, Visit&& visit) const {
    if (density_ == CoordinateDensity::gaussian) {
      integrate_panels(a, b, [&](double x, double dx) { visit(x, dx * std::exp(-0.5 * head_dim_ * x * x)); });
    } else {
      // Substituting x = sin(t) turns (1 - x^2)^((D-3)/2) dx into
      // cos(t)^(D-2) dt, which is smooth at x = +-1 (no endpoint singularity
      // for small D); the power is evaluated as exp((D-2) log cos t), which
      // goes smoothly to 0 in the far tail for large D.
      integrate_panels(std::asin(a), std::asin(b), [&](double t, double dt) {
        visit(std::sin(t), dt * std::exp((head_dim_ - 2) * std::log(std::cos(t))));
      });
    }
  }

 private:
  // Composite Gauss-Legendre over [a, b]: calls node(y, weight) per node.
  template <class Node>
  static void integrate_panels(double a, double b, Node&& node) {
    const QuadratureRule& rule = gauss_legendre();
    const double panel_width = (b - a) / kPanelsPerCell;
    for (int panel = 0; panel < kPanelsPerCell; ++panel) {
      const double center = a + (panel + 0.5) * panel_width;
      for (int i = 0; i < kQuadratureOrder; ++i) {
        node(center + 0.5 * panel_width * rule.nodes[i], 0.5 * panel_width * rule.weights[i]);
      }
    }
  }

  CoordinateDensity density_;
  int head_dim_;
};

void validate_head_dim(int head_dim) {
  TQ_REQUIRE(head_dim >= kMinHeadDim, "head_dim",
          std::to_string(head_dim) + " is not supported; accepted: >= " + std::to_string(kMinHeadDim));
}

void validate_density(CoordinateDensity density) {
  TQ_REQUIRE(density == CoordinateDensity::sphere || density == CoordinateDensity::gaussian, "density",
          "unknown density value " + std::to_string(static_cast<int>(density)) +
              "; accepted: sphere, gaussian");
}

// Lloyd iteration for the positive half of a symmetric codebook. The density
// is even and the level count is even, so the optimum is symmetric with a
// cell boundary at 0; optimizing one half keeps the result exactly symmetric.
std::vector<double> lloyd_max_positive_levels(const CoordinateModel& model, int half_count) {
  constexpr double kTolerance = 1e-12;
  constexpr int kMaxIterations = 100000;
  // Start evenly spaced over [0, 3 sigma], kept inside the support (which
  // is narrower than 3 sigma for small D, where the sphere ends at x = 1).
  const double support = model.support();
  const double spread = std::min(3.0 * model.standard_deviation(), support);
  std::vector<double> levels(half_count);
  for (int j = 0; j < half_count; ++j) levels[j] = spread * (j + 0.5) / half_count;

  std::vector<double> boundaries(half_count + 1);
  boundaries.front() = 0.0;
  boundaries.back() = support;
  for (int iteration = 0; iteration < kMaxIterations; ++iteration) {
    for (int j = 1; j < half_count; ++j) boundaries[j] = 0.5 * (levels[j - 1] + levels[j]);
    double max_change = 0.0;
    for (int j = 0; j < half_count; ++j) {
      double mass = 0.0;
      double first_moment = 0.0;
      model.for_each_node(boundaries[j], boundaries[j + 1], [&](double x, double w) {
        mass += w;
        first_moment += w * x;
      });
      const double centroid = first_moment / mass;
      max_change = std::max(max_change, std::abs(centroid - levels[j]));
      levels[j] = centroid;
    }
    if (max_change < kTolerance) break;
  }
  return levels;
}

std::vector<float> compute_lloyd_max_centroids(int bits, int head_dim, CoordinateDensity density) {
  const int half_count = 1 << (bits - 1);
  const std::vector<double> positive =
      lloyd_max_positive_levels(CoordinateModel(density, head_dim), half_count);
  std::vector<float> centroids(2 * half_count);
  for (int j = 0; j < half_count; ++j) {
    centroids[half_count + j] = static_cast<float>(positive[j]);
    centroids[half_count - 1 - j] = -static_cast<float>(positive[j]);
  }
  return centroids;
}

}  // namespace

const std::vector<float>& lloyd_max_centroids(int bits, int head_dim, CoordinateDensity density) {
  TQ_REQUIRE(bits >= kMinBits && bits <= kMaxBits, "bits",
          std::to_string(bits) + " is not supported; accepted: " + std::to_string(kMinBits) + " to " +
              std::to_string(kMaxBits));
  validate_head_dim(head_dim);
  validate_density(density);

  using Key = std::tuple<int, int, CoordinateDensity>;
  // std::map never moves its elements, so returned references stay valid.
  static std::mutex mutex;
  static std::map<Key, std::vector<float>> cache;
  const Key key{bits, head_dim, density};
  {
    const std::lock_guard lock(mutex);
    if (const auto found = cache.find(key); found != cache.end()) return found->second;
  }
  // Computed outside the lock so other keys are not blocked; if two threads
  // race on one key, both results are identical and the first one is kept.
  std::vector<float> centroids = compute_lloyd_max_centroids(bits, head_dim, density);
  const std::lock_guard lock(mutex);
  return cache.try_emplace(key, std::move(centroids)).first->second;
}

double lloyd_max_unit_vector_mse(const std::vector<float>& centroids, int head_dim, CoordinateDensity density) {
  TQ_REQUIRE(!centroids.empty(), "centroids", "is empty; accepted: at least one level");
  TQ_REQUIRE(std::is_sorted(centroids.begin(), centroids.end()), "centroids",
          "levels are not sorted in ascending order");
  validate_head_dim(head_dim);
  validate_density(density);

  const CoordinateModel model(density, head_dim);
  const double support = model.support();
  double mass = 0.0;
  double squared_error = 0.0;
  // Cell i holds the x nearest to centroids[i]: it spans the midpoints to its
  // neighbours, clipped to the support.
  for (std::size_t i = 0; i < centroids.size(); ++i) {
    const double level = centroids[i];
    const double lower = i == 0 ? -support : 0.5 * (static_cast<double>(centroids[i - 1]) + level);
    const double upper = i + 1 == centroids.size() ? support : 0.5 * (level + static_cast<double>(centroids[i + 1]));
    const double a = std::clamp(lower, -support, support);
    const double b = std::clamp(upper, -support, support);
    model.for_each_node(a, b, [&](double x, double w) {
      mass += w;
      squared_error += w * (x - level) * (x - level);
    });
  }
  return head_dim * squared_error / mass;
}

int nearest_centroid(const float* centroids, int count, float x) {
  TQ_REQUIRE(count >= 1, "count", std::to_string(count) + " centroids given; accepted: >= 1");
  TQ_REQUIRE(centroids != nullptr, "centroids", "is null; a table of count levels is required");
  // The reference rule: fp32 distances, strict '<' so a tie keeps the lower index.
  int best = 0;
  float best_distance = std::abs(x - centroids[0]);
  for (int i = 1; i < count; ++i) {
    const float distance = std::abs(x - centroids[i]);
    if (distance < best_distance) {
      best = i;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace tqdecode
