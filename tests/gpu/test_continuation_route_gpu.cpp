// The device's continuation route against the host's on random rows: runs
// of rising lengths (chunks) and the same with one row changed, more rows
// than the kernel's CTA has threads, at and past the row's capacity; and on
// fixed rows the random ones do not reach: runs from a length below 1, and
// lengths whose difference wraps in 32 bits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "expect_error.hpp"
#include "gpu/gpu_test_support.hpp"
#include "random.hpp"
#include "tqdecode/continuation.hpp"

namespace tqdecode::test {
namespace {

std::vector<std::int32_t> device_route(const std::vector<std::int32_t>& seq_lens, std::int64_t capacity) {
  const int rows = static_cast<int>(seq_lens.size());
  DeviceBuffer<std::int32_t> device_lengths(seq_lens);
  DeviceBuffer<std::int32_t> route(std::vector<std::int32_t>(continuation_route_size(rows), -7));
  continuation_route(device_lengths.get(), rows, capacity, route.get());
  check_cuda(cudaDeviceSynchronize(), "continuation_route");
  return route.download();
}

std::vector<std::int32_t> host_route(const std::vector<std::int32_t>& seq_lens, std::int64_t capacity) {
  const int rows = static_cast<int>(seq_lens.size());
  std::vector<std::int32_t> route(continuation_route_size(rows));
  continuation_route_host(seq_lens.data(), rows, capacity, route.data());
  return route;
}

TEST(ContinuationRouteGpu, MatchesTheHost) {
  TQ_SKIP_WITHOUT_GPU();
  Rng rng(2026);
  int chunks = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int rows = 1 + static_cast<int>(rng.below(trial % 4 == 0 ? 1000 : 40));
    const std::int32_t first = static_cast<std::int32_t>(rng.below(3000));
    std::vector<std::int32_t> seq_lens(rows);
    for (int i = 0; i < rows; ++i) seq_lens[i] = first + i;
    if (rng.below(2) == 0) seq_lens[rng.below(rows)] += static_cast<std::int32_t>(rng.below(5)) - 2;
    const std::int64_t capacity = first + rows - 2 + static_cast<std::int64_t>(rng.below(4));
    const std::vector<std::int32_t> expected = host_route(seq_lens, capacity);
    chunks += expected[rows + 1] == rows;
    ASSERT_EQ(device_route(seq_lens, capacity), expected)
        << "trial " << trial << ": " << rows << " rows from " << first;
  }
  EXPECT_GT(chunks, 20);  // both outcomes drawn
  EXPECT_LT(chunks, 180);
}

TEST(ContinuationRouteGpu, RowsTheRandomOnesMissStayRows) {
  TQ_SKIP_WITHOUT_GPU();
  std::vector<std::vector<std::int32_t>> not_chunks = {{0}, {-1}, {-1, 0, 1}, {2147483647, -2147483647 - 1}};
  for (const std::int32_t first : {0, -1, -5}) {  // a rising run from below 1, past the CTA's 256 threads
    std::vector<std::int32_t> lengths(300);
    for (int i = 0; i < 300; ++i) lengths[i] = first + i;
    not_chunks.push_back(lengths);
  }
  for (const auto& lengths : not_chunks) {
    const std::vector<std::int32_t> expected = host_route(lengths, 1000);
    ASSERT_EQ(expected[lengths.size() + 1], 0) << "the host counts rows from " << lengths[0] << " as a chunk";
    EXPECT_EQ(device_route(lengths, 1000), expected) << lengths.size() << " rows from " << lengths[0];
  }
}

TEST(ContinuationRouteGpu, BadArgumentsNameThemselves) {
  TQ_SKIP_WITHOUT_GPU();
  DeviceBuffer<std::int32_t> lengths(std::vector<std::int32_t>{1, 2}), route(5);
  expect_error_naming("rows", [&] { continuation_route(lengths.get(), 0, 8, route.get()); });
  expect_error_naming("seq_lens", [&] { continuation_route(nullptr, 2, 8, route.get()); });
  expect_error_naming("route", [&] { continuation_route(lengths.get(), 2, 8, nullptr); });
}

}  // namespace
}  // namespace tqdecode::test
