// The instances ("layers") of one benchmark shape in device memory: each its
// own cache region, block table, sequence lengths, query, output, PiT and
// centroids, and the decode arguments that read them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "bench_cuda.hpp"
#include "bench_shapes.hpp"
#include "tqdecode/decode_args.hpp"

namespace tqbench {

/// bf16 values ~U(-1, 1) in `data` (weights and activations of the engine-like step).
void fill_random_bf16(std::uint16_t* data, std::int64_t count, std::uint64_t seed, cudaStream_t stream, int sm_count);

class Instances {
 public:
  /// Allocates and fills plan.instances instances (synchronises `stream`).
  Instances(const Shape& shape, const InstancePlan& plan, cudaStream_t stream, int sm_count);

  const std::vector<tqdecode::DecodeArgs>& args() const { return args_; }

  /// Instance `instance`'s output as fp32 (synchronises `stream`).
  std::vector<float> output(int instance, cudaStream_t stream) const;

 private:
  InstancePlan plan_;
  DeviceArray<std::uint8_t> cache_;
  DeviceArray<std::int32_t> block_tables_;
  DeviceArray<std::int32_t> seq_lens_;
  DeviceArray<std::uint16_t> queries_;
  DeviceArray<std::uint16_t> outputs_;
  DeviceArray<float> centroids_;  // [instances][2^key_bits]; empty for fp8 keys
  DeviceArray<float> PiT_;        // [instances][D * D]; empty for fp8 keys
  std::vector<tqdecode::DecodeArgs> args_;
};

}  // namespace tqbench
