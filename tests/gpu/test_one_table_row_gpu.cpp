// DecodeArgs::block_table_one_row (an expanded table row, vLLM's
// continuation chunks) on every CUDA path: rows whose table is one row read
// as it lies give bit for bit the output of the same rows over the row
// copied into each, and both match the CPU reference. The other rows of the
// device table hold -1 in the one-row call, so a kernel that reads any row
// but row 0 fails the closeness check or faults.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "support/device_scenario.hpp"
#include "tqdecode/decode.hpp"

namespace tqdecode::test {
namespace {

struct OneRowCase {
  std::string name;
  CacheOrder order;
  bool renormalize;
  std::vector<int> query_lens;  // empty: one token a row
  PathRequest request;
};

TEST(OneTableRowGpu, ReadsRowZeroAsTheCopiedRowsDo) {
  TQ_SKIP_WITHOUT_GPU();
  const std::vector<OneRowCase> cases = {
      {"slots_renorm_rows", CacheOrder::token_slots, true, {}, PathRequest::automatic},
      {"slots_renorm_rows_generic", CacheOrder::token_slots, true, {}, PathRequest::cuda_generic},
      {"blocks_rows_scalar", CacheOrder::blocks, false, {}, PathRequest::cuda_generic_scalar},
      {"blocks_varlen", CacheOrder::blocks, false, {4, 8, 1, 0, 3, 8}, PathRequest::automatic},
      {"slots_varlen_warp_specialized",
       CacheOrder::token_slots,
       true,
       {8, 8, 5, 0, 8, 2},
       PathRequest::hopper_warp_specialized},
  };
  for (const OneRowCase& c : cases) {
    SCOPED_TRACE(c.name);
    ScenarioConfig config;
    config.num_q_heads = 64;
    config.num_kv_heads = 8;
    config.seq_lens = {3001, 17, 100, 1, 40, 2000};
    config.order = c.order;
    config.renormalize_keys = c.renormalize;
    config.query_lens = c.query_lens;
    config.keep_unquantized = false;
    config.seed = 31;
    if (c.request == PathRequest::hopper_warp_specialized && !is_available()) {
      std::printf("[  SKIPPED ] %s: no Hopper path on this device\n", c.name.c_str());
      continue;
    }
    const Scenario scenario = make_scenario(config);
    const int batch = scenario.batch();
    const std::size_t columns = scenario.max_blocks_per_seq;
    // Every row reads sequence 0's blocks, at a length of at least its query tokens (positions before 0 see nothing).
    Rng rng(5);
    std::vector<std::int32_t> lengths(batch);
    for (int b = 0; b < batch; ++b) {
      const int query_tokens = scenario.varlen() ? scenario.query_start_loc[b + 1] - scenario.query_start_loc[b] : 0;
      lengths[b] = query_tokens + static_cast<std::int32_t>(rng.below(scenario.seq_lens[0] - query_tokens + 1));
    }
    lengths[1] = scenario.seq_lens[0];
    std::vector<std::int32_t> copied(scenario.block_table.size()), one_row(scenario.block_table.size(), -1);
    for (int b = 0; b < batch; ++b) {
      std::copy_n(scenario.block_table.begin(), columns, copied.begin() + b * columns);
    }
    std::copy_n(scenario.block_table.begin(), columns, one_row.begin());

    DeviceScenario device(scenario);
    DecodeWorkspace workspace;
    device.upload_lengths(lengths, copied);
    device.poison_output();
    decode(device.args(), workspace, nullptr, c.request);
    const std::vector<float> expected_bits = device.output();

    device.upload_lengths(lengths, one_row);
    device.poison_output();
    DecodeArgs args = device.args();
    args.block_table_one_row = true;
    args.block_table_stride = 0;
    decode(args, workspace, nullptr, c.request);
    const std::vector<float> output = device.output();
    EXPECT_EQ(bitwise_mismatches(output, expected_bits), 0u) << "the one-row call differs from the copied rows'";

    DecodeArgs host = scenario.host_args(nullptr);
    host.seq_lens = lengths.data();
    host.block_table = copied.data();
    std::vector<float> expected(scenario.query.size());
    decode_reference(host, expected.data());
    expect_close(output, expected, c.name);
  }
}

}  // namespace
}  // namespace tqdecode::test
