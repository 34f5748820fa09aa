// Store a small random K/V cache on the CPU and decode one step through the
// public API, on the GPU when this build has CUDA and a device is present
// (device copies of every input), else with the CPU reference; then compare
// with exact attention on the unquantized K/V.
// Exits non-zero when the outputs disagree or a call fails.
#include <tqdecode/constants.hpp>
#include <tqdecode/decode.hpp>
#include <tqdecode/error.hpp>
#include <tqdecode/numeric.hpp>
#include <tqdecode/reference.hpp>
#include <tqdecode/store.hpp>
#include <tqdecode/version.hpp>

#if defined(TQDECODE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int kBatch = 3, kNumQHeads = 16, kNumKvHeads = 2, kHeadDim = 128, kBlockSize = 16;
constexpr int kSeqLens[kBatch] = {37, 300, 129};

#if defined(TQDECODE_WITH_CUDA)
void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// A device copy of a host vector, freed with the object.
class DeviceCopy {
 public:
  template <typename T>
  explicit DeviceCopy(const std::vector<T>& host) : bytes_(host.size() * sizeof(T)) {
    check(cudaMalloc(&data_, bytes_), "cudaMalloc");
    check(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~DeviceCopy() { cudaFree(data_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  template <typename T>
  T* get() const {
    return static_cast<T*>(data_);
  }
  template <typename T>
  void copy_to(std::vector<T>& host) const {
    check(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }

 private:
  std::size_t bytes_;
  void* data_ = nullptr;
};

// The decode on the device: every input copied there, the default stream.
tqdecode::PathChoice decode_on_gpu(tqdecode::DecodeArgs args, tqdecode::DecodeWorkspace& workspace,
                                   const std::vector<std::uint8_t>& cache, const std::vector<std::uint16_t>& query,
                                   const std::vector<std::int32_t>& block_table,
                                   const std::vector<std::int32_t>& seq_lens, const tqdecode::ModelConstants& constants,
                                   std::vector<std::uint16_t>& output) {
  const DeviceCopy device_cache(cache), device_query(query), device_table(block_table), device_lens(seq_lens),
      device_centroids(constants.centroids), device_PiT(constants.PiT), device_output(output);
  args.cache = device_cache.get<std::uint8_t>();
  args.query = device_query.get<std::uint16_t>();
  args.block_table = device_table.get<std::int32_t>();
  args.seq_lens = device_lens.get<std::int32_t>();
  args.centroids = device_centroids.get<float>();
  args.PiT = device_PiT.get<float>();
  args.output = device_output.get<std::uint16_t>();
  const tqdecode::PathChoice choice = tqdecode::choose_decode_path(args);
  tqdecode::decode(args, workspace, nullptr);
  check(cudaDeviceSynchronize(), "decode");
  device_output.copy_to(output);
  return choice;
}
#endif

double relative_l2(const std::vector<float>& got, const std::vector<float>& expected) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    diff += (double(got[i]) - expected[i]) * (double(got[i]) - expected[i]);
    norm += double(expected[i]) * expected[i];
  }
  return std::sqrt(diff / norm);
}

int run() {
  const tqdecode::Preset preset = tqdecode::Preset::turboquant_4bit_nc;
  const tqdecode::ModelConstants constants = tqdecode::make_model_constants(preset, kHeadDim, /*seed=*/1);
  const tqdecode::CacheLayout layout = tqdecode::make_layout(preset, kHeadDim, kBlockSize, kNumKvHeads);

  // Tokens of sequence b at rows token_offsets[b]..; its blocks, shuffled, in block_table row b.
  std::vector<std::int64_t> token_offsets{0};
  int max_blocks = 0;
  for (int len : kSeqLens) {
    token_offsets.push_back(token_offsets.back() + len);
    max_blocks = std::max(max_blocks, (len + kBlockSize - 1) / kBlockSize);
  }
  const std::int64_t num_tokens = token_offsets.back();
  const int num_blocks = kBatch * max_blocks;
  std::mt19937 rng(7);
  std::vector<std::int32_t> block_ids(num_blocks);
  for (int i = 0; i < num_blocks; ++i) block_ids[i] = i;
  std::shuffle(block_ids.begin(), block_ids.end(), rng);
  std::vector<std::int32_t> block_table(block_ids.begin(), block_ids.end());

  std::normal_distribution<float> normal;
  std::vector<float> key(num_tokens * kNumKvHeads * kHeadDim), value(key.size());
  for (float& x : key) x = normal(rng);
  for (float& x : value) x = normal(rng);
  std::vector<std::int64_t> slot_mapping(num_tokens);
  for (int b = 0; b < kBatch; ++b)
    for (int t = 0; t < kSeqLens[b]; ++t)
      slot_mapping[token_offsets[b] + t] =
          std::int64_t(block_table[b * max_blocks + t / kBlockSize]) * kBlockSize + t % kBlockSize;

  std::vector<std::uint8_t> cache(num_blocks * layout.block_stride);
  tqdecode::StoreArgs store;
  store.layout = layout;
  store.num_blocks = num_blocks;
  store.cache = cache.data();
  store.key = key.data();
  store.value = value.data();
  store.kv_dtype = tqdecode::DType::f32;
  store.num_tokens = num_tokens;
  store.slot_mapping = slot_mapping.data();
  store.Pi = constants.Pi.data();
  store.centroids = constants.centroids.data();
  store.num_centroids = int(constants.centroids.size());
  tqdecode::store_cpu(store);

  std::vector<float> query(kBatch * kNumQHeads * kHeadDim);
  for (float& x : query) x = normal(rng);
  std::vector<std::uint16_t> query_bf16(query.size());
  for (std::size_t i = 0; i < query.size(); ++i) {
    query_bf16[i] = tqdecode::float_to_bf16_bits(query[i]);
    query[i] = tqdecode::bf16_bits_to_float(query_bf16[i]);
  }
  std::vector<std::int32_t> seq_lens(kSeqLens, kSeqLens + kBatch);
  std::vector<std::uint16_t> output(query.size(), 0x7fc0);  // bf16 NaN: a row left unwritten fails the check

  tqdecode::DecodeArgs args;
  args.query = query_bf16.data();
  args.query_dtype = tqdecode::DType::bf16;
  args.batch = kBatch;
  args.num_q_heads = kNumQHeads;
  args.layout = layout;
  args.num_blocks = num_blocks;
  args.cache = cache.data();
  args.block_table = block_table.data();
  args.max_blocks_per_seq = max_blocks;
  args.seq_lens = seq_lens.data();
  args.centroids = constants.centroids.data();
  args.num_centroids = int(constants.centroids.size());
  args.PiT = constants.PiT.data();
  args.scale = 1.0f / std::sqrt(float(kHeadDim));
  args.output = output.data();

  // An engine passes device pointers and its stream and gets the fastest
  // kernel for its GPU; host pointers take the CPU reference.
  tqdecode::DecodeWorkspace workspace;
  tqdecode::PathChoice choice;
#if defined(TQDECODE_WITH_CUDA)
  if (tqdecode::cuda_available()) {
    choice = decode_on_gpu(args, workspace, cache, query_bf16, block_table, seq_lens, constants, output);
  } else
#endif
  {
    choice = tqdecode::choose_decode_path(args, tqdecode::PathRequest::cpu_reference);
    tqdecode::decode(args, workspace, nullptr, tqdecode::PathRequest::cpu_reference);
  }

  // Two checks: against the CPU reference of the same cache bytes (the
  // same function, so only rounding differs), and against exact attention
  // on the unquantized K/V (4-bit quantization error at this data).
  std::vector<float> decoded(output.size()), reference(output.size()), exact(output.size());
  for (std::size_t i = 0; i < output.size(); ++i) decoded[i] = tqdecode::bf16_bits_to_float(output[i]);
  tqdecode::decode_reference(args, reference.data());
  tqdecode::exact_attention(query.data(), key.data(), value.data(), token_offsets.data(), kBatch, kNumQHeads,
                            kNumKvHeads, kHeadDim, args.scale, nullptr, exact.data());
  const double error = relative_l2(decoded, reference), quantization_error = relative_l2(decoded, exact);
  std::printf("tqdecode " TQDECODE_VERSION_STRING
              ", %s: %s path (%s)\n  relative L2 error against the CPU reference %.2e (bf16 output)\n"
              "  against exact attention on the unquantized K/V %.3f\n",
              tqdecode::preset_info(preset).name, tqdecode::decode_path_name(choice.path), choice.reason.c_str(), error,
              quantization_error);
  return error < 1e-2 && quantization_error < 0.2 ? 0 : 1;
}

}  // namespace

int main() {
  try {
    return run();
  } catch (const std::exception& error) {  // tqdecode::Error names the argument at fault
    std::fprintf(stderr, "error: %s\n", error.what());
    return 2;
  }
}
