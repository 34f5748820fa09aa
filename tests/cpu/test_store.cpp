// The store path (docs/FORMAT.md section 3): exact bytes of hand-made
// vectors, placement in the block, skipped slots, input dtypes, determinism,
// the distortion of real data, and every rejected input (with the cache
// intact).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "random.hpp"
#include "support/scenario.hpp"
#include "tqdecode/codebook.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode::test {
namespace {

// A junk-filled cache, fp32 K/V [tokens, Hk, D] and the constants to store them with.
struct StoreCase {
  CacheLayout layout;
  std::int64_t num_blocks;
  std::vector<std::uint8_t> cache;
  std::vector<float> key;
  std::vector<float> value;
  std::vector<std::int64_t> slots;
  std::vector<float> Pi;
  std::vector<float> centroids;

  StoreCase(Preset preset, int head_dim, int num_kv_heads, std::int64_t blocks, std::int64_t padding = 0)
      : layout(make_layout(preset, head_dim, 16, num_kv_heads)), num_blocks(blocks) {
    layout.block_stride += padding;
    cache = random_bytes(std::size_t(num_blocks * layout.block_stride), 77);
  }

  StoreArgs args() {
    StoreArgs args;
    args.layout = layout;
    args.num_blocks = num_blocks;
    args.cache = cache.data();
    args.key = key.data();
    args.value = value.data();
    args.kv_dtype = DType::f32;
    args.num_tokens = static_cast<std::int64_t>(slots.size());
    args.slot_mapping = slots.data();
    args.Pi = Pi.empty() ? nullptr : Pi.data();
    args.centroids = centroids.empty() ? nullptr : centroids.data();
    args.num_centroids = static_cast<int>(centroids.size());
    return args;
  }

  const std::uint8_t* record(std::int64_t slot, int head) const {
    return cache.data() + layout.block_offset(slot / 16) + layout.record_offset(slot % 16, head);
  }
  std::uint16_t field(std::int64_t slot, int head, int f) const {
    return read_field_bits(cache.data() + layout.block_offset(slot / 16), layout, static_cast<int>(slot % 16), head, f);
  }
};

std::vector<std::uint8_t> bytes_of(const std::uint8_t* at, int count) { return {at, at + count}; }

std::vector<std::uint8_t> repeat(std::vector<std::uint8_t> head, const std::vector<std::uint8_t>& tail, int times) {
  for (int i = 0; i < times; ++i) head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

// 4-bit codes d % 16 packed: low nibble first.
const std::vector<std::uint8_t> kRamp16 = {0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe};

// Keys: Pi[j][(j + 1) % D] = 1, so r[j] = k[(j + 1) % D] (a transposed Pi
// would give r[j] = k[j - 1] and different bytes). k = 3 e0 + 4 e1, n = 5:
// u[0] = 0.8 -> level 14 (0.8125), u[63] = 0.6 -> level 12 (0.5625), every
// other u = 0 sits between levels 7 (-0.0625) and 8 (0.0625): the tie goes
// to 7. ||c||^2 = 0.8125^2 + 0.5625^2 + 62 * 0.0625^2 = 1.21875, stored
// norm fp16(5 / sqrt(1.21875)) = fp16(4.5291) = 0x4487.
// Values: lo -1, hi 2.75, scale 3.75 / 15 = 0.25 (0x3400), zero -1 (0xbc00);
// (v + 1) / 0.25 hits the ties 2.5 -> 2, 3.5 -> 4, 1.5 -> 2 (half to even).
// Head 0 holds a zero key (codes 0, norm 0) and a constant value (scale 0,
// codes 0, zero fp16(0.3) = 0x34cd).
TEST(Store, HandMade4BitVectorsGiveTheExpectedBytes) {
  const int D = 64;
  StoreCase c(Preset::turboquant_4bit_nc, D, 2, 2, 48);
  c.Pi.assign(D * D, 0.0f);
  for (int j = 0; j < D; ++j) c.Pi[j * D + (j + 1) % D] = 1.0f;
  for (int i = 0; i < 16; ++i) c.centroids.push_back((i - 7.5f) / 8.0f);
  c.key.assign(2 * D, 0.0f);
  c.value.assign(2 * D, 0.3f);
  float* key = c.key.data() + D;
  float* value = c.value.data() + D;
  key[0] = 3.0f;
  key[1] = 4.0f;
  for (int d = 0; d < D; ++d) value[d] = -1.0f + 0.25f * (d % 16);
  value[1] = 2.75f;
  value[2] = -1.0f + 0.625f;  // code 2.5 -> 2
  value[3] = -1.0f + 0.875f;  // code 3.5 -> 4
  value[4] = -1.0f + 0.375f;  // code 1.5 -> 2
  c.slots = {21};             // block 1, slot 5
  const std::vector<std::uint8_t> before = c.cache;
  store_cpu(c.args());

  const CacheLayout& L = c.layout;
  std::vector<std::uint8_t> key_bytes(32, 0x77);
  key_bytes[0] = 0x7e;   // idx 14 | idx 7 << 4
  key_bytes[31] = 0xc7;  // idx 7 | idx 12 << 4
  EXPECT_EQ(bytes_of(c.record(21, 1), 32), key_bytes);
  EXPECT_EQ(c.field(21, 1, L.key_norm_field()), 0x4487);
  EXPECT_EQ(bytes_of(c.record(21, 1) + 32, 32),
            repeat({0xf0, 0x42, 0x52, 0x76, 0x98, 0xba, 0xdc, 0xfe}, kRamp16, 3));
  EXPECT_EQ(c.field(21, 1, L.value_scale_field()), 0x3400);
  EXPECT_EQ(c.field(21, 1, L.value_zero_field()), 0xbc00);

  EXPECT_EQ(bytes_of(c.record(21, 0), 64), std::vector<std::uint8_t>(64, 0));
  EXPECT_EQ(c.field(21, 0, L.key_norm_field()), 0x0000);
  EXPECT_EQ(c.field(21, 0, L.value_scale_field()), 0x0000);
  EXPECT_EQ(c.field(21, 0, L.value_zero_field()), 0x34cd);

  // Nothing else changed: 2 records and 6 fields, 2 * 64 + 6 * 2 bytes.
  std::size_t changed_or_written = 0;
  for (std::size_t i = 0; i < before.size(); ++i) changed_or_written += before[i] != c.cache[i];
  EXPECT_LE(changed_or_written, 2u * 64 + 6 * 2);
  std::vector<std::uint8_t> restored = c.cache;
  const std::int64_t block = L.block_offset(1);
  for (int h = 0; h < 2; ++h) {
    std::copy_n(before.begin() + block + L.record_offset(5, h), 64, restored.begin() + block + L.record_offset(5, h));
    for (int f = 0; f < 3; ++f) {
      std::copy_n(before.begin() + block + L.field_offset(5, h, f), 2, restored.begin() + block + L.field_offset(5, h, f));
    }
  }
  EXPECT_EQ(restored, before);
}

// 3 bits, Pi = I, levels (i - 3.5) / 4: k = 2 e0 -> idx 7 then 3 (the tie
// between -0.125 and 0.125 goes low); ||c||^2 = 0.875^2 + 63 / 64 = 1.75,
// norm fp16(2 / sqrt(1.75)) = 0x3e0c. Codes 7,3,3,... pack LSB first as
// DF B6 6D, then all-3 codes as DB B6 6D. Values 0.25 * (d % 8): scale 0.25,
// zero 0, codes 0..7 pack as 88 C6 FA.
TEST(Store, HandMade3BitVectorGivesTheExpectedBytes) {
  const int D = 64;
  StoreCase c(Preset::turboquant_3bit_nc, D, 1, 1);
  c.Pi.assign(D * D, 0.0f);
  for (int j = 0; j < D; ++j) c.Pi[j * D + j] = 1.0f;
  for (int i = 0; i < 8; ++i) c.centroids.push_back((i - 3.5f) / 4.0f);
  c.key.assign(D, 0.0f);
  c.key[0] = 2.0f;
  for (int d = 0; d < D; ++d) c.value.push_back(0.25f * (d % 8));
  c.slots = {3};
  store_cpu(c.args());
  EXPECT_EQ(bytes_of(c.record(3, 0), 24), repeat({0xdf, 0xb6, 0x6d}, {0xdb, 0xb6, 0x6d}, 7));
  EXPECT_EQ(c.field(3, 0, 0), 0x3e0c);
  EXPECT_EQ(bytes_of(c.record(3, 0) + 24, 24), repeat({}, {0x88, 0xc6, 0xfa}, 8));
  EXPECT_EQ(c.field(3, 0, 1), 0x3400);
  EXPECT_EQ(c.field(3, 0, 2), 0x0000);
}

// fp8 keys are the key itself, element by element (saturating at 448), and
// the two metadata fields are value scale (0) and value zero (1).
TEST(Store, HandMadeFp8VectorGivesTheExpectedBytes) {
  const int D = 64;
  StoreCase c(Preset::turboquant_k8v4, D, 1, 1);
  c.key.assign(D, 0.5f);  // 0x30
  const float special[] = {1.0f, -2.5f, 448.0f, 1000.0f, 0x1p-9f, 1.0625f, -0.0f};
  const std::uint8_t special_bytes[] = {0x38, 0xc2, 0x7e, 0x7e, 0x01, 0x38, 0x80};
  std::copy(std::begin(special), std::end(special), c.key.begin());
  for (int d = 0; d < D; ++d) c.value.push_back(0.25f * (d % 16));
  c.slots = {15};
  store_cpu(c.args());
  std::vector<std::uint8_t> expected(D, 0x30);
  std::copy(std::begin(special_bytes), std::end(special_bytes), expected.begin());
  EXPECT_EQ(bytes_of(c.record(15, 0), D), expected);
  EXPECT_EQ(bytes_of(c.record(15, 0) + D, 32), repeat({}, kRamp16, 4));
  EXPECT_EQ(c.field(15, 0, 0), 0x3400);
  EXPECT_EQ(c.field(15, 0, 1), 0x0000);
}

// The same values given as f32, f16 or bf16 give the same cache.
TEST(Store, InputDtypesGiveTheSameBytes) {
  for (Preset preset : kAllPresets) {
    const ModelConstants constants = make_model_constants(preset, 128, 5);
    StoreCase c(preset, 128, 2, 3);
    c.Pi = constants.Pi;
    c.centroids = constants.centroids;
    Rng rng(11);
    for (int i = 0; i < 20 * 2 * 128; ++i) {
      // bf16 values of magnitude >= 2^-8 are exact in fp16 too.
      const float key = round_to_bf16(static_cast<float>(2.0 * rng.normal()));
      c.key.push_back(std::abs(key) < 0x1p-8f ? 0.5f : key);
      const float value = round_to_bf16(static_cast<float>(rng.normal() + 0.5));
      c.value.push_back(std::abs(value) < 0x1p-8f ? 0.5f : value);
    }
    for (int t = 0; t < 20; ++t) c.slots.push_back(47 - 2 * t);
    store_cpu(c.args());
    for (DType dtype : {DType::f16, DType::bf16}) {
      std::vector<std::uint16_t> key(c.key.size()), value(c.value.size());
      for (std::size_t i = 0; i < key.size(); ++i) {
        store_from_float(key.data(), dtype, i, c.key[i]);
        store_from_float(value.data(), dtype, i, c.value[i]);
      }
      std::vector<std::uint8_t> cache = random_bytes(c.cache.size(), 77);
      StoreArgs args = c.args();
      args.cache = cache.data();
      args.key = key.data();
      args.value = value.data();
      args.kv_dtype = dtype;
      store_cpu(args);
      EXPECT_EQ(cache, c.cache) << preset_info(preset).name << " " << dtype_name(dtype);
    }
  }
}

// One call over many tokens equals one call per token in any order.
TEST(Store, OneCallEqualsTokenByTokenCalls) {
  for (Preset preset : kAllPresets) {
    ScenarioConfig config;
    config.preset = preset;
    config.head_dim = 64;
    config.num_kv_heads = 4;
    config.seq_lens = {37, 20};
    config.kv_dtype = DType::f32;
    const Scenario scenario = make_scenario(config);
    StoreCase c(preset, 64, 4, scenario.num_blocks);
    c.key = scenario.keys;
    c.value = scenario.values;
    c.slots = scenario.slot_mapping;
    c.Pi = scenario.constants.Pi;
    c.centroids = scenario.constants.centroids;
    const std::vector<std::uint8_t> junk = c.cache;
    store_cpu(c.args());
    std::vector<std::uint8_t> one_by_one = junk;
    const std::int64_t row = 4 * 64;
    for (std::int64_t t = std::int64_t(c.slots.size()) - 1; t >= 0; --t) {
      StoreArgs args = c.args();
      args.cache = one_by_one.data();
      args.num_tokens = 1;
      args.key = c.key.data() + t * row;
      args.value = c.value.data() + t * row;
      args.slot_mapping = c.slots.data() + t;
      store_cpu(args);
    }
    EXPECT_EQ(one_by_one, c.cache) << preset_info(preset).name;
  }
}

// Negative slots are skipped: nothing written and their K/V never read
// (NaN there is fine).
TEST(Store, NegativeSlotsAreSkipped) {
  const int D = 64;
  StoreCase c(Preset::turboquant_k3v4_nc, D, 1, 2);
  const ModelConstants constants = make_model_constants(Preset::turboquant_k3v4_nc, D, 3);
  c.Pi = constants.Pi;
  c.centroids = constants.centroids;
  c.key.assign(3 * D, std::numeric_limits<float>::quiet_NaN());
  c.value.assign(3 * D, std::numeric_limits<float>::infinity());
  for (int d = 0; d < D; ++d) {
    c.key[D + d] = std::sin(0.1f * d);
    c.value[D + d] = std::cos(0.2f * d);
  }
  c.slots = {-1, 5, -7};
  StoreCase only_middle = c;
  store_cpu(c.args());

  only_middle.key.erase(only_middle.key.begin(), only_middle.key.begin() + D);
  only_middle.value.erase(only_middle.value.begin(), only_middle.value.begin() + D);
  only_middle.slots = {5};
  store_cpu(only_middle.args());
  EXPECT_EQ(c.cache, only_middle.cache);

  c.slots = {-1, -1, -1};
  const std::vector<std::uint8_t> before = c.cache;
  store_cpu(c.args());
  EXPECT_EQ(c.cache, before);
}

// The stored keys reach the Lloyd-Max distortion of their codebook (relative
// squared error of a key; measured 0.0082 at 4 bits and 0.0297 at 3 bits
// against the codebook's 0.0093 and 0.0340 for a uniformly random direction
// at D = 128: norm correction helps), fp8 keys their rounding error
// (measured 7.0e-4), and values their uniform step (measured 0.0099 at
// 4 bits, 0.045 at 3 bits).
TEST(Store, DistortionMatchesTheQuantizers) {
  for (Preset preset : kAllPresets) {
    ScenarioConfig config;
    config.preset = preset;
    config.head_dim = 128;
    config.num_kv_heads = 2;
    config.seq_lens = {300};
    const Scenario scenario = make_scenario(config);
    const DequantizedKv kv = dequantize(scenario);
    auto relative_mse = [](const std::vector<float>& actual, const std::vector<float>& expected) {
      const double rel = relative_l2(actual, expected);
      return rel * rel;
    };
    const PresetInfo info = preset_info(preset);
    const double key_error = relative_mse(kv.keys, scenario.keys);
    const double value_error = relative_mse(kv.values, scenario.values);
    if (info.key_fp8) {
      EXPECT_LE(key_error, 1.5e-3);
    } else {
      EXPECT_LE(key_error, 1.1 * lloyd_max_unit_vector_mse(scenario.constants.centroids, 128)) << info.name;
    }
    EXPECT_LE(value_error, info.value_bits == 4 ? 0.015 : 0.07) << info.name;
  }
}

// ---------------------------------------------------------------- rejected inputs

struct BadStore {
  const char* what;
  std::function<void(StoreCase&, StoreArgs&)> corrupt;
  const char* argument;
};

// Every rejected input throws Error naming the argument and leaves the cache
// byte-for-byte as it was, even when other tokens were fine.
TEST(StoreRejects, EveryBadInputNamingTheArgumentAndWritingNothing) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<BadStore> cases = {
      {"head dim", [](StoreCase&, StoreArgs& a) { a.layout.head_dim = 96; }, "head_dim"},
      {"block size", [](StoreCase&, StoreArgs& a) { a.layout.block_size = 8; }, "block_size"},
      {"kv heads", [](StoreCase&, StoreArgs& a) { a.layout.num_kv_heads = 0; }, "num_kv_heads"},
      {"block stride below natural",
       [](StoreCase&, StoreArgs& a) { a.layout.block_stride = a.layout.natural_block_bytes() - 1; }, "block_stride"},
      {"stride of a smaller geometry", [](StoreCase&, StoreArgs& a) { a.layout.head_dim = 128; }, "block_stride"},
      {"no blocks", [](StoreCase&, StoreArgs& a) { a.num_blocks = 0; }, "num_blocks"},
      {"negative tokens", [](StoreCase&, StoreArgs& a) { a.num_tokens = -1; }, "num_tokens"},
      {"unknown dtype", [](StoreCase&, StoreArgs& a) { a.kv_dtype = static_cast<DType>(9); }, "kv_dtype"},
      {"codebook size", [](StoreCase&, StoreArgs& a) { a.num_centroids = 8; }, "num_centroids"},
      {"null cache", [](StoreCase&, StoreArgs& a) { a.cache = nullptr; }, "cache"},
      {"null key", [](StoreCase&, StoreArgs& a) { a.key = nullptr; }, "key"},
      {"null value", [](StoreCase&, StoreArgs& a) { a.value = nullptr; }, "value"},
      {"null slot mapping", [](StoreCase&, StoreArgs& a) { a.slot_mapping = nullptr; }, "slot_mapping"},
      {"null Pi", [](StoreCase&, StoreArgs& a) { a.Pi = nullptr; }, "Pi"},
      {"null centroids", [](StoreCase&, StoreArgs& a) { a.centroids = nullptr; }, "centroids"},
      {"unsorted centroids", [](StoreCase& c, StoreArgs&) { std::swap(c.centroids[3], c.centroids[4]); }, "centroids[4]"},
      {"NaN centroid", [nan](StoreCase& c, StoreArgs&) { c.centroids[0] = nan; }, "centroids[0]"},
      {"NaN in Pi", [nan](StoreCase& c, StoreArgs&) { c.Pi[77] = nan; }, "Pi"},
      {"slot past the cache", [](StoreCase& c, StoreArgs&) { c.slots[1] = 2 * 16; }, "slot_mapping[1]"},
      {"slot written twice", [](StoreCase& c, StoreArgs&) { c.slots[2] = c.slots[0]; }, "slot_mapping[2]"},
      {"NaN key", [nan](StoreCase& c, StoreArgs&) { c.key[1 * 128 + 64 + 5] = nan; }, "key"},
      {"infinite value", [inf](StoreCase& c, StoreArgs&) { c.value[2 * 128 + 3] = -inf; }, "value"},
      {"key norm beyond fp16", [](StoreCase& c, StoreArgs&) { std::fill_n(c.key.begin() + 64, 64, 1e5f); }, "key"},
      {"value beyond fp16", [](StoreCase& c, StoreArgs&) { c.value[100] = -70000.0f; }, "value"},
  };
  for (const BadStore& bad : cases) {
    SCOPED_TRACE(bad.what);
    const int D = 64;
    StoreCase c(Preset::turboquant_4bit_nc, D, 2, 2);
    const ModelConstants constants = make_model_constants(Preset::turboquant_4bit_nc, D, 1);
    c.Pi = constants.Pi;
    c.centroids = constants.centroids;
    for (int i = 0; i < 3 * 2 * D; ++i) {
      c.key.push_back(std::sin(0.37f * i));
      c.value.push_back(std::cos(0.11f * i));
    }
    c.slots = {0, 17, 30};
    StoreArgs args = c.args();
    bad.corrupt(c, args);
    const std::vector<std::uint8_t> before = c.cache;
    try {
      store_cpu(args);
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_EQ(error.argument(), bad.argument) << error.what();
    }
    EXPECT_EQ(c.cache, before);
  }
}

TEST(StoreRejects, ErrorSaysWhichTokenAndHead) {
  const int D = 64;
  StoreCase c(Preset::turboquant_k8v4, D, 2, 1);
  c.key.assign(3 * 2 * D, 1.0f);
  c.value.assign(3 * 2 * D, 1.0f);
  c.key[(2 * 2 + 1) * D + 9] = std::numeric_limits<float>::infinity();
  c.slots = {0, 1, 2};
  try {
    store_cpu(c.args());
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), "key");
    EXPECT_NE(std::string(error.what()).find("token 2, kv head 1, element 9"), std::string::npos) << error.what();
  }
}

TEST(StoreRejects, NothingToStoreNeedsNoTensors) {
  StoreArgs args;
  args.layout = make_layout(Preset::turboquant_4bit_nc, 128, 16, 2);
  args.num_blocks = 1;
  args.num_centroids = 16;
  EXPECT_NO_THROW(store_cpu(args));
  args.layout = make_layout(Preset::turboquant_k8v4, 128, 16, 2);
  args.num_centroids = 0;  // fp8 keys use no codebook
  EXPECT_NO_THROW(store_cpu(args));
}

}  // namespace
}  // namespace tqdecode::test
