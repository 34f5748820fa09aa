// continuation_route_host and continuation_calls (include/tqdecode/continuation.hpp).
#include "tqdecode/continuation.hpp"

#include <string>

#include "tqdecode/error.hpp"

namespace tqdecode {

void continuation_route_host(const std::int32_t* seq_lens, int rows, std::int64_t capacity, std::int32_t* route) {
  TQ_REQUIRE(rows >= 1, "rows", std::to_string(rows) + " rows; accepted: at least 1");
  TQ_REQUIRE(seq_lens != nullptr, "seq_lens", "null; accepted: rows int32 lengths");
  TQ_REQUIRE(route != nullptr, "route", "null; accepted: rows + 3 int32");
  bool chunk = seq_lens[0] >= 1 && seq_lens[rows - 1] <= capacity;
  for (int i = 0; chunk && i + 1 < rows; ++i) chunk = std::int64_t(seq_lens[i + 1]) - seq_lens[i] == 1;
  const std::int32_t last = seq_lens[rows - 1];
  for (int i = 0; i < rows; ++i) route[i] = chunk ? 0 : seq_lens[i];
  route[rows] = 0;
  route[rows + 1] = chunk ? rows : 0;
  route[rows + 2] = chunk ? last : 0;
}

ContinuationCalls continuation_calls(const DecodeArgs& rows, const std::int32_t* route) {
  TQ_REQUIRE(!rows.varlen(), "query_start_loc",
             "is set; accepted: a single-token call of rows (the route makes the varlen call)");
  TQ_REQUIRE(rows.batch >= 1 && rows.batch <= kMaxQueryLen, "batch",
             std::to_string(rows.batch) + " rows; accepted: 1 to " + std::to_string(kMaxQueryLen));
  TQ_REQUIRE(route != nullptr, "route", "null; accepted: continuation_route_size(rows) int32");
  ContinuationCalls calls{rows, rows};
  calls.per_row.seq_lens = route;
  DecodeArgs& chunk = calls.chunk;
  chunk.batch = 1;
  chunk.block_table_stride = 0;
  chunk.query_start_loc = route + rows.batch;
  chunk.num_tokens = rows.batch;
  chunk.max_query_len = rows.batch;
  chunk.seq_lens = route + rows.batch + 2;
  return calls;
}

}  // namespace tqdecode
