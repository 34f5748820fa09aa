// Reliability promises of the CPU paths (docs/RELIABILITY.md): the store
// refuses non-finite K/V with the cache bytes untouched, non-finite queries
// and sinks give NaN rows for that head only, cache offsets are 64-bit end to
// end, and arguments that would overflow int arithmetic are rejected (cases
// the fuzzer, tests/fuzz/, found or guards).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/scenario.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/reference.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode::test {
namespace {

// FNV-1a, 64 bits: a fingerprint of every cache byte.
std::uint64_t fnv1a(const std::vector<std::uint8_t>& bytes) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for (std::uint8_t byte : bytes) hash = (hash ^ byte) * 0x100000001b3ull;
  return hash;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------- store

// A batch big enough for the parallel encode (>= 64 (token, head) pairs),
// one non-finite element at the first, a middle or the last token, in keys
// or values, in every input dtype: Error naming "key" or "value", and the
// cache hashes the same before and after, junk and earlier stores included.
TEST(StoreNonFinite, RefusesAndLeavesTheCacheUntouched) {
  for (Preset preset : kAllPresets) {
    // 80 tokens, 160 (token, head) pairs; the cache holds them already.
    const Scenario scenario =
        make_scenario({.preset = preset, .num_q_heads = 2, .num_kv_heads = 2, .head_dim = 64, .seq_lens = {50, 30}});
    const std::int64_t row = 2 * 64;
    for (DType dtype : {DType::f32, DType::f16, DType::bf16}) {
      for (const bool in_key : {true, false}) {
        for (const std::int64_t token : {std::int64_t(0), std::int64_t(41), scenario.total_tokens() - 1}) {
          for (const float bad : {kNaN, kInf, -kInf}) {
            SCOPED_TRACE(std::string(preset_info(preset).name) + " " + dtype_name(dtype) + (in_key ? " key" : " value") +
                         " token " + std::to_string(token) + " value " + std::to_string(bad));
            std::vector<float> key = scenario.keys, value = scenario.values;
            (in_key ? key : value)[token * row + 64 + 17] = bad;  // kv head 1, element 17
            std::vector<std::uint8_t> key_data(key.size() * dtype_size(dtype)), value_data(key_data.size());
            for (std::size_t i = 0; i < key.size(); ++i) {
              store_from_float(key_data.data(), dtype, std::int64_t(i), key[i]);
              store_from_float(value_data.data(), dtype, std::int64_t(i), value[i]);
            }
            std::vector<std::uint8_t> cache = scenario.cache;
            const std::uint64_t before = fnv1a(cache);
            try {
              store_cpu(scenario.store_args(cache.data(), key_data.data(), value_data.data(), dtype));
              ADD_FAILURE() << "no error";
            } catch (const Error& error) {
              EXPECT_EQ(error.argument(), in_key ? "key" : "value") << error.what();
              EXPECT_NE(std::string(error.what()).find("token " + std::to_string(token) + ", kv head 1, element 17"),
                        std::string::npos)
                  << error.what();
            }
            EXPECT_EQ(fnv1a(cache), before);
            EXPECT_EQ(cache, scenario.cache);
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- decode

// Decoding with one query row or sink changed, by the direct reference, the
// split-KV pair and decode_cpu.
struct Outputs {
  std::vector<float> direct;
  std::vector<float> split;
  std::vector<std::uint16_t> cpu;  // query dtype bits
};

// Outputs start as a finite, non-zero value that no decode gives here, so
// rows expected NaN or zero must have been written.
constexpr float kUnwritten = 3.0e6f;
constexpr std::uint16_t kUnwrittenBits = 0x4a4a;  // finite and non-zero as bf16 and as fp16

Outputs decode_all(const Scenario& scenario) {
  const DecodeArgs args = scenario.host_args();
  Outputs out{std::vector<float>(scenario.query.size(), kUnwritten),
              std::vector<float>(scenario.query.size(), kUnwritten),
              std::vector<std::uint16_t>(scenario.query.size(), kUnwrittenBits)};
  decode_reference(args, out.direct.data());
  const int N = 3;
  const std::size_t rows = scenario.query.size() / scenario.config.head_dim;
  std::vector<float> max(rows * N), sum(rows * N), partial(rows * N * scenario.config.head_dim);
  const PartitionBuffers buffers{max.data(), sum.data(), partial.data()};
  decode_partitions_reference(args, N, 16, buffers);
  reduce_partitions_reference(args, N, buffers, out.split.data());
  decode_cpu(scenario.host_args(out.cpu.data()));
  return out;
}

enum class Expect { nan, zero, unchanged };

// Checks every [D] row of `got` against `clean` as `expect_of(b, hq)` says.
template <typename ExpectOf>
void expect_rows(const Scenario& scenario, const Outputs& got, const Outputs& clean, ExpectOf expect_of) {
  const int Hq = scenario.config.num_q_heads, D = scenario.config.head_dim;
  for (int b = 0; b < scenario.batch(); ++b) {
    for (int hq = 0; hq < Hq; ++hq) {
      SCOPED_TRACE("b " + std::to_string(b) + " hq " + std::to_string(hq));
      const std::size_t first = (std::size_t(b) * Hq + hq) * D;
      const Expect expect = expect_of(b, hq);
      for (std::size_t i = first; i < first + D; ++i) {
        const float cpu = load_as_float(got.cpu.data(), scenario.config.query_dtype, std::int64_t(i));
        if (expect == Expect::nan) {
          ASSERT_TRUE(std::isnan(got.direct[i]) && std::isnan(got.split[i]) && std::isnan(cpu)) << "element " << i - first;
        } else if (expect == Expect::zero) {
          ASSERT_TRUE(got.direct[i] == 0.0f && got.split[i] == 0.0f && cpu == 0.0f) << "element " << i - first;
        } else {
          ASSERT_EQ(got.direct[i], clean.direct[i]) << "element " << i - first;
          ASSERT_EQ(got.split[i], clean.split[i]) << "element " << i - first;
          ASSERT_EQ(got.cpu[i], clean.cpu[i]) << "element " << i - first;
        }
      }
    }
  }
}

ScenarioConfig decode_config(Preset preset, DType query_dtype, bool sinks = true) {
  return {.preset = preset, .num_q_heads = 8, .num_kv_heads = 2, .head_dim = 64, .seq_lens = {40, 0, 7},
          .sinks = sinks, .query_dtype = query_dtype};
}

class NonFinite : public testing::TestWithParam<std::tuple<Preset, DType>> {};

// A NaN or an infinity anywhere in a query row makes that (sequence, query
// head)'s output all NaN when the sequence has tokens, and all zero when it
// has none; every other row is bit-for-bit what it is with a finite query.
// With and without sinks (without, a reducer that drops NaN partitions from
// its max would see no tokens and write zeros).
TEST_P(NonFinite, QueryGivesNanRowsForThatHeadOnly) {
  const auto [preset, dtype] = GetParam();
  for (const bool sinks : {false, true}) {
    SCOPED_TRACE(sinks ? "with sinks" : "without sinks");
    const Scenario clean = make_scenario(decode_config(preset, dtype, sinks));
    const Outputs expected = decode_all(clean);
    const int Hq = 8, D = 64;
    struct Poison {
      int b, hq, d;
      float value;
    };
    const Poison poisons[] = {{0, 1, 5, kNaN}, {2, 6, 0, kInf}, {2, 7, 63, -kInf}, {1, 3, 9, kNaN}};
    Scenario poisoned = clean;
    for (const Poison& p : poisons) {
      store_from_float(poisoned.query_bits.data(), dtype, (std::int64_t(p.b) * Hq + p.hq) * D + p.d, p.value);
    }
    const Outputs got = decode_all(poisoned);
    expect_rows(clean, got, expected, [&](int b, int hq) {
      if (clean.seq_lens[b] == 0) return Expect::zero;
      for (const Poison& p : poisons) {
        if (p.b == b && p.hq == hq) return Expect::nan;
      }
      return Expect::unchanged;
    });
  }
}

// A NaN or +inf sink makes that head's rows NaN (zero for an empty
// sequence); a sink of -inf is no sink at all.
TEST_P(NonFinite, SinkGivesNanRowsForThatHeadOnly) {
  const auto [preset, dtype] = GetParam();
  const Scenario clean = make_scenario(decode_config(preset, dtype));
  const Outputs expected = decode_all(clean);
  Scenario poisoned = clean;
  poisoned.sinks[2] = kNaN;
  poisoned.sinks[5] = kInf;
  const Outputs got = decode_all(poisoned);
  expect_rows(clean, got, expected, [&](int b, int hq) {
    if (clean.seq_lens[b] == 0) return Expect::zero;
    return hq == 2 || hq == 5 ? Expect::nan : Expect::unchanged;
  });

  Scenario no_sink = clean;
  no_sink.sinks.clear();
  Scenario minus_infinity = clean;
  minus_infinity.sinks.assign(8, -kInf);
  const Outputs a = decode_all(no_sink), b = decode_all(minus_infinity);
  EXPECT_EQ(a.direct, b.direct);
  EXPECT_EQ(a.split, b.split);
  EXPECT_EQ(a.cpu, b.cpu);
}

INSTANTIATE_TEST_SUITE_P(PresetsAndDtypes, NonFinite,
                         testing::Combine(testing::ValuesIn(kAllPresets), testing::Values(DType::bf16, DType::f16)),
                         [](const testing::TestParamInfo<std::tuple<Preset, DType>>& info) {
                           return std::string(preset_info(std::get<0>(info.param)).name) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------- 64-bit offsets

// Anonymous memory reserved without backing: only the pages written use RAM.
class SparseBytes {
 public:
  explicit SparseBytes(std::size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    data_ = p == MAP_FAILED ? nullptr : static_cast<std::uint8_t*>(p);
  }
  ~SparseBytes() {
    if (data_) munmap(data_, bytes_);
  }
  SparseBytes(const SparseBytes&) = delete;
  SparseBytes& operator=(const SparseBytes&) = delete;
  std::uint8_t* data() const { return data_; }

 private:
  std::size_t bytes_;
  std::uint8_t* data_;
};

// The store and every decode entry point address blocks that start past
// 4 GiB (and past 2 GiB, where a 32-bit signed offset breaks): a scenario
// moved to the top of a 4.3 GB cache decodes exactly as it does at the bottom.
TEST(Offsets64, StoreAndDecodeReachBlocksPast4GiB) {
  // 4-bit, D 128, Hk 8: 17152-byte blocks.
  const Scenario scenario = make_scenario({.seq_lens = {40, 17, 33}, .sinks = true});
  const std::int64_t stride = scenario.layout.block_stride;
  const std::int64_t shift = (std::int64_t(1) << 32) / stride + 1;  // first block wholly past 4 GiB
  const std::int64_t num_blocks = shift + scenario.num_blocks;
  SparseBytes cache(std::size_t(num_blocks * stride));
  if (cache.data() == nullptr) GTEST_SKIP() << "could not reserve " << num_blocks * stride << " bytes of address space";

  const int bs = scenario.layout.block_size;
  std::vector<std::int64_t> slots = scenario.slot_mapping;
  for (std::int64_t& slot : slots) slot += shift * bs;
  // fp32 K/V holding bf16 values: the same bytes as the scenario's bf16 store.
  StoreArgs store = scenario.store_args(cache.data(), scenario.keys.data(), scenario.values.data(), DType::f32);
  store.num_blocks = num_blocks;
  store.slot_mapping = slots.data();
  store_cpu(store);

  // Every stored record and field is where the layout says, with the scenario's bytes.
  const CacheLayout& layout = scenario.layout;
  for (std::size_t t = 0; t < slots.size(); ++t) {
    const std::int64_t block = scenario.slot_mapping[t] / bs;
    const int slot = static_cast<int>(scenario.slot_mapping[t] % bs);
    const std::uint8_t* low = scenario.cache.data() + layout.block_offset(block);
    const std::uint8_t* high = cache.data() + layout.block_offset(block + shift);
    ASSERT_GT(layout.block_offset(block + shift), std::int64_t(1) << 32);
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      ASSERT_TRUE(std::equal(low + layout.record_offset(slot, h), low + layout.record_offset(slot, h) + layout.record_bytes(),
                             high + layout.record_offset(slot, h)))
          << "token " << t << " head " << h;
      for (int f = 0; f < layout.fields(); ++f) {
        ASSERT_EQ(read_field_bits(high, layout, slot, h, f), read_field_bits(low, layout, slot, h, f));
      }
    }
  }

  std::vector<std::int32_t> table = scenario.block_table;
  for (int b = 0; b < scenario.batch(); ++b) {
    for (int j = 0; j < (scenario.seq_lens[b] + bs - 1) / bs; ++j) {
      table[std::size_t(b) * scenario.max_blocks_per_seq + j] += static_cast<std::int32_t>(shift);
    }
  }
  DecodeArgs high = scenario.host_args();
  high.cache = cache.data();
  high.num_blocks = num_blocks;
  high.block_table = table.data();
  const Outputs expected = decode_all(scenario);  // the same decode over the original cache
  std::vector<float> direct(scenario.query.size());
  decode_reference(high, direct.data());
  EXPECT_EQ(direct, expected.direct);
  const int N = 4;
  const std::size_t rows = scenario.query.size() / 128;
  std::vector<float> max(rows * N), sum(rows * N), partial(rows * N * 128);
  decode_partitions_reference(high, N, 16, {max.data(), sum.data(), partial.data()});
  std::vector<float> max0(rows * N), sum0(rows * N), partial0(rows * N * 128);
  decode_partitions_reference(scenario.host_args(), N, 16, {max0.data(), sum0.data(), partial0.data()});
  EXPECT_EQ(max, max0);
  EXPECT_EQ(sum, sum0);
  EXPECT_EQ(partial, partial0);
  std::vector<std::uint16_t> output(scenario.query.size());
  high.output = output.data();
  decode_cpu(high);
  EXPECT_EQ(output, expected.cpu);
}

// ---------------------------------------------------------------- int overflow guards

// make_layout checks the geometry before it computes the natural block size,
// whose int arithmetic would overflow for a huge head_dim or block_size
// (found by the fuzzer under UBSan).
TEST(OverflowGuards, MakeLayoutRejectsHugeValuesBeforeSizing) {
  auto argument_of = [](auto call) {
    try {
      call();
    } catch (const Error& error) {
      return error.argument();
    }
    return std::string("no error");
  };
  EXPECT_EQ(argument_of([] { make_layout(Preset::turboquant_4bit_nc, INT_MAX, 16, 8); }), "head_dim");
  EXPECT_EQ(argument_of([] { make_layout(Preset::turboquant_4bit_nc, 128, INT_MAX, INT_MAX); }), "block_size");
  EXPECT_EQ(argument_of([] { make_layout(Preset::turboquant_k8v4, 128, 16, INT_MAX); }), "num_kv_heads");
  EXPECT_EQ(argument_of([] { make_layout(Preset::turboquant_4bit_nc, INT_MIN, 16, 8, -1); }), "head_dim");
}

// The partition step bounds its count and alignment so partition_range's int
// arithmetic cannot overflow; out-of-range values are rejected by name.
TEST(OverflowGuards, PartitionCountAndAlignmentAreBounded) {
  const Scenario scenario = make_scenario({.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 64, .seq_lens = {5}});
  std::vector<float> max(1 << 17), sum(1 << 17), partial(64 << 17), out(64);
  const PartitionBuffers buffers{max.data(), sum.data(), partial.data()};
  auto argument_of = [&](int N, int align) {
    try {
      decode_partitions_reference(scenario.host_args(), N, align, buffers);
    } catch (const Error& error) {
      return error.argument();
    }
    return std::string("no error");
  };
  EXPECT_EQ(argument_of(1 << 16, 1 << 16), "no error");
  EXPECT_EQ(argument_of((1 << 16) + 1, 16), "num_partitions");
  EXPECT_EQ(argument_of(4, (1 << 16) + 1), "align");
  EXPECT_EQ(argument_of(4, INT_MAX), "align");
  try {
    reduce_partitions_reference(scenario.host_args(), INT_MAX, buffers, out.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), "num_partitions");
  }
}

}  // namespace
}  // namespace tqdecode::test
