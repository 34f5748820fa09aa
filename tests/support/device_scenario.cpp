#include "support/device_scenario.hpp"

#include <cuda_runtime.h>

#include <limits>

#include "cuda/cuda_check.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode {

namespace {

void* upload(const void* data, std::size_t bytes) {
  void* device = nullptr;
  if (bytes == 0) return nullptr;
  TQ_CUDA_CHECK(cudaMalloc(&device, bytes));
  TQ_CUDA_CHECK(cudaMemcpy(device, data, bytes, cudaMemcpyHostToDevice));
  return device;
}

template <typename T>
T* upload(const std::vector<T>& values) {
  return static_cast<T*>(upload(values.data(), values.size() * sizeof(T)));
}

}  // namespace

struct DeviceScenario::Buffers {
  std::uint8_t* cache = nullptr;
  std::int32_t* block_table = nullptr;
  std::int32_t* seq_lens = nullptr;
  std::int32_t* query_start_loc = nullptr;
  std::uint16_t* query = nullptr;
  float* centroids = nullptr;
  float* PiT = nullptr;
  float* sinks = nullptr;
  std::uint16_t* output = nullptr;
  std::size_t output_elements = 0;

  ~Buffers() {
    for (void* pointer : {static_cast<void*>(cache), static_cast<void*>(block_table), static_cast<void*>(seq_lens),
                          static_cast<void*>(query_start_loc), static_cast<void*>(query), static_cast<void*>(centroids), static_cast<void*>(PiT),
                          static_cast<void*>(sinks), static_cast<void*>(output)}) {
      cudaFree(pointer);
    }
  }
};

DeviceScenario::DeviceScenario(const Scenario& scenario) : scenario_(scenario), buffers_(std::make_unique<Buffers>()) {
  Buffers& b = *buffers_;
  b.cache = upload(scenario.cache);
  b.block_table = upload(scenario.block_table);
  b.seq_lens = upload(scenario.seq_lens);
  b.query_start_loc = upload(scenario.query_start_loc);
  b.query = upload(scenario.query_bits);
  b.centroids = upload(scenario.constants.centroids);
  b.PiT = upload(scenario.constants.PiT);
  b.sinks = upload(scenario.sinks);
  b.output_elements = scenario.query.size();
  TQ_CUDA_CHECK(cudaMalloc(&b.output, std::max<std::size_t>(1, b.output_elements) * sizeof(std::uint16_t)));
  poison_output();
}

DeviceScenario::~DeviceScenario() = default;

DecodeArgs DeviceScenario::args() const {
  DecodeArgs args = scenario_.host_args(buffers_->output);
  args.query = buffers_->query;
  args.cache = buffers_->cache;
  args.block_table = buffers_->block_table;
  args.seq_lens = buffers_->seq_lens;
  if (scenario_.varlen()) args.query_start_loc = buffers_->query_start_loc;
  args.centroids = buffers_->centroids;
  args.PiT = buffers_->PiT;
  args.sinks = buffers_->sinks;
  return args;
}

// 0xffff is a NaN in both fp16 and bf16.
void DeviceScenario::poison_output() { fill_output(0xff); }

void DeviceScenario::fill_output(unsigned char byte) {
  // cudaMemset is asynchronous on the legacy stream, which a non-blocking
  // stream (graph replays) does not wait for: the fill must have landed
  // before the call under test runs.
  TQ_CUDA_CHECK(cudaMemset(buffers_->output, byte, buffers_->output_elements * sizeof(std::uint16_t)));
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
}

std::vector<float> DeviceScenario::output() const {
  std::vector<std::uint16_t> bits(buffers_->output_elements);
  TQ_CUDA_CHECK(cudaDeviceSynchronize());
  TQ_CUDA_CHECK(cudaMemcpy(bits.data(), buffers_->output, bits.size() * sizeof(std::uint16_t), cudaMemcpyDeviceToHost));
  std::vector<float> values(bits.size());
  const bool half = scenario_.config.query_dtype == DType::f16;
  for (std::size_t i = 0; i < bits.size(); ++i) values[i] = half ? half_bits_to_float(bits[i]) : bf16_bits_to_float(bits[i]);
  return values;
}

void DeviceScenario::upload_lengths(const std::vector<std::int32_t>& seq_lens, const std::vector<std::int32_t>& block_table) {
  TQ_REQUIRE(seq_lens.size() == scenario_.seq_lens.size(), "seq_lens", "size differs from the scenario's batch");
  TQ_REQUIRE(block_table.size() == scenario_.block_table.size(), "block_table", "size differs from the scenario's table");
  TQ_CUDA_CHECK(cudaMemcpy(buffers_->seq_lens, seq_lens.data(), seq_lens.size() * 4, cudaMemcpyHostToDevice));
  TQ_CUDA_CHECK(cudaMemcpy(buffers_->block_table, block_table.data(), block_table.size() * 4, cudaMemcpyHostToDevice));
}

void DeviceScenario::upload_query_start_loc(const std::vector<std::int32_t>& query_start_loc) {
  TQ_REQUIRE(scenario_.varlen() && query_start_loc.size() == scenario_.query_start_loc.size(), "query_start_loc",
             "size differs from the scenario's batch + 1, or the scenario has one token per sequence");
  TQ_CUDA_CHECK(cudaMemcpy(buffers_->query_start_loc, query_start_loc.data(), query_start_loc.size() * 4,
                           cudaMemcpyHostToDevice));
}

}  // namespace tqdecode
