// GPU reliability: a differential run of random configurations against the
// CPU reference, a cache over 4 GiB holding a 512K-token sequence,
// concurrent decodes from several streams and host threads, the device-side
// input checks (eager and in CUDA graphs), and non-finite queries and sinks.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "scoped_variable.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode {
namespace {

using test::check_cuda;
using test::closeness_failure;
using test::bitwise_mismatches;
using test::DeviceBuffer;
using test::expect_close;

/// decode_reference of the scenario's cache with these lengths and block table.
std::vector<float> reference_output(const Scenario& scenario, const std::vector<std::int32_t>& seq_lens,
                                    const std::vector<std::int32_t>& block_table) {
  DecodeArgs args = scenario.host_args(nullptr);
  args.seq_lens = seq_lens.data();
  args.block_table = block_table.data();
  std::vector<float> out(scenario.query.size());
  decode_reference(args, out.data());
  return out;
}

std::vector<float> reference_output(const Scenario& scenario) {
  return reference_output(scenario, scenario.seq_lens, scenario.block_table);
}

// ---------------------------------------------------------------------------
// 1. Differential run.

constexpr std::uint64_t kDifferentialBaseSeed = 0x7d1ff0000ull;  // config i uses seed base + i
constexpr int kDefaultDifferentialConfigs = 1000;
constexpr int kMaxTokensPerConfig = 6000;  // bounds the CPU store and reference, which dominate the run time
constexpr int kMaxQueryHeads = 64;
// Several query tokens per sequence: the reference's work is the sum over sequences of query tokens x context.
constexpr std::int64_t kMaxQueryTokenPositions = 4 * kMaxTokensPerConfig;

/// The environment variable `name` as an integer in [lowest, 1000000], else `fallback` where it is unset, and -1
/// where it is not such an integer.
int environment_count(const char* name, int lowest, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  const long count = std::strtol(text, &end, 10);
  return (*text != '\0' && *end == '\0' && count >= lowest && count <= 1000000) ? static_cast<int>(count) : -1;
}

/// One random configuration, entirely determined by `seed`.
ScenarioConfig random_config(std::uint64_t seed) {
  Rng rng(seed);
  ScenarioConfig config;
  config.preset = kAllPresets[rng.below(kAllPresets.size())];
  config.head_dim = kHeadDims[rng.below(kHeadDims.size())];
  const int group_size = 1 + static_cast<int>(rng.below(kMaxGroupSize));
  config.num_kv_heads = std::min(1 + static_cast<int>(rng.below(8)), kMaxQueryHeads / group_size);
  config.num_q_heads = group_size * config.num_kv_heads;
  config.block_size = kBlockSizes[rng.below(kBlockSizes.size())];
  const int batch = 1 + static_cast<int>(rng.below(8));
  // Mixed lengths: some empty, some within the first two blocks (edges of a
  // block and of a tile), the rest anywhere up to 3000 within the token budget.
  const int max_length = std::min(3000, kMaxTokensPerConfig / batch);
  for (int i = 0; i < batch; ++i) {
    const std::uint64_t kind = rng.below(10);
    const int length = kind == 0   ? 0
                       : kind <= 3 ? 1 + static_cast<int>(rng.below(2 * config.block_size))
                                   : static_cast<int>(rng.below(max_length + 1));
    config.seq_lens.push_back(length);
  }
  const std::int64_t paddings[] = {0, 16, 48};
  config.block_stride_padding = paddings[rng.below(3)];
  config.sinks = rng.below(2) == 1;
  config.query_dtype = rng.below(2) == 1 ? DType::f16 : DType::bf16;
  config.seed = seed;
  config.keep_unquantized = false;
  // Half the configurations in vLLM's token_slots order (docs/FORMAT.md
  // section 4b): either stride order, even padding between slots, and
  // decode-time norm correction for MSE keys.
  if (rng.below(2) == 1) {
    config.order = CacheOrder::token_slots;
    config.heads_major = rng.below(2) == 1;
    const std::int64_t slot_paddings[] = {0, 2, 14};
    config.slot_padding = slot_paddings[rng.below(3)];
    config.renormalize_keys = config.preset != Preset::turboquant_k8v4 && rng.below(2) == 1;
  }
  // Two in five through the varlen entry: per sequence 0, 1, 2-8 (speculative
  // drafts), 17 or 128 (continuation chunks) query tokens, at most its length;
  // a quarter of them declare a larger max_query_len, as an engine captures
  // its graphs with one.
  if (rng.below(5) < 2) {
    for (const int length : config.seq_lens) {
      const std::uint64_t kind = rng.below(10);
      const int wanted = kind == 0   ? 0
                         : kind <= 3 ? 1
                         : kind <= 7 ? 2 + static_cast<int>(rng.below(7))
                         : kind == 8 ? 17
                                     : 128;
      config.query_lens.push_back(std::min(wanted, length));
    }
    const auto positions = [&] {
      std::int64_t total = 0;
      for (std::size_t b = 0; b < config.seq_lens.size(); ++b)
        total += std::int64_t(config.query_lens[b]) * config.seq_lens[b];
      return total;
    };
    // Over the budget, at most 8 query tokens a sequence, then 2 (always within it: 2 x 6000 tokens).
    for (const int cap : {8, 2}) {
      if (positions() <= kMaxQueryTokenPositions) break;
      for (int& query_len : config.query_lens) query_len = std::min(query_len, cap);
    }
    const int longest = *std::max_element(config.query_lens.begin(), config.query_lens.end());
    if (longest == 0) {
      config.query_lens.clear();  // no query token at all: the one-token form
    } else if (rng.below(4) == 0) {
      config.max_query_len = longest + 1 + static_cast<int>(rng.below(8));
    }
  }
  return config;
}

std::string describe(const ScenarioConfig& config) {
  std::ostringstream text;
  text << preset_info(config.preset).name << " Hq=" << config.num_q_heads << " Hk=" << config.num_kv_heads
       << " D=" << config.head_dim << " block_size=" << config.block_size << " padding=" << config.block_stride_padding
       << " sinks=" << (config.sinks ? "on" : "off")
       << " dtype=" << (config.query_dtype == DType::f16 ? "fp16" : "bf16");
  if (config.order == CacheOrder::token_slots) {
    text << " token_slots (" << (config.heads_major ? "heads major" : "tokens major")
         << ", slot padding=" << config.slot_padding << ", norm correction " << (config.renormalize_keys ? "on" : "off")
         << ")";
  }
  text << " seq_lens={";
  for (std::size_t i = 0; i < config.seq_lens.size(); ++i) text << (i ? "," : "") << config.seq_lens[i];
  text << "}";
  if (!config.query_lens.empty()) {
    text << " query_lens={";
    for (std::size_t i = 0; i < config.query_lens.size(); ++i) text << (i ? "," : "") << config.query_lens[i];
    text << "} max_query_len=" << config.max_query_len;
  }
  return text.str();
}

// TQDECODE_DIFF_CONFIGS configurations from index TQDECODE_DIFF_FIRST, in
// kDifferentialParts tests of consecutive index ranges, so the suite's shards
// (gtest's or gpu_check.sh's) run them side by side: most of the time is the
// CPU store and reference.
constexpr int kDifferentialParts = 4;

class ReliabilityGpuDifferential : public ::testing::TestWithParam<int> {};

TEST_P(ReliabilityGpuDifferential, RandomConfigurationsMatchTheCpuReference) {
  TQ_SKIP_WITHOUT_GPU();
  const int total = environment_count("TQDECODE_DIFF_CONFIGS", 1, kDefaultDifferentialConfigs);
  ASSERT_GT(total, 0) << "TQDECODE_DIFF_CONFIGS must be an integer from 1 to 1000000";
  const int start = environment_count("TQDECODE_DIFF_FIRST", 0, 0);
  ASSERT_GE(start, 0) << "TQDECODE_DIFF_FIRST must be an integer from 0 to 1000000";
  const int part = GetParam();
  const int first = start + static_cast<int>(std::int64_t(total) * part / kDifferentialParts);
  const int count = start + static_cast<int>(std::int64_t(total) * (part + 1) / kDifferentialParts) - first;
  DecodeWorkspace workspace(8);
  struct Tally {
    int passed = 0;
    int run = 0;
  };
  // By kernel, cache order and entry: the automatic path's kernel, the
  // generic path's kernels where they differ (its tensor-core kernel beside
  // the Hopper kernel, its scalar kernel), and on the Hopper path with
  // several query tokens per sequence the other of its two kernels (the row
  // tiles, the warp-specialized kernel where it serves).
  std::map<std::string, Tally> tallies;
  const auto kernel_name = [](const LaunchPlan& plan) {
    if (plan.path == DecodePath::cuda_generic)
      return std::string("generic ") + generic_kernel_name(plan.generic_kernel);
    return std::string(decode_path_name(plan.path)) + (plan.warp_specialized ? " warp-specialized" : "");
  };
  for (int index = first; index < first + count; ++index) {
    const std::uint64_t seed = kDifferentialBaseSeed + static_cast<std::uint64_t>(index);
    const ScenarioConfig config = random_config(seed);
    const auto tally = [&](const std::string& kernel, const std::string& failure) {
      Tally& counts = tallies[kernel];
      ++counts.run;
      if (failure.empty()) {
        ++counts.passed;
      } else {
        ADD_FAILURE() << "config " << index << " (seed 0x" << std::hex << seed << std::dec << ", " << kernel
                      << "): " << describe(config) << ": " << failure;
      }
    };
    std::string kernel = "setup";  // tallied as such if the setup throws
    try {
      const Scenario scenario = make_scenario(config);
      DeviceScenario device(scenario);
      // The output holds the query dtype, so the reference rounded through it
      // is what the kernels can give: where a sink takes nearly all the
      // weight, the outputs are fp16 subnormals, whose rounding alone moves
      // the cosine past the tolerance.
      std::vector<float> expected = reference_output(scenario);
      round_through_dtype(expected, config.query_dtype);
      const LaunchPlan automatic = plan_decode(device.args());
      const std::string form = std::string(config.order == CacheOrder::token_slots ? ", token_slots" : ", blocks") +
                               (scenario.varlen() ? ", varlen" : "");
      std::vector<PathRequest> requests = {PathRequest::automatic, PathRequest::cuda_generic,
                                           PathRequest::cuda_generic_scalar};
      if (automatic.path == DecodePath::hopper && scenario.varlen()) {
        requests.push_back(automatic.warp_specialized ? PathRequest::hopper : PathRequest::hopper_warp_specialized);
      }
      std::vector<std::string> kernels_run;
      for (const PathRequest request : requests) {
        LaunchPlan plan;
        try {
          plan = plan_decode(device.args(), request);
        } catch (const Error&) {
          if (request == PathRequest::hopper_warp_specialized) continue;  // the kernel does not serve this call
          throw;
        }
        kernel = kernel_name(plan) + form;
        if (std::find(kernels_run.begin(), kernels_run.end(), kernel) != kernels_run.end()) continue;
        kernels_run.push_back(kernel);
        device.poison_output();
        decode(device.args(), workspace, nullptr, request);
        const std::vector<float> actual = device.output();
        std::string failure = closeness_failure(actual, expected);
        // A varlen sequence of length 0 has no query rows.
        if (failure.empty() && !scenario.varlen()) failure = test::zero_row_failure(actual, scenario);
        tally(kernel, failure);
      }
    } catch (const std::exception& error) {
      tally(kernel, std::string("threw: ") + error.what());
    }
  }
  std::printf("[ configs  ] %d to %d\n", first, first + count - 1);
  for (const auto& [kernel, tally] : tallies) {
    std::printf("[ paths    ] %-48s %d of %d configurations passed\n", kernel.c_str(), tally.passed, tally.run);
  }
}

INSTANTIATE_TEST_SUITE_P(Parts, ReliabilityGpuDifferential, ::testing::Range(0, kDifferentialParts));

// ---------------------------------------------------------------------------
// 2. A cache over 4 GiB holding one sequence of 512K + 3 tokens.
//
// The long sequence is the small scenario's n tokens repeated R times. Without
// a sink, out = sum_t e^(s_t - m) v_t / sum_t e^(s_t - m); R exact copies of
// the tokens multiply both sums by R (and leave the max m unchanged), so the
// output equals the small scenario's. A sink would add e^(sink - m) to the
// denominator only, once, breaking the equality: the scenario has none.

constexpr int kRepeatedLength = 2929;  // 29 * 101
constexpr int kRepeats = 179;          // 2929 * 179 = 524291 = 512K + 3
constexpr std::int64_t kFourGiB = std::int64_t(1) << 32;
constexpr std::int64_t kLargeCacheBytes = kFourGiB + (std::int64_t(512) << 20);

/// Copies the record and metadata fields of every head of `from_slot` in
/// block `from` to `to_slot` in block `to` (same layout).
void copy_token(const std::uint8_t* from, int from_slot, std::uint8_t* to, int to_slot, const CacheLayout& layout) {
  for (int head = 0; head < layout.num_kv_heads; ++head) {
    std::memcpy(to + layout.record_offset(to_slot, head), from + layout.record_offset(from_slot, head),
                layout.record_bytes());
    for (int field = 0; field < layout.fields(); ++field) {
      std::memcpy(to + layout.field_offset(to_slot, head, field), from + layout.field_offset(from_slot, head, field), 2);
    }
  }
}

TEST(ReliabilityGpuLargeCache, SequenceOf512KTokensInACacheOver4GiB) {
  TQ_SKIP_WITHOUT_GPU();
  ScenarioConfig config;
  config.preset = Preset::turboquant_4bit_nc;
  config.num_q_heads = 8;
  config.num_kv_heads = 1;
  config.head_dim = 128;
  config.block_size = 16;
  config.seq_lens = {kRepeatedLength};
  config.keep_unquantized = false;
  const Scenario small = make_scenario(config);
  const std::vector<float> expected = reference_output(small);
  const CacheLayout& layout = small.layout;
  const std::int64_t stride = layout.block_stride;

  const std::int64_t total_tokens = std::int64_t(kRepeatedLength) * kRepeats;
  const int used_blocks = static_cast<int>((total_tokens + layout.block_size - 1) / layout.block_size);
  const std::int64_t num_blocks = kLargeCacheBytes / stride;
  DeviceBuffer<std::uint8_t> cache;
  try {
    cache = DeviceBuffer<std::uint8_t>(static_cast<std::size_t>(num_blocks * stride));
  } catch (const std::runtime_error& error) {
    cudaGetLastError();
    GTEST_SKIP() << "could not allocate a " << num_blocks * stride << "-byte device cache: " << error.what();
  }

  // The long sequence's blocks, composed on the host: logical token t holds
  // the small scenario's token t mod n. Unused slots stay 0xff (NaN fields).
  std::vector<std::uint8_t> blocks(static_cast<std::size_t>(used_blocks * stride), 0xff);
  for (std::int64_t t = 0; t < total_tokens; ++t) {
    const int source = static_cast<int>(t % kRepeatedLength);
    const std::uint8_t* from = small.cache.data() + small.block_table[source / layout.block_size] * stride;
    copy_token(from, source % layout.block_size, blocks.data() + (t / layout.block_size) * stride,
               static_cast<int>(t % layout.block_size), layout);
  }
  // Logical block j lives in physical block j * step: spread over the whole
  // allocation, the last ones past 4 GiB. Everything else is 0xff junk, so a
  // truncated 32-bit offset reads NaN metadata and shows in the output.
  const std::int64_t step = num_blocks / used_blocks;
  check_cuda(cudaMemset(cache.get(), 0xff, cache.bytes()), "cudaMemset");
  check_cuda(cudaMemcpy2D(cache.get(), step * stride, blocks.data(), stride, stride, used_blocks,
                          cudaMemcpyHostToDevice),
             "cudaMemcpy2D");
  std::vector<std::int32_t> table(used_blocks);
  int blocks_past_4gib = 0;
  for (int j = 0; j < used_blocks; ++j) {
    table[j] = static_cast<std::int32_t>(j * step);
    blocks_past_4gib += j * step * stride >= kFourGiB;
  }
  ASSERT_GT(blocks_past_4gib, 0);
  std::printf("[ geometry ] %lld tokens, %d blocks over a %lld-byte cache, %d of them past 4 GiB\n",
              static_cast<long long>(total_tokens), used_blocks, static_cast<long long>(num_blocks * stride),
              blocks_past_4gib);
  const DeviceBuffer<std::int32_t> device_table(table);
  const DeviceBuffer<std::int32_t> device_lengths(std::vector<std::int32_t>{static_cast<std::int32_t>(total_tokens)});

  DeviceScenario device(small);
  DecodeArgs args = device.args();
  args.cache = cache.get();
  args.num_blocks = num_blocks;
  args.block_table = device_table.get();
  args.max_blocks_per_seq = used_blocks;
  args.block_table_stride = 0;
  args.seq_lens = device_lengths.get();
  DecodeWorkspace workspace(1);
  for (const PathRequest request : {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar}) {
    const LaunchPlan plan = plan_decode(args, request);
    device.poison_output();
    decode(args, workspace, nullptr, request);
    expect_close(device.output(), expected,
                 std::string("512K tokens past 4 GiB, ") + decode_path_name(plan.path) + " " + generic_kernel_name(plan.generic_kernel));
  }
}

// ---------------------------------------------------------------------------
// 3. Concurrency.

constexpr int kConcurrentStreams = 4;
constexpr int kRounds = 5;
constexpr int kDecodesPerRound = 3;

/// Per stream: a scenario (its own seed; presets alternate between the Hopper
/// kernel's and the generic kernel's), its device copy, workspace and stream.
struct StreamSetup {
  Scenario scenario;
  std::unique_ptr<DeviceScenario> device;
  std::unique_ptr<DecodeWorkspace> workspace;
  cudaStream_t stream = nullptr;
  std::vector<float> serial;  ///< the output of a decode run alone

  explicit StreamSetup(int index) {
    ScenarioConfig config;
    config.preset = kAllPresets[index % kAllPresets.size()];
    config.num_q_heads = 32;
    config.num_kv_heads = 8;
    config.head_dim = 128;
    config.seq_lens = {3000, 1, 700, 2222, 0, 1500};
    config.sinks = index % 2 == 1;
    config.seed = 1000 + static_cast<std::uint64_t>(index);
    config.keep_unquantized = false;
    scenario = make_scenario(config);
    device = std::make_unique<DeviceScenario>(scenario);
    workspace = std::make_unique<DecodeWorkspace>(scenario.batch());
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    device->poison_output();
    check_cuda(cudaDeviceSynchronize(), "poison");
    decode(device->args(), *workspace, stream);
    check_cuda(cudaStreamSynchronize(stream), "serial decode");
    serial = device->output();
  }
  ~StreamSetup() { cudaStreamDestroy(stream); }
  StreamSetup(const StreamSetup&) = delete;
  StreamSetup& operator=(const StreamSetup&) = delete;
};

/// The setups, each with its serial output computed one at a time.
std::vector<std::unique_ptr<StreamSetup>> make_stream_setups() {
  std::vector<std::unique_ptr<StreamSetup>> setups;
  for (int i = 0; i < kConcurrentStreams; ++i) setups.push_back(std::make_unique<StreamSetup>(i));
  return setups;
}

TEST(ReliabilityGpuConcurrency, StreamsWithOwnWorkspacesMatchSerialDecodesBitwise) {
  TQ_SKIP_WITHOUT_GPU();
  const auto setups = make_stream_setups();
  for (const auto& setup : setups) expect_close(setup->serial, reference_output(setup->scenario), "serial decode");
  for (int round = 0; round < kRounds; ++round) {
    for (const auto& setup : setups) setup->device->poison_output();
    check_cuda(cudaDeviceSynchronize(), "poison");  // the memsets run on the legacy stream
    // Interleaved launches so the streams' kernels overlap on the device.
    for (int repeat = 0; repeat < kDecodesPerRound; ++repeat) {
      for (const auto& setup : setups) decode(setup->device->args(), *setup->workspace, setup->stream);
    }
    for (int i = 0; i < kConcurrentStreams; ++i) {
      EXPECT_EQ(bitwise_mismatches(setups[i]->device->output(), setups[i]->serial), 0u)
          << "round " << round << ", stream " << i;
    }
  }
}

TEST(ReliabilityGpuConcurrency, HostThreadsWithOwnStreamsMatchSerialDecodesBitwise) {
  TQ_SKIP_WITHOUT_GPU();
  const auto setups = make_stream_setups();
  std::vector<std::vector<std::vector<float>>> outputs(kConcurrentStreams);  // [thread][round]
  std::vector<std::exception_ptr> errors(kConcurrentStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kConcurrentStreams; ++i) {
    threads.emplace_back([&, i] {
      try {
        StreamSetup& setup = *setups[i];
        for (int round = 0; round < kRounds; ++round) {
          setup.device->poison_output();
          check_cuda(cudaDeviceSynchronize(), "poison");
          for (int repeat = 0; repeat < kDecodesPerRound; ++repeat) {
            decode(setup.device->args(), *setup.workspace, setup.stream);
          }
          check_cuda(cudaStreamSynchronize(setup.stream), "decode");
          outputs[i].push_back(setup.device->output());
        }
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int i = 0; i < kConcurrentStreams; ++i) {
    if (errors[i]) std::rethrow_exception(errors[i]);
    ASSERT_EQ(outputs[i].size(), static_cast<std::size_t>(kRounds));
    for (int round = 0; round < kRounds; ++round) {
      EXPECT_EQ(bitwise_mismatches(outputs[i][round], setups[i]->serial), 0u) << "thread " << i << ", round " << round;
    }
  }
}

/// Decode arguments of many shape signatures (every preset, head size and
/// block size, several batches and groups) over one scenario's device
/// pointers: planning reads shapes only, never the tensors.
std::vector<DecodeArgs> planning_shapes(const DecodeArgs& base) {
  std::vector<DecodeArgs> shapes;
  for (const Preset preset : kAllPresets) {
    for (const int head_dim : kHeadDims) {
      for (const int block_size : kBlockSizes) {
        for (const int batch : {1, 7, 64}) {
          for (const int num_kv_heads : {1, 8}) {
            for (const int group_size : {1, 4}) {
              DecodeArgs args = base;
              args.layout = make_layout(preset, head_dim, block_size, num_kv_heads);
              args.num_centroids = preset_info(preset).key_fp8 ? 0 : 1 << preset_info(preset).key_bits;
              args.batch = batch;
              args.num_q_heads = group_size * num_kv_heads;
              args.max_blocks_per_seq = 4096 / block_size;
              args.query_stride_batch = args.query_stride_head = 0;
              args.output_stride_batch = args.output_stride_head = 0;
              args.block_table_stride = 0;
              shapes.push_back(args);
            }
          }
        }
      }
    }
  }
  return shapes;
}

bool same_plan(const LaunchPlan& a, const LaunchPlan& b) {
  return a.path == b.path && a.reason == b.reason && a.num_partitions == b.num_partitions &&
         a.partition_align == b.partition_align && a.wide_table == b.wide_table && a.kv_heads_per_cta == b.kv_heads_per_cta &&
         a.token_runs == b.token_runs && a.whole_rows == b.whole_rows && a.generic_kernel == b.generic_kernel;
}

TEST(ReliabilityGpuConcurrency, ConcurrentPlanningGivesConsistentAnswers) {
  TQ_SKIP_WITHOUT_GPU();
  ScenarioConfig config;
  config.seq_lens = {16};
  config.keep_unquantized = false;
  const Scenario scenario = make_scenario(config);
  const DeviceScenario device(scenario);
  const std::vector<DecodeArgs> shapes = planning_shapes(device.args());
  const PathRequest requests[] = {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar};
  constexpr std::size_t kRequests = std::size(requests);
  constexpr int kPasses = 3;

  // Every thread plans every (shape, request) in its own order, so first
  // insertions into the plan cache race with lookups from the other threads.
  using Answers = std::vector<LaunchPlan>;  // [shape * kRequests + request]
  std::vector<Answers> answers(kConcurrentStreams, Answers(shapes.size() * kRequests));
  std::vector<std::vector<PathChoice>> choices(kConcurrentStreams, std::vector<PathChoice>(shapes.size()));
  std::vector<std::exception_ptr> errors(kConcurrentStreams);
  std::vector<std::thread> threads;
  for (int i = 0; i < kConcurrentStreams; ++i) {
    threads.emplace_back([&, i] {
      try {
        const std::size_t start = shapes.size() * i / kConcurrentStreams;
        for (int pass = 0; pass < kPasses; ++pass) {
          for (std::size_t k = 0; k < shapes.size(); ++k) {
            const std::size_t shape = (start + k) % shapes.size();
            for (std::size_t r = 0; r < kRequests; ++r) answers[i][shape * kRequests + r] = plan_decode(shapes[shape], requests[r]);
            choices[i][shape] = choose_decode_path(shapes[shape]);
          }
        }
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }

  const bool hopper_device = is_available();
  for (std::size_t shape = 0; shape < shapes.size(); ++shape) {
    const DecodeArgs& args = shapes[shape];
    const LaunchPlan& automatic = answers[0][shape * kRequests];
    const LaunchPlan& generic = answers[0][shape * kRequests + 1];
    const LaunchPlan& scalar = answers[0][shape * kRequests + 2];
    // The tensor-core kernel: every preset at D = 64, 128 and 256.
    const bool tensor_cores = hopper_device;
    SCOPED_TRACE(std::string(preset_info(args.layout.preset).name) + " D=" + std::to_string(args.layout.head_dim) +
                 " block_size=" + std::to_string(args.layout.block_size) + " B=" + std::to_string(args.batch) +
                 " Hk=" + std::to_string(args.layout.num_kv_heads) + " Hq=" + std::to_string(args.num_q_heads));
    EXPECT_EQ(automatic.path, tensor_cores ? DecodePath::hopper : DecodePath::cuda_generic) << automatic.reason;
    EXPECT_EQ(generic.path, DecodePath::cuda_generic);
    EXPECT_EQ(generic.generic_kernel, tensor_cores ? GenericKernel::tensor_core : GenericKernel::scalar) << generic.reason;
    EXPECT_EQ(scalar.path, DecodePath::cuda_generic);
    EXPECT_EQ(scalar.generic_kernel, GenericKernel::scalar);
    EXPECT_GE(automatic.num_partitions, 1);
    EXPECT_LE(automatic.num_partitions, 32);
    // N depends on the resident CTAs of the serving kernel, so only one kernel's plans must agree.
    if (automatic.path == generic.path) EXPECT_EQ(automatic.num_partitions, generic.num_partitions);
    for (int i = 0; i < kConcurrentStreams; ++i) {
      for (std::size_t r = 0; r < kRequests; ++r) {
        EXPECT_TRUE(same_plan(answers[i][shape * kRequests + r], answers[0][shape * kRequests + r])) << "thread " << i;
      }
      EXPECT_EQ(choices[i][shape].path, automatic.path) << "thread " << i;
      EXPECT_EQ(choices[i][shape].reason, automatic.reason) << "thread " << i;
    }
    // And a serial call now, from the cache, agrees.
    EXPECT_TRUE(same_plan(plan_decode(args), automatic));
  }
}

// ---------------------------------------------------------------------------
// 4. Device-side input checks (DecodeWorkspace::set_device_checks).
//
// The longest sequence fills whole blocks, so pointing its spare block-table
// columns at its own first blocks gives a valid length of exactly the
// table's coverage. Next to it: bad inputs of each kind and valid sequences.

constexpr PathRequest kGpuRequests[] = {PathRequest::automatic, PathRequest::cuda_generic, PathRequest::cuda_generic_scalar};

ScenarioConfig check_config() {
  ScenarioConfig config;
  config.num_q_heads = 16;
  config.num_kv_heads = 4;
  config.seq_lens = {304, 40, 200, 0, 77, 100, 129, 1};  // 304 = 19 whole blocks of 16
  config.sinks = true;
  config.keep_unquantized = false;
  return config;
}

/// Inputs with bad lengths and entries, and what the checks let through.
struct CheckedInputs {
  std::vector<std::int32_t> seq_lens;     ///< as uploaded
  std::vector<std::int32_t> block_table;  ///< as uploaded
  std::vector<std::int32_t> passed_lens;  ///< as decoded: 0 for a sequence that fails
};

constexpr int kFailingSequences[] = {1, 2, 5, 6};

/// Sequence 0: length exactly the coverage (valid). 1: entry num_blocks at
/// column 1 (inside its 3 used columns). 2: INT32_MAX at column 5 and -7 at
/// its last used column. 5: length one past the coverage. 6: length -4.
/// 3 (length 0), 4 and 7 are untouched.
CheckedInputs bad_inputs(const Scenario& scenario) {
  const int columns = scenario.max_blocks_per_seq;
  const int block_size = scenario.config.block_size;
  const std::int32_t coverage = columns * block_size;
  CheckedInputs inputs{scenario.seq_lens, scenario.block_table, {}};
  const auto entry = [&](int sequence, int column) -> std::int32_t& {
    return inputs.block_table[std::size_t(sequence) * columns + column];
  };
  const int full_blocks = scenario.seq_lens[0] / block_size;
  for (int column = full_blocks; column < columns; ++column) entry(0, column) = entry(0, column - full_blocks);
  inputs.seq_lens[0] = coverage;
  entry(1, 1) = static_cast<std::int32_t>(scenario.num_blocks);
  entry(2, 5) = std::numeric_limits<std::int32_t>::max();
  entry(2, (scenario.seq_lens[2] - 1) / block_size) = -7;
  inputs.seq_lens[5] = coverage + 1;
  inputs.seq_lens[6] = -4;
  inputs.passed_lens = inputs.seq_lens;
  for (const int sequence : kFailingSequences) inputs.passed_lens[sequence] = 0;
  return inputs;
}

/// What the report says after `failing_calls` decodes of bad_inputs among `checked_calls`.
void expect_bad_inputs_reported(const DeviceCheckReport& report, const Scenario& scenario, std::int64_t failing_calls,
                                std::int64_t checked_calls) {
  EXPECT_EQ(report.checked_calls, checked_calls);
  EXPECT_EQ(report.failed_sequences, 4 * failing_calls);
  EXPECT_EQ(report.bad_seq_lens, 2 * failing_calls);
  EXPECT_EQ(report.bad_block_entries, 3 * failing_calls);
  EXPECT_EQ(report.first_bad_seq_len.sequence, 5);
  EXPECT_EQ(report.first_bad_seq_len.value, scenario.max_blocks_per_seq * scenario.config.block_size + 1);
  EXPECT_EQ(report.first_bad_block_entry.sequence, 1);
  EXPECT_EQ(report.first_bad_block_entry.column, 1);
  EXPECT_EQ(report.first_bad_block_entry.value, scenario.num_blocks);
  EXPECT_EQ(report.first_failed_sequence(), 1);
}

void expect_no_failures(const DeviceCheckReport& report, std::int64_t checked_calls) {
  EXPECT_EQ(report.checked_calls, checked_calls);
  EXPECT_EQ(report.failed_sequences, 0);
  EXPECT_EQ(report.bad_seq_lens, 0);
  EXPECT_EQ(report.bad_block_entries, 0);
  EXPECT_EQ(report.first_failed_sequence(), -1);
}

/// The failing sequences' rows are exactly zero and the others match the
/// reference over the lengths the checks let through.
void expect_checked_output(const std::vector<float>& actual, const Scenario& scenario, const CheckedInputs& inputs,
                           const std::string& what) {
  const std::string zero_rows = test::zero_row_failure(actual, scenario, inputs.passed_lens);
  EXPECT_TRUE(zero_rows.empty()) << what << ": " << zero_rows;
  expect_close(actual, reference_output(scenario, inputs.passed_lens, inputs.block_table), what);
}

void upload_and_poison(DeviceScenario& device, const std::vector<std::int32_t>& seq_lens,
                       const std::vector<std::int32_t>& block_table) {
  device.upload_lengths(seq_lens, block_table);
  device.poison_output();
  check_cuda(cudaDeviceSynchronize(), "upload");  // the copies run on the legacy stream
}

/// The check scenario on the device; the tests run once per GPU path.
class ReliabilityGpuDeviceChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    TQ_SKIP_WITHOUT_GPU();
    device_ = std::make_unique<DeviceScenario>(scenario_);
  }

  /// Calls body(request, path name) for each GPU path, traced by the path.
  template <typename Body>
  void for_each_gpu_path(Body body) {
    for (const PathRequest request : kGpuRequests) {
      const std::string path = decode_path_name(choose_decode_path(device_->args(), request).path);
      SCOPED_TRACE(path);
      body(request, path);
    }
  }

  const Scenario scenario_ = make_scenario(check_config());
  const CheckedInputs inputs_ = bad_inputs(scenario_);
  std::unique_ptr<DeviceScenario> device_;
};

TEST_F(ReliabilityGpuDeviceChecks, BadSequencesGiveZeroRowsAndAreReported) {
  for_each_gpu_path([&](PathRequest request, const std::string& path) {
    DecodeWorkspace workspace(scenario_.batch());
    workspace.set_device_checks(true);
    upload_and_poison(*device_, inputs_.seq_lens, inputs_.block_table);
    decode(device_->args(), workspace, nullptr, request);
    expect_checked_output(device_->output(), scenario_, inputs_, "bad inputs, checks on, " + path);
    expect_bad_inputs_reported(workspace.device_check_report(), scenario_, 1, 1);
    expect_no_failures(workspace.device_check_report(), 0);  // reading cleared it
  });
}

TEST_F(ReliabilityGpuDeviceChecks, ValidInputsDecodeBitwiseAsWithoutChecks) {
  for_each_gpu_path([&](PathRequest request, const std::string& path) {
    DecodeWorkspace workspace(scenario_.batch());
    workspace.set_device_checks(false);
    device_->poison_output();  // not the previous path's output
    decode(device_->args(), workspace, nullptr, request);
    const std::vector<float> unchecked = device_->output();
    expect_close(unchecked, reference_output(scenario_), "valid inputs, checks off, " + path);
    workspace.set_device_checks(true);
    device_->poison_output();
    decode(device_->args(), workspace, nullptr, request);
    EXPECT_EQ(bitwise_mismatches(device_->output(), unchecked), 0u);
    expect_no_failures(workspace.device_check_report(), 1);
  });
}

TEST_F(ReliabilityGpuDeviceChecks, OffByDefault) {
  const test::ScopedVariable unset("TQDECODE_DEVICE_CHECKS", nullptr);
  DecodeWorkspace workspace(scenario_.batch());
  EXPECT_FALSE(workspace.device_checks());
  decode(device_->args(), workspace);
  expect_close(device_->output(), reference_output(scenario_), "checks off by default");
  expect_no_failures(workspace.device_check_report(), 0);  // no check ran
}

// Captured with checks on and valid inputs; replayed with valid, then bad
// inputs: each replay equals an eager checked decode of the same inputs, and
// the report counts replays and eager calls alike.
TEST_F(ReliabilityGpuDeviceChecks, WorkInsideCudaGraphCaptureAndReplay) {
  for_each_gpu_path([&](PathRequest request, const std::string& path) {
    DecodeWorkspace workspace(scenario_.batch());
    workspace.set_device_checks(true);
    cudaStream_t stream;
    check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    upload_and_poison(*device_, scenario_.seq_lens, scenario_.block_table);
    const DecodeArgs args = device_->args();
    decode(args, workspace, stream, request);  // warm-up: the pool allocates here, not during capture
    expect_no_failures(workspace.device_check_report(stream), 1);

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    decode(args, workspace, stream, request);
    check_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");

    const auto replay_and_eager = [&](const std::vector<std::int32_t>& seq_lens,
                                      const std::vector<std::int32_t>& block_table) {
      upload_and_poison(*device_, seq_lens, block_table);
      check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
      check_cuda(cudaStreamSynchronize(stream), "replay");
      const std::vector<float> replayed = device_->output();
      device_->poison_output();
      check_cuda(cudaDeviceSynchronize(), "poison");
      decode(args, workspace, stream, request);
      check_cuda(cudaStreamSynchronize(stream), "eager decode");
      EXPECT_EQ(bitwise_mismatches(replayed, device_->output()), 0u) << "replay against eager";
      return replayed;
    };
    expect_close(replay_and_eager(scenario_.seq_lens, scenario_.block_table), reference_output(scenario_),
                 "graph replay, valid inputs, " + path);
    expect_no_failures(workspace.device_check_report(stream), 2);
    expect_checked_output(replay_and_eager(inputs_.seq_lens, inputs_.block_table), scenario_, inputs_,
                          "graph replay, bad inputs, " + path);
    expect_checked_output(replay_and_eager(inputs_.seq_lens, inputs_.block_table), scenario_, inputs_,
                          "graph replay again, bad inputs, " + path);
    expect_bad_inputs_reported(workspace.device_check_report(stream), scenario_, 4, 4);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  });
}

// ---------------------------------------------------------------------------
// 5. Non-finite queries and sinks (the CPU rule of NonFinite.* in
// tests/cpu/test_reliability.cpp): NaN rows for that head only, zeros for an
// empty sequence, every other row bit for bit what it is with finite inputs.

ScenarioConfig non_finite_config(Preset preset, bool sinks) {
  ScenarioConfig config;
  config.preset = preset;
  config.num_q_heads = 8;
  config.num_kv_heads = 2;
  config.seq_lens = {40, 0, 7, 300};
  config.sinks = sinks;
  config.query_dtype = preset == Preset::turboquant_4bit_nc ? DType::bf16 : DType::f16;
  config.keep_unquantized = false;
  return config;
}

/// One decode of `scenario` by `request` into a poisoned output.
/// The decode's output, which starts finite and non-zero (0x4a4a in bf16 or
/// fp16), so rows expected NaN or zero must have been written.
std::vector<float> gpu_decode(const Scenario& scenario, PathRequest request) {
  DeviceScenario device(scenario);
  device.fill_output(0x4a);
  DecodeWorkspace workspace(scenario.batch());
  decode(device.args(), workspace, nullptr, request);
  return device.output();
}

std::string describe_path(const Scenario& scenario, PathRequest request) {
  return decode_path_name(choose_decode_path(DeviceScenario(scenario).args(), request).path);
}

enum class RowExpect { nan, zero, unchanged };

/// The first row of `actual` that is not as `expect_of(b, hq)` says
/// (against `clean` for unchanged rows), described, or empty.
template <typename ExpectOf>
std::string row_failure(const std::vector<float>& actual, const std::vector<float>& clean, const Scenario& scenario,
                        ExpectOf expect_of) {
  const int Hq = scenario.config.num_q_heads, D = scenario.config.head_dim;
  for (int b = 0; b < scenario.batch(); ++b) {
    for (int hq = 0; hq < Hq; ++hq) {
      const RowExpect expect = expect_of(b, hq);
      const std::size_t first = (std::size_t(b) * Hq + hq) * D;
      for (std::size_t i = first; i < first + D; ++i) {
        const bool ok = expect == RowExpect::nan    ? std::isnan(actual[i])
                        : expect == RowExpect::zero ? actual[i] == 0.0f
                                                    : std::memcmp(&actual[i], &clean[i], sizeof(float)) == 0;
        if (!ok) {
          const char* wanted = expect == RowExpect::nan ? "NaN" : expect == RowExpect::zero ? "0" : "unchanged";
          return "sequence " + std::to_string(b) + " head " + std::to_string(hq) + " element " +
                 std::to_string(i - first) + " is " + std::to_string(actual[i]) + ", expected " + wanted;
        }
      }
    }
  }
  return {};
}

TEST(ReliabilityGpuNonFinite, NanQueryGivesNanRowsForThatHeadOnly) {
  TQ_SKIP_WITHOUT_GPU();
  struct Poison {
    int b, hq, d;
  };
  const Poison poisons[] = {{0, 1, 5}, {2, 6, 0}, {2, 7, 127}, {1, 3, 9}, {3, 0, 64}};  // sequence 1 is empty
  for (const Preset preset : kAllPresets) {
    for (const bool sinks : {false, true}) {
      const Scenario clean = make_scenario(non_finite_config(preset, sinks));
      Scenario poisoned = clean;
      for (const Poison& p : poisons) {
        store_from_float(poisoned.query_bits.data(), clean.config.query_dtype,
                         (std::int64_t(p.b) * clean.config.num_q_heads + p.hq) * clean.config.head_dim + p.d,
                         std::numeric_limits<float>::quiet_NaN());
      }
      for (const PathRequest request : kGpuRequests) {
        const std::string what =
            std::string(preset_info(preset).name) + (sinks ? " with sinks, " : ", ") + describe_path(clean, request);
        const std::vector<float> expected = gpu_decode(clean, request);
        expect_close(expected, reference_output(clean), what);
        const std::string failure = row_failure(gpu_decode(poisoned, request), expected, clean, [&](int b, int hq) {
          if (clean.seq_lens[b] == 0) return RowExpect::zero;
          for (const Poison& p : poisons) {
            if (p.b == b && p.hq == hq) return RowExpect::nan;
          }
          return RowExpect::unchanged;
        });
        EXPECT_TRUE(failure.empty()) << what << ": " << failure;
      }
    }
  }
}

TEST(ReliabilityGpuNonFinite, NanOrInfiniteSinkGivesNanRowsForThatHeadOnly) {
  TQ_SKIP_WITHOUT_GPU();
  for (const Preset preset : kAllPresets) {
    const Scenario clean = make_scenario(non_finite_config(preset, true));
    Scenario poisoned = clean;
    poisoned.sinks[2] = std::numeric_limits<float>::quiet_NaN();
    poisoned.sinks[5] = std::numeric_limits<float>::infinity();
    Scenario no_sink = clean;
    no_sink.sinks.clear();
    Scenario minus_infinity = clean;
    minus_infinity.sinks.assign(minus_infinity.sinks.size(), -std::numeric_limits<float>::infinity());
    for (const PathRequest request : kGpuRequests) {
      const std::string what = std::string(preset_info(preset).name) + ", " + describe_path(clean, request);
      const std::vector<float> expected = gpu_decode(clean, request);
      const std::string failure = row_failure(gpu_decode(poisoned, request), expected, clean, [&](int b, int hq) {
        if (clean.seq_lens[b] == 0) return RowExpect::zero;
        return hq == 2 || hq == 5 ? RowExpect::nan : RowExpect::unchanged;
      });
      EXPECT_TRUE(failure.empty()) << what << ": " << failure;
      // A sink of -inf is no sink.
      EXPECT_EQ(bitwise_mismatches(gpu_decode(minus_infinity, request), gpu_decode(no_sink, request)), 0u) << what;
    }
  }
}

}  // namespace
}  // namespace tqdecode
