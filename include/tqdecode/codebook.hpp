// Lloyd-Max scalar codebooks for one coordinate of a rotated unit vector
// (docs/FORMAT.md section 2).
#pragma once

#include <cstdint>
#include <vector>

namespace tqdecode {

/// Which density the levels are optimal for.
enum class CoordinateDensity : std::uint8_t {
  sphere,    ///< exact: f(x) ~ (1 - x^2)^((D-3)/2) on [-1, 1]
  gaussian,  ///< approximation N(0, 1/D)
};

/// 2^bits sorted Lloyd-Max levels (bits 1..4, head_dim >= 3). Deterministic;
/// results are cached per (bits, head_dim, density). Throws Error on bad input.
const std::vector<float>& lloyd_max_centroids(int bits, int head_dim,
                                              CoordinateDensity density = CoordinateDensity::sphere);

/// Expected squared error of one coordinate quantized with `centroids` under
/// `density`, times head_dim: the MSE of a whole unit vector (about 0.3634,
/// 0.1175, 0.0345, 0.0095 at 1..4 bits).
double lloyd_max_unit_vector_mse(const std::vector<float>& centroids, int head_dim,
                                 CoordinateDensity density = CoordinateDensity::sphere);

/// Index of the centroid nearest to `x` (ties to the lower index). Centroids sorted.
int nearest_centroid(const float* centroids, int count, float x);

}  // namespace tqdecode
