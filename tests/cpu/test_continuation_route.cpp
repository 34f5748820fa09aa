// continuation_route_host: which rows are one request's chunk, and the two
// calls' inputs it writes; continuation_calls: the two calls' arguments
// (include/tqdecode/continuation.hpp).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "expect_error.hpp"
#include "tqdecode/continuation.hpp"

namespace tqdecode::test {
namespace {

std::vector<std::int32_t> route_of(const std::vector<std::int32_t>& seq_lens, std::int64_t capacity) {
  const int rows = static_cast<int>(seq_lens.size());
  std::vector<std::int32_t> route(continuation_route_size(rows), -7);
  continuation_route_host(seq_lens.data(), rows, capacity, route.data());
  return route;
}

TEST(ContinuationRoute, ConsecutiveLengthsAreOneChunk) {
  // Rows of lengths 5..8 over a row of 8 positions: the per-row call gets 0s, the chunk (0, 4) and length 8.
  EXPECT_EQ(route_of({5, 6, 7, 8}, 8), (std::vector<std::int32_t>{0, 0, 0, 0, 0, 4, 8}));
  EXPECT_EQ(route_of({1}, 1), (std::vector<std::int32_t>{0, 0, 1, 1}));
}

TEST(ContinuationRoute, OtherRowsStayRows) {
  const std::vector<std::vector<std::int32_t>> not_chunks = {
      {5, 7, 8},                      // a gap
      {6, 5, 7},                      // not rising
      {4, 4},                         // equal
      {0, 1, 2},                      // a row of no position
      {7, 8, 9},                      // past the 8 positions of the row
      {-3, -2, -1},                   // negative lengths: the per-row call names them
      {-1, 0, 1},                     // rising from below 1
      {2147483647, -2147483647 - 1},  // a difference that wraps in 32 bits
  };
  for (const auto& lengths : not_chunks) {
    std::vector<std::int32_t> expected = lengths;
    expected.insert(expected.end(), {0, 0, 0});
    EXPECT_EQ(route_of(lengths, 8), expected) << "lengths from " << lengths[0];
  }
}

TEST(ContinuationRoute, BadArgumentsNameThemselves) {
  std::int32_t lengths[2] = {1, 2}, route[5] = {};
  expect_error_naming("rows", [&] { continuation_route_host(lengths, 0, 8, route); });
  expect_error_naming("seq_lens", [&] { continuation_route_host(nullptr, 2, 8, route); });
  expect_error_naming("route", [&] { continuation_route_host(lengths, 2, 8, nullptr); });
}

TEST(ContinuationCalls, PerRowLengthsAndOneChunkFromTheRoute) {
  std::int32_t route[7] = {};
  const std::int32_t table[3] = {4, 9, 2};
  DecodeArgs rows;
  rows.batch = 4;
  rows.block_table = table;
  rows.max_blocks_per_seq = 3;
  rows.block_table_stride = 3;
  rows.query_stride_batch = 1024;
  rows.layout.block_size = 16;
  EXPECT_EQ(continuation_capacity(rows), 48);
  const ContinuationCalls calls = continuation_calls(rows, route);
  EXPECT_EQ(calls.per_row.batch, 4);
  EXPECT_EQ(calls.per_row.seq_lens, route);
  EXPECT_EQ(calls.per_row.block_table_stride, 3);
  EXPECT_FALSE(calls.per_row.varlen());
  // One sequence over the first table row: offsets route[4], route[5]; its length route[6].
  EXPECT_EQ(calls.chunk.batch, 1);
  EXPECT_EQ(calls.chunk.block_table, table);
  EXPECT_EQ(calls.chunk.query_start_loc, route + 4);
  EXPECT_EQ(calls.chunk.seq_lens, route + 6);
  EXPECT_EQ(calls.chunk.num_tokens, 4);
  EXPECT_EQ(calls.chunk.max_query_len, 4);
  EXPECT_EQ(calls.chunk.query_stride_batch, 1024);  // the rows' stride steps over the chunk's tokens
}

TEST(ContinuationCalls, BadArgumentsNameThemselves) {
  std::int32_t route[4] = {}, starts[2] = {0, 1};
  DecodeArgs rows;
  rows.batch = 1;
  expect_error_naming("route", [&] { continuation_calls(rows, nullptr); });
  rows.batch = 0;
  expect_error_naming("batch", [&] { continuation_calls(rows, route); });
  rows.batch = kMaxQueryLen + 1;
  expect_error_naming("batch", [&] { continuation_calls(rows, route); });
  rows.batch = 1;
  rows.query_start_loc = starts;
  expect_error_naming("query_start_loc", [&] { continuation_calls(rows, route); });
}

}  // namespace
}  // namespace tqdecode::test
