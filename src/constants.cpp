#include "tqdecode/constants.hpp"

#include <algorithm>
#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode {

ModelConstants make_model_constants(Preset preset, int head_dim, std::uint64_t seed, RotationKind rotation,
                                    CoordinateDensity density) {
  if (std::find(kAllPresets.begin(), kAllPresets.end(), preset) == kAllPresets.end()) {
    std::string names;
    for (Preset known : kAllPresets) names += (names.empty() ? "" : ", ") + std::string(preset_info(known).name);
    fail("preset", "unknown preset value " + std::to_string(static_cast<int>(preset)) + "; accepted: " + names);
  }
  TQ_REQUIRE(std::find(kHeadDims.begin(), kHeadDims.end(), head_dim) != kHeadDims.end(), "head_dim",
          std::to_string(head_dim) + " is not supported; accepted: " + accepted_list(kHeadDims));
  // Checked here even for fp8 keys, which use neither, so a bad value never passes silently.
  TQ_REQUIRE(rotation == RotationKind::hadamard || rotation == RotationKind::dense, "rotation",
          "unknown rotation kind " + std::to_string(static_cast<int>(rotation)) + "; accepted: hadamard, dense");
  TQ_REQUIRE(density == CoordinateDensity::sphere || density == CoordinateDensity::gaussian, "density",
          "unknown density value " + std::to_string(static_cast<int>(density)) + "; accepted: sphere, gaussian");

  ModelConstants constants{preset, head_dim, {}, {}, {}};
  const PresetInfo info = preset_info(preset);
  if (info.key_fp8) return constants;  // fp8 keys are neither rotated nor codebook-quantized
  constants.centroids = lloyd_max_centroids(info.key_bits, head_dim, density);
  constants.Pi = make_rotation(rotation, head_dim, seed);
  constants.PiT = transpose_square(constants.Pi, head_dim);
  return constants;
}

}  // namespace tqdecode
