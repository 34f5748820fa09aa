// Accuracy of every GPU kernel at four score spreads (tests/score_spreads.hpp:
// flat, moderate, peaked, sharp), every preset and head size: against the CPU
// reference on the same cache bytes within the spread's tolerance, which a
// 2 % error on the values of every 16th token exceeds, and against exact
// attention on the unquantized K/V (docs/FORMAT.md section 6b) within the
// reference's own quantization error plus that tolerance. fp16 queries, so
// the output's rounding (2^-11) stays below the tolerances; lengths that are
// not multiples of the tile; random block tables; poisoned outputs.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "score_spreads.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

struct AccuracyCase {
  Preset preset;
  int head_dim;
  ScoreSpread spread;
};

std::string case_name(const AccuracyCase& c) {
  return std::string(preset_info(c.preset).name).substr(11) + "_d" + std::to_string(c.head_dim) + "_" + c.spread.name;
}

std::vector<AccuracyCase> accuracy_cases() {
  std::vector<AccuracyCase> cases;
  for (const Preset preset : kAllPresets) {
    for (const int head_dim : kHeadDims) {
      for (const ScoreSpread& spread : kScoreSpreads) cases.push_back({preset, head_dim, spread});
    }
  }
  return cases;
}

class AccuracyGpu : public ::testing::TestWithParam<AccuracyCase> {};

TEST_P(AccuracyGpu, EveryKernelWithinTheSpreadsTolerance) {
  TQ_SKIP_WITHOUT_GPU();
  const AccuracyCase& c = GetParam();
  ScenarioConfig config;  // as tests/cpu/test_score_spreads.cpp, which checks the tolerance catches a small bug
  config.preset = c.preset;
  config.head_dim = c.head_dim;
  config.num_q_heads = 32;
  config.num_kv_heads = 4;
  config.seq_lens = {700, 37, 1501, 257};
  config.query_dtype = DType::f16;
  config.query_amplitude = c.spread.query_amplitude;
  config.seed = 5;
  const Scenario scenario = make_scenario(config);
  std::vector<float> reference(scenario.query.size());
  decode_reference(scenario.host_args(), reference.data());
  const std::vector<float> exact = scenario.exact_output();
  const double reference_vs_exact = relative_l2(reference, exact);

  DeviceScenario device(scenario);
  DecodeWorkspace workspace;
  const std::string name = case_name(c);
  for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
    const LaunchPlan plan = plan_decode(device.args(), request);
    const std::string kernel = std::string(decode_path_name(plan.path)) +
                               (plan.path == DecodePath::cuda_generic ? std::string(" ") + generic_kernel_name(plan.generic_kernel) : "");
    device.poison_output();
    decode(device.args(), workspace, nullptr, request);
    const std::vector<float> output = device.output();
    ErrorStats error{};
    const std::string failure = closeness_failure(output, reference, &error);  // finite, and the general bounds
    const double versus_exact = relative_l2(output, exact);
    std::printf("[ measure  ] %-24s %-28s rel_l2 %.2e (tolerance %.1e)  vs exact %.3e (reference %.3e)\n", name.c_str(),
                kernel.c_str(), error.relative_l2, c.spread.tolerance, versus_exact, reference_vs_exact);
    EXPECT_TRUE(failure.empty()) << name << " " << kernel << ": " << failure;
    EXPECT_LT(error.relative_l2, c.spread.tolerance) << name << " " << kernel;
    EXPECT_LT(versus_exact, reference_vs_exact + c.spread.tolerance) << name << " " << kernel;
  }
}

INSTANTIATE_TEST_SUITE_P(Spreads, AccuracyGpu, ::testing::ValuesIn(accuracy_cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace tqdecode::test
