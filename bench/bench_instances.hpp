// The instances ("layers") of one benchmark shape in device memory: each its
// own cache region, block table, sequence lengths, query, output, PiT and
// centroids, and the decode arguments that read them. Shapes of q_len > 1
// have two forms of the same step: the varlen entry (query_start_loc, one
// array for every layer, as an engine's step has) and the rows pattern (each
// token a row of the one-token entry over its own prefix).
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

  /// Each instance's decode: one token per sequence, or the varlen form.
  const std::vector<tqdecode::DecodeArgs>& args() const { return args_; }
  /// q_len > 1: the same tokens as rows of the one-token entry (empty otherwise).
  const std::vector<tqdecode::DecodeArgs>& rows_args() const { return rows_args_; }

  /// Instance `instance`'s output as fp32 (synchronises `stream`).
  std::vector<float> output(int instance, cudaStream_t stream) const;

 private:
  /// q_len > 1: the varlen offsets (every sequence q_len tokens) into args(),
  /// and rows_args() over row tables copied from `tables`.
  void add_query_tokens(const Shape& shape, const std::vector<std::int32_t>& tables, cudaStream_t stream);

  InstancePlan plan_;
  DeviceArray<std::uint8_t> cache_;
  DeviceArray<std::int32_t> block_tables_;
  DeviceArray<std::int32_t> seq_lens_;
  DeviceArray<std::uint16_t> queries_;
  DeviceArray<std::uint16_t> outputs_;
  DeviceArray<float> centroids_;  // [instances][2^key_bits]; empty for fp8 keys
  DeviceArray<float> PiT_;        // [instances][D * D]; empty for fp8 keys
  DeviceArray<std::int32_t> query_start_loc_;  // [B + 1] (q_len > 1)
  DeviceArray<std::int32_t> row_tables_;       // [instances][B * q_len][table_width] (q_len > 1)
  DeviceArray<std::int32_t> row_lengths_;      // [instances][B * q_len] (q_len > 1)
  std::vector<tqdecode::DecodeArgs> args_;
  std::vector<tqdecode::DecodeArgs> rows_args_;
};

}  // namespace tqbench
