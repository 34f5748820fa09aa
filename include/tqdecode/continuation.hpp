// vLLM's continuation chunks sent as per-token rows (docs/VLLM.md): the
// route that serves them as one varlen call without a synchronisation.
#pragma once

#include <cstdint>

#include "tqdecode/decode_args.hpp"

struct CUstream_st;

namespace tqdecode {

/// Entries of a route for `rows` rows (continuation_route).
constexpr std::int64_t continuation_route_size(int rows) { return std::int64_t(rows) + 3; }

/// Decides on the device whether `rows` rows of a single-token decode with
/// lengths `seq_lens` over one shared block-table row of `capacity`
/// positions are one request's consecutive positions (lengths rising by one
/// from at least 1, the last at most `capacity`), and writes into `route`
/// (continuation_route_size(rows) int32) the inputs of two calls that
/// together give the rows' results:
/// - route[0 .. rows): the per-row call's seq_lens: all 0 where the rows
///   are one chunk (zero outputs, no cache read), else the rows' own;
/// - route[rows], route[rows + 1]: the chunk's varlen query_start_loc,
///   (0, rows) where the rows are one chunk, else (0, 0) (no query token);
/// - route[rows + 2]: the chunk's seq_len: the last row's, or 0.
/// The per-row call first, then the varlen call over the same output.
/// Device pointers, asynchronous on `stream`, no synchronisation, so it
/// works inside CUDA graphs. Throws Error naming the argument for rows < 1
/// or a null pointer, CudaError on a launch failure, and Error in a build
/// without CUDA.
void continuation_route(const std::int32_t* seq_lens, int rows, std::int64_t capacity, std::int32_t* route,
                        CUstream_st* stream = nullptr);

/// The same route from host memory (the CPU path, and the device route's reference).
void continuation_route_host(const std::int32_t* seq_lens, int rows, std::int64_t capacity, std::int32_t* route);

/// The two calls of a route: `rows` is a single-token decode of rows whose
/// block-table rows are all its first row (`rows.block_table`), and `route`
/// the route continuation_route wrote for rows.seq_lens (memory of the same
/// kind as the call's other pointers).
struct ContinuationCalls {
  DecodeArgs per_row;  ///< `rows` with the route's per-row lengths
  DecodeArgs chunk;    ///< one sequence of rows.batch tokens at most over the first table row (varlen)
};

/// The calls that serve `rows` through `route`; run per_row, then chunk, on
/// one stream. Throws Error naming the argument where `rows` has
/// query_start_loc set, no rows, or more than kMaxQueryLen.
ContinuationCalls continuation_calls(const DecodeArgs& rows, const std::int32_t* route);

/// The positions a route's rows may reach: the shared table row's blocks.
inline std::int64_t continuation_capacity(const DecodeArgs& rows) {
  return std::int64_t(rows.max_blocks_per_seq) * rows.layout.block_size;
}

}  // namespace tqdecode
