// The GPU store against the CPU store: the same input bytes must give the
// same cache bytes, for every preset, head dim, K/V dtype, rotation kind and
// cache order (blocks; token_slots in both stride orders, with padded slots),
// in a junk-filled cache with a padded block stride and skipped slots. Every
// rejected input (slot out of range, two tokens in one slot, non-finite K or
// V, fp16 overflow) must throw the same argument as the CPU and leave the
// device cache untouched; the default recording mode works inside graphs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "support/scenario.hpp"
#include "support/synthetic.hpp"
#include "tqdecode/constants.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode::test {
namespace {

struct StoreGpuCase {
  Preset preset;
  int head_dim;
  int block_size;
  int num_kv_heads;
  DType kv_dtype;
  std::int64_t padding;  ///< bytes added to the natural block stride (or to the slots' extent)
  RotationKind rotation;
  CacheOrder order = CacheOrder::blocks;
  bool heads_major = false;      ///< token_slots: the slots of a kv head side by side
  std::int64_t slot_padding = 0;  ///< token_slots: even bytes between slots
};

std::string case_name(const StoreGpuCase& c) {
  return std::string(preset_info(c.preset).name) + "_d" + std::to_string(c.head_dim) + "_bs" +
         std::to_string(c.block_size) + "_hk" + std::to_string(c.num_kv_heads) + "_" + dtype_name(c.kv_dtype) + "_pad" +
         std::to_string(c.padding) + (c.rotation == RotationKind::dense ? "_dense" : "_hadamard") +
         (c.order == CacheOrder::token_slots
              ? std::string(c.heads_major ? "_slots_heads_major" : "_slots") + "_pitch" + std::to_string(c.slot_padding)
              : "");
}

/// Host inputs of one store, and the same inputs on the device.
struct StoreInputs {
  CacheLayout layout;
  std::int64_t num_blocks = 0;
  std::int64_t num_tokens = 0;
  DType kv_dtype = DType::bf16;
  std::vector<std::uint8_t> junk;  ///< the cache before the store
  std::vector<std::uint8_t> key;   ///< [tokens, Hk, D] raw kv_dtype elements
  std::vector<std::uint8_t> value;
  std::vector<std::int64_t> slots;
  ModelConstants constants;

  StoreArgs host_args(std::uint8_t* cache) const {
    StoreArgs args;
    args.layout = layout;
    args.num_blocks = num_blocks;
    args.cache = cache;
    args.key = key.data();
    args.value = value.data();
    args.kv_dtype = kv_dtype;
    args.num_tokens = num_tokens;
    args.slot_mapping = slots.data();
    args.Pi = constants.Pi.empty() ? nullptr : constants.Pi.data();
    args.centroids = constants.centroids.empty() ? nullptr : constants.centroids.data();
    args.num_centroids = static_cast<int>(constants.centroids.size());
    return args;
  }
};

struct DeviceInputs {
  DeviceBuffer<std::uint8_t> cache;
  DeviceBuffer<std::uint8_t> key;
  DeviceBuffer<std::uint8_t> value;
  DeviceBuffer<std::int64_t> slots;
  DeviceBuffer<float> Pi;
  DeviceBuffer<float> centroids;

  explicit DeviceInputs(const StoreInputs& in)
      : cache(in.junk),
        key(in.key),
        value(in.value),
        slots(in.slots),
        Pi(in.constants.Pi),
        centroids(in.constants.centroids) {}

  StoreArgs args(const StoreInputs& in) {
    StoreArgs args = in.host_args(cache.get());
    args.key = key.get();
    args.value = value.get();
    args.slot_mapping = slots.get();
    args.Pi = in.constants.Pi.empty() ? nullptr : Pi.get();
    args.centroids = in.constants.centroids.empty() ? nullptr : centroids.get();
    return args;
  }
};

/// fp32 elements as raw `dtype` elements.
std::vector<std::uint8_t> to_dtype(const std::vector<float>& values, DType dtype) {
  std::vector<std::uint8_t> data(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) store_from_float(data.data(), dtype, std::int64_t(i), values[i]);
  return data;
}

/// Synthetic K/V for `tokens` tokens, distinct random slots with about one
/// token in five skipped (negative), in a cache of random junk.
StoreInputs make_inputs(const StoreGpuCase& c, std::int64_t tokens, std::uint64_t seed) {
  StoreInputs in;
  ScenarioConfig config;
  config.preset = c.preset;
  config.head_dim = c.head_dim;
  config.block_size = c.block_size;
  config.num_kv_heads = c.num_kv_heads;
  config.block_stride_padding = c.padding;
  config.order = c.order;
  config.heads_major = c.heads_major;
  config.slot_padding = c.slot_padding;
  in.layout = scenario_layout(config);
  in.num_tokens = tokens;
  in.kv_dtype = c.kv_dtype;
  in.num_blocks = (tokens + c.block_size - 1) / c.block_size + 3;  // spare blocks stay junk
  in.junk = random_bytes(static_cast<std::size_t>(in.num_blocks * in.layout.block_stride), seed ^ 0x6a756e6bull);
  const SyntheticShape shape{c.num_kv_heads, c.num_kv_heads, c.head_dim};
  in.key = to_dtype(synthetic_keys(tokens, shape, seed), c.kv_dtype);
  in.value = to_dtype(synthetic_values(tokens, shape, seed + 1), c.kv_dtype);
  in.constants = make_model_constants(c.preset, c.head_dim, seed + 2, c.rotation);

  std::vector<std::int64_t> all_slots(static_cast<std::size_t>(in.num_blocks * c.block_size));
  std::iota(all_slots.begin(), all_slots.end(), 0);
  Rng rng(seed + 3);
  for (std::size_t i = all_slots.size(); i > 1; --i) std::swap(all_slots[i - 1], all_slots[rng.below(i)]);
  in.slots.assign(all_slots.begin(), all_slots.begin() + tokens);
  for (auto& slot : in.slots) {
    if (rng.below(5) == 0) slot = -1 - static_cast<std::int64_t>(rng.below(3));
  }
  return in;
}

/// Index of the first differing byte, or -1.
std::int64_t first_difference(const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  const auto mismatch = std::mismatch(a.begin(), a.end(), b.begin());
  return mismatch.first == a.end() ? -1 : mismatch.first - a.begin();
}

/// Describes where byte `offset` of the cache lies, for failure messages.
std::string describe_offset(const CacheLayout& layout, std::int64_t offset) {
  const std::int64_t block = offset / layout.block_stride;
  const std::int64_t within = offset % layout.block_stride;
  std::string text = "byte " + std::to_string(offset) + " (block " + std::to_string(block) + ", ";
  if (layout.token_slots()) {
    text += "byte " + std::to_string(within) + " of the block; slots " + std::to_string(layout.slot_bytes()) +
            " bytes at token stride " + std::to_string(layout.token_stride) + ", head stride " +
            std::to_string(layout.head_stride) + ")";
  } else if (within < layout.metadata_region_offset()) {
    const std::int64_t record = within / layout.record_bytes();
    text += "slot " + std::to_string(record / layout.num_kv_heads) + " head " +
            std::to_string(record % layout.num_kv_heads) + " record byte " +
            std::to_string(within % layout.record_bytes()) + ")";
  } else {
    text += "metadata byte " + std::to_string(within - layout.metadata_region_offset()) + ")";
  }
  return text;
}

/// Stores `in` on the CPU and on the GPU and compares every cache byte.
void expect_same_bytes(const StoreInputs& in) {
  std::vector<std::uint8_t> expected = in.junk;
  store_cpu(in.host_args(expected.data()));

  DeviceInputs device(in);
  store_cuda(device.args(in), nullptr, StoreChecking::raise);
  const std::vector<std::uint8_t> actual = device.cache.download();
  const std::int64_t diff = first_difference(actual, expected);
  EXPECT_EQ(diff, -1) << "GPU and CPU stores differ first at " << describe_offset(in.layout, diff) << ": GPU "
                      << int(actual[std::size_t(std::max<std::int64_t>(diff, 0))]) << ", CPU "
                      << int(expected[std::size_t(std::max<std::int64_t>(diff, 0))]);

  // Slots nobody stores keep their junk (checked directly, not only through the CPU).
  std::vector<bool> stored(static_cast<std::size_t>(in.num_blocks * in.layout.block_size), false);
  for (std::int64_t slot : in.slots) {
    if (slot >= 0) stored[std::size_t(slot)] = true;
  }
  const CacheLayout& layout = in.layout;
  const auto unchanged = [&](std::int64_t at, int bytes) {
    return std::equal(actual.begin() + at, actual.begin() + at + bytes, in.junk.begin() + at);
  };
  for (std::int64_t slot = 0; slot < std::int64_t(stored.size()); ++slot) {
    if (stored[std::size_t(slot)]) continue;
    const std::int64_t base = layout.block_offset(slot / layout.block_size);
    const int s = static_cast<int>(slot % layout.block_size);
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      bool junk = unchanged(base + layout.key_offset(s, h), layout.key_bytes()) &&
                  unchanged(base + layout.value_offset(s, h), layout.value_bytes());
      for (int f = 0; f < layout.fields(); ++f) junk = junk && unchanged(base + layout.field_offset(s, h, f), 2);
      ASSERT_TRUE(junk) << "unstored slot " << slot << " head " << h << " was written";
    }
  }
}

class StoreGpuBytes : public ::testing::TestWithParam<StoreGpuCase> {};

TEST_P(StoreGpuBytes, MatchesCpuStoreByteForByte) {
  TQ_SKIP_WITHOUT_GPU();
  const StoreGpuCase& c = GetParam();
  // 150 tokens: a partial last CTA of vectors, several blocks per head.
  expect_same_bytes(make_inputs(c, 150, 1000 + c.head_dim + static_cast<int>(c.preset)));
}

std::vector<StoreGpuCase> store_cases() {
  std::vector<StoreGpuCase> cases;
  const DType dtypes[] = {DType::bf16, DType::f16, DType::f32};
  int variant = 0;
  for (Preset preset : kAllPresets) {
    for (int d : kHeadDims) {
      const int block_size = kBlockSizes[std::size_t(variant % 4)];
      const std::int64_t padding = variant % 2 ? 48 : 0;  // a padded stride that keeps 16-byte alignment
      const RotationKind rotation = variant % 3 == 1 ? RotationKind::dense : RotationKind::hadamard;
      cases.push_back({preset, d, block_size, 1 + variant % 3, dtypes[variant % 3], padding, rotation});
      ++variant;
    }
  }
  // An odd padding: metadata fields and records at odd addresses.
  cases.push_back({Preset::turboquant_3bit_nc, 128, 16, 2, DType::bf16, 7, RotationKind::dense});
  // The token_slots order: vLLM's dense order and heads-major, padded slots
  // and pages, every preset and head dim.
  for (Preset preset : kAllPresets) {
    for (int d : kHeadDims) {
      const int block_size = kBlockSizes[std::size_t(variant % 4)];
      const std::int64_t padding = variant % 2 ? 48 : 0;
      const RotationKind rotation = variant % 3 == 1 ? RotationKind::dense : RotationKind::hadamard;
      cases.push_back({preset, d, block_size, 1 + variant % 3, dtypes[variant % 3], padding, rotation,
                       CacheOrder::token_slots, variant % 2 == 0, 2 * (variant % 3)});
      ++variant;
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllPresets, StoreGpuBytes, ::testing::ValuesIn(store_cases()),
                         [](const ::testing::TestParamInfo<StoreGpuCase>& info) { return case_name(info.param); });

// Degenerate vectors: an all-zero key (norm 0: codes 0, stored norm 0),
// constant values (scale 0: codes 0), signed zeros in a zero range (the sign
// reaches the stored zero and scale), and exact ties between codes.
TEST(StoreGpu, DegenerateVectorsMatchCpu) {
  TQ_SKIP_WITHOUT_GPU();
  for (const CacheOrder order : {CacheOrder::blocks, CacheOrder::token_slots}) {
    for (Preset preset : kAllPresets) {
      SCOPED_TRACE(std::string(preset_info(preset).name) + " " + cache_order_name(order));
      const StoreGpuCase c{preset, 64, 16, 1, DType::f32, 0, RotationKind::hadamard, order};
      StoreInputs in = make_inputs(c, 6, 99);
      std::vector<float> key(std::size_t(6) * 64);
      std::vector<float> value(key.size());
      for (int d = 0; d < 64; ++d) {
        key[std::size_t(0 * 64 + d)] = 0.0f;                     // token 0: zero key
        key[std::size_t(1 * 64 + d)] = d % 2 ? -0.0f : 0.0f;     // token 1: signed zeros
        key[std::size_t(2 * 64 + d)] = 1.0f;                     // token 2: constant key
        key[std::size_t(3 * 64 + d)] = float(d % 5) - 2.0f;      // token 3: repeated levels
        key[std::size_t(4 * 64 + d)] = d == 7 ? 3.0f : 0.0f;     // token 4: one-hot
        key[std::size_t(5 * 64 + d)] = float(d) * 0.25f - 8.0f;  // token 5: ramp
        value[std::size_t(0 * 64 + d)] = 0.5f;                   // constant: scale 0
        value[std::size_t(1 * 64 + d)] = d % 3 ? -0.0f : 0.0f;   // +0 first, -0 later
        value[std::size_t(2 * 64 + d)] = d % 2 ? 0.0f : -0.0f;   // -0 first
        value[std::size_t(3 * 64 + d)] = float(d % 16);          // codes exactly on the grid
        value[std::size_t(4 * 64 + d)] = d == 0 ? 0.0f : d == 1 ? 15.0f : float(d % 15) + 0.5f;  // 4-bit: ties
        value[std::size_t(5 * 64 + d)] = d == 0 ? -1.0f : 1.0f;                                  // two levels
      }
      in.key = to_dtype(key, DType::f32);
      in.value = to_dtype(value, DType::f32);
      in.slots = {3, 17, 0, 40, 41, 5};
      expect_same_bytes(in);
    }
  }
}

/// Runs a store expected to fail with `expected`: both paths must throw
/// Error naming `argument`, and the device cache must keep every junk byte.
void expect_rejected(const StoreInputs& in, const std::string& argument, StoreStatus expected) {
  std::vector<std::uint8_t> host = in.junk;
  try {
    store_cpu(in.host_args(host.data()));
    ADD_FAILURE() << "store_cpu accepted the input";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument().substr(0, argument.size()), argument) << error.what();
  }

  DeviceInputs device(in);
  try {
    store_cuda(device.args(in), nullptr, StoreChecking::raise);
    ADD_FAILURE() << "store_cuda accepted the input";
  } catch (const Error& error) {
    EXPECT_EQ(error.argument(), argument) << error.what();
  }
  EXPECT_EQ(first_difference(device.cache.download(), in.junk), -1) << "a rejected store wrote to the cache";

  // The same store in the default recording mode, with a caller-owned status
  // word: it names the failure, nothing is written, and the device's report
  // counts the call.
  store_check_report();  // start from an empty report
  DeviceBuffer<int> status(1);
  store_cuda(device.args(in), nullptr, StoreChecking::record, status.get());
  const int code = status.download()[0];
  EXPECT_EQ(code, static_cast<int>(expected));
  EXPECT_EQ(first_difference(device.cache.download(), in.junk), -1) << "a rejected store wrote to the cache";
  const StoreCheckReport report = store_check_report();
  EXPECT_EQ(report.checked_calls, 1);
  EXPECT_EQ(report.failed_calls, 1);
  EXPECT_EQ(report.failures[code], 1);
  EXPECT_EQ(report.first_failure, expected);
  EXPECT_EQ(store_check_report().checked_calls, 0) << "reading cleared the report";
}

void set_element(std::vector<std::uint8_t>& data, DType dtype, std::int64_t index, float value) {
  store_from_float(data.data(), dtype, index, value);
}

TEST(StoreGpu, RejectsBadInputsAndWritesNothing) {
  TQ_SKIP_WITHOUT_GPU();
  for (const CacheOrder order : {CacheOrder::blocks, CacheOrder::token_slots}) {
    for (Preset preset : {Preset::turboquant_4bit_nc, Preset::turboquant_k8v4}) {
      SCOPED_TRACE(std::string(preset_info(preset).name) + " " + cache_order_name(order));
      const StoreGpuCase c{preset, 128, 16, 2, DType::bf16, 16, RotationKind::hadamard, order};
      const StoreInputs good = make_inputs(c, 40, 5);
      const std::int64_t row = std::int64_t(c.num_kv_heads) * c.head_dim;
      std::int64_t stored_token = 0;
      while (good.slots[std::size_t(stored_token)] < 0) ++stored_token;

      {
        SCOPED_TRACE("slot past the cache");
        StoreInputs in = good;
        in.slots[std::size_t(stored_token)] = in.num_blocks * c.block_size;
        expect_rejected(in, "slot_mapping", StoreStatus::slot_out_of_range);
      }
      {
        SCOPED_TRACE("NaN value");
        StoreInputs in = good;
        set_element(in.value, c.kv_dtype, stored_token * row + 77, std::numeric_limits<float>::quiet_NaN());
        expect_rejected(in, "value", StoreStatus::non_finite_value);
      }
      {
        SCOPED_TRACE("infinite key");
        StoreInputs in = good;
        set_element(in.key, c.kv_dtype, (stored_token + 1) * row - 1, -std::numeric_limits<float>::infinity());
        expect_rejected(in, "key", StoreStatus::non_finite_key);
      }
      {
        SCOPED_TRACE("value range past fp16");
        StoreInputs in = good;
        set_element(in.value, c.kv_dtype, stored_token * row + 3, 1.0e6f);
        expect_rejected(in, "value", StoreStatus::non_finite_value);
      }
      {
        SCOPED_TRACE("two tokens in one slot");
        StoreInputs in = good;
        std::int64_t other = stored_token + 1;
        while (in.slots[std::size_t(other)] < 0) ++other;
        in.slots[std::size_t(other)] = in.slots[std::size_t(stored_token)];
        expect_rejected(in, "slot_mapping", StoreStatus::duplicate_slot);
      }
      if (preset != Preset::turboquant_k8v4) {
        // MSE keys: the model constants, checked as store_cpu checks them, and the key norm.
        {
          SCOPED_TRACE("unsorted centroids");
          StoreInputs in = good;
          std::swap(in.constants.centroids[3], in.constants.centroids[4]);
          expect_rejected(in, "centroids", StoreStatus::invalid_centroids);
        }
        {
          SCOPED_TRACE("infinite centroid");
          StoreInputs in = good;
          in.constants.centroids.back() = std::numeric_limits<float>::infinity();
          expect_rejected(in, "centroids", StoreStatus::invalid_centroids);
        }
        {
          SCOPED_TRACE("NaN in Pi");
          StoreInputs in = good;
          in.constants.Pi[std::size_t(c.head_dim) * c.head_dim - 5] = std::numeric_limits<float>::quiet_NaN();
          expect_rejected(in, "Pi", StoreStatus::non_finite_rotation);
        }
        {
          SCOPED_TRACE("key norm past fp16");
          StoreInputs in = good;
          // |k| = 1.1e6: over 65504 times any centroid-vector norm of these codebooks.
          for (int d = 0; d < c.head_dim; ++d) set_element(in.key, c.kv_dtype, stored_token * row + d, 1.0e5f);
          expect_rejected(in, "key", StoreStatus::non_finite_key);
        }
      }
    }
  }
}

// Duplicates in the same 256-token tile and across tiles, the first and the
// last token of a long call: each is refused like the CPU refuses it; many
// distinct slots and repeated negative (skipped) slots pass.
TEST(StoreGpu, DuplicateSlotsAreRefusedAcrossTiles) {
  TQ_SKIP_WITHOUT_GPU();
  const StoreGpuCase c{Preset::turboquant_3bit_nc, 64, 16, 1, DType::bf16, 0, RotationKind::hadamard};
  const StoreInputs good = make_inputs(c, 1300, 31);
  expect_same_bytes(good);  // distinct slots, repeated negative ones
  const auto stored_after = [&](std::int64_t token) {
    while (good.slots[std::size_t(token)] < 0) ++token;
    return token;
  };
  for (const auto& [first, second] : {std::pair<std::int64_t, std::int64_t>{3, 200}, {5, 700}, {0, 1299}, {600, 1290}}) {
    SCOPED_TRACE("tokens " + std::to_string(first) + " and " + std::to_string(second));
    StoreInputs in = good;
    const std::int64_t a = stored_after(first);
    std::int64_t b = second;
    while (b > a && in.slots[std::size_t(b)] < 0) --b;
    ASSERT_GT(b, a);
    in.slots[std::size_t(b)] = in.slots[std::size_t(a)];
    expect_rejected(in, "slot_mapping", StoreStatus::duplicate_slot);
  }
}

// The default (recording) mode synchronises nothing: a store captured in a
// CUDA graph replays with new inputs, and a failing replay writes nothing and
// is counted in the report.
TEST(StoreGpu, RecordingModeWorksInsideCudaGraphs) {
  TQ_SKIP_WITHOUT_GPU();
  const StoreGpuCase c{Preset::turboquant_4bit_nc, 128, 16, 2, DType::bf16, 0, RotationKind::hadamard};
  const StoreInputs in = make_inputs(c, 70, 41);
  DeviceInputs device(in);
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  store_cuda(device.args(in), stream);  // warm-up: the device's report exists before capture
  check_cuda(cudaStreamSynchronize(stream), "warm-up");
  store_check_report(stream);
  device.cache.upload(in.junk);

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
  store_cuda(device.args(in), stream);
  EXPECT_THROW(store_cuda(device.args(in), stream, StoreChecking::raise), Error) << "raise mode is refused in capture";
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");

  check_cuda(cudaGraphLaunch(exec, stream), "replay");
  check_cuda(cudaStreamSynchronize(stream), "replay");
  std::vector<std::uint8_t> expected = in.junk;
  store_cpu(in.host_args(expected.data()));
  EXPECT_EQ(first_difference(device.cache.download(), expected), -1) << "the replay wrote the CPU bytes";

  StoreInputs bad = in;  // the same buffers, a stray slot: the replay must write nothing
  std::int64_t stored = 0;
  while (bad.slots[std::size_t(stored)] < 0) ++stored;
  bad.slots[std::size_t(stored)] = bad.num_blocks * c.block_size + 5;
  device.slots.upload(bad.slots);
  device.cache.upload(in.junk);
  check_cuda(cudaGraphLaunch(exec, stream), "replay");
  const StoreCheckReport report = store_check_report(stream);
  EXPECT_EQ(first_difference(device.cache.download(), in.junk), -1) << "a failing replay wrote to the cache";
  EXPECT_EQ(report.checked_calls, 2);
  EXPECT_EQ(report.failed_calls, 1);
  EXPECT_EQ(report.failures[static_cast<int>(StoreStatus::slot_out_of_range)], 1);
  EXPECT_EQ(report.first_failure, StoreStatus::slot_out_of_range);
  check_cuda(cudaGraphExecDestroy(exec), "destroy");
  check_cuda(cudaGraphDestroy(graph), "destroy");
  check_cuda(cudaStreamDestroy(stream), "destroy");
}

TEST(StoreGpu, SkippedTokensAreNeitherCheckedNorWritten) {
  TQ_SKIP_WITHOUT_GPU();
  const StoreGpuCase c{Preset::turboquant_4bit_nc, 128, 16, 2, DType::bf16, 0, RotationKind::hadamard};
  StoreInputs in = make_inputs(c, 40, 11);
  std::int64_t skipped = 0;
  while (in.slots[std::size_t(skipped)] >= 0) ++skipped;
  set_element(in.value, c.kv_dtype, skipped * 256 + 5, std::numeric_limits<float>::quiet_NaN());
  expect_same_bytes(in);
}

TEST(StoreGpu, StatusWordIsZeroAfterAGoodStore) {
  TQ_SKIP_WITHOUT_GPU();
  const StoreGpuCase c{Preset::turboquant_k3v4_nc, 128, 32, 2, DType::f16, 0, RotationKind::hadamard};
  const StoreInputs in = make_inputs(c, 33, 21);
  DeviceInputs device(in);
  DeviceBuffer<int> status(std::vector<int>{12345});
  store_check_report();
  store_cuda(device.args(in), nullptr, StoreChecking::record, status.get());
  EXPECT_EQ(status.download()[0], 0);
  const StoreCheckReport report = store_check_report();
  EXPECT_EQ(report.checked_calls, 1);
  EXPECT_EQ(report.failed_calls, 0);
  EXPECT_EQ(report.first_failure, StoreStatus::ok);

  std::vector<std::uint8_t> expected = in.junk;
  store_cpu(in.host_args(expected.data()));
  EXPECT_EQ(first_difference(device.cache.download(), expected), -1);
}

}  // namespace
}  // namespace tqdecode::test
