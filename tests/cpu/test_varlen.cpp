// Several query tokens per sequence (docs/FORMAT.md section 5b) on the CPU:
// the reference against a direct causal computation on the dequantized
// cache, against per-token calls of the one-token decode (bit for bit), and
// against exact attention (quantization error); decode_cpu's strides and
// dtype; and every bad varlen argument named, with nothing written.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

struct VarlenShape {
  int head_dim;
  int block_size;
  int num_kv_heads;
  int num_q_heads;
  std::vector<int> seq_lens;
  std::vector<int> query_lens;
  bool sinks;
};

// Query lengths 0, 1, 2-8, 17 and 128 (whole sequences and continuations),
// groups 1 to 16, head dims 64 / 128 / 256, lengths off the block size.
const std::vector<VarlenShape> kShapes = {
    {128, 16, 2, 8, {40, 1, 300, 9, 0, 150}, {4, 1, 17, 9, 0, 2}, false},
    {64, 32, 4, 4, {200, 128, 77, 31}, {128, 128, 0, 8}, true},
    {256, 16, 1, 16, {65, 3, 20}, {5, 3, 1}, true},
    {128, 64, 8, 8, {513, 2}, {7, 2}, false},
};

ScenarioConfig config_for(Preset preset, const VarlenShape& shape, std::uint64_t seed) {
  ScenarioConfig config;
  config.preset = preset;
  config.head_dim = shape.head_dim;
  config.block_size = shape.block_size;
  config.num_kv_heads = shape.num_kv_heads;
  config.num_q_heads = shape.num_q_heads;
  config.seq_lens = shape.seq_lens;
  config.query_lens = shape.query_lens;
  config.sinks = shape.sinks;
  config.seed = seed;
  return config;
}

// The direct computation, written out: token j of sequence b (q new tokens)
// scores every position t <= seq_len - q + j against the dequantized keys in
// double, with the sink in the denominator, over the same query the
// reference sees (q itself; the dequantized keys are in the original space,
// so with Pi = I the rotation is exact).
std::vector<float> causal_attention(const Scenario& scenario, const DequantizedKv& kv) {
  const int D = scenario.config.head_dim;
  const int Hq = scenario.config.num_q_heads;
  const int Hk = scenario.config.num_kv_heads;
  std::vector<float> out(scenario.query.size(), 0.0f);
  for (int b = 0; b < scenario.batch(); ++b) {
    const int first = scenario.query_start_loc[b];
    const int query_len = scenario.query_start_loc[b + 1] - first;
    for (int j = 0; j < query_len; ++j) {
      const int context = scenario.seq_lens[b] - query_len + j + 1;
      for (int hq = 0; hq < Hq; ++hq) {
        const float* q = scenario.query.data() + (std::size_t(first + j) * Hq + hq) * D;
        std::vector<double> scores(context);
        double m = scenario.sinks.empty() ? -std::numeric_limits<double>::infinity() : scenario.sinks[hq];
        for (int t = 0; t < context; ++t) {
          const float* k = kv.keys.data() + ((scenario.token_offsets[b] + t) * Hk + hq / (Hq / Hk)) * D;
          double dot = 0.0;
          for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
          scores[t] = scenario.scale * dot;
          m = std::max(m, scores[t]);
        }
        double denominator = scenario.sinks.empty() ? 0.0 : std::exp(scenario.sinks[hq] - m);
        std::vector<double> acc(D, 0.0);
        for (int t = 0; t < context; ++t) {
          const double w = std::exp(scores[t] - m);
          const float* v = kv.values.data() + ((scenario.token_offsets[b] + t) * Hk + hq / (Hq / Hk)) * D;
          for (int d = 0; d < D; ++d) acc[d] += w * v[d];
          denominator += w;
        }
        float* o = out.data() + (std::size_t(first + j) * Hq + hq) * D;
        for (int d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d] / denominator);
      }
    }
  }
  return out;
}

class VarlenReference : public testing::TestWithParam<Preset> {};

// With Pi = I only fp32 rounding of the dequantized elements and the
// summation order separate the two (as the one-token reference's test).
TEST_P(VarlenReference, IsCausalAttentionOnTheDequantizedCache) {
  for (std::size_t i = 0; i < kShapes.size(); ++i) {
    ScenarioConfig config = config_for(GetParam(), kShapes[i], 500 + i);
    config.identity_rotation = true;
    const Scenario scenario = make_scenario(config);
    ASSERT_EQ(scenario.query_rows(), scenario.query_start_loc.back());
    const double error = relative_l2(scenario.reference_output(), causal_attention(scenario, dequantize(scenario)));
    std::printf("[ measure  ] %-20s shape %zu: rel_l2 %.2e against the direct computation\n",
                preset_info(GetParam()).name, i, error);
    EXPECT_LE(error, 2e-6) << "shape " << i;
  }
}

// Token j of a sequence is the one-token decode of that query row over the
// first seq_len - q_len + j + 1 positions: the same function, bit for bit.
TEST_P(VarlenReference, EachTokenIsTheOneTokenDecodeOfItsPrefix) {
  for (std::size_t i = 0; i < kShapes.size(); ++i) {
    const Scenario scenario = make_scenario(config_for(GetParam(), kShapes[i], 600 + i));
    const std::vector<float> varlen = scenario.reference_output();
    const int D = scenario.config.head_dim;
    const std::size_t row = std::size_t(scenario.config.num_q_heads) * D;
    for (int b = 0; b < scenario.batch(); ++b) {
      const int first = scenario.query_start_loc[b];
      const int query_len = scenario.query_start_loc[b + 1] - first;
      for (int j = 0; j < query_len; ++j) {
        DecodeArgs one = scenario.host_args();
        one.query_start_loc = nullptr;
        one.num_tokens = 0;
        one.max_query_len = 0;
        one.batch = 1;
        one.query = scenario.query_bits.data() + (first + j) * row;
        one.block_table = scenario.block_table.data() + std::size_t(b) * scenario.max_blocks_per_seq;
        const std::int32_t context = scenario.seq_lens[b] - query_len + j + 1;
        one.seq_lens = &context;
        std::vector<float> expected(row);
        decode_reference(one, expected.data());
        const std::vector<float> actual(varlen.begin() + (first + j) * row, varlen.begin() + (first + j + 1) * row);
        ASSERT_EQ(actual, expected) << "shape " << i << " sequence " << b << " token " << j;
      }
    }
  }
}

TEST_P(VarlenReference, MatchesExactAttentionWithinQuantizationError) {
  const Scenario scenario = make_scenario(config_for(GetParam(), kShapes[0], 700));
  const std::vector<float> out = scenario.reference_output();
  const std::vector<float> exact = scenario.exact_output();
  const double cos = cosine_similarity(out, exact);
  std::printf("[ accuracy ] %-20s cos %.5f rel_l2 %.4f\n", preset_info(GetParam()).name, cos, relative_l2(out, exact));
  // Measured cos 0.9888 (4-bit keys), 0.9926 (fp8), 0.9659 (k3v4), 0.9511
  // (3-bit); a decoding bug (wrong field, code, block or mask) gives far less.
  EXPECT_GE(cos, preset_info(GetParam()).key_bits == 3 ? 0.93 : 0.98);
}

INSTANTIATE_TEST_SUITE_P(AllPresets, VarlenReference, testing::ValuesIn(kAllPresets),
                         [](const auto& info) { return std::string(preset_info(info.param).name); });

// Random query lengths in ragged batches, through the launcher's CPU path
// with strided rows, in both query dtypes: decode_cpu writes what
// decode_reference computes, rounded to the dtype, and nothing between rows.
TEST(VarlenDecodeCpu, RandomLengthsThroughTheLauncherWithStridedRows) {
  Rng rng(31);
  for (const DType dtype : {DType::bf16, DType::f16}) {
    ScenarioConfig config;
    config.num_q_heads = 12;
    config.num_kv_heads = 4;
    config.head_dim = 64;
    config.query_dtype = dtype;
    config.sinks = true;
    for (int b = 0; b < 9; ++b) {
      const int query_len = static_cast<int>(rng.below(10));
      config.query_lens.push_back(query_len);
      config.seq_lens.push_back(query_len + static_cast<int>(rng.below(90)));
    }
    config.max_query_len = 12;  // declared above the longest
    config.seed = 41;
    const Scenario scenario = make_scenario(config);
    std::vector<float> expected(scenario.query.size());
    decode_reference(scenario.host_args(), expected.data());

    const int D = config.head_dim;
    const std::int64_t row_stride = std::int64_t(config.num_q_heads) * D + 8;  // a gap after each token
    const std::uint16_t poison = 0x7e00;
    std::vector<std::uint16_t> output(std::size_t(scenario.query_rows()) * row_stride, poison);
    DecodeArgs args = scenario.host_args(output.data());
    args.output_stride_batch = row_stride;
    DecodeWorkspace workspace;
    decode(args, workspace, nullptr, PathRequest::cpu_reference);
    for (int t = 0; t < scenario.query_rows(); ++t) {
      for (int e = 0; e < config.num_q_heads * D; ++e) {
        const std::uint16_t bits = output[t * row_stride + e];
        const float value = dtype == DType::f16 ? half_bits_to_float(bits) : bf16_bits_to_float(bits);
        const float want = expected[std::size_t(t) * config.num_q_heads * D + e];
        ASSERT_EQ(value, dtype == DType::f16 ? half_bits_to_float(float_to_half_bits(want))
                                             : bf16_bits_to_float(float_to_bf16_bits(want)))
            << "token " << t << " element " << e;
      }
      for (int e = config.num_q_heads * D; e < row_stride; ++e) ASSERT_EQ(output[t * row_stride + e], poison);
    }
  }
}

// Every bad varlen argument throws an Error naming it, and the output is
// left as it was.
TEST(VarlenValidation, EveryBadInputNamesTheArgumentAndWritesNothing) {
  ScenarioConfig config;
  config.num_q_heads = 8;
  config.num_kv_heads = 2;
  config.head_dim = 64;
  config.seq_lens = {20, 5, 9};
  config.query_lens = {3, 0, 4};
  config.seed = 3;
  const Scenario scenario = make_scenario(config);
  const float poison = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::uint16_t> output(scenario.query.size(), 0x7fc1);
  const auto expect_rejected = [&](const std::string& argument, auto&& change) {
    std::vector<std::int32_t> starts = scenario.query_start_loc;
    std::vector<std::int32_t> lengths = scenario.seq_lens;
    DecodeArgs args = scenario.host_args(output.data());
    args.query_start_loc = starts.data();
    args.seq_lens = lengths.data();
    change(args, starts, lengths);
    expect_error_naming(argument, [&] { decode_cpu(args); });
    std::vector<float> out(scenario.query.size(), poison);
    expect_error_naming(argument, [&] { decode_reference(args, out.data()); });
    for (const std::uint16_t bits : output) ASSERT_EQ(bits, 0x7fc1) << argument << ": the output was written";
  };
  using Starts = std::vector<std::int32_t>;
  expect_rejected("query_start_loc[0]", [](DecodeArgs&, Starts& starts, Starts&) { starts[0] = 1; });
  expect_rejected("query_start_loc[2]", [](DecodeArgs&, Starts& starts, Starts&) { starts[2] = 2; });
  expect_rejected("max_query_len", [](DecodeArgs& args, Starts&, Starts&) { args.max_query_len = 3; });
  expect_rejected("seq_lens[2]", [](DecodeArgs&, Starts&, Starts& lengths) { lengths[2] = 3; });
  expect_rejected("query_start_loc[3]", [](DecodeArgs& args, Starts&, Starts&) { args.num_tokens = 6; });
  expect_rejected("num_tokens", [](DecodeArgs& args, Starts&, Starts&) { args.num_tokens = 13; });
  expect_rejected("max_query_len", [](DecodeArgs& args, Starts&, Starts&) { args.max_query_len = 0; });
  expect_rejected("max_query_len", [](DecodeArgs& args, Starts&, Starts&) { args.max_query_len = kMaxQueryLen + 1; });
  expect_rejected("query_start_loc", [](DecodeArgs& args, Starts&, Starts&) { args.query_start_loc = nullptr; });
  // Shapes alone (no tensor read) are checked by the planner too.
  DecodeArgs args = scenario.host_args(output.data());
  args.max_query_len = 0;
  expect_error_naming("max_query_len", [&] { plan_decode(args); });

  // The split-KV reference steps take one token per sequence.
  std::vector<float> max(64), sum(64), partial(64 * 64);
  expect_error_naming("query_start_loc", [&] {
    decode_partitions_reference(scenario.host_args(), 1, 16, {max.data(), sum.data(), partial.data()});
  });
}

// No tokens at all: every sequence has q_len 0 (T = 0, no query or output
// tensor needed); nothing is read or written.
TEST(VarlenValidation, ACallWithoutTokensIsAccepted) {
  ScenarioConfig config;
  config.num_q_heads = 4;
  config.num_kv_heads = 1;
  config.head_dim = 64;
  config.seq_lens = {7, 0};
  config.query_lens = {0, 0};
  const Scenario scenario = make_scenario(config);
  DecodeArgs args = scenario.host_args(nullptr);
  args.query = nullptr;
  ASSERT_EQ(args.num_tokens, 0);
  EXPECT_NO_THROW(decode_cpu(args));
}

}  // namespace
}  // namespace tqdecode::test
