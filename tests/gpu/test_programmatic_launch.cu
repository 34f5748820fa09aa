// Programmatic dependent launch (DecodeWorkspace::set_programmatic_launch):
// the Hopper kernel's CTAs may start while the kernel before it on the
// stream still runs, and must read nothing but PiT and the centroids before
// that kernel has finished. Here the kernel before the decode lets its
// dependents start at once, spins for about a millisecond, and only then
// writes the decode's real query, cache, seq_lens, block table and sinks
// over poisoned ones (NaN query and sinks, junk cache, zero lengths, a table
// of block 0). A decode that read any of them early would see the poison;
// it must give the bits of an ordinary decode, eagerly and as a CUDA graph.
// With DecodeArgs::constants_stable = false the same kernel may also write
// PiT and the centroids late.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "support/device_scenario.hpp"
#include "support/scenario.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode {
namespace {

using test::check_cuda;
using test::DeviceBuffer;

constexpr int kMaxLateInputs = 7;

/// Inputs written late: for i < count, bytes[i] bytes from `from[i]` to `to[i]`.
struct LateWrites {
  const std::uint8_t* from[kMaxLateInputs];
  std::uint8_t* to[kMaxLateInputs];
  std::size_t bytes[kMaxLateInputs];
  int count;
  long long spin_cycles;
};

__global__ void write_inputs_late(LateWrites writes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // dependents may start now, before the writes below
#endif
  const long long start = clock64();
  while (clock64() - start < writes.spin_cycles) {
  }
  const std::size_t stride = std::size_t(gridDim.x) * blockDim.x;
  for (int i = 0; i < writes.count; ++i) {
    for (std::size_t j = std::size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < writes.bytes[i]; j += stride) {
      writes.to[i][j] = writes.from[i][j];
    }
  }
}

/// A device copy of `bytes` bytes at `source`, kept to be written back late.
DeviceBuffer<std::uint8_t> saved_copy(const void* source, std::size_t bytes) {
  DeviceBuffer<std::uint8_t> copy(bytes);
  check_cuda(cudaMemcpy(copy.get(), source, bytes, cudaMemcpyDeviceToDevice), "saved copy");
  return copy;
}

struct LateInputCase {
  std::string name;
  Preset preset;
  int num_q_heads;
  std::vector<int> seq_lens;
  bool late_constants = false;  ///< PiT and the centroids written late too, with constants_stable = false
};

void PrintTo(const LateInputCase& c, std::ostream* os) { *os << c.name; }

class ProgrammaticLaunch : public ::testing::TestWithParam<LateInputCase> {};

TEST_P(ProgrammaticLaunch, DecodeReadsInputsWrittenByThePreviousKernelOnlyAfterItFinishes) {
  TQ_SKIP_WITHOUT_GPU();
  const LateInputCase& c = GetParam();
  ScenarioConfig config;
  config.preset = c.preset;
  config.num_q_heads = c.num_q_heads;
  config.num_kv_heads = 8;
  config.seq_lens = c.seq_lens;
  config.sinks = true;
  config.seed = 31;
  const Scenario scenario = make_scenario(config);
  DeviceScenario device(scenario);
  DecodeArgs args = device.args();
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");

  // The bits to expect: the same decode without programmatic launch.
  DecodeWorkspace workspace(64);
  workspace.set_programmatic_launch(false);
  device.poison_output();
  decode(args, workspace, stream);
  check_cuda(cudaStreamSynchronize(stream), "plain decode");
  const std::vector<float> expected = device.output();
  std::vector<float> reference(expected.size());
  decode_reference(scenario.host_args(nullptr), reference.data());
  test::expect_close(expected, reference, c.name + " without programmatic launch");

  const bool mse_keys = args.PiT != nullptr && args.centroids != nullptr;
  const std::size_t sizes[kMaxLateInputs] = {scenario.query_bits.size() * 2,
                                             scenario.cache.size(),
                                             scenario.seq_lens.size() * 4,
                                             scenario.block_table.size() * 4,
                                             scenario.sinks.size() * 4,
                                             std::size_t(args.layout.head_dim) * args.layout.head_dim * 4,
                                             std::size_t(args.num_centroids) * 4};
  const void* inputs[kMaxLateInputs] = {args.query, args.cache,   args.seq_lens, args.block_table,
                                        args.sinks, args.PiT, args.centroids};
  // NaN query, junk cache, no tokens, block 0, NaN sinks, NaN PiT and centroids.
  const int poison[kMaxLateInputs] = {0xff, 0xff, 0, 0, 0xff, 0xff, 0xff};
  std::vector<DeviceBuffer<std::uint8_t>> saved;
  LateWrites writes{};
  writes.count = c.late_constants ? kMaxLateInputs : 5;
  ASSERT_TRUE(!c.late_constants || mse_keys) << "late constants need an MSE preset";
  args.constants_stable = !c.late_constants;
  for (int i = 0; i < writes.count; ++i) {
    saved.push_back(saved_copy(inputs[i], sizes[i]));
    writes.from[i] = saved.back().get();
    writes.to[i] = static_cast<std::uint8_t*>(const_cast<void*>(inputs[i]));
    writes.bytes[i] = sizes[i];
  }
  int clock_khz = 0;
  check_cuda(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0), "clock rate");
  writes.spin_cycles = static_cast<long long>(clock_khz);  // about a millisecond
  const auto poison_inputs = [&] {
    for (int i = 0; i < writes.count; ++i) check_cuda(cudaMemset(writes.to[i], poison[i], sizes[i]), "poison");
    device.poison_output();
    // cudaMemset runs on the default stream, which `stream` (non-blocking)
    // does not wait for: finish the poison before the late writes start.
    check_cuda(cudaDeviceSynchronize(), "poison");
  };
  const auto expect_bits = [&](const std::string& what) {
    const std::vector<float> actual = device.output();
    ASSERT_EQ(actual.size(), expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      ASSERT_EQ(actual[i], expected[i]) << what << ", element " << i;
    }
  };

  workspace.set_programmatic_launch(true);
  const auto enqueue = [&] {
    write_inputs_late<<<32, 256, 0, stream>>>(writes);
    check_cuda(cudaGetLastError(), "write_inputs_late");
    decode(args, workspace, stream);
  };
  poison_inputs();
  enqueue();
  check_cuda(cudaStreamSynchronize(stream), "eager");
  expect_bits(c.name + ", eager");

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  enqueue();
  check_cuda(cudaStreamEndCapture(stream, &graph), "end capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int replay = 0; replay < 2; ++replay) {
    poison_inputs();
    check_cuda(cudaGraphLaunch(exec, stream), "replay");
    check_cuda(cudaStreamSynchronize(stream), "replay");
    expect_bits(c.name + ", graph replay " + std::to_string(replay));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// One sequence split over many partitions (the fused reduction), grids with
// four and eight kv heads per CTA, keys without a table (fp8), and
// PiT and the centroids written late with constants_stable = false.
INSTANTIATE_TEST_SUITE_P(Grid, ProgrammaticLaunch,
                         ::testing::Values(LateInputCase{"q4_split", Preset::turboquant_4bit_nc, 64, {3001}},
                                           LateInputCase{"q4_octo_waves", Preset::turboquant_4bit_nc, 64,
                                                         {700, 0, 1500, 33, 2048, 999, 1, 1200, 640, 1777, 300, 5,
                                                          2500, 820, 64, 1100, 90, 1999, 400, 1300, 17, 2222, 760,
                                                          1024, 3, 1600, 250, 1400, 880, 2100, 45, 1000, 1500, 600,
                                                          1800, 128, 2400, 333, 1111, 77}},
                                           LateInputCase{"q4_quad_waves", Preset::turboquant_4bit_nc, 64,
                                                         {3900, 0, 1500, 33, 2048, 999, 1, 1200, 640, 1777, 300, 5,
                                                          2500, 820, 64, 1100, 90, 1999, 400, 1300, 17, 2222, 760,
                                                          1024, 3, 1600, 250, 1400, 880, 2100, 45, 1000, 1500, 600,
                                                          3000, 12, 700, 2700}},
                                           LateInputCase{"3bit_split", Preset::turboquant_3bit_nc, 32, {2049, 5}},
                                           LateInputCase{"k8v4_split", Preset::turboquant_k8v4, 64, {3001, 40}},
                                           LateInputCase{"q4_split_late_constants", Preset::turboquant_4bit_nc, 64,
                                                         {3001}, true}),
                         [](const ::testing::TestParamInfo<LateInputCase>& info) { return info.param.name; });

}  // namespace
}  // namespace tqdecode
