// The accuracy tests' tolerances catch small bugs: a 2 % error on the value
// scale and zero of every 16th token moves the reference output by more than
// each score spread's tolerance (tests/score_spreads.hpp), for every preset.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "score_spreads.hpp"
#include "support/scenario.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

/// The accuracy scenario of tests/gpu/test_accuracy_gpu.cpp at one spread.
Scenario spread_scenario(Preset preset, const ScoreSpread& spread) {
  ScenarioConfig config;
  config.preset = preset;
  config.num_q_heads = 32;
  config.num_kv_heads = 4;
  config.seq_lens = {700, 37, 1501, 257};
  config.query_dtype = DType::f16;
  config.query_amplitude = spread.query_amplitude;
  config.seed = 5;
  config.keep_unquantized = false;
  return make_scenario(config);
}

/// Multiplies the value scale and zero of every 16th token of every sequence by `factor`.
void scale_every_16th_value(Scenario& scenario, float factor) {
  const CacheLayout& layout = scenario.layout;
  for (int b = 0; b < scenario.batch(); ++b) {
    for (int t = 0; t < scenario.seq_lens[b]; t += 16) {
      const std::int64_t block = scenario.block_table[std::size_t(b) * scenario.max_blocks_per_seq + t / layout.block_size];
      std::uint8_t* base = scenario.cache.data() + layout.block_offset(block);
      for (int h = 0; h < layout.num_kv_heads; ++h) {
        for (const int field : {layout.value_scale_field(), layout.value_zero_field()}) {
          const std::uint16_t bits = read_field_bits(base, layout, t % layout.block_size, h, field);
          const std::uint16_t scaled = float_to_half_bits(half_bits_to_float(bits) * factor);
          std::memcpy(base + layout.field_offset(t % layout.block_size, h, field), &scaled, 2);
        }
      }
    }
  }
}

TEST(ScoreSpreads, ToleranceCatchesATwoPercentValueErrorOnEvery16thToken) {
  for (const Preset preset : kAllPresets) {
    for (const ScoreSpread& spread : kScoreSpreads) {
      Scenario scenario = spread_scenario(preset, spread);
      std::vector<float> expected(scenario.query.size()), bugged(scenario.query.size());
      decode_reference(scenario.host_args(), expected.data());
      scale_every_16th_value(scenario, 1.02f);
      decode_reference(scenario.host_args(), bugged.data());
      const double error = relative_l2(bugged, expected);
      std::printf("[ measure  ] %-20s %-9s the bug moves the output by %.2e (tolerance %.1e)\n",
                  preset_info(preset).name, spread.name, error, spread.tolerance);
      EXPECT_GT(error, 1.2 * spread.tolerance) << preset_info(preset).name << " " << spread.name;
    }
  }
}

}  // namespace
}  // namespace tqdecode::test
