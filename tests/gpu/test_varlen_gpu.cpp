// Several query tokens per sequence on the GPU (docs/FORMAT.md section 5b):
// the tensor-core kernel (query tokens folded into row tiles with the
// group), the warp-specialized kernel (up to 64 rows of a kv head per CTA)
// and the scalar kernel against the CPU reference on the same cache bytes over
// random query lengths (0, 1, 2-8, 17, 128) in ragged batches, every
// preset, head dims 64 / 128 / 256, groups 1 to 16, sinks, fp16, both cache
// orders; one token per sequence bit for bit as the one-token decode; CUDA
// graph replay with new lengths, block tables and query_start_loc; and
// inconsistent offsets and lengths, which must stay inside the call's rows.
// Every output is poisoned with NaN first.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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

// Whether the warp-specialized kernel's request (PathRequest::hopper_warp_specialized) serves the call on the
// Hopper path.
bool warp_specialized_serves(const DecodeArgs& args) {
  return cuda::warp_specialized_serves(DecodePath::hopper, args.layout, args.varlen(),
                                       cuda::tensor_core_rows_per_head(args));
}

struct VarlenCase {
  std::string name;
  Preset preset;
  int num_q_heads;
  int num_kv_heads;
  int head_dim;
  int block_size;
  int batch;
  int max_context;  ///< seq_len = query length + up to this many earlier tokens
  std::uint64_t seed;
  bool sinks = false;
  DType dtype = DType::bf16;
  CacheOrder order = CacheOrder::blocks;
  int declared_max_query_len = 0;  ///< 0: the longest query
  int longest_query = 128;         ///< query lengths drawn up to this (speculative decoding: a few)
  bool raw_norms = false;          ///< token_slots MSE keys without norm correction
  float value_amplitude = 1.0f;    ///< ScenarioConfig::value_amplitude
};

// Query lengths drawn from 0, 1, 2-8, 17 and 128, those up to `longest`.
std::vector<int> random_query_lens(int batch, int longest, Rng& rng) {
  std::vector<int> choices;
  for (const int length : {0, 1, 2, 3, 4, 5, 6, 7, 8, 17, 128}) {
    if (length <= longest) choices.push_back(length);
  }
  std::vector<int> lengths(batch);
  for (int& length : lengths) length = choices[rng.below(choices.size())];
  return lengths;
}

ScenarioConfig config_of(const VarlenCase& c) {
  Rng rng(c.seed);
  ScenarioConfig config;
  config.preset = c.preset;
  config.num_q_heads = c.num_q_heads;
  config.num_kv_heads = c.num_kv_heads;
  config.head_dim = c.head_dim;
  config.block_size = c.block_size;
  config.query_lens = random_query_lens(c.batch, c.longest_query, rng);
  config.query_lens[0] = c.longest_query;  // every case has its longest query and a sequence without tokens
  if (c.batch > 1) config.query_lens[1] = 0;
  for (const int query_len : config.query_lens) {
    config.seq_lens.push_back(query_len + static_cast<int>(rng.below(c.max_context + 1)));
  }
  config.max_query_len = c.declared_max_query_len;
  config.sinks = c.sinks;
  config.query_dtype = c.dtype;
  config.order = c.order;
  config.renormalize_keys = c.order == CacheOrder::token_slots && !preset_info(c.preset).key_fp8 && !c.raw_norms;
  config.seed = c.seed;
  config.value_amplitude = c.value_amplitude;
  config.keep_unquantized = false;
  return config;
}

std::vector<VarlenCase> varlen_cases() {
  const Preset p4 = Preset::turboquant_4bit_nc;
  std::vector<VarlenCase> cases = {
      // The shape, scaled down: Hq 64, Hk 8 (group 8: four tokens per CTA).
      {"q4_d128_g8_sinks", p4, 64, 8, 128, 16, 9, 3000, 1, true},
      {"q4_d128_g4_f16_declared_256", p4, 32, 8, 128, 32, 7, 1500, 2, false, DType::f16, CacheOrder::blocks, 256},
      {"q4_d128_g1_bs64", p4, 4, 4, 128, 64, 6, 900, 3},
      {"q4_d128_g3_sinks", p4, 6, 2, 128, 16, 8, 700, 4, true},
      {"q4_d128_g12_f16", p4, 24, 2, 128, 128, 5, 1200, 5, false, DType::f16},
      {"q4_d128_g16_sinks", p4, 32, 2, 128, 16, 6, 2100, 6, true},
      {"q4_slots_renorm_g8", p4, 32, 4, 128, 16, 6, 1000, 7, true, DType::bf16, CacheOrder::token_slots},
      {"k8v4_slots_g5", Preset::turboquant_k8v4, 10, 2, 64, 32, 5, 600, 8, false, DType::f16, CacheOrder::token_slots},
      // vLLM's CUDA cache at Hk 8: the wide shape's bulk copies, speculative verification of up to 4 tokens.
      {"q4_slots_renorm_hk8_spec4_bulk", p4, 64, 8, 128, 16, 7, 1500, 11, false, DType::bf16, CacheOrder::token_slots,
       0, 4},
      // vLLM's CUDA cache at Hk 8 with many rows: the warp-specialized kernel's token_slots boxes, 128-token chunks
      // (128-row CTAs) with norm correction, and up to 8 tokens (64-row CTAs) without it at block size 64.
      {"q4_slots_renorm_hk8_chunks", p4, 64, 8, 128, 16, 4, 3000, 18, true, DType::bf16, CacheOrder::token_slots},
      {"q4_slots_raw_hk8_spec8_bs64", p4, 64, 8, 128, 64, 5, 4000, 19, false, DType::f16, CacheOrder::token_slots, 0, 8,
       true},
      // 64 kv heads at group 2, up to 4 tokens (8 rows): whole token rows of 8 kv heads per CTA.
      {"k3v4_slots_hk64_g2_spec4_rows", Preset::turboquant_k3v4_nc, 128, 64, 128, 16, 8, 5000, 12, true, DType::bf16,
       CacheOrder::token_slots, 0, 4},
      // Speculative-decoding verification: up to 4 tokens at group 8 (32 rows, one query tile), up to 8 at
      // group 2 (16 rows) and 3 at group 3 (9 rows, a bucket of 16).
      {"q4_d128_g8_spec4", p4, 64, 8, 128, 16, 12, 2500, 9, true, DType::bf16, CacheOrder::blocks, 0, 4},
      {"k3v4_d64_g2_spec8", Preset::turboquant_k3v4_nc, 8, 4, 64, 32, 9, 900, 10, false, DType::f16, CacheOrder::blocks,
       0, 8},
      {"k8v4_d256_g3_spec3", Preset::turboquant_k8v4, 6, 2, 256, 16, 7, 700, 11, true, DType::bf16, CacheOrder::blocks,
       0, 3},
      // Enough CTAs for the Hopper kernel's four head tiles (32 rows of up to 32 query tokens at group 1).
      {"q4_d128_g1_hk8_four_head_tiles", p4, 8, 8, 128, 16, 6, 800, 13},
      {"q4_d128_g3_hk16_four_head_tiles", p4, 48, 16, 128, 32, 4, 600, 14, true, DType::f16},
      // The warp-specialized kernel's request at group 8 (speculative decoding of up to 8 tokens: 64 rows) with
      // block size 64 and a few sequences of up to 9000 tokens: partitions. Every case it serves (more than 16
      // rows of 4-bit keys in the blocks order at D = 128) runs it too.
      {"q4_d128_g8_spec8_hk8", p4, 64, 8, 128, 64, 3, 9000, 15, true, DType::bf16, CacheOrder::blocks, 0, 8},
      // The smallest calls it serves, to tell its layouts from its pipeline when a case fails: one kv head and
      // one sequence of at most one 64-token tile, then two sequences of many tiles.
      {"q4_d128_g8_hk1_one_tile", p4, 8, 1, 128, 16, 1, 56, 16, false, DType::bf16, CacheOrder::blocks, 0, 8},
      {"q4_d128_g8_hk1_tiles", p4, 8, 1, 128, 32, 2, 3000, 17, false, DType::bf16, CacheOrder::blocks, 0, 8},
      // Values near 10^4 in its 64-row and 128-row CTAs, both orders: value ranges past fp16's largest value
      // (code x scale would overflow), and scales for which p x scale would overflow at the lazy rescale's
      // p <= 16, so those tiles take the exact references.
      {"q4_d128_g8_spec8_hk8_large_values", p4, 64, 8, 128, 16, 3, 2500, 20, true, DType::bf16, CacheOrder::blocks, 0,
       8, false, 10000.0f},
      {"q4_slots_renorm_hk8_spec8_large_values", p4, 64, 8, 128, 16, 3, 2500, 21, false, DType::bf16,
       CacheOrder::token_slots, 0, 8, false, 10000.0f},
      {"q4_d128_g8_hk8_chunks_large_values", p4, 64, 8, 128, 32, 2, 2000, 22, false, DType::f16, CacheOrder::blocks, 0,
       128, false, 10000.0f},
      {"q4_slots_renorm_hk8_chunks_large_values", p4, 64, 8, 128, 16, 2, 2000, 23, true, DType::bf16,
       CacheOrder::token_slots, 0, 128, false, 10000.0f},
  };
  // Every preset at every head dim, with groups 1 to 16 spread over them.
  const int groups[] = {1, 2, 4, 6, 8, 16, 3, 5, 7, 9, 12, 16};
  int variant = 0;
  for (const Preset preset : kAllPresets) {
    for (const int head_dim : {64, 128, 256}) {
      const int group = groups[variant % 12];
      const int kv_heads = group >= 8 ? 1 : 2;
      cases.push_back({std::string(preset_info(preset).name).substr(11) + "_d" + std::to_string(head_dim) + "_g" +
                           std::to_string(group),
                       preset, group * kv_heads, kv_heads, head_dim, 16 << (variant % 3), 5, 800,
                       100 + std::uint64_t(variant), variant % 2 == 0, variant % 3 == 1 ? DType::f16 : DType::bf16});
      ++variant;
    }
  }
  return cases;
}

class VarlenGpu : public ::testing::TestWithParam<VarlenCase> {};

TEST_P(VarlenGpu, MatchesCpuReferenceOnSameCacheBytes) {
  TQ_SKIP_WITHOUT_GPU();
  const VarlenCase& c = GetParam();
  const Scenario scenario = make_scenario(config_of(c));
  DeviceScenario device(scenario);
  const std::vector<float> expected = scenario.reference_output();
  const LaunchPlan plan = plan_decode(device.args());
  // The call takes the kernel the one-token decode of its shape takes.
  DecodeArgs one_token = device.args();
  one_token.query_start_loc = nullptr;
  one_token.num_tokens = 0;
  one_token.max_query_len = 0;
  const LaunchPlan one_token_plan = plan_decode(one_token);
  EXPECT_EQ(plan.path, one_token_plan.path) << plan.reason;
  EXPECT_EQ(plan.generic_kernel, one_token_plan.generic_kernel) << plan.reason;
  if (c.name.ends_with("_rows") && plan.path == DecodePath::hopper) EXPECT_EQ(plan.kv_heads_per_cta, 8) << plan.reason;
  if (plan.path == DecodePath::hopper) {
    // The warp-specialized kernel where the policy takes it (where built); the Hopper request keeps the row tiles.
    EXPECT_EQ(plan.warp_specialized,
              cuda::warp_specialized_automatic(DecodePath::hopper, device.args().layout, true,
                                               cuda::tensor_core_rows_per_head(device.args()), device.args().batch,
                                               cuda::current_device_info().sm_count))
        << plan.reason;
    const LaunchPlan row_tiles = plan_decode(device.args(), PathRequest::hopper);
    EXPECT_FALSE(row_tiles.warp_specialized) << row_tiles.reason;
    if (c.name.ends_with("_four_head_tiles")) EXPECT_EQ(row_tiles.head_tiles, 4) << row_tiles.reason;
  }
  std::vector<PathRequest> requests = {PathRequest::automatic, PathRequest::cuda_generic,
                                       PathRequest::cuda_generic_scalar};
  if (plan.path == DecodePath::hopper) requests.push_back(PathRequest::hopper);
  if (plan.path == DecodePath::hopper && warp_specialized_serves(device.args())) {
    requests.push_back(PathRequest::hopper_warp_specialized);
  }
  for (const PathRequest request : requests) {
    const LaunchPlan served = plan_decode(device.args(), request);
    std::printf("[ path     ] %s: T = %d, max_query_len %d: %s %s (%s), N = %d\n", c.name.c_str(), scenario.query_rows(),
                scenario.max_query_len, decode_path_name(served.path),
                served.path == DecodePath::cuda_generic ? generic_kernel_name(served.generic_kernel) : "",
                served.reason.c_str(), served.num_partitions);
    if (served.path == DecodePath::cuda_generic && served.generic_kernel == GenericKernel::scalar) {
      EXPECT_LE(served.query_tokens_per_cta * (c.num_q_heads / c.num_kv_heads), 32);
    } else {
      EXPECT_NE(served.reason.find("query rows per kv head"), std::string::npos) << served.reason;
    }
    DecodeWorkspace workspace;
    device.poison_output();
    decode(device.args(), workspace, nullptr, request);
    expect_close(device.output(), expected,
                 c.name + " " + decode_path_name(served.path) + " " + generic_kernel_name(served.generic_kernel));
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, VarlenGpu, ::testing::ValuesIn(varlen_cases()),
                         [](const auto& info) { return info.param.name; });

// One token per sequence through the varlen form is the one-token decode,
// bit for bit, on every kernel (same instance, partitions and order).
TEST(VarlenGpuOneToken, MatchesTheOneTokenDecodeBitwiseOnEveryKernel) {
  TQ_SKIP_WITHOUT_GPU();
  for (const Preset preset : kAllPresets) {
    for (const int group : {1, 4, 8, 16}) {
      ScenarioConfig config;
      config.preset = preset;
      config.num_kv_heads = 2;
      config.num_q_heads = 2 * group;
      config.seq_lens = {1, 4000, 333, 17, 2500};
      config.query_lens = {1, 1, 1, 1, 1};
      config.sinks = true;
      config.seed = 50 + group;
      config.keep_unquantized = false;
      const Scenario scenario = make_scenario(config);
      DeviceScenario device(scenario);
      DecodeWorkspace workspace;
      DecodeArgs one = device.args();
      one.query_start_loc = nullptr;
      one.num_tokens = 0;
      one.max_query_len = 0;
      for (const PathRequest request :
           {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
        const LaunchPlan plan = plan_decode(device.args(), request);
        const std::string what = std::string(preset_info(preset).name) + " group " + std::to_string(group) + " " +
                                 decode_path_name(plan.path) + " " + generic_kernel_name(plan.generic_kernel);
        device.poison_output();
        decode(device.args(), workspace, nullptr, request);
        const std::vector<float> varlen = device.output();
        device.poison_output();
        decode(one, workspace, nullptr, request);
        const std::vector<float> single = device.output();
        ASSERT_EQ(varlen.size(), single.size());
        for (std::size_t i = 0; i < single.size(); ++i) {
          ASSERT_TRUE(std::isfinite(varlen[i])) << what << " element " << i;
          ASSERT_EQ(varlen[i], single[i]) << what << " element " << i;
        }
      }
    }
  }
}

// Capture one varlen decode of a cache in `order`, then change seq_lens,
// block tables and how the T tokens split over the sequences
// (query_start_loc) in place and replay: each replay equals an eager call and
// the reference.
void replay_with_new_lengths(CacheOrder order) {
  VarlenCase c{"graph", Preset::turboquant_4bit_nc, 32, 8, 128, 16, 6, 2000, 77, true, DType::bf16, order};
  c.declared_max_query_len = 128;
  const Scenario scenario = make_scenario(config_of(c));
  DeviceScenario device(scenario);
  // The automatic path, and the warp-specialized kernel's request where it serves the call.
  std::vector<PathRequest> requests = {PathRequest::automatic};
  if (plan_decode(device.args()).path == DecodePath::hopper && warp_specialized_serves(device.args())) {
    requests.push_back(PathRequest::hopper_warp_specialized);
  }
  for (const PathRequest request : requests) {
    SCOPED_TRACE(decode_path_name(plan_decode(device.args(), request).path));
    DecodeWorkspace workspace(16);
    const test::DecodeGraph graph(device.args(), workspace, request);

    Rng rng(5);
    const int batch = scenario.batch();
    const int total = scenario.query_rows();
    for (int replay = 0; replay < 4; ++replay) {
      // The same T tokens split differently (each at most 128), and sequence i
      // on the blocks of sequence order[i] with a length no longer than that one's.
      const test::ReorderedSequences reordered = test::reorder_sequences(scenario, rng);
      const auto capacity = [&](int b) { return scenario.seq_lens[reordered.order[b]]; };
      std::vector<std::int32_t> query_lens(batch, 0);
      for (int left = total; left > 0;) {
        const int b = static_cast<int>(rng.below(batch));
        const int room = std::min(128, capacity(b)) - query_lens[b];
        const int take = std::min(left, std::min(room, 1 + static_cast<int>(rng.below(9))));
        query_lens[b] += take;
        left -= take;
      }
      std::vector<std::int32_t> starts(batch + 1, 0), lengths(batch);
      for (int i = 0; i < batch; ++i) {
        starts[i + 1] = starts[i] + query_lens[i];
        lengths[i] = query_lens[i] + static_cast<std::int32_t>(rng.below(capacity(i) - query_lens[i] + 1));
      }
      device.upload_lengths(lengths, reordered.block_table);
      device.upload_query_start_loc(starts);
      DecodeArgs host = scenario.host_args(nullptr);
      host.seq_lens = lengths.data();
      host.block_table = reordered.block_table.data();
      host.query_start_loc = starts.data();
      test::expect_replay_matches_eager_and_reference(graph, device, host, "varlen graph replay " + std::to_string(replay));
    }
  }
}

TEST(VarlenGpuGraph, ReplayWithNewLengthsAndQueryStartLocMatchesEager) {
  TQ_SKIP_WITHOUT_GPU();
  for (const CacheOrder order : {CacheOrder::blocks, CacheOrder::token_slots}) {
    SCOPED_TRACE(order == CacheOrder::blocks ? "blocks" : "token_slots");
    replay_with_new_lengths(order);
  }
}

// The warp-specialized kernel's request on calls it does not serve (one
// token per sequence, k8v4 keys, 16 rows per kv head, token_slots rows that
// are not 16-byte multiples) is refused naming `path`, and nothing is written.
TEST(VarlenGpuArguments, WarpSpecializedRequestRefusesWhatItDoesNotServe) {
  TQ_SKIP_WITHOUT_GPU();
  const Preset p4 = Preset::turboquant_4bit_nc;
  const std::vector<VarlenCase> refused = {
      {"k8v4", Preset::turboquant_k8v4, 64, 8, 128, 16, 3, 500, 21, false, DType::bf16, CacheOrder::blocks, 0, 8},
      {"rows16", p4, 32, 8, 128, 16, 3, 500, 22, false, DType::bf16, CacheOrder::blocks, 0, 4},
      {"slots_hk4", p4, 32, 4, 128, 16, 3, 500, 23, false, DType::bf16, CacheOrder::token_slots, 0, 8},
  };
  for (const VarlenCase& c : refused) {
    const Scenario scenario = make_scenario(config_of(c));
    DeviceScenario device(scenario);
    DecodeArgs one_token = device.args();
    one_token.query_start_loc = nullptr;
    one_token.num_tokens = 0;
    one_token.max_query_len = 0;
    for (const DecodeArgs& args : {device.args(), one_token}) {
      device.poison_output();
      DecodeWorkspace workspace;
      try {
        decode(args, workspace, nullptr, PathRequest::hopper_warp_specialized);
        ADD_FAILURE() << c.name << (args.varlen() ? "" : " one token") << ": the request was accepted";
      } catch (const Error& error) {
        EXPECT_EQ(error.argument(), "path") << error.what();
      }
      for (const float value : device.output()) ASSERT_TRUE(std::isnan(value)) << c.name << ": the output was written";
    }
  }
}

// Offsets and lengths the CUDA path does not check on the host (device
// memory): decreasing, negative or past T offsets, a query longer than
// max_query_len or than its seq_len. The call completes, writes nothing
// outside the T output rows (guard rows before and after them stay
// poisoned), and a consistent sequence in the same batch is still right.
TEST(VarlenGpuArguments, InconsistentOffsetsAndLengthsStayInsideTheCall) {
  TQ_SKIP_WITHOUT_GPU();
  // Group 4 (16 rows: the tensor-core kernel's two head tiles) and group 8 (32: four head tiles, and the
  // warp-specialized kernel's request).
  for (const int num_q_heads : {16, 32}) {
    SCOPED_TRACE("Hq " + std::to_string(num_q_heads));
    ScenarioConfig config;
    config.num_q_heads = num_q_heads;
    config.num_kv_heads = 4;
    config.seq_lens = {300, 40, 500, 20, 90};
    config.query_lens = {4, 4, 4, 4, 4};
    config.max_query_len = 4;
    config.seed = 9;
    config.keep_unquantized = false;
    const Scenario scenario = make_scenario(config);
    DeviceScenario device(scenario);
    const std::vector<float> expected = scenario.reference_output();
    const std::size_t row = std::size_t(config.num_q_heads) * config.head_dim;
    const int total = scenario.query_rows();  // 20
    const std::size_t guard_rows = 64;
    test::DeviceBuffer<std::uint16_t> output((guard_rows + total + guard_rows) * row);
    DecodeArgs args = device.args();
    args.output = output.get() + guard_rows * row;
    const std::vector<std::vector<std::int32_t>> bad_starts = {
        {0, 4, 2, 12, 16, 20},        // sequence 1 decreasing
        {0, 4, 8, 12, 16, 9999},      // past T
        {-50, 4, 8, 12, 16, 20},      // negative
        {0, 4, 8, 19, 16, 20},        // sequence 2 with 11 tokens, over max_query_len
        {0, 0, 0, 0, 0, 2147483647},  // the last sequence over everything
    };
    for (std::size_t k = 0; k < bad_starts.size(); ++k) {
      SCOPED_TRACE("case " + std::to_string(k));
      device.upload_query_start_loc(bad_starts[k]);
      std::vector<std::int32_t> lengths = scenario.seq_lens;
      if (k == 3) lengths[1] = 2;  // sequence 1: four tokens over two positions
      device.upload_lengths(lengths, scenario.block_table);
      std::vector<PathRequest> requests = {PathRequest::automatic, PathRequest::cuda_generic,
                                           PathRequest::cuda_generic_scalar};
      if (plan_decode(args).path == DecodePath::hopper && warp_specialized_serves(args)) {
        requests.push_back(PathRequest::hopper_warp_specialized);
      }
      for (const PathRequest request : requests) {
        const LaunchPlan plan = plan_decode(args, request);
        SCOPED_TRACE(std::string(decode_path_name(plan.path)) + " " + generic_kernel_name(plan.generic_kernel));
        ASSERT_EQ(cudaMemset(output.get(), 0xff, output.bytes()), cudaSuccess);
        DecodeWorkspace workspace;
        decode(args, workspace, nullptr, request);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::vector<std::uint16_t> bits = output.download();
        const std::size_t first = guard_rows * row, end = (guard_rows + total) * row;  // the T rows' elements
        for (std::size_t i = 0; i < bits.size(); ++i) {
          if (i < first || i >= end)
            ASSERT_EQ(bits[i], 0xffff) << "guard element " << i << " (T rows from " << first << ")";
        }
        if (k == 0 || k == 3) {  // sequence 4 keeps its rows 16..19 and its length
          std::vector<float> last(4 * row), want(expected.begin() + 16 * row, expected.begin() + 20 * row);
          for (std::size_t i = 0; i < last.size(); ++i) last[i] = bf16_bits_to_float(bits[first + 16 * row + i]);
          expect_close(last, want, "sequence 4 beside inconsistent ones");
        }
      }
    }
  }
}

}  // namespace
}  // namespace tqdecode
