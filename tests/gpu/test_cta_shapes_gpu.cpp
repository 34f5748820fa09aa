// Every CTA shape of the tensor-core kernel on a split grid (N >= 2, so the
// in-kernel reduction of partitions runs), on the Hopper path and as the
// generic path's tensor-core kernel, against the CPU reference (the scalar
// kernel's split grids are Grid/DecodeGpu's; its group-16 merge draws
// racecheck's false report, docs/RELIABILITY.md): one long sequence sets the block table's width
// (and with it N), the others are short, so partitions past a sequence's end
// are empty too. Small enough for compute-sanitizer's memcheck and racecheck
// (scripts/gpu_check.sh runs CtaShapes.* under both).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

struct ShapeCase {
  std::string name;
  Preset preset;
  int group;
  int batch;
  int num_kv_heads;
  int context;  ///< block-table width in tokens (block size 16)
  int head_dim;
  // The plan expected on an H200 (132 SMs), from the policy (src/cuda/policy.cpp).
  bool wide_table;
  int kv_heads_per_cta;
  int num_partitions;
  CacheOrder order = CacheOrder::blocks;
  bool renormalize = false;  ///< token_slots: decode-time norm correction
  bool token_runs = false;   ///< token_slots: every kv head's whole rows per CTA
  bool whole_rows = false;   ///< token_slots, 4-bit keys at eight kv heads per CTA: whole rows
};

std::vector<ShapeCase> shape_cases() {
  const Preset q4 = Preset::turboquant_4bit_nc;
  const CacheOrder slots = CacheOrder::token_slots;
  return {
      {"wide_one_kv_head", q4, 8, 1, 8, 4096, 128, true, 1, 16},
      {"wide_two_kv_heads", q4, 6, 48, 8, 2496, 128, true, 2, 2},
      {"wide_four_kv_heads", q4, 6, 38, 8, 4000, 128, true, 4, 5},
      {"wide_eight_kv_heads", q4, 8, 40, 8, 3008, 128, true, 8, 3},
      {"wide_two_head_tiles", q4, 16, 1, 2, 4096, 128, true, 1, 16},
      {"narrow_4bit_odd_hk", q4, 3, 300, 1, 1024, 128, false, 1, 4},
      {"narrow_k3v4", Preset::turboquant_k3v4_nc, 8, 48, 8, 2000, 128, false, 1, 2},
      {"narrow_k8v4_two_head_tiles", Preset::turboquant_k8v4, 12, 4, 2, 1504, 128, false, 1, 6},
      {"paired_3bit", Preset::turboquant_3bit_nc, 8, 2, 4, 2064, 128, false, 2, 9},
      {"d64_4bit", q4, 4, 2, 8, 4096, 64, false, 1, 16},
      {"d64_4bit_two_head_tiles", q4, 16, 3, 2, 2048, 64, false, 1, 8},
      {"d64_k8v4", Preset::turboquant_k8v4, 6, 2, 4, 1024, 64, false, 1, 4},
      {"d256_4bit", q4, 8, 2, 4, 4096, 256, false, 1, 16},
      {"d256_k8v4", Preset::turboquant_k8v4, 6, 3, 2, 2048, 256, false, 1, 8},
      {"d64_k3v4_odd_hk", Preset::turboquant_k3v4_nc, 8, 2, 3, 2048, 64, false, 1, 8},
      {"d64_k3v4_two_head_tiles", Preset::turboquant_k3v4_nc, 16, 3, 1, 1024, 64, false, 1, 4},
      {"d64_3bit", Preset::turboquant_3bit_nc, 4, 2, 5, 4096, 64, false, 1, 16},
      {"d64_3bit_two_head_tiles", Preset::turboquant_3bit_nc, 12, 3, 2, 1024, 64, false, 1, 4},
      {"d256_k3v4", Preset::turboquant_k3v4_nc, 4, 2, 4, 4096, 256, false, 1, 16},
      {"d256_3bit_odd_hk", Preset::turboquant_3bit_nc, 8, 3, 3, 2048, 256, false, 1, 8},
      // token_slots in whole token rows (one bulk copy per tile for a CTA's
      // 8 or 4 kv heads; two waves for 3bit), and the one-kv-head CTAs where
      // rows would not fill the GPU.
      {"rows_k8v4_eight_kv_heads", Preset::turboquant_k8v4, 2, 8, 64, 4096, 128, false, 8, 2, slots},
      {"rows_k8v4_four_kv_heads", Preset::turboquant_k8v4, 4, 21, 12, 4096, 128, false, 4, 2, slots},
      {"rows_k3v4_renormalized", Preset::turboquant_k3v4_nc, 8, 8, 64, 4096, 128, false, 8, 2, slots, true},
      {"rows_3bit_two_waves", Preset::turboquant_3bit_nc, 6, 22, 32, 6144, 128, false, 8, 3, slots, true},
      {"slots_k8v4_one_sequence", Preset::turboquant_k8v4, 8, 1, 8, 8192, 128, false, 1, 32, slots},
      // 4-bit keys in the wide shape at eight kv heads per CTA, where
      // one-kv-head CTAs would stream long ranges: whole rows without norm
      // correction (two kv head groups per token row) and with it on long
      // streams (N = 1), else a box per kv head.
      {"rows_4bit_two_head_groups", q4, 5, 4, 16, 20000, 128, true, 8, 16, slots, false, false, true},
      {"rows_4bit_renormalized", q4, 8, 132, 8, 33024, 128, true, 8, 1, slots, true, false, true},
      {"wide_4bit_eight_kv_heads_renormalized", q4, 8, 20, 8, 33024, 128, true, 8, 13, slots, true},
      // Tensor-parallel shards (Hk 2, 4; fp8 keys also 1) in token runs:
      // every kv head's rows, one bulk copy per tile of their contiguous run
      // (two waves for 3bit; one kv head in two 8-warp CTAs per SM); the
      // narrow configuration where the grid would not fill the GPU, and for
      // one kv head of the other presets.
      {"runs_4bit_four_kv_heads", q4, 8, 16, 4, 32768, 128, false, 4, 8, slots, true, true},
      {"runs_4bit_two_kv_heads", q4, 4, 64, 2, 8192, 128, false, 2, 2, slots, false, true},
      {"runs_k8v4_two_kv_heads", Preset::turboquant_k8v4, 4, 32, 2, 8192, 128, false, 2, 4, slots, false, true},
      {"runs_k3v4_four_kv_heads", Preset::turboquant_k3v4_nc, 8, 64, 4, 4096, 128, false, 4, 2, slots, true, true},
      {"runs_3bit_two_waves", Preset::turboquant_3bit_nc, 6, 264, 2, 4096, 128, false, 2, 1, slots, true, true},
      {"runs_k8v4_one_kv_head", Preset::turboquant_k8v4, 4, 64, 1, 8192, 128, false, 1, 4, slots, false, true},
      {"slots_4bit_one_kv_head", q4, 8, 16, 1, 32768, 128, false, 1, 16, slots, true},
      {"slots_4bit_one_kv_head_one_sequence", q4, 8, 1, 1, 8192, 128, false, 1, 32, slots, true},
  };
}

Scenario shape_scenario(const ShapeCase& c) {
  ScenarioConfig config;
  config.preset = c.preset;
  config.num_kv_heads = c.num_kv_heads;
  config.num_q_heads = c.group * c.num_kv_heads;
  config.block_size = 16;
  config.head_dim = c.head_dim;
  Rng rng(77);
  config.seq_lens.resize(c.batch);
  for (int& length : config.seq_lens) length = static_cast<int>(rng.below(200));
  config.spare_table_columns = 2;
  config.seq_lens[c.batch / 2] = c.context - 16 * config.spare_table_columns - 5;  // width = context tokens
  config.sinks = true;
  config.seed = 31;
  config.keep_unquantized = false;
  config.order = c.order;
  config.renormalize_keys = c.renormalize;
  return make_scenario(config);
}

class CtaShapes : public ::testing::TestWithParam<ShapeCase> {};

TEST_P(CtaShapes, SplitGridMatchesTheReference) {
  TQ_SKIP_WITHOUT_GPU();
  const ShapeCase& c = GetParam();
  const Scenario scenario = shape_scenario(c);
  ASSERT_EQ(scenario.max_blocks_per_seq * 16, c.context);
  std::vector<float> expected(scenario.query.size());
  decode_reference(scenario.host_args(), expected.data());
  DeviceScenario device(scenario);
  DecodeWorkspace workspace;

  const LaunchPlan plan = plan_decode(device.args());
  if (plan.path == DecodePath::hopper) {  // the shapes are the Hopper path's
    EXPECT_EQ(plan.wide_table, c.wide_table) << c.name;
    EXPECT_EQ(plan.kv_heads_per_cta, c.kv_heads_per_cta) << c.name;
    EXPECT_EQ(plan.num_partitions, c.num_partitions) << c.name;
    EXPECT_EQ(plan.token_runs, c.token_runs) << c.name;
    EXPECT_EQ(plan.whole_rows, c.whole_rows) << c.name;
  }
  for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic}) {
    const LaunchPlan used = plan_decode(device.args(), request);
    const std::string what = c.name + " " + decode_path_name(used.path) +
                             (used.path == DecodePath::cuda_generic ? std::string(" ") + generic_kernel_name(used.generic_kernel) : "") +
                             " N=" + std::to_string(used.num_partitions);
    device.poison_output();
    decode(device.args(), workspace, nullptr, request);
    const std::vector<float> output = device.output();
    expect_close(output, expected, what);
    const std::string zero = zero_row_failure(output, scenario);
    EXPECT_TRUE(zero.empty()) << what << ": " << zero;
  }
}

INSTANTIATE_TEST_SUITE_P(Split, CtaShapes, ::testing::ValuesIn(shape_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace tqdecode::test
