// The model constants a cache is written and read with: codebook and rotation.
#pragma once

#include <cstdint>
#include <vector>

#include "tqdecode/codebook.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/rotation.hpp"

namespace tqdecode {

struct ModelConstants {
  Preset preset;
  int head_dim;
  std::vector<float> centroids;  ///< 2^key_bits sorted levels; empty for fp8 keys
  std::vector<float> Pi;         ///< D x D row-major rotation; empty for fp8 keys
  std::vector<float> PiT;        ///< its transpose
};

/// Builds the constants for a preset and head dim (defaults: Hadamard
/// rotation, exact sphere density).
ModelConstants make_model_constants(Preset preset, int head_dim, std::uint64_t seed,
                                    RotationKind rotation = RotationKind::hadamard,
                                    CoordinateDensity density = CoordinateDensity::sphere);

}  // namespace tqdecode
