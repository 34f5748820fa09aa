// GPU decode against the CPU reference on the same cache bytes, the Hopper
// kernel against the generic kernel, and CUDA-graph replay against eager
// calls, in both cache orders (token_slots: every preset, with and without
// decode-time renormalization, both stride orders, padded slots and pages,
// served by the scalar kernel with a reason naming the order). Every output
// buffer is poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "cuda/policy.hpp"
#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode {
namespace {

using test::expect_close;

struct DecodeCase {
  std::string name;
  Preset preset;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  std::vector<int> seq_lens;
  std::int64_t padding = 0;
  bool sinks = false;
  DType dtype = DType::bf16;
  float value_amplitude = 1.0f;
  CacheOrder order = CacheOrder::blocks;
  bool renormalize = false;       ///< token_slots: decode-time norm correction
  bool heads_major = false;       ///< token_slots: the slots of a kv head side by side
  std::int64_t slot_padding = 0;  ///< token_slots: even bytes between slots
};

std::vector<int> random_lengths(int batch, int max_len, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<int> lengths(batch);
  for (int& length : lengths) length = static_cast<int>(rng.below(max_len + 1));
  return lengths;
}

std::vector<DecodeCase> decode_cases() {
  const Preset p4 = Preset::turboquant_4bit_nc;
  std::vector<DecodeCase> cases = {
      {"q4_g4_bs16_mixed", p4, 32, 8, 128, 16, {1, 17, 100, 1000, 3001, 0, 5000}},
      {"q4_g8_bs32_pad_sinks_f16", p4, 64, 8, 128, 32, {1, 17, 100, 1000, 3001, 0, 5000}, 48, true, DType::f16},
      {"q4_g16_bs64_sinks", p4, 32, 2, 128, 64, {4097, 33, 0, 1}, 0, true},
      {"q4_g6_bs128_f16", p4, 12, 2, 128, 128, {2500, 130}, 16, false, DType::f16},
      {"q4_g1_bs16", p4, 8, 8, 128, 16, {777}},
      {"q4_g3_short", p4, 3, 1, 128, 16, {1, 2, 15, 16, 31}, 0, true},
      {"q4_g5_bs32", p4, 10, 2, 128, 32, {1234, 4321}},
      {"q4_long_128k", p4, 64, 8, 128, 16, {131072 + 7}},
      {"q4_batch256", p4, 16, 4, 128, 16, random_lengths(256, 700, 5)},
      // Grids of several waves of CTAs (on an H200) with split partitions,
      // empty sequences, one and two head tiles, every preset (the b48 cases
      // of the other presets on two 8-warp CTAs per SM; their _d128 cases
      // below take two kv heads per 16-warp CTA).
      {"q4_b40_split_waves", p4, 64, 8, 128, 16, random_lengths(40, 3000, 11)},
      {"k3v4_b48_waves", Preset::turboquant_k3v4_nc, 64, 8, 128, 32, random_lengths(48, 2000, 12), 0, true},
      {"3bit_b48_waves_f16", Preset::turboquant_3bit_nc, 64, 8, 128, 16, random_lengths(48, 2000, 13), 16, false,
       DType::f16},
      {"k8v4_b48_waves", Preset::turboquant_k8v4, 64, 8, 128, 16, random_lengths(48, 2000, 14)},
      {"q4_g16_b101_waves_sinks", p4, 32, 2, 128, 16, random_lengths(101, 1500, 15), 0, true},
      // Two head tiles (12-warp CTAs) for the other key formats: a padded
      // second head tile (group 12) and 3-bit keys and values.
      {"k8v4_g12_sinks", Preset::turboquant_k8v4, 24, 2, 128, 16, {1500, 7, 0, 300}, 0, true},
      {"3bit_g16_bs32_f16", Preset::turboquant_3bit_nc, 32, 2, 128, 32, {1100, 33}, 0, false, DType::f16},
      // Two, four and eight kv heads per CTA (wide table, grids over two
      // waves; test_policy.cpp has each case's plan): N = 2, 5 with sinks,
      // fp16 and padded head tiles (group 6); q4_b40_split_waves takes eight
      // (N = 3), q4_batch256 four (group 4).
      {"q4_g6_b48_paired_split_sinks_f16", p4, 48, 8, 128, 16, random_lengths(48, 2500, 17), 0, true, DType::f16},
      {"q4_g6_b38_quad_split_sinks_f16", p4, 48, 8, 128, 16, random_lengths(38, 4000, 19), 0, true, DType::f16},
      // Eight kv heads per CTA, 1200 tokens each: 9600 per CTA.
      {"q4_b128_octo_1200", p4, 64, 8, 128, 16, [] {
         std::vector<int> lengths = random_lengths(128, 1200, 20);
         lengths[7] = 1200;
         return lengths;
       }()},
      // Two kv heads per CTA in one wave (one per CTA would take two) with
      // partitions of 5000 tokens.
      {"q4_b32_paired_long", p4, 64, 8, 128, 16, [] {
         std::vector<int> lengths = random_lengths(32, 3000, 21);
         lengths[3] = 5000;
         return lengths;
       }()},
      // Four kv heads per CTA with partitions over 8192 tokens.
      {"q4_b66_quad_long", p4, 64, 8, 128, 16, [] {
         std::vector<int> lengths = random_lengths(66, 2000, 18);
         lengths[5] = 9001;  // N = 1 (132 CTAs of four kv heads: one wave), so partitions of 9001 tokens
         return lengths;
       }()},
      // 2100 query rows of 3 heads: the rotation kernel's eight-rows-per-thread
      // variant with a partial last tile and rows crossing sequences.
      {"q4_g3_b700_rows", p4, 3, 1, 128, 16, random_lengths(700, 64, 16)},
      // One long sequence among short and empty ones (N = 4 for 32 work
      // items): the length-balanced partitions give it more than 32 slots,
      // so its slots past the reducer's 32 stay idle.
      {"q4_hk2_b16_one_long_sinks", p4, 16, 2, 128, 16, {3, 0, 40, 20000, 1, 0, 17, 5, 0, 100, 2, 0, 0, 64, 9, 1}, 0,
       true},
      // Values near 10^4: most tokens' value scales exceed what the lazy
      // rescale allows (p * scale would overflow fp16), so their tiles take
      // the exact softmax path; partitions and sinks too.
      {"q4_large_values", p4, 32, 8, 128, 16, {3000, 17, 1200, 0, 2500}, 0, true, DType::bf16, 10000.0f},
      {"k3v4_large_values", Preset::turboquant_k3v4_nc, 16, 4, 128, 16, {2000, 333}, 16, false, DType::f16, 10000.0f},
      {"q4_d64", p4, 16, 4, 64, 16, {1, 300, 2049}},
      {"q4_d256_sinks", p4, 16, 4, 256, 32, {0, 999}, 0, true},
      // Head sizes 64 and 256 on the tensor-core kernel (4-bit and fp8 keys):
      // one and two head tiles at D = 64 (groups 3, 8, 16), groups 1 to 16 at
      // D = 256 (over 8 in two row tiles of one head tile), every block size,
      // padded blocks, fp16 queries, sinks, large values, grids of several waves.
      {"q4_d64_g3_bs128_f16", p4, 9, 3, 64, 128, {8191, 1, 130, 0, 4000}, 16, false, DType::f16},
      {"q4_d64_g8_b40_waves", p4, 64, 8, 64, 16, random_lengths(40, 3000, 24), 0, true},
      {"q4_d64_g16_bs32_sinks", p4, 32, 2, 64, 32, {4097, 33, 0, 1}, 32, true},
      {"q4_d256_g6_bs16", p4, 12, 2, 256, 16, {5000, 17, 1, 0, 2049}, 0, false, DType::bf16},
      {"q4_d256_g8_bs64_pad_f16", p4, 32, 4, 256, 64, {3001, 100, 0, 1000}, 64, true, DType::f16},
      {"q4_d256_g1_b24_waves", p4, 8, 8, 256, 16, random_lengths(24, 2500, 25)},
      {"q4_d256_g16_row_tiles", p4, 32, 2, 256, 16, {1500, 7}, 0, true},
      {"q4_d256_g12_row_tiles_b30_waves", p4, 24, 2, 256, 32, random_lengths(30, 2500, 27), 16, false, DType::f16},
      {"k8v4_d256_g10_row_tiles", Preset::turboquant_k8v4, 20, 2, 256, 64, {4000, 1, 65, 0}, 0, true},
      {"q4_d256_large_values", p4, 16, 2, 256, 16, {3000, 17, 1200}, 0, true, DType::bf16, 10000.0f},
      {"k8v4_d64_g16_bs128", Preset::turboquant_k8v4, 32, 2, 64, 128, {3000, 1, 0, 129}, 16, true, DType::f16},
      {"k8v4_d256_g8_bs32_waves", Preset::turboquant_k8v4, 64, 8, 256, 32, random_lengths(20, 2000, 26), 0, true},
      {"k8v4_d256_g2_large_values", Preset::turboquant_k8v4, 4, 2, 256, 16, {2000, 333}, 16, false, DType::f16,
       10000.0f},
      // 3-bit keys at D = 64 (groups 3, 8, 16) and 256 (groups 1, 6, 8; 12
      // and 16 in two row tiles): odd and even kv head counts, whose records
      // start at every offset from a sector the layouts allow (0 to 24 bytes
      // at D = 64, k3v4), block sizes 16 to 128, padded blocks, fp16 queries,
      // sinks, large values.
      {"k3v4_d64_g3_bs128_pad_f16", Preset::turboquant_k3v4_nc, 9, 3, 64, 128, {8191, 1, 130, 0, 4000}, 16, false,
       DType::f16},
      {"k3v4_d64_g8_bs16_sinks", Preset::turboquant_k3v4_nc, 40, 5, 64, 16, random_lengths(12, 3000, 27), 0, true},
      {"k3v4_d64_g16_bs128_pad_sinks_f16", Preset::turboquant_k3v4_nc, 48, 3, 64, 128, {3000, 1, 0, 129}, 32, true,
       DType::f16},
      {"k3v4_d64_g8_b40_waves", Preset::turboquant_k3v4_nc, 64, 8, 64, 16, random_lengths(40, 3000, 28), 0, true},
      {"3bit_d64_g3_bs16_pad_sinks", Preset::turboquant_3bit_nc, 3, 1, 64, 16, {1, 2, 15, 16, 31, 2049}, 48, true},
      {"3bit_d64_g8_bs128_f16", Preset::turboquant_3bit_nc, 24, 3, 64, 128, {3000, 1, 0, 129}, 16, false, DType::f16},
      {"3bit_d64_g16_bs16_sinks", Preset::turboquant_3bit_nc, 32, 2, 64, 16, {4097, 33, 0, 1}, 0, true},
      {"k3v4_d256_g6_bs16", Preset::turboquant_k3v4_nc, 12, 2, 256, 16, {5000, 17, 1, 0, 2049}},
      {"k3v4_d256_g8_bs64_pad_sinks_f16", Preset::turboquant_k3v4_nc, 24, 3, 256, 64, {3001, 100, 0, 1000}, 64, true,
       DType::f16},
      {"k3v4_d256_g1_b24_waves", Preset::turboquant_k3v4_nc, 8, 8, 256, 16, random_lengths(24, 2500, 29)},
      {"k3v4_d256_g16_row_tiles", Preset::turboquant_k3v4_nc, 48, 3, 256, 16, {1500, 7, 0, 2049}, 0, true},
      {"3bit_d256_g12_row_tiles_f16", Preset::turboquant_3bit_nc, 24, 2, 256, 32, {4000, 1, 65}, 16, false,
       DType::f16},
      {"k3v4_d256_large_values", Preset::turboquant_k3v4_nc, 16, 2, 256, 16, {3000, 17, 1200}, 0, true, DType::bf16,
       10000.0f},
      {"3bit_d256_g8_bs32_waves_sinks", Preset::turboquant_3bit_nc, 64, 8, 256, 32, random_lengths(20, 2000, 30), 0,
       true},
      {"3bit_d256_g1_bs128_pad_f16", Preset::turboquant_3bit_nc, 5, 5, 256, 128, {2500, 130, 1}, 16, false, DType::f16},
      {"3bit_d256_g6_large_values", Preset::turboquant_3bit_nc, 6, 1, 256, 16, {2000, 333}, 16, false, DType::f16,
       10000.0f},
  };
  // The token_slots order: every preset in both renormalization modes (fp8
  // keys: raw only), head dims 64 / 128 / 256, groups 3 to 16, block sizes
  // 16 to 128, padded slots (`padding` then pads the page after them), both
  // stride orders, sinks, fp16 queries, and grids of several waves.
  int slots_variant = 0;
  for (const Preset preset : kAllPresets) {
    for (const bool renormalize : {true, false}) {
      if (renormalize && preset_info(preset).key_fp8) continue;
      const std::string name =
          "slots_" + std::string(preset_info(preset).name).substr(11) + (renormalize ? "_renorm" : "_raw");
      const bool odd = slots_variant++ % 2 == 1;
      const CacheOrder slots = CacheOrder::token_slots;
      cases.push_back({name + "_d128_g8", preset, 32, 4, 128, 16, {1, 17, 100, 1000, 3001, 0, 777}, 0, !odd,
                       DType::bf16, 1.0f, slots, renormalize});
      cases.push_back({name + "_d64_g4_heads_major_bs32", preset, 8, 2, 64, 32, {33, 2049, 0, 5}, 32, false,
                       DType::f16, 1.0f, slots, renormalize, true, 4});
      cases.push_back({name + "_d256_g16_bs64", preset, 32, 2, 256, 64, {999, 1, 130}, 48, true, DType::bf16, 1.0f,
                       slots, renormalize, odd, 2});
      cases.push_back({name + "_d128_g3_bs128", preset, 6, 2, 128, 128, {2500, 129, 1}, 0, false, DType::f16, 1.0f,
                       slots, renormalize, odd});
    }
  }
  cases.push_back({"slots_4bit_renorm_b48_waves", p4, 64, 8, 128, 16, random_lengths(48, 2000, 22), 0, false,
                   DType::bf16, 1.0f, CacheOrder::token_slots, true});
  // vLLM's shapes: 8 kv heads, and the 1- and 2-kv-head shards (slot
  // offsets at every residue mod 16); groups over 8 at D = 128 (two head tiles).
  cases.push_back({"slots_4bit_renorm_hk8_g8_bs16", p4, 64, 8, 128, 16, random_lengths(6, 3000, 24), 0, false,
                   DType::bf16, 1.0f, CacheOrder::token_slots, true});
  cases.push_back({"slots_4bit_raw_hk1_g8", p4, 8, 1, 128, 16, {2047, 1, 513}, 0, true, DType::f16, 1.0f,
                   CacheOrder::token_slots, false});
  // The wide shape's bulk copies (token rows of 16-byte multiples): group 16
  // (two head tiles), padded slots and pages, fp16 queries with sinks.
  cases.push_back({"slots_4bit_raw_hk8_g16_bulk", p4, 128, 8, 128, 16, {1000, 4097, 31}, 0, false, DType::bf16, 1.0f,
                   CacheOrder::token_slots, false});
  cases.push_back({"slots_4bit_renorm_hk8_g4_bulk_padded_bs64", p4, 32, 8, 128, 64, {3000, 2, 65, 640}, 128, true,
                   DType::f16, 1.0f, CacheOrder::token_slots, true, false, 2});
  // Values near 10^4 over token_slots (value scales for which p x scale
  // would overflow fp16 at the lazy rescale's p <= 16, and value ranges past
  // fp16's largest value): 8 kv heads in boxes or whole rows, a shard of 2 in
  // token runs.
  cases.push_back({"slots_4bit_renorm_hk8_large_values", p4, 64, 8, 128, 16, random_lengths(6, 3000, 26), 0, true,
                   DType::bf16, 10000.0f, CacheOrder::token_slots, true});
  cases.push_back({"slots_k8v4_hk8_large_values", Preset::turboquant_k8v4, 64, 8, 128, 16, {2500, 17, 900}, 0,
                   false, DType::f16, 10000.0f, CacheOrder::token_slots, false});
  cases.push_back({"slots_k3v4_renorm_hk2_large_values", Preset::turboquant_k3v4_nc, 16, 2, 128, 16, {2000, 333}, 0,
                   false, DType::bf16, 10000.0f, CacheOrder::token_slots, true});
  // Length-balanced partitions over slots: one long sequence beside short
  // and empty ones, one kv head per CTA (4-bit) and whole token rows (fp8).
  cases.push_back({"slots_4bit_renorm_hk2_b16_one_long", p4, 16, 2, 128, 16,
                   {3, 0, 40, 20000, 1, 0, 17, 5, 0, 100, 2, 0, 0, 64, 9, 1}, 0, false, DType::bf16, 1.0f,
                   CacheOrder::token_slots, true});
  cases.push_back({"slots_k8v4_hk8_b4_one_long_sinks", Preset::turboquant_k8v4, 64, 8, 128, 16, {0, 30000, 5, 700}, 0,
                   true, DType::bf16, 1.0f, CacheOrder::token_slots, false});
  cases.push_back({"slots_k3v4_renorm_hk2_g8", Preset::turboquant_k3v4_nc, 16, 2, 128, 16, {1999, 40}, 0, false,
                   DType::bf16, 1.0f, CacheOrder::token_slots, true});
  cases.push_back({"slots_3bit_renorm_hk1_g16_d128", Preset::turboquant_3bit_nc, 16, 1, 128, 32, {1500, 3}, 0, true,
                   DType::bf16, 1.0f, CacheOrder::token_slots, true});
  cases.push_back({"slots_4bit_renorm_g12_d128_padded", p4, 24, 2, 128, 16, {777, 2100}, 32, false, DType::f16, 1.0f,
                   CacheOrder::token_slots, true, false, 6});
  // D = 128 with blocks off 16-byte boundaries (a page padded by 2 bytes): the repack.
  cases.push_back({"slots_3bit_renorm_d128_g8_page_padding_2", Preset::turboquant_3bit_nc, 16, 2, 128, 16, {1200, 33, 0},
                   2, false, DType::bf16, 1.0f, CacheOrder::token_slots, true});
  cases.push_back({"slots_k8v4_hk1_g8_d128", Preset::turboquant_k8v4, 8, 1, 128, 64, {3001, 65}, 0, false,
                   DType::bf16, 1.0f, CacheOrder::token_slots, false});
  // fp8 keys read rotated (4 kv heads: 784-byte token rows) at two head tiles.
  cases.push_back({"slots_k8v4_raw_hk4_g16_d128_rotated", Preset::turboquant_k8v4, 64, 4, 128, 32, {2500, 47, 1},
                   0, true, DType::f16, 1.0f, CacheOrder::token_slots, false});
  cases.push_back({"slots_k8v4_b40_waves_heads_major", Preset::turboquant_k8v4, 64, 8, 128, 16,
                   random_lengths(40, 1500, 23), 16, true, DType::bf16, 1.0f, CacheOrder::token_slots, false, true});
  const Preset others[] = {Preset::turboquant_k3v4_nc, Preset::turboquant_3bit_nc, Preset::turboquant_k8v4};
  const int dims[] = {64, 128, 256};
  int variant = 0;
  for (Preset preset : others) {
    for (int d : dims) {
      const int block_size = 16 << (variant % 3);
      cases.push_back({std::string(preset_info(preset).name).substr(11) + "_d" + std::to_string(d), preset, 16, 4, d,
                       block_size, {1, 100, 1500, 0, 2049 + variant}, variant % 2 ? 32 : 0, variant % 2 == 0,
                       variant % 2 ? DType::f16 : DType::bf16});
      ++variant;
    }
  }
  return cases;
}

Scenario build(const DecodeCase& c, std::uint64_t seed = 7) {
  ScenarioConfig config;
  config.preset = c.preset;
  config.num_q_heads = c.num_q_heads;
  config.num_kv_heads = c.num_kv_heads;
  config.head_dim = c.head_dim;
  config.block_size = c.block_size;
  config.seq_lens = c.seq_lens;
  config.block_stride_padding = c.padding;
  config.sinks = c.sinks;
  config.query_dtype = c.dtype;
  config.value_amplitude = c.value_amplitude;
  config.order = c.order;
  config.renormalize_keys = c.renormalize;
  config.heads_major = c.heads_major;
  config.slot_padding = c.slot_padding;
  config.seed = seed;
  config.keep_unquantized = false;
  return make_scenario(config);
}

void expect_zero_rows(const std::vector<float>& output, const Scenario& scenario) {
  const std::string failure = test::zero_row_failure(output, scenario);
  EXPECT_TRUE(failure.empty()) << failure;
}

class DecodeGpu : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DecodeGpu, MatchesCpuReferenceOnSameCacheBytes) {
  TQ_SKIP_WITHOUT_GPU();
  const DecodeCase& c = GetParam();
  const Scenario scenario = build(c);
  DeviceScenario device(scenario);
  DecodeWorkspace workspace;
  const std::vector<float> expected = scenario.reference_output();

  const PathChoice choice = choose_decode_path(device.args());
  const LaunchPlan plan = plan_decode(device.args());
  const std::string shape = plan.wide_table ? ", wide-table shape, " + std::to_string(plan.kv_heads_per_cta) + " kv head(s) per CTA"
                            : plan.token_runs ? ", token runs of " + std::to_string(plan.kv_heads_per_cta) + " kv head(s) per CTA"
                            : plan.kv_heads_per_cta > 1 ? ", " + std::to_string(plan.kv_heads_per_cta) + " kv heads per CTA"
                                                        : "";
  std::printf("[ path     ] %s: %s (%s), N = %d%s\n", c.name.c_str(), decode_path_name(choice.path),
              choice.reason.c_str(), plan.num_partitions, shape.c_str());
  if (c.order == CacheOrder::token_slots) {  // the tensor-core kernels read both orders
    if (is_available()) {
      EXPECT_EQ(plan.path, DecodePath::hopper) << plan.reason;
    } else {
      EXPECT_EQ(plan.generic_kernel, GenericKernel::tensor_core) << plan.reason;
    }
    EXPECT_NE(plan.reason.find("token_slots order"), std::string::npos) << plan.reason;
    // The wide shape's bulk copies: 4-bit keys at D = 128 on sm_90, token
    // rows (and blocks) on 16-byte boundaries holding every kv head's slot.
    const CacheLayout& layout = device.args().layout;
    const bool bulk = is_available() && layout.preset == Preset::turboquant_4bit_nc && layout.head_dim == 128 &&
                      layout.token_stride % 16 == 0 && layout.block_stride % 16 == 0 &&
                      (layout.num_kv_heads - 1) * layout.head_stride + layout.slot_bytes() <= layout.token_stride;
    EXPECT_EQ(plan.wide_table, bulk) << plan.reason;
    // Slots read where they land at D = 128 with blocks on 16-byte boundaries
    // (fp8 keys in token rows of 16-byte multiples: aligned loads of rotated
    // data), else repacked; the other presets at D = 128 up to group 8 in
    // whole token rows of 8 (or 4) kv heads side by side where the grid fills
    // the GPU with long enough partitions (CtaShapes has those grids).
    const bool in_place = layout.head_dim == 128 && layout.block_stride % 16 == 0;
    const bool rotated = in_place && layout.token_stride % 16 == 0 && layout.preset == Preset::turboquant_k8v4;
    // Token runs: every kv head's rows (Hk = 2 or 4, dense rows; fp8 keys also 1) per CTA.
    const bool runs = plan.token_runs;
    const bool rows = !bulk && !runs && plan.kv_heads_per_cta > 1;
    if (runs) {
      EXPECT_TRUE(is_available() && in_place && !bulk && plan.kv_heads_per_cta == layout.num_kv_heads &&
                  (layout.num_kv_heads == 2 || layout.num_kv_heads == 4 ||
                   (layout.num_kv_heads == 1 && layout.preset == Preset::turboquant_k8v4)) &&
                  layout.token_stride == layout.num_kv_heads * layout.slot_bytes() &&
                  c.num_q_heads <= 8 * c.num_kv_heads)
          << plan.reason;
    } else if (rows) {
      EXPECT_TRUE(in_place && layout.token_stride % 16 == 0 && layout.head_stride == layout.slot_bytes() &&
                  layout.num_kv_heads % plan.kv_heads_per_cta == 0 && c.num_q_heads <= 8 * c.num_kv_heads)
          << plan.reason;
    } else if (!bulk) {
      EXPECT_EQ(plan.kv_heads_per_cta, 1);
    }
    // 4-bit keys in the wide shape: eight kv heads per CTA in whole rows (LaunchPlan::whole_rows), read rotated.
    const char* access = bulk && plan.whole_rows ? "(whole token rows by bulk copies, read in place, rotated)"
                         : bulk     ? "(bulk copies, read in place)"
                         : runs     ? "(token runs of every kv head by bulk copies, read in place)"
                         : rows     ? "(whole token rows by bulk copies, read in place"
                         : rotated  ? "(read in place, rotated)"
                         : in_place ? "(read in place)"
                                    : "(repacked)";
    EXPECT_NE(plan.reason.find(access), std::string::npos) << plan.reason;
  }
  decode(device.args(), workspace);
  const std::vector<float> automatic = device.output();
  expect_close(automatic, expected, c.name + " " + decode_path_name(choice.path));
  expect_zero_rows(automatic, scenario);

  // The other kernels that can serve the case: the generic path's
  // tensor-core kernel (sm_80 and newer) and its scalar kernel.
  for (const PathRequest request : {PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
    const LaunchPlan other = plan_decode(device.args(), request);
    if (other.path == plan.path && other.generic_kernel == plan.generic_kernel) continue;  // the automatic call's kernel
    if (request == PathRequest::cuda_generic_scalar && plan_decode(device.args(), PathRequest::cuda_generic).generic_kernel ==
                                                           GenericKernel::scalar) {
      continue;  // the cuda_generic request ran it
    }
    const std::string name = c.name + " cuda_generic " + generic_kernel_name(other.generic_kernel);
    std::printf("[ path     ] %s: N = %d\n", name.c_str(), other.num_partitions);
    device.poison_output();
    decode(device.args(), workspace, nullptr, request);
    const std::vector<float> generic = device.output();
    expect_close(generic, expected, name);
    expect_close(generic, automatic, name + " vs automatic");
    expect_zero_rows(generic, scenario);
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, DecodeGpu, ::testing::ValuesIn(decode_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(DecodeGpuPath, HopperKernelServesEveryPresetAtHeadDims64To256OnSm90) {
  TQ_SKIP_WITHOUT_GPU();
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  const bool sm90 = major == 9 && minor == 0;
  EXPECT_EQ(is_available(), sm90);
  for (const Preset preset : kAllPresets) {
    const Scenario scenario = build({"preset", preset, 32, 8, 128, 16, {100}});
    DeviceScenario device(scenario);
    const PathChoice choice = choose_decode_path(device.args());
    EXPECT_EQ(choice.path, sm90 ? DecodePath::hopper : DecodePath::cuda_generic) << preset_info(preset).name;
    EXPECT_FALSE(choice.reason.empty());
  }
  // Head sizes 64 and 256: the tensor-core kernel for every preset (at D =
  // 256 groups over 8 in two row tiles).
  for (const Preset preset : kAllPresets) {
    for (const int d : {64, 256}) {
      const Scenario scenario = build({"d", preset, 32, 8, d, 16, {100}});
      DeviceScenario device(scenario);
      const LaunchPlan plan = plan_decode(device.args());
      EXPECT_EQ(plan.path, sm90 ? DecodePath::hopper : DecodePath::cuda_generic) << d << " " << plan.reason;
      if (!sm90) EXPECT_EQ(plan.generic_kernel, GenericKernel::tensor_core) << d << " " << plan.reason;
      EXPECT_FALSE(plan.wide_table);
      EXPECT_EQ(plan.kv_heads_per_cta, 1);
    }
  }
  const Scenario large_group = build({"d256_g16", Preset::turboquant_4bit_nc, 32, 2, 256, 16, {100}});
  DeviceScenario large_group_device(large_group);
  const LaunchPlan row_tiles = plan_decode(large_group_device.args());
  EXPECT_EQ(row_tiles.path, sm90 ? DecodePath::hopper : DecodePath::cuda_generic) << row_tiles.reason;
  if (!sm90) EXPECT_EQ(row_tiles.generic_kernel, GenericKernel::tensor_core) << row_tiles.reason;
  EXPECT_NE(row_tiles.reason.find("2 row tiles"), std::string::npos) << row_tiles.reason;
}

TEST(DecodeGpuPath, GenericPathTakesTheTensorCoreKernelOnSm80AndNewerUnlessTheScalarIsRequested) {
  TQ_SKIP_WITHOUT_GPU();
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  const Scenario scenario = build({"generic", Preset::turboquant_k3v4_nc, 32, 8, 128, 16, {100}});
  DeviceScenario device(scenario);
  const LaunchPlan generic = plan_decode(device.args(), PathRequest::cuda_generic);
  EXPECT_EQ(generic.path, DecodePath::cuda_generic);
  // The k3v4 CTA (74 KB) fits every sm_80-and-newer part's shared memory.
  EXPECT_EQ(generic.generic_kernel, major >= 8 ? GenericKernel::tensor_core : GenericKernel::scalar) << generic.reason;
  const LaunchPlan scalar = plan_decode(device.args(), PathRequest::cuda_generic_scalar);
  EXPECT_EQ(scalar.path, DecodePath::cuda_generic);
  EXPECT_EQ(scalar.generic_kernel, GenericKernel::scalar);
  EXPECT_NE(scalar.reason.find("scalar kernel was requested"), std::string::npos) << scalar.reason;
}

// The plan cache keys on everything that chooses a plan: token_slots caches
// of the same shapes but other strides, or the other norm-correction mode,
// get their own plans (token runs only for dense rows; eight kv heads per
// 4-bit CTA only without norm correction at these lengths), each decoding
// to the reference in one process.
TEST(DecodeGpuPlans, TokenSlotsStridesAndNormCorrectionGetTheirOwnPlans) {
  TQ_SKIP_WITHOUT_GPU();
  const std::vector<int> lengths = {16400, 3000, 1, 700, 2222, 0, 1500, 5, 64, 999, 17, 4000, 33, 250, 1024, 16};
  const DecodeCase dense{"plans_k8v4_dense", Preset::turboquant_k8v4, 16, 2, 128, 16, lengths, 0, true,
                         DType::bf16, 1.0f, CacheOrder::token_slots};
  DecodeCase padded = dense;
  padded.name = "plans_k8v4_padded_slots";
  padded.slot_padding = 2;
  DecodeCase heads_major = dense;
  heads_major.name = "plans_k8v4_heads_major";
  heads_major.heads_major = true;
  const DecodeCase renormalized{"plans_4bit_renormalized", Preset::turboquant_4bit_nc, 64, 8, 128, 16, lengths, 0,
                                true, DType::bf16, 1.0f, CacheOrder::token_slots, true};
  DecodeCase unnormalized = renormalized;
  unnormalized.name = "plans_4bit_unnormalized";
  unnormalized.renormalize = false;
  std::vector<LaunchPlan> plans;
  for (const DecodeCase& c : {dense, padded, heads_major, renormalized, unnormalized}) {
    const Scenario scenario = build(c);
    DeviceScenario device(scenario);
    DecodeWorkspace workspace;
    plans.push_back(plan_decode(device.args()));
    device.poison_output();
    decode(device.args(), workspace);
    expect_close(device.output(), scenario.reference_output(), c.name);
  }
  if (is_available()) {
    EXPECT_TRUE(plans[0].token_runs) << plans[0].reason;
    EXPECT_FALSE(plans[1].token_runs) << plans[1].reason;
    EXPECT_FALSE(plans[2].token_runs) << plans[2].reason;
    // With norm correction one kv head per CTA for a 16400-token stream, or on a device of little DRAM bandwidth per
    // SM cycle (cuda::kSlotsBoxesMinBytesPerSmCycle) four in half rows (N = 4, 4100 tokens a CTA; eight: N = 8).
    const bool memory_bound = cuda::slot_boxes_memory_bound(cuda::current_device_info().memory_bytes_per_sm_cycle);
    EXPECT_EQ(plans[3].kv_heads_per_cta, memory_bound ? 4 : 1) << plans[3].reason;
    EXPECT_EQ(plans[3].whole_rows, memory_bound) << plans[3].reason;
    if (memory_bound) EXPECT_EQ(plans[3].num_partitions, 4) << plans[3].reason;
    EXPECT_EQ(plans[4].kv_heads_per_cta, 8) << plans[4].reason;
  }
}

// On a device of little DRAM bandwidth per SM cycle, 64 norm-corrected 4-bit
// sequences of an 8192-token table take four kv heads per CTA in half rows
// and no partitions (eight would take two); elsewhere (an H200) a box per kv
// head and warp, never whole rows. Either way the decode matches the
// reference.
TEST(DecodeGpuPlans, HalfRowsOfFourKvHeadsWhereTheyNeedNoPartitions) {
  TQ_SKIP_WITHOUT_GPU();
  std::vector<int> lengths = random_lengths(64, 600, 41);
  lengths[9] = 8192 - 16 * 2;  // with the scenario's two spare columns, an 8192-token table
  const DecodeCase c{"plans_4bit_renormalized_half_rows",
                     Preset::turboquant_4bit_nc,
                     64,
                     8,
                     128,
                     16,
                     lengths,
                     0,
                     true,
                     DType::bf16,
                     1.0f,
                     CacheOrder::token_slots,
                     true};
  const Scenario scenario = build(c);
  DeviceScenario device(scenario);
  DecodeWorkspace workspace;
  const LaunchPlan plan = plan_decode(device.args());
  device.poison_output();
  decode(device.args(), workspace);
  expect_close(device.output(), scenario.reference_output(), c.name);
  if (!is_available()) return;  // not the Hopper path: its grid rules do not apply
  if (cuda::slot_boxes_memory_bound(cuda::current_device_info().memory_bytes_per_sm_cycle)) {
    EXPECT_EQ(plan.kv_heads_per_cta, 4) << plan.reason;
    EXPECT_EQ(plan.num_partitions, 1) << plan.reason;
    EXPECT_TRUE(plan.whole_rows) << plan.reason;
  } else {
    EXPECT_FALSE(plan.whole_rows) << plan.reason;
  }
}

// Capture one decode in a CUDA graph, then change seq_lens and block tables in
// place and replay: each replay must equal an eager call on the same inputs.
// Every path, in the blocks order and for a token_slots cache (padded,
// renormalized keys).
TEST(DecodeGpuGraph, ReplayWithNewLengthsAndBlockTablesMatchesEager) {
  TQ_SKIP_WITHOUT_GPU();
  const std::vector<int> captured_lengths = {3000, 1, 700, 2222, 0, 1500};
  const DecodeCase blocks{"graph", Preset::turboquant_4bit_nc, 32, 8, 128, 16, captured_lengths, 0, true};
  const DecodeCase slots{"graph_slots", Preset::turboquant_4bit_nc, 32, 8, 128, 16, captured_lengths, 64, true,
                         DType::bf16, 1.0f, CacheOrder::token_slots, true, false, 2};
  // fp8 keys in whole token rows (the CTA's shared ring): 16 sequences and
  // a table 16400 tokens wide, so the grid takes 8 kv heads per CTA.
  const DecodeCase fp8_rows{"graph_slots_k8v4_rows",
                            Preset::turboquant_k8v4,
                            64,
                            8,
                            128,
                            16,
                            {16400, 3000, 1, 700, 2222, 0, 1500, 5, 64, 999, 17, 4000, 33, 250, 1024, 16},
                            0,
                            true,
                            DType::bf16,
                            1.0f,
                            CacheOrder::token_slots,
                            false};
  // A two-kv-head shard's token runs (every kv head's rows per CTA), the
  // same lengths, renormalized 3-bit keys.
  DecodeCase runs = fp8_rows;
  runs.name = "graph_slots_k3v4_runs";
  runs.preset = Preset::turboquant_k3v4_nc;
  runs.num_q_heads = 16;
  runs.num_kv_heads = 2;
  runs.renormalize = true;
  for (const auto& [c, request] :
       {std::pair{blocks, PathRequest::automatic}, std::pair{blocks, PathRequest::cuda_generic},
        std::pair{blocks, PathRequest::cuda_generic_scalar}, std::pair{slots, PathRequest::automatic},
        std::pair{slots, PathRequest::cuda_generic}, std::pair{slots, PathRequest::cuda_generic_scalar},
        std::pair{fp8_rows, PathRequest::automatic}, std::pair{runs, PathRequest::automatic}}) {
    SCOPED_TRACE(c.name + " request " + std::to_string(static_cast<int>(request)));
    const Scenario scenario = build(c);
    DeviceScenario device(scenario);
    DecodeWorkspace workspace(16);
    const test::DecodeGraph graph(device.args(), workspace, request);
    if (c.name == fp8_rows.name && is_available()) EXPECT_EQ(plan_decode(device.args()).kv_heads_per_cta, 8);
    if (c.name == runs.name && is_available()) EXPECT_TRUE(plan_decode(device.args()).token_runs);

    Rng rng(99);
    const int batch = scenario.batch();
    for (int replay = 0; replay < 4; ++replay) {
      // Sequence i takes the blocks of sequence order[i] and a length no longer than that one's.
      const test::ReorderedSequences reordered = test::reorder_sequences(scenario, rng);
      std::vector<std::int32_t> lengths(batch);
      for (int i = 0; i < batch; ++i) {
        lengths[i] = static_cast<std::int32_t>(rng.below(scenario.seq_lens[reordered.order[i]] + 1));
      }
      device.upload_lengths(lengths, reordered.block_table);
      DecodeArgs host = scenario.host_args(nullptr);
      host.seq_lens = lengths.data();
      host.block_table = reordered.block_table.data();
      test::expect_replay_matches_eager_and_reference(graph, device, host, "graph replay " + std::to_string(replay));
    }
  }
}

// A token_slots cache: the Hopper kernel and the generic path's tensor-core
// kernel serve it, naming the order; a cache pointer that is even but not
// 16-byte aligned takes the scalar kernel, which says why, and decodes
// correctly; the same shapes in the blocks order are planned apart (the plan
// cache keys on the order).
TEST(DecodeGpuPath, TokenSlotsCachesTakeTheTensorCoreKernelsNamingTheOrder) {
  TQ_SKIP_WITHOUT_GPU();
  DecodeCase c{"path", Preset::turboquant_4bit_nc, 32, 8, 128, 16, {100, 37}};
  c.order = CacheOrder::token_slots;
  c.renormalize = true;
  const Scenario slots = build(c);
  DeviceScenario slots_device(slots);
  if (is_available()) {
    EXPECT_EQ(plan_decode(slots_device.args(), PathRequest::hopper).path, DecodePath::hopper);
    const LaunchPlan automatic = plan_decode(slots_device.args());
    EXPECT_EQ(automatic.path, DecodePath::hopper);
    EXPECT_NE(automatic.reason.find("token_slots order"), std::string::npos) << automatic.reason;
  }
  const LaunchPlan generic = plan_decode(slots_device.args(), PathRequest::cuda_generic);
  EXPECT_EQ(generic.path, DecodePath::cuda_generic);
  EXPECT_EQ(generic.generic_kernel, GenericKernel::tensor_core) << generic.reason;
  EXPECT_NE(generic.reason.find("token_slots order"), std::string::npos) << generic.reason;

  // The same bytes 2 bytes past a 16-byte boundary.
  std::uint8_t* shifted = nullptr;
  ASSERT_EQ(cudaMalloc(&shifted, slots.cache.size() + 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(shifted + 2, slots.cache.data(), slots.cache.size(), cudaMemcpyHostToDevice), cudaSuccess);
  DecodeArgs args = slots_device.args();
  args.cache = shifted + 2;
  const LaunchPlan unaligned = plan_decode(args);
  EXPECT_EQ(unaligned.path, DecodePath::cuda_generic);
  EXPECT_EQ(unaligned.generic_kernel, GenericKernel::scalar);
  EXPECT_NE(unaligned.reason.find("token_slots cache pointer not a multiple of 16"), std::string::npos)
      << unaligned.reason;
  DecodeWorkspace workspace;
  slots_device.poison_output();
  decode(args, workspace);
  expect_close(slots_device.output(), slots.reference_output(), "token_slots cache at a 2-byte offset");
  cudaFree(shifted);

  c.order = CacheOrder::blocks;
  const Scenario blocks = build(c);
  DeviceScenario blocks_device(blocks);
  EXPECT_EQ(plan_decode(blocks_device.args()).reason.find("token_slots"), std::string::npos);
  EXPECT_NE(plan_decode(slots_device.args()).reason.find("token_slots"), std::string::npos);
}

// The query is read through its strides: rows and heads padded apart, on
// and off 16-byte boundaries (the kernels load 16-byte chunks of a row where
// pointer and strides allow, else element by element), give the dense
// query's output bit for bit on every kernel that serves the case.
TEST(DecodeGpuQuery, StridedQueriesOnAndOffSixteenByteBoundariesMatchTheDenseQuery) {
  TQ_SKIP_WITHOUT_GPU();
  const Preset p4 = Preset::turboquant_4bit_nc;
  std::vector<DecodeCase> cases = {
      {"q4_blocks", p4, 64, 8, 128, 16, {1000, 37, 0, 2500}},
      {"q4_d64_g4", p4, 16, 4, 64, 16, {700, 9}},
      {"q4_d256_g8_f16", p4, 32, 4, 256, 16, {900, 1}, 0, false, DType::f16},
      {"q4_slots_nc", p4, 64, 8, 128, 16, {1000, 37, 0, 2500}},
      {"k8v4_slots", Preset::turboquant_k8v4, 64, 8, 128, 16, random_lengths(16, 4000, 21)},
      {"3bit_slots_nc", Preset::turboquant_3bit_nc, 64, 8, 128, 16, random_lengths(16, 4000, 22)},
      {"k3v4_slots_nc_sinks", Preset::turboquant_k3v4_nc, 16, 2, 128, 16, {3000, 5}, 0, true},
  };
  for (DecodeCase& c : cases) {
    if (c.name.find("slots") != std::string::npos) c.order = CacheOrder::token_slots;
    c.renormalize = c.name.find("_nc") != std::string::npos;
  }
  struct QueryLayout {
    const char* name;
    std::int64_t offset;       ///< elements before the first row
    std::int64_t head_pad;     ///< elements between heads past head_dim
    std::int64_t batch_extra;  ///< elements between rows past the padded heads
  };
  const QueryLayout layouts[] = {{"aligned, padded", 8, 8, 16}, {"2-byte offset, odd strides", 1, 1, 3}};
  for (const DecodeCase& c : cases) {
    const Scenario scenario = build(c);
    DeviceScenario device(scenario);
    DecodeWorkspace workspace;
    const int rows = scenario.query_rows();
    const int heads = c.num_q_heads;
    const int dims = c.head_dim;
    for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic}) {
      device.poison_output();
      decode(device.args(), workspace, nullptr, request);
      const std::vector<float> dense = device.output();
      expect_close(dense, scenario.reference_output(), c.name + " dense query");
      for (const QueryLayout& q : layouts) {
        const std::int64_t stride_head = dims + q.head_pad;
        const std::int64_t stride_batch = heads * stride_head + q.batch_extra;
        std::vector<std::uint16_t> padded(q.offset + rows * stride_batch, 0xffff);  // NaN where no element is
        for (int r = 0; r < rows; ++r) {
          for (int h = 0; h < heads; ++h) {
            std::copy_n(scenario.query_bits.begin() + (std::int64_t(r) * heads + h) * dims, dims,
                        padded.begin() + q.offset + r * stride_batch + h * stride_head);
          }
        }
        const test::DeviceBuffer<std::uint16_t> query(padded);
        DecodeArgs args = device.args();
        args.query = query.get() + q.offset;
        args.query_stride_batch = stride_batch;
        args.query_stride_head = stride_head;
        device.poison_output();
        decode(args, workspace, nullptr, request);
        const std::string what = c.name + " " + (request == PathRequest::automatic ? "automatic" : "cuda_generic") +
                                 ", query " + q.name;
        EXPECT_EQ(test::bitwise_mismatches(device.output(), dense), 0u) << what;
      }
    }
  }
}

// Decodes `batch` sequences of 40 tokens (Hq 32, D 128) into the workspace's pooled output, which it returns.
void* pooled_decode(DecodeWorkspace& workspace, int batch) {
  const Scenario scenario = build({"pool", Preset::turboquant_4bit_nc, 32, 8, 128, 16, std::vector<int>(batch, 40)});
  DeviceScenario device(scenario);
  DecodeArgs args = device.args();
  args.output = nullptr;  // ask for the pooled output
  void* const output = decode(args, workspace);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return output;
}

// A pool sized for one bucket serves every batch up to it from the same pointers.
TEST(DecodeGpuPool, PointersStableAcrossBatchSizes) {
  TQ_SKIP_WITHOUT_GPU();
  DecodeWorkspace workspace(64);
  std::vector<void*> outputs;
  for (int batch : {1, 7, 64}) outputs.push_back(pooled_decode(workspace, batch));
  EXPECT_EQ(outputs[0], outputs[1]);
  EXPECT_EQ(outputs[1], outputs[2]);
  const DecodeWorkspace::Stats stats = workspace.stats();
  ASSERT_EQ(stats.entries.size(), 1u);
  EXPECT_EQ(stats.entries[0].bucket_batch, 64);
  EXPECT_GT(stats.total_bytes, 0);
}

// A growth retires the buffers it replaces until the workspace ends: a call
// of another thread that acquired them, or a graph captured on them, still
// runs on valid memory; stats count them.
TEST(DecodeGpuPool, AGrowthKeepsTheReplacedBuffersUntilTheWorkspaceEnds) {
  TQ_SKIP_WITHOUT_GPU();
  DecodeWorkspace workspace(8);
  std::vector<void*> outputs = {pooled_decode(workspace, 8)};
  std::vector<std::uint16_t> first_rows(8 * 32 * 128);  // bf16
  ASSERT_EQ(cudaMemcpy(first_rows.data(), outputs[0], first_rows.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  outputs.push_back(pooled_decode(workspace, 9));
  ASSERT_NE(outputs[0], outputs[1]);
  std::vector<std::uint16_t> retired(first_rows.size());
  ASSERT_EQ(cudaMemcpy(retired.data(), outputs[0], retired.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(retired, first_rows) << "the replaced pool's output was reused or freed";
  const DecodeWorkspace::Stats stats = workspace.stats();
  ASSERT_EQ(stats.entries.size(), 1u);
  EXPECT_EQ(stats.entries[0].bucket_batch, 16);
  EXPECT_GT(stats.total_bytes, stats.entries[0].bytes);
}

// The GPU rotations copy PiT in 16-byte units: a misaligned PiT is refused,
// naming it, before anything is launched.
TEST(DecodeGpuArguments, MisalignedPiTIsRefusedAndNothingIsWritten) {
  TQ_SKIP_WITHOUT_GPU();
  const Scenario scenario = build({"pit", Preset::turboquant_4bit_nc, 32, 8, 128, 16, {300, 5}});
  DeviceScenario device(scenario);
  const int d = scenario.layout.head_dim;
  float* shifted = nullptr;
  ASSERT_EQ(cudaMalloc(&shifted, (std::size_t(d) * d + 1) * sizeof(float)), cudaSuccess);
  DecodeArgs args = device.args();
  ASSERT_EQ(cudaMemcpy(shifted + 1, args.PiT, std::size_t(d) * d * sizeof(float), cudaMemcpyDeviceToDevice), cudaSuccess);
  args.PiT = shifted + 1;
  for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
    device.poison_output();
    DecodeWorkspace workspace;
    try {
      decode(args, workspace, nullptr, request);
      ADD_FAILURE() << "a PiT 4 bytes past a 16-byte boundary was accepted";
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find("PiT"), std::string::npos) << error.what();
    }
    for (const float value : device.output()) ASSERT_TRUE(std::isnan(value)) << "the output was written";
  }
  cudaFree(shifted);
}

// A device allocation holding the scenario's cache `offset` bytes past its
// (256-byte aligned) start, for pointers off the alignment the kernels want.
std::uint8_t* cache_copy_at(const Scenario& scenario, int offset) {
  std::uint8_t* allocation = nullptr;
  EXPECT_EQ(cudaMalloc(&allocation, scenario.cache.size() + offset), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(allocation + offset, scenario.cache.data(), scenario.cache.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  return allocation;
}

// The scalar kernel reads token_slots caches in 2-byte pieces: an odd
// cache pointer is refused, naming it, before anything is launched.
TEST(DecodeGpuArguments, OddTokenSlotsCachePointerIsRefusedAndNothingIsWritten) {
  TQ_SKIP_WITHOUT_GPU();
  DecodeCase c{"odd", Preset::turboquant_k3v4_nc, 8, 2, 128, 16, {300, 5}};
  c.order = CacheOrder::token_slots;
  const Scenario scenario = build(c);
  DeviceScenario device(scenario);
  std::uint8_t* shifted = cache_copy_at(scenario, 1);
  DecodeArgs args = device.args();
  args.cache = shifted + 1;
  for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic_scalar}) {
    device.poison_output();
    DecodeWorkspace workspace;
    try {
      decode(args, workspace, nullptr, request);
      ADD_FAILURE() << "an odd token_slots cache pointer was accepted";
    } catch (const Error& error) {
      EXPECT_EQ(error.argument(), "cache") << error.what();
    }
    for (const float value : device.output()) ASSERT_TRUE(std::isnan(value)) << "the output was written";
  }
  cudaFree(shifted);
}

// The plan cache keys the cache pointer's 16-byte alignment apart from the
// block stride's: token_slots pages of a stride off 16 bytes take the
// tensor-core kernel from an aligned pointer only, whichever call comes first.
TEST(DecodeGpuArguments, PlansKeyThePointersAlignmentApartFromTheBlockStrides) {
  TQ_SKIP_WITHOUT_GPU();
  DecodeCase c{"pages", Preset::turboquant_k3v4_nc, 16, 2, 128, 16, {300, 5}};
  c.order = CacheOrder::token_slots;
  c.padding = 2;
  const Scenario scenario = build(c);
  ASSERT_NE(scenario.layout.block_stride % 16, 0);
  DeviceScenario device(scenario);
  std::uint8_t* shifted = cache_copy_at(scenario, 2);
  DecodeArgs misaligned = device.args();
  misaligned.cache = shifted + 2;
  std::vector<float> expected(scenario.query.size());
  decode_reference(scenario.host_args(nullptr), expected.data());
  plan_decode(device.args());  // the aligned pointer's plan first
  const LaunchPlan misaligned_plan = plan_decode(misaligned);
  EXPECT_TRUE(misaligned_plan.path == DecodePath::cuda_generic && misaligned_plan.generic_kernel == GenericKernel::scalar)
      << misaligned_plan.reason;
  DecodeWorkspace workspace;
  device.poison_output();
  decode(misaligned, workspace, nullptr);
  expect_close(device.output(), expected, "misaligned pointer after an aligned one");
  cudaFree(shifted);
}

// Every GPU kernel has a call's sequences in its grid's z dimension: more
// are refused, naming batch, before a pool is allocated or anything launched.
TEST(DecodeGpuArguments, MoreSequencesThanAGridTakesAreRefusedBeforeAnyPool) {
  TQ_SKIP_WITHOUT_GPU();
  const Scenario scenario = build({"many", Preset::turboquant_4bit_nc, 8, 8, 128, 16, {40, 3}});
  DeviceScenario device(scenario);
  DecodeArgs args = device.args();
  args.batch = 65536;  // refused on its shape: the two-row tables are never read
  device.poison_output();
  DecodeWorkspace workspace;
  try {
    decode(args, workspace, nullptr);
    ADD_FAILURE() << "65536 sequences were accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), "batch") << error.what();
  }
  EXPECT_TRUE(workspace.stats().entries.empty()) << "a pool was allocated";
  for (const float value : device.output()) ASSERT_TRUE(std::isnan(value)) << "the output was written";
}

// With device checks off (the default), a length past the block table's
// coverage is clamped to it on every path and a negative one is empty:
// nothing past the sequence's row of the table is read (the rows follow each
// other in memory, so a read past one would take the next row's blocks; the
// last row ends the allocation, which memcheck watches).
TEST(DecodeGpuArguments, LengthsPastTheBlockTableAreClampedOnEveryPath) {
  TQ_SKIP_WITHOUT_GPU();
  for (const Preset preset : {Preset::turboquant_4bit_nc, Preset::turboquant_k3v4_nc, Preset::turboquant_k8v4}) {
    ScenarioConfig config;
    config.preset = preset;
    config.num_q_heads = 32;
    config.num_kv_heads = 8;
    config.seq_lens = {48 * 16, 48 * 16, 48 * 16, 48 * 16};  // whole blocks: every entry of every row is used
    config.spare_table_columns = 0;
    config.sinks = true;
    config.seed = 23;
    config.keep_unquantized = false;
    Scenario scenario = make_scenario(config);
    const int coverage = scenario.max_blocks_per_seq * scenario.layout.block_size;
    ASSERT_EQ(coverage, 48 * 16);
    // A read one position past row 0's coverage takes physical block 0:
    // through the table's next entry (row 1's first, made block 0 here, with
    // stored tokens), or through a copy of the table that fills entries past
    // a row with 0. Row 1 is empty, so no row reads block 0 legitimately;
    // its first slot's values get a zero of 2000 in every kv head, so even
    // one such read moves a row far outside its closeness bounds.
    const CacheLayout& layout = scenario.layout;
    std::vector<std::int32_t>& table = scenario.block_table;
    std::int32_t& next_row_block = table[std::size_t(scenario.max_blocks_per_seq)];
    const auto block_zero = std::find(table.begin(), table.end(), 0);
    if (block_zero != table.end()) {
      std::swap(*block_zero, next_row_block);
    } else {
      std::copy_n(scenario.cache.begin() + layout.block_offset(next_row_block), layout.block_stride,
                  scenario.cache.begin());
      next_row_block = 0;
    }
    for (int head = 0; head < layout.num_kv_heads; ++head) {
      write_field_bits(scenario.cache.data() + layout.block_offset(0), layout, 0, head, layout.value_zero_field(),
                       float_to_half_bits(2000.0f));
    }
    const std::vector<std::int32_t> lengths = {coverage + 1, -5, std::numeric_limits<std::int32_t>::max(), coverage + 999};
    const std::vector<std::int32_t> clamped = {coverage, 0, coverage, coverage};
    DecodeArgs host = scenario.host_args(nullptr);
    host.seq_lens = clamped.data();
    std::vector<float> expected(scenario.query.size());
    decode_reference(host, expected.data());

    DeviceScenario device(scenario);
    device.upload_lengths(lengths, scenario.block_table);
    DecodeWorkspace workspace;
    ASSERT_FALSE(workspace.device_checks());
    for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
      device.poison_output();
      decode(device.args(), workspace, nullptr, request);
      const std::vector<float> output = device.output();
      const std::string what = std::string(preset_info(preset).name) + " " + decode_path_name(plan_decode(device.args(), request).path);
      // Row by row: the other rows' outputs must not hide row 0's one extra token.
      const std::size_t row = output.size() / clamped.size();
      for (std::size_t b = 0; b < clamped.size(); ++b) {
        if (clamped[b] == 0) continue;  // zero_row_failure below
        const auto first = static_cast<std::ptrdiff_t>(b * row), last = static_cast<std::ptrdiff_t>((b + 1) * row);
        expect_close({output.begin() + first, output.begin() + last}, {expected.begin() + first, expected.begin() + last},
                     what + " row " + std::to_string(b));
      }
      const std::string zero = test::zero_row_failure(output, scenario, clamped);
      EXPECT_TRUE(zero.empty()) << what << ": " << zero;
    }
  }
}

}  // namespace
}  // namespace tqdecode
