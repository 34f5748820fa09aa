// The CPU reference decode: against exact attention on the unquantized K/V
// (quantization error, measured and bounded), against exact attention on the
// dequantized cache (the math itself, tight), split-KV invariance, sinks,
// strides and the output dtype.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "random.hpp"
#include "support/scenario.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/partition.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

struct Shape {
  int head_dim;
  int block_size;
  int num_kv_heads;
  int num_q_heads;
  std::vector<int> seq_lens;
  bool sinks;
  std::int64_t block_stride_padding;
  // D = 64 with 3001 tokens: four outlier channels dominate the scores, the
  // softmax is close to one-hot among thousands of keys and the sink (set at
  // the top score's level) takes about half the mass, so tiny key errors
  // move the output a lot (fp8 keys, relative key MSE 7e-4, still give rel
  // L2 0.28 from the keys alone). Bounded separately.
  bool peaked;
};

// Head dims 64/128/256, group sizes 1/4/8/16, block sizes 16/64/128, lengths
// that are not multiples of the block size (and one that is), an empty
// sequence inside a batch, sinks on and off, padded block strides.
const std::vector<Shape> kShapes = {
    {128, 16, 2, 8, {1, 17, 100, 0, 1000}, false, 0, false},
    {64, 64, 4, 4, {3001, 0, 33}, true, 64, true},
    {256, 128, 1, 16, {129, 1000, 128}, true, 32, false},
    {128, 16, 8, 64, {517, 1}, false, 16, false},
};

ScenarioConfig config_for(Preset preset, const Shape& shape, std::uint64_t seed) {
  ScenarioConfig config;
  config.preset = preset;
  config.head_dim = shape.head_dim;
  config.block_size = shape.block_size;
  config.num_kv_heads = shape.num_kv_heads;
  config.num_q_heads = shape.num_q_heads;
  config.seq_lens = shape.seq_lens;
  config.sinks = shape.sinks;
  config.block_stride_padding = shape.block_stride_padding;
  config.seed = seed;
  return config;
}

std::vector<float> attention_on(const Scenario& scenario, const DequantizedKv& kv) {
  std::vector<float> out(scenario.query.size());
  exact_attention(scenario.query.data(), kv.keys.data(), kv.values.data(), scenario.token_offsets.data(),
                  scenario.batch(), scenario.config.num_q_heads, scenario.config.num_kv_heads,
                  scenario.config.head_dim, scenario.scale, scenario.sinks.empty() ? nullptr : scenario.sinks.data(),
                  out.data());
  return out;
}

// [Hq * D] slice of batch entry b of a [B, Hq, D] output.
std::vector<float> batch_rows(const std::vector<float>& out, const Scenario& scenario, int b) {
  const std::size_t row = std::size_t(scenario.config.num_q_heads) * scenario.config.head_dim;
  return {out.begin() + b * row, out.begin() + (b + 1) * row};
}

struct Accuracy {
  double cos;
  double rel_l2;
};

// Bounds against exact attention on the unquantized K/V: the quantization
// error. Measured on these seeds (cos, rel L2 over a whole batch; worst shape):
//                        other shapes       peaked shape
//   turboquant_4bit_nc   0.98974  0.1444    0.96819  0.2502
//   turboquant_k3v4_nc   0.97922  0.2030    0.80306  0.6548
//   turboquant_3bit_nc   0.95970  0.2848    0.79308  0.6682
//   turboquant_k8v4      0.98960  0.1444    0.95765  0.2917
// Key errors dominate where the softmax is peaked; 3-bit values add about
// 0.2 rel L2 on their own (4-bit values 0.10). The bounds leave a margin of
// about a third of the measured error; a decoding bug (wrong field, code or
// block) gives cos far below them.
Accuracy bound(Preset preset, bool peaked) {
  switch (preset) {
    case Preset::turboquant_4bit_nc: return peaked ? Accuracy{0.96, 0.29} : Accuracy{0.985, 0.17};
    case Preset::turboquant_k3v4_nc: return peaked ? Accuracy{0.77, 0.72} : Accuracy{0.97, 0.24};
    case Preset::turboquant_3bit_nc: return peaked ? Accuracy{0.76, 0.73} : Accuracy{0.95, 0.33};
    default: return peaked ? Accuracy{0.95, 0.33} : Accuracy{0.985, 0.17};
  }
}

// The headline profile at D = 128 (measured cos 0.99189 and 0.99120).
constexpr double kHeadlineCos = 0.99;

// The reference against exact attention on its own dequantized cache differs
// only by the bf16 rounding of the rotated query (measured rel L2 <= 1.6e-3,
// 0 for fp8 keys); with Pi = I that rounding is exact and only fp32 rounding
// of dequantized elements and summation order are left (measured <= 4.3e-7).
constexpr double kRotatedQueryRoundingRelL2 = 3e-3;
constexpr double kSummationOrderRelL2 = 2e-6;

class ReferenceDecode : public testing::TestWithParam<Preset> {};

TEST_P(ReferenceDecode, MatchesExactAttentionWithinQuantizationError) {
  const Preset preset = GetParam();
  for (std::size_t i = 0; i < kShapes.size(); ++i) {
    const Scenario scenario = make_scenario(config_for(preset, kShapes[i], 100 + i));
    const std::vector<float> out = scenario.reference_output();
    const std::vector<float> exact = scenario.exact_output();
    const double cos = cosine_similarity(out, exact);
    const double rel = relative_l2(out, exact);
    std::printf("[ accuracy ] %-20s shape %zu: cos %.5f rel_l2 %.4f\n", preset_info(preset).name, i, cos, rel);
    const Accuracy limit = bound(preset, kShapes[i].peaked);
    EXPECT_GE(cos, limit.cos) << "shape " << i;
    EXPECT_LE(rel, limit.rel_l2) << "shape " << i;
    if (preset == Preset::turboquant_4bit_nc && kShapes[i].head_dim == 128) {
      EXPECT_GE(cos, kHeadlineCos) << "shape " << i;
    }
    EXPECT_LE(relative_l2(out, attention_on(scenario, dequantize(scenario))), kRotatedQueryRoundingRelL2)
        << "shape " << i;
    for (int b = 0; b < scenario.batch(); ++b) {
      if (scenario.seq_lens[b] != 0) continue;
      const std::vector<float> row = batch_rows(out, scenario, b);
      EXPECT_EQ(row, std::vector<float>(row.size(), 0.0f)) << "seq_len 0 gives zeros, sink or not";
    }
  }
}

TEST_P(ReferenceDecode, IsExactAttentionOnTheDequantizedCache) {
  for (std::size_t i = 0; i < kShapes.size(); ++i) {
    ScenarioConfig config = config_for(GetParam(), kShapes[i], 200 + i);
    config.identity_rotation = true;
    const Scenario scenario = make_scenario(config);
    EXPECT_LE(relative_l2(scenario.reference_output(), attention_on(scenario, dequantize(scenario))), kSummationOrderRelL2)
        << "shape " << i;
  }
}

// Split-KV: partitions plus reducer give decode_reference's output for any
// partition count and alignment (measured peak-relative error <= 1.2e-7:
// the fp32 partition buffers), and every partition buffer element is written.
TEST_P(ReferenceDecode, PartitionsAndReducerMatchTheDirectDecode) {
  const Shape shapes[] = {
      {128, 16, 2, 8, {1, 17, 100, 0, 1000}, true, 0, false},
      {64, 64, 1, 4, {250, 64, 0, 3}, false, 16, false},
  };
  for (const Shape& shape : shapes) {
    const Scenario scenario = make_scenario(config_for(GetParam(), shape, 300));
    const DecodeArgs args = scenario.host_args();
    const std::vector<float> direct = scenario.reference_output();
    const int D = shape.head_dim;
    const std::size_t rows = std::size_t(scenario.batch()) * shape.num_q_heads;
    for (int num_partitions : {1, 2, 7, 32}) {
      for (int align : {shape.block_size, 16}) {
        SCOPED_TRACE("block_size " + std::to_string(shape.block_size) + ", partitions " +
                     std::to_string(num_partitions) + ", align " + std::to_string(align));
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::vector<float> max(rows * num_partitions, nan), sum(rows * num_partitions, nan);
        std::vector<float> partial(rows * num_partitions * D, nan);
        const PartitionBuffers buffers{max.data(), sum.data(), partial.data()};
        decode_partitions_reference(args, num_partitions, align, buffers);
        std::vector<float> reduced(direct.size(), nan);
        reduce_partitions_reference(args, num_partitions, buffers, reduced.data());
        EXPECT_LE(peak_relative_error(reduced, direct), 1e-5);

        for (std::size_t row = 0; row < rows; ++row) {
          const int seq_len = scenario.seq_lens[row / shape.num_q_heads];
          for (int p = 0; p < num_partitions; ++p) {
            const std::size_t index = row * num_partitions + p;
            const TokenRange range = partition_range(seq_len, num_partitions, align, p);
            const auto first = partial.begin() + index * D;
            if (range.begin < range.end) {
              EXPECT_TRUE(std::isfinite(max[index]));
              // The top token contributes exp(s - fp32(s)), 1 up to the rounding of the max.
              EXPECT_GE(sum[index], 1.0f - 1e-6f);
              EXPECT_TRUE(std::all_of(first, first + D, [](float x) { return std::isfinite(x); }));
            } else {
              EXPECT_EQ(max[index], -std::numeric_limits<float>::infinity());
              EXPECT_EQ(sum[index], 0.0f);
              EXPECT_TRUE(std::all_of(first, first + D, [](float x) { return x == 0.0f; }));
            }
          }
        }
      }
    }
  }
}

// The Hopper kernel's length-balanced partitions: B x N slots dealt to the
// sequences in order, every sequence at least one, equal lengths N each,
// and no partition longer than the larger of its sequence's length / N
// (what the other kernels run) and total / (B (N - 1)) tokens.
TEST(BalancedPartitions, DealEverySlotByLength) {
  Rng rng(41);
  const std::vector<std::vector<long long>> fixed = {
      {32768, 32768, 32768},         {0, 0, 0, 0},
      {0, 131072, 0, 1, 0},          {1, 17, 100, 1000, 3001, 0, 5000},
      {1LL << 30, 1, 1LL << 30}};
  std::vector<std::vector<long long>> batches = fixed;
  for (int i = 0; i < 200; ++i) {
    std::vector<long long> lengths(1 + rng.below(300));
    for (long long& length : lengths) length = rng.below(4) == 0 ? 0 : static_cast<long long>(rng.below(70000));
    batches.push_back(lengths);
  }
  for (const auto& lengths : batches) {
    const long long total = std::accumulate(lengths.begin(), lengths.end(), 0LL);
    const bool uniform = std::all_of(lengths.begin(), lengths.end(), [&](long long l) { return l == lengths[0]; });
    const int batch = static_cast<int>(lengths.size());
    for (const int num_partitions : {1, 2, 3, 8, 32}) {
      SCOPED_TRACE("batch " + std::to_string(batch) + ", N " + std::to_string(num_partitions));
      const long long extra = static_cast<long long>(batch) * (num_partitions - 1);
      long long before = 0, first = balanced_first_slot(0, 0, total, extra);
      EXPECT_EQ(first, 0);
      for (int s = 0; s < batch; ++s) {
        before += lengths[s];
        const long long next = balanced_first_slot(s + 1, before, total, extra);
        const long long count = next - first;
        EXPECT_GE(count, 1);
        if (uniform && total > 0) EXPECT_EQ(count, num_partitions);
        const int dealt = static_cast<int>(std::min<long long>(count, 32));
        // count > length x extra / total, so a partition holds under total / extra tokens, or under
        // length / N where the count is capped at 32.
        const long long balanced = extra > 0 ? 16 * (((total + extra - 1) / extra + 15) / 16) : 0;
        EXPECT_LE(partition_tokens(static_cast<int>(lengths[s]), dealt, 16),
                  std::max<long long>(partition_tokens(static_cast<int>(lengths[s]), num_partitions, 16), balanced))
            << "sequence " << s << " of length " << lengths[s];
        first = next;
      }
      // Every slot is dealt, but with no tokens at all: then one per sequence, the rest idle.
      EXPECT_EQ(first, total > 0 ? static_cast<long long>(batch) * num_partitions : batch);
    }
  }
}

// The sink takes exp(sink) of the softmax mass: with one partition holding
// (m, l, o), out = o * l e^m / (l e^m + e^sink). A sink of -inf is no sink.
TEST_P(ReferenceDecode, SinkTakesItsShareOfTheSoftmax) {
  const Shape shape{128, 16, 2, 8, {1, 17, 300}, true, 0, false};
  const Scenario scenario = make_scenario(config_for(GetParam(), shape, 400));
  const int D = shape.head_dim;
  const std::size_t rows = std::size_t(scenario.batch()) * shape.num_q_heads;
  std::vector<float> max(rows), sum(rows), partial(rows * D);
  decode_partitions_reference(scenario.host_args(), 1, 16, {max.data(), sum.data(), partial.data()});
  std::vector<float> expected(rows * D);
  double smallest_share = 1.0, largest_share = 0.0;
  for (std::size_t row = 0; row < rows; ++row) {
    const double sink = scenario.sinks[row % shape.num_q_heads];
    const double m = std::max<double>(max[row], sink);
    const double tokens = sum[row] * std::exp(max[row] - m);
    const double share = tokens / (tokens + std::exp(sink - m));
    smallest_share = std::min(smallest_share, share);
    largest_share = std::max(largest_share, share);
    for (int d = 0; d < D; ++d) expected[row * D + d] = static_cast<float>(partial[row * D + d] * share);
  }
  EXPECT_LE(peak_relative_error(scenario.reference_output(), expected), 1e-5);
  // The scenario's sinks must matter for this to test anything.
  EXPECT_LT(smallest_share, 0.9);
  EXPECT_GT(largest_share, 0.1);

  Scenario no_sink = scenario;
  no_sink.sinks.clear();
  Scenario minus_infinity_sink = scenario;
  minus_infinity_sink.sinks.assign(shape.num_q_heads, -std::numeric_limits<float>::infinity());
  EXPECT_EQ(minus_infinity_sink.reference_output(), no_sink.reference_output());
}

INSTANTIATE_TEST_SUITE_P(AllPresets, ReferenceDecode, testing::ValuesIn(kAllPresets),
                         [](const testing::TestParamInfo<Preset>& info) { return preset_info(info.param).name; });

// q_rot = bf16(fp32(q) @ PiT): with PiT = 0.5 * (a permutation) every product
// and sum is exact, so q_rot[j] = 0.5 * q[i] where PiT[i][j] = 0.5.
TEST(RotateQueries, MultipliesByPiTAndRoundsToBf16) {
  ScenarioConfig config;
  config.head_dim = 64;
  config.num_kv_heads = 1;
  config.num_q_heads = 2;
  config.seq_lens = {1, 1};
  config.query_dtype = DType::f16;
  Scenario scenario = make_scenario(config);
  const int D = 64;
  std::vector<float> PiT(D * D, 0.0f);
  for (int i = 0; i < D; ++i) PiT[i * D + (5 * i + 3) % D] = 0.5f;  // 5 is odd: a permutation of 0..63
  DecodeArgs args = scenario.host_args();
  args.PiT = PiT.data();
  std::vector<float> q_rot(scenario.query.size());
  rotate_queries_reference(args, q_rot.data());
  for (int row = 0; row < 4; ++row) {
    for (int i = 0; i < D; ++i) {
      const float q = scenario.query[row * D + i];
      EXPECT_EQ(q_rot[row * D + (5 * i + 3) % D], round_to_bf16(0.5f * q)) << "row " << row << " i " << i;
    }
  }
}

TEST(RotateQueries, MatchesTheMatrixProductToBf16Precision) {
  ScenarioConfig config;
  config.head_dim = 128;
  config.num_kv_heads = 2;
  config.num_q_heads = 8;
  config.seq_lens = {1, 2, 3};
  const Scenario scenario = make_scenario(config);
  const int D = 128;
  std::vector<float> q_rot(scenario.query.size());
  rotate_queries_reference(scenario.host_args(), q_rot.data());
  for (std::size_t row = 0; row < q_rot.size() / D; ++row) {
    for (int j = 0; j < D; ++j) {
      double exact = 0.0;
      for (int i = 0; i < D; ++i) exact += double(scenario.query[row * D + i]) * scenario.constants.PiT[i * D + j];
      // bf16 keeps 8 significant bits: half an ulp is 2^-9 relative, plus fp32 summation error.
      EXPECT_NEAR(q_rot[row * D + j], exact, std::abs(exact) * 0x1p-8 + 1e-5);
    }
  }
}

TEST(RotateQueries, Fp8KeysUseTheQueryUnrotated) {
  ScenarioConfig config;
  config.preset = Preset::turboquant_k8v4;
  config.head_dim = 64;
  config.num_kv_heads = 2;
  config.num_q_heads = 8;
  config.seq_lens = {1, 2};
  const Scenario scenario = make_scenario(config);
  std::vector<float> q_rot(scenario.query.size());
  rotate_queries_reference(scenario.host_args(), q_rot.data());
  EXPECT_EQ(q_rot, scenario.query);
}

// Strided query and block table give the contiguous result; decode_cpu writes
// the query dtype through output strides and leaves the padding alone.
class DecodeCpu : public testing::TestWithParam<DType> {};

TEST_P(DecodeCpu, HonorsStridesAndWritesTheQueryDtype) {
  ScenarioConfig config;
  config.head_dim = 64;
  config.block_size = 16;
  config.num_kv_heads = 2;
  config.num_q_heads = 4;
  config.seq_lens = {40, 0, 7};
  config.sinks = true;
  config.query_dtype = GetParam();
  const Scenario scenario = make_scenario(config);
  const int D = 64, Hq = 4, B = 3;
  const std::vector<float> expected = scenario.reference_output();

  // Query [B, Hq, D] inside [B, Hq, D + 3] rows with 5 spare elements per batch entry.
  const std::int64_t q_head = D + 3, q_batch = Hq * q_head + 5;
  std::vector<std::uint16_t> query(B * q_batch, 0x7fc0);  // padding: NaN in fp16 and in bf16
  const auto* packed = scenario.query_bits.data();
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int d = 0; d < D; ++d) query[b * q_batch + h * q_head + d] = packed[(b * Hq + h) * D + d];
  // Block table rows padded to a stride of max_blocks_per_seq + 3, padding out of range.
  const std::int64_t table_stride = scenario.max_blocks_per_seq + 3;
  std::vector<std::int32_t> table(B * table_stride, -7);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < scenario.max_blocks_per_seq; ++j)
      table[b * table_stride + j] = scenario.block_table[b * scenario.max_blocks_per_seq + j];
  // Output [B, Hq, D] inside [B, Hq, D + 8] rows with 16 spare elements per batch entry.
  const std::int64_t o_head = D + 8, o_batch = Hq * o_head + 16;
  constexpr std::uint16_t kSentinel = 0xabcd;
  std::vector<std::uint16_t> output(B * o_batch, kSentinel);

  DecodeArgs args = scenario.host_args(output.data());
  args.query = query.data();
  args.query_stride_batch = q_batch;
  args.query_stride_head = q_head;
  args.block_table = table.data();
  args.block_table_stride = table_stride;
  args.output_stride_batch = o_batch;
  args.output_stride_head = o_head;
  std::vector<float> strided(expected.size());
  decode_reference(args, strided.data());
  EXPECT_EQ(strided, expected);

  decode_cpu(args);
  for (std::int64_t i = 0; i < B * o_batch; ++i) {
    const std::int64_t b = i / o_batch, h = (i % o_batch) / o_head, d = (i % o_batch) % o_head;
    if (h < Hq && d < D) {
      const float value = expected[(b * Hq + h) * D + d];
      const std::uint16_t bits = GetParam() == DType::f16 ? float_to_half_bits(value) : float_to_bf16_bits(value);
      EXPECT_EQ(output[i], bits) << "b " << b << " h " << h << " d " << d;
    } else {
      EXPECT_EQ(output[i], kSentinel) << "padding element " << i << " was written";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(QueryDtypes, DecodeCpu, testing::Values(DType::bf16, DType::f16),
                         [](const testing::TestParamInfo<DType>& info) { return dtype_name(info.param); });

// exact_attention itself, on a case small enough to work out by hand: two
// tokens with scores 0 and ln 3 give weights 1/4 and 3/4; a sink of ln 4
// adds 4 to the denominator 1 + 3.
// The GPU decode tests' large-value cases (test_decode_gpu.cpp) rely on
// this: values of amplitude 10^4 stay in fp16 range, and many vectors get a
// value scale over 4094, the largest the Hopper kernel's lazy rescale takes
// (tensor_core/shape.cuh, kMaxLazyValueScale), so their tiles take the exact path.
TEST(ScenarioValues, AmplitudeTenThousandGivesScalesPastTheLazyRescaleLimit) {
  ScenarioConfig config;
  config.seq_lens = {3000, 17, 1200, 0, 2500};
  config.value_amplitude = 10000.0f;
  const Scenario scenario = make_scenario(config);
  const int D = config.head_dim;
  std::size_t large = 0, vectors = 0;
  for (std::size_t row = 0; row + D <= scenario.values.size(); row += D, ++vectors) {
    const auto [low, high] = std::minmax_element(scenario.values.begin() + row, scenario.values.begin() + row + D);
    ASSERT_LT(std::max(std::abs(*low), std::abs(*high)), 65504.0f) << "vector " << vectors;
    if ((*high - *low) / 15.0f > 4094.0f) ++large;
  }
  EXPECT_GT(large, vectors / 10) << large << " of " << vectors;
  const DequantizedKv kv = dequantize(scenario);
  EXPECT_TRUE(std::all_of(kv.values.begin(), kv.values.end(), [](float v) { return std::isfinite(v); }));
}

TEST(ExactAttention, WeightsValuesBySoftmaxOfScores) {
  const int D = 2;
  const float query[D] = {1.0f, 0.0f};
  const float log3 = std::log(3.0f);
  const float keys[2 * D] = {0.0f, 5.0f, log3, -1.0f};
  const float values[2 * D] = {4.0f, 8.0f, 0.0f, -4.0f};
  const std::int64_t offsets[] = {0, 2};
  float out[D];
  exact_attention(query, keys, values, offsets, 1, 1, 1, D, 1.0f, nullptr, out);
  EXPECT_NEAR(out[0], 0.25f * 4.0f, 1e-6);
  EXPECT_NEAR(out[1], 0.25f * 8.0f + 0.75f * -4.0f, 1e-6);
  const float sink = std::log(4.0f);
  exact_attention(query, keys, values, offsets, 1, 1, 1, D, 1.0f, &sink, out);
  EXPECT_NEAR(out[0], 4.0f / 8.0f, 1e-6);
  EXPECT_NEAR(out[1], (8.0f - 12.0f) / 8.0f, 1e-6);
}

}  // namespace
}  // namespace tqdecode::test
