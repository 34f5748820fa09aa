// A Scenario copied to GPU memory (CUDA builds only): the demo and the GPU
// tests decode from it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "support/scenario.hpp"

namespace tqdecode {

class DeviceScenario {
 public:
  /// Uploads cache, block table, seq_lens, query_start_loc (varlen
  /// scenarios), query, constants and sinks, and allocates an output
  /// [query rows, Hq, D] in the query dtype.
  explicit DeviceScenario(const Scenario& scenario);
  ~DeviceScenario();
  DeviceScenario(const DeviceScenario&) = delete;
  DeviceScenario& operator=(const DeviceScenario&) = delete;

  /// Decode arguments over device memory, writing the device output.
  DecodeArgs args() const;
  /// Fills the output with NaN so a test sees any element not written.
  void poison_output();
  /// Sets every output byte to `byte` (landed before the next call on any stream).
  void fill_output(unsigned char byte);
  /// The output as fp32 [query rows, Hq, D] (synchronises).
  std::vector<float> output() const;
  /// Replaces seq_lens and the block table (same shapes) on the device.
  void upload_lengths(const std::vector<std::int32_t>& seq_lens, const std::vector<std::int32_t>& block_table);
  /// Replaces query_start_loc (same size) on the device (varlen scenarios).
  void upload_query_start_loc(const std::vector<std::int32_t>& query_start_loc);

 private:
  struct Buffers;
  const Scenario& scenario_;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace tqdecode
