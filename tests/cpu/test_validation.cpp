// Every rejected decode input (validate_decode_shapes and
// validate_decode_host_contents through every CPU entry point): an Error that
// names the argument or element, and nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "support/scenario.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode::test {
namespace {

using tqdecode::test::expect_error_naming;

// 4-bit, D = 64, block 16, Hk = 2, Hq = 4; seq_lens {5, 20} use 1 and 2 of
// 4 table columns, the rest hold -1 or out-of-range junk.
Scenario small_scenario(Preset preset = Preset::turboquant_4bit_nc) {
  ScenarioConfig config;
  config.preset = preset;
  config.head_dim = 64;
  config.num_kv_heads = 2;
  config.num_q_heads = 4;
  config.seq_lens = {5, 20};
  return make_scenario(config);
}

// Host tensors a case may corrupt, and the output the call must leave alone.
struct Inputs {
  std::vector<std::int32_t> seq_lens;
  std::vector<std::int32_t> block_table;
  std::vector<std::uint16_t> output;
};

struct BadDecode {
  const char* what;
  std::function<void(DecodeArgs&, Inputs&)> corrupt;
  const char* argument;
  bool content;  ///< caught by validate_decode_host_contents only
};

TEST(DecodeValidation, AValueOutsideTheDtypeEnumIsNotNamedAsAnother) {
  EXPECT_STREQ(dtype_name(static_cast<DType>(77)), "an unknown dtype");
  EXPECT_STREQ(dtype_name(DType::bf16), "bfloat16");
}

TEST(DecodeValidation, EveryBadInputNamesTheArgumentAndWritesNothing) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<BadDecode> cases = {
      {"negative batch", [](DecodeArgs& a, Inputs&) { a.batch = -1; }, "batch", false},
      {"unknown preset", [](DecodeArgs& a, Inputs&) { a.layout.preset = static_cast<Preset>(9); }, "preset", false},
      {"head dim", [](DecodeArgs& a, Inputs&) { a.layout.head_dim = 96; }, "head_dim", false},
      {"block size", [](DecodeArgs& a, Inputs&) { a.layout.block_size = 24; }, "block_size", false},
      {"no kv heads", [](DecodeArgs& a, Inputs&) { a.layout.num_kv_heads = 0; }, "num_kv_heads", false},
      {"block stride below natural",
       [](DecodeArgs& a, Inputs&) { a.layout.block_stride = a.layout.natural_block_bytes() - 2; }, "block_stride",
       false},
      {"q heads not a multiple", [](DecodeArgs& a, Inputs&) { a.num_q_heads = 3; }, "num_q_heads", false},
      {"no q heads", [](DecodeArgs& a, Inputs&) { a.num_q_heads = 0; }, "num_q_heads", false},
      {"group of 17", [](DecodeArgs& a, Inputs&) { a.num_q_heads = 34; }, "num_q_heads", false},
      {"fp32 query", [](DecodeArgs& a, Inputs&) { a.query_dtype = DType::f32; }, "query_dtype", false},
      {"dtype outside the enum", [](DecodeArgs& a, Inputs&) { a.query_dtype = static_cast<DType>(77); }, "query_dtype",
       false},
      {"no blocks", [](DecodeArgs& a, Inputs&) { a.num_blocks = 0; }, "num_blocks", false},
      {"no table columns", [](DecodeArgs& a, Inputs&) { a.max_blocks_per_seq = 0; }, "max_blocks_per_seq", false},
      {"table past 2^31 positions", [](DecodeArgs& a, Inputs&) { a.max_blocks_per_seq = (1 << 27) + 1; },
       "max_blocks_per_seq", false},
      {"query batch stride", [](DecodeArgs& a, Inputs&) { a.query_stride_batch = -1; }, "query_stride_batch", false},
      {"query head stride", [](DecodeArgs& a, Inputs&) { a.query_stride_head = -64; }, "query_stride_head", false},
      {"table stride", [](DecodeArgs& a, Inputs&) { a.block_table_stride = -4; }, "block_table_stride", false},
      {"output batch stride", [](DecodeArgs& a, Inputs&) { a.output_stride_batch = -1; }, "output_stride_batch", false},
      {"output head stride", [](DecodeArgs& a, Inputs&) { a.output_stride_head = -1; }, "output_stride_head", false},
      {"output heads overlapping", [](DecodeArgs& a, Inputs&) { a.output_stride_head = 32; }, "output_stride_head",
       false},
      {"output rows overlapping", [](DecodeArgs& a, Inputs&) { a.output_stride_batch = 3 * 64; }, "output_stride_batch",
       false},
      {"output dims over heads", [](DecodeArgs& a, Inputs&) { a.output_stride_head = 1; }, "output_stride_head", false},
      {"NaN scale", [nan](DecodeArgs& a, Inputs&) { a.scale = nan; }, "scale", false},
      {"infinite scale", [inf](DecodeArgs& a, Inputs&) { a.scale = inf; }, "scale", false},
      {"codebook size", [](DecodeArgs& a, Inputs&) { a.num_centroids = 8; }, "num_centroids", false},
      {"null query", [](DecodeArgs& a, Inputs&) { a.query = nullptr; }, "query", false},
      {"null cache", [](DecodeArgs& a, Inputs&) { a.cache = nullptr; }, "cache", false},
      {"null block table", [](DecodeArgs& a, Inputs&) { a.block_table = nullptr; }, "block_table", false},
      {"null seq lens", [](DecodeArgs& a, Inputs&) { a.seq_lens = nullptr; }, "seq_lens", false},
      {"null output", [](DecodeArgs& a, Inputs&) { a.output = nullptr; }, "output", false},
      {"null centroids", [](DecodeArgs& a, Inputs&) { a.centroids = nullptr; }, "centroids", false},
      {"null PiT", [](DecodeArgs& a, Inputs&) { a.PiT = nullptr; }, "PiT", false},
      {"negative seq len", [](DecodeArgs&, Inputs& in) { in.seq_lens[1] = -1; }, "seq_lens[1]", true},
      {"seq len past the table", [](DecodeArgs&, Inputs& in) { in.seq_lens[1] = 4 * 16 + 1; }, "seq_lens[1]", true},
      {"seq len reaching a junk entry", [](DecodeArgs&, Inputs& in) { in.seq_lens[0] = 17; }, "block_table[0][1]",
       true},
      {"block past the cache",
       [](DecodeArgs& a, Inputs& in) { in.block_table[1 * 4 + 1] = static_cast<std::int32_t>(a.num_blocks); },
       "block_table[1][1]", true},
      {"negative block", [](DecodeArgs&, Inputs& in) { in.block_table[1 * 4 + 0] = -1; }, "block_table[1][0]", true},
      {"row stride shifts a junk entry in", [](DecodeArgs& a, Inputs&) { a.block_table_stride = 1; },
       "block_table[1][0]", true},
      {"one table row with a row stride",
       [](DecodeArgs& a, Inputs&) {
         a.block_table_one_row = true;
         a.block_table_stride = 4;
       },
       "block_table_stride", false},
      {"one table row past row 0's blocks",  // the expanded view's element [1][1] is row 0's junk entry
       [](DecodeArgs& a, Inputs& in) {
         a.block_table_one_row = true;
         in.seq_lens[1] = 17;
       },
       "block_table[1][1]", true},
  };
  const Scenario scenario = small_scenario();
  ASSERT_EQ(scenario.max_blocks_per_seq, 4);
  for (const BadDecode& bad : cases) {
    SCOPED_TRACE(bad.what);
    constexpr std::uint16_t kSentinel = 0x5a5a;
    Inputs inputs{scenario.seq_lens, scenario.block_table, std::vector<std::uint16_t>(2 * 4 * 64, kSentinel)};
    DecodeArgs args = scenario.host_args(inputs.output.data());
    args.seq_lens = inputs.seq_lens.data();
    args.block_table = inputs.block_table.data();
    bad.corrupt(args, inputs);
    if (bad.content) {
      EXPECT_NO_THROW(validate_decode_shapes(args));
    } else {
      expect_error_naming(bad.argument, [&] { validate_decode_shapes(args); });
    }
    expect_error_naming(bad.argument, [&] { validate_decode_host_contents(args); });
    expect_error_naming(bad.argument, [&] { decode_cpu(args); });
    EXPECT_EQ(inputs.output, std::vector<std::uint16_t>(inputs.output.size(), kSentinel)) << "output was written";
  }
}

// block_table_one_row: every sequence reads row 0, whatever the other rows hold.
TEST(DecodeValidation, OneTableRowReadsRowZeroForEverySequence) {
  const Scenario scenario = small_scenario();
  ASSERT_LE(scenario.seq_lens[0], 16);
  const std::vector<std::int32_t> seq_lens = {scenario.seq_lens[0], 1};
  std::vector<std::int32_t> copied = scenario.block_table, one_row = scenario.block_table;
  std::copy_n(scenario.block_table.begin(), 4, copied.begin() + 4);
  std::fill(one_row.begin() + 4, one_row.end(), -1);
  std::vector<std::uint16_t> expected(2 * 4 * 64, 0x5a5a), output(2 * 4 * 64, 0x5a5a);
  DecodeArgs args = scenario.host_args(expected.data());
  args.seq_lens = seq_lens.data();
  args.block_table = copied.data();
  decode_cpu(args);
  args.output = output.data();
  args.block_table = one_row.data();
  args.block_table_one_row = true;
  decode_cpu(args);
  EXPECT_EQ(output, expected);
  EXPECT_NE(output[2 * 4 * 64 - 1], 0x5a5a);  // row 1 was written
}

TEST(DecodeValidation, AcceptsTheEdgesOfTheValidRange) {
  const Scenario scenario = small_scenario();
  std::vector<std::uint16_t> output(2 * 4 * 64);
  DecodeArgs args = scenario.host_args(output.data());

  // A sequence that fills every table column, all of them valid blocks.
  std::vector<std::int32_t> seq_lens = {5, 4 * 16};
  std::vector<std::int32_t> table = scenario.block_table;
  for (int j = 2; j < 4; ++j) table[4 + j] = static_cast<std::int32_t>(scenario.num_blocks - 1);
  args.seq_lens = seq_lens.data();
  args.block_table = table.data();
  EXPECT_NO_THROW(decode_cpu(args));

  // Batch 0 is a no-op that needs no tensors.
  DecodeArgs empty = scenario.host_args();
  empty.batch = 0;
  empty.query = nullptr;
  empty.cache = nullptr;
  empty.block_table = nullptr;
  empty.seq_lens = nullptr;
  empty.centroids = nullptr;
  empty.PiT = nullptr;
  EXPECT_NO_THROW(decode_cpu(empty));

  // fp8 keys use neither codebook nor rotation.
  const Scenario fp8 = small_scenario(Preset::turboquant_k8v4);
  DecodeArgs fp8_args = fp8.host_args(output.data());
  EXPECT_EQ(fp8_args.centroids, nullptr);
  EXPECT_EQ(fp8_args.PiT, nullptr);
  EXPECT_EQ(fp8_args.num_centroids, 0);
  EXPECT_NO_THROW(decode_cpu(fp8_args));
}

// The reference steps validate like decode_cpu, plus their own arguments,
// and write nothing on error.
TEST(DecodeValidation, ReferenceStepsValidateTheirArguments) {
  const Scenario scenario = small_scenario();
  const DecodeArgs args = scenario.host_args();
  const int N = 3;
  const float sentinel = 7.0f;
  std::vector<float> max(8 * N, sentinel), sum(8 * N, sentinel), partial(8 * N * 64, sentinel), out(8 * 64, sentinel);
  const PartitionBuffers buffers{max.data(), sum.data(), partial.data()};

  std::vector<std::int32_t> bad_lens = {5, -2};
  DecodeArgs bad = args;
  bad.seq_lens = bad_lens.data();
  expect_error_naming("seq_lens[1]", [&] { decode_reference(bad, out.data()); });
  expect_error_naming("seq_lens[1]", [&] { decode_partitions_reference(bad, N, 16, buffers); });
  bad = args;
  bad.scale = std::numeric_limits<float>::infinity();
  expect_error_naming("scale", [&] { reduce_partitions_reference(bad, N, buffers, out.data()); });
  expect_error_naming("scale", [&] { rotate_queries_reference(bad, out.data()); });

  expect_error_naming("output", [&] { decode_reference(args, nullptr); });
  expect_error_naming("q_rot", [&] { rotate_queries_reference(args, nullptr); });
  expect_error_naming("num_partitions", [&] { decode_partitions_reference(args, 0, 16, buffers); });
  expect_error_naming("align", [&] { decode_partitions_reference(args, N, 0, buffers); });
  expect_error_naming("partitions.max", [&] { decode_partitions_reference(args, N, 16, {nullptr, sum.data(), partial.data()}); });
  expect_error_naming("partitions.sum", [&] { decode_partitions_reference(args, N, 16, {max.data(), nullptr, partial.data()}); });
  expect_error_naming("partitions.out", [&] { decode_partitions_reference(args, N, 16, {max.data(), sum.data(), nullptr}); });
  expect_error_naming("num_partitions", [&] { reduce_partitions_reference(args, 0, buffers, out.data()); });
  expect_error_naming("partitions.out", [&] { reduce_partitions_reference(args, N, {max.data(), sum.data(), nullptr}, out.data()); });
  for (const std::vector<float>* buffer : {&max, &sum, &partial, &out}) {
    EXPECT_EQ(*buffer, std::vector<float>(buffer->size(), sentinel)) << "a buffer was written";
  }

  std::vector<float> exact_out(2 * 4 * 64, sentinel);
  const auto exact = [&](const float* query, const float* keys, const std::int64_t* offsets, int num_kv_heads,
                         float* destination) {
    exact_attention(query, keys, scenario.values.data(), offsets, 2, 4, num_kv_heads, 64, scenario.scale, nullptr,
                    destination);
  };
  const float* query = scenario.query.data();
  const float* keys = scenario.keys.data();
  const std::int64_t* offsets = scenario.token_offsets.data();
  expect_error_naming("num_q_heads", [&] { exact(query, keys, offsets, 3, exact_out.data()); });
  expect_error_naming("query", [&] { exact(nullptr, keys, offsets, 2, exact_out.data()); });
  expect_error_naming("keys", [&] { exact(query, nullptr, offsets, 2, exact_out.data()); });
  expect_error_naming("token_offsets", [&] { exact(query, keys, nullptr, 2, exact_out.data()); });
  expect_error_naming("out", [&] { exact(query, keys, offsets, 2, nullptr); });
  const std::vector<std::int64_t> decreasing = {0, 20, 5};
  expect_error_naming("token_offsets[2]", [&] { exact(query, keys, decreasing.data(), 2, exact_out.data()); });
  EXPECT_EQ(exact_out, std::vector<float>(exact_out.size(), sentinel)) << "exact_attention wrote on error";
}

}  // namespace
}  // namespace tqdecode::test
