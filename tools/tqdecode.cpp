// tqdecode: command-line tool. `tqdecode demo` encodes a paged cache from
// built-in synthetic data for every preset and cache order, decodes it (on the
// GPU when one is present, else with the CPU reference) and prints accuracy
// against exact attention, compression and time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/version.hpp"
#if defined(TQDECODE_WITH_CUDA)
#include <cuda_runtime.h>

#include "support/device_scenario.hpp"
#endif

namespace {

using namespace tqdecode;

struct DemoOptions {
  int batch = 4;
  int context = 3000;
  int kv_heads = 8;
  int group_size = 4;
  int head_dim = 128;
  int block_size = 16;
  std::uint64_t seed = 1;
  std::vector<CacheOrder> orders{kAllCacheOrders.begin(), kAllCacheOrders.end()};
  bool cpu = false;
};

const char* kUsage =
    "usage: tqdecode <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo    encode a paged TurboQuant cache from built-in synthetic data for each\n"
    "          preset and cache order, decode it, and print accuracy vs exact\n"
    "          attention, compression and time (GPU when present, else the CPU\n"
    "          reference)\n"
    "  info    print the version, the build, the device and whether the fast Hopper\n"
    "          kernel can run on it\n"
    "\n"
    "demo options (defaults in brackets):\n"
    "  --batch N        sequences [4]\n"
    "  --context N      longest sequence in tokens; others are shorter and not\n"
    "                   multiples of the block size [3000]\n"
    "  --kv-heads N     key/value heads [8]\n"
    "  --group-size N   query heads per kv head, 1..16 [4]\n"
    "  --head-dim N     64, 128 or 256 [128]\n"
    "  --block-size N   16, 32, 64 or 128 [16]\n"
    "  --seed N         data, rotation and block-table seed [1]\n"
    "  --order O        blocks (structure-of-arrays blocks), token_slots (the\n"
    "                   token-interleaved slots vLLM writes on CUDA GPUs; the _nc\n"
    "                   presets with the engine's norm correction) or both [both]\n"
    "  --cpu            use the CPU reference even when a GPU is present\n"
    "  --help           this text\n";

int parse_int(std::string_view flag, const char* text) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  TQ_REQUIRE(text[0] != '\0' && *end == '\0' && value >= 0 && value <= (1L << 30), std::string(flag),
          "'" + std::string(text) + "' is not a non-negative integer");
  return static_cast<int>(value);
}

std::vector<CacheOrder> parse_orders(std::string_view text) {
  if (text == "both") return {kAllCacheOrders.begin(), kAllCacheOrders.end()};
  for (CacheOrder order : kAllCacheOrders) {
    if (text == cache_order_name(order)) return {order};
  }
  fail("--order", "'" + std::string(text) + "' is not blocks, token_slots or both");
}

DemoOptions parse_demo_options(int argc, char** argv) {
  DemoOptions options;
  for (int i = 2; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--cpu") {
      options.cpu = true;
      continue;
    }
    TQ_REQUIRE(i + 1 < argc, std::string(flag), "needs a value (see tqdecode --help)");
    const char* value = argv[++i];
    if (flag == "--batch") options.batch = parse_int(flag, value);
    else if (flag == "--context") options.context = parse_int(flag, value);
    else if (flag == "--kv-heads") options.kv_heads = parse_int(flag, value);
    else if (flag == "--group-size") options.group_size = parse_int(flag, value);
    else if (flag == "--head-dim") options.head_dim = parse_int(flag, value);
    else if (flag == "--block-size") options.block_size = parse_int(flag, value);
    else if (flag == "--seed") options.seed = static_cast<std::uint64_t>(parse_int(flag, value));
    else if (flag == "--order") options.orders = parse_orders(value);
    else fail(std::string(flag), "unknown option (see tqdecode --help)");
  }
  TQ_REQUIRE(options.batch >= 1, "--batch", "must be >= 1");
  TQ_REQUIRE(options.context >= 1, "--context", "must be >= 1");
  return options;
}

// Lengths from `context` down, none a multiple of the block size (except by chance of the user's choice).
std::vector<int> demo_lengths(const DemoOptions& options) {
  std::vector<int> lengths;
  for (int i = 0; i < options.batch; ++i) {
    const int shorter = options.context - i * (options.context / (2 * options.batch)) - 7 * (i % 3);
    lengths.push_back(std::max(1, shorter));
  }
  return lengths;
}

struct DemoRow {
  std::vector<float> output;
  double milliseconds;
  std::string path;
};

double milliseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

DemoRow decode_on_cpu(const Scenario& scenario) {
  std::vector<std::uint16_t> output(scenario.query.size());
  DecodeWorkspace workspace;
  const auto start = std::chrono::steady_clock::now();
  decode(scenario.host_args(output.data()), workspace, nullptr, PathRequest::cpu_reference);
  const double elapsed = milliseconds_since(start);
  std::vector<float> values(output.size());
  for (std::size_t i = 0; i < output.size(); ++i) values[i] = bf16_bits_to_float(output[i]);
  return {values, elapsed, "cpu_reference"};
}

#if defined(TQDECODE_WITH_CUDA)
DemoRow decode_on_gpu(const Scenario& scenario) {
  DeviceScenario device(scenario);
  DecodeWorkspace workspace;
  const DecodeArgs args = device.args();
  const PathChoice choice = choose_decode_path(args);
  decode(args, workspace);  // warm-up: pool allocation, module load
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  constexpr int kRepeats = 20;
  cudaEventRecord(start);
  for (int i = 0; i < kRepeats; ++i) decode(args, workspace);
  cudaEventRecord(stop);
  cudaEventSynchronize(stop);
  float total = 0;
  cudaEventElapsedTime(&total, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return {device.output(), total / kRepeats, std::string("gpu:") + decode_path_name(choice.path)};
}
#endif

int run_demo(const DemoOptions& options) {
  const bool gpu = !options.cpu && cuda_available();
  std::printf("tqdecode demo: batch %d, longest context %d, Hq %d, Hk %d, D %d, block size %d, seed %llu, %s\n",
              options.batch, options.context, options.kv_heads * options.group_size, options.kv_heads,
              options.head_dim, options.block_size, static_cast<unsigned long long>(options.seed),
              gpu ? "GPU" : (options.cpu ? "CPU reference (--cpu)" : "CPU reference (no GPU present)"));
  std::printf("synthetic data: keys with outlier channels and non-zero means, values with non-zero means\n\n");
  std::printf("%-20s %-12s %10s %10s %10s %10s %12s  %s\n", "preset", "order", "bytes/tok", "vs bf16", "cosine",
              "rel L2", "decode ms", "path");
  for (Preset preset : kAllPresets) {
    for (CacheOrder order : options.orders) {
      ScenarioConfig config;
      config.preset = preset;
      config.order = order;
      // vLLM's _nc presets re-normalise the centroid vectors at decode time over the slots it writes.
      config.renormalize_keys = order == CacheOrder::token_slots && !preset_info(preset).key_fp8;
      config.num_kv_heads = options.kv_heads;
      config.num_q_heads = options.kv_heads * options.group_size;
      config.head_dim = options.head_dim;
      config.block_size = options.block_size;
      config.seq_lens = demo_lengths(options);
      config.seed = options.seed;
      const char* name = preset_info(preset).name;
      std::fprintf(stderr, "  %s, %s: encoding %d sequences...\r", name, cache_order_name(order), options.batch);
      const auto encode_start = std::chrono::steady_clock::now();
      const Scenario scenario = make_scenario(config);
      const double encode_ms = milliseconds_since(encode_start);
      std::fprintf(stderr, "  %s, %s: encoded in %.0f ms, decoding...   \r", name, cache_order_name(order), encode_ms);
#if defined(TQDECODE_WITH_CUDA)
      const DemoRow row = gpu ? decode_on_gpu(scenario) : decode_on_cpu(scenario);
#else
      const DemoRow row = decode_on_cpu(scenario);
#endif
      const ErrorStats error = compare_outputs(row.output, scenario.exact_output());
      const int bytes = scenario.layout.bytes_per_token_head();
      const int bf16_bytes = 4 * options.head_dim;
      std::fprintf(stderr, "%72s\r", "");
      std::printf("%-20s %-12s %10d %9.2fx %10.5f %10.5f %12.3f  %s\n", name, cache_order_name(order), bytes,
                  static_cast<double>(bf16_bytes) / bytes, error.cosine, error.relative_l2, row.milliseconds,
                  row.path.c_str());
    }
  }
  std::printf("\nbytes/tok: cache bytes per token and kv head (bf16 K+V: %d); cosine and rel L2: output vs exact\n"
              "fp32 attention on the unquantized K/V; decode ms: one decode step%s.\n",
              4 * options.head_dim, gpu ? " (mean of 20, GPU events)" : " (wall clock)");
  return 0;
}

int run_info() {
#if defined(TQDECODE_WITH_CUDA)
  std::printf("tqdecode %s, CUDA build\n", TQDECODE_VERSION_STRING);
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0) {
    cudaDeviceProp properties;
    cudaGetDeviceProperties(&properties, 0);
    std::printf("device 0: %s, sm_%d%d, %d SMs, %.1f GiB\n", properties.name, properties.major, properties.minor,
                properties.multiProcessorCount, properties.totalGlobalMem / 1073741824.0);
  } else {
    std::printf("no CUDA device present\n");
  }
#else
  std::printf("tqdecode %s, CPU-only build\n", TQDECODE_VERSION_STRING);
#endif
  std::printf("fast Hopper kernel available: %s\n", is_available() ? "yes" : "no");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string_view command = argc > 1 ? argv[1] : "--help";
    if (command == "--help" || command == "-h" || command == "help") {
      std::printf("%s", kUsage);
      return argc > 1 ? 0 : 2;
    }
    if (command == "demo") {
      for (int i = 2; i < argc; ++i) {
        if (std::string_view(argv[i]) == "--help") {
          std::printf("%s", kUsage);
          return 0;
        }
      }
      return run_demo(parse_demo_options(argc, argv));
    }
    if (command == "info") return run_info();
    std::fprintf(stderr, "tqdecode: unknown command '%s'\n\n%s", argv[1], kUsage);
    return 2;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
}
