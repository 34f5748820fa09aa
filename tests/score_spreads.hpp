// Score distributions of the accuracy tests, and for each the tolerance of a
// GPU decode against the CPU reference on the same cache bytes (relative L2
// error, fp16 queries and outputs). Each tolerance sits near the error the
// GPU kernels measure and below what a small bug does: a 2 % error on the
// value scale and zero of every 16th token must fail it
// (ScoreSpreads.ToleranceCatchesATwoPercentValueErrorOnEvery16thToken).
#pragma once

#include <array>

namespace tqdecode::test {

struct ScoreSpread {
  const char* name;
  float query_amplitude;  ///< ScenarioConfig::query_amplitude
  double tolerance;       ///< relative L2 error of the GPU output against the CPU reference
};

// flat: nearly every token carries weight; moderate: a few percent of the
// tokens; peaked: the synthetic data's own queries; sharp: queries times 8,
// where fp16 rounding of the key operands shows most.
inline constexpr std::array<ScoreSpread, 4> kScoreSpreads = {{
    {"flat", 0.05f, 6e-4},
    {"moderate", 0.3f, 8e-4},
    {"peaked", 1.0f, 1.2e-3},
    {"sharp", 8.0f, 3e-3},
}};

}  // namespace tqdecode::test
