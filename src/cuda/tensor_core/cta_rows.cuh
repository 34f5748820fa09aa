// The query rows a CTA of the tensor-core kernel serves (internal). A kv
// head of sequence b has group x q_len query rows: row i is query head
// i % group of the kv head at the sequence's query token i / group
// (docs/FORMAT.md section 5b; q_len 1 without query_start_loc). The grid
// has row_tiles CTAs per (partition, kv heads, sequence); CTA row r serves
// kv head first_head + r / kRows and that head's row row_tile kRows +
// r % kRows, so the query tokens of a sequence fold into the mma's N side
// with the group and each row tile reads the kv head's cache once for all
// of its rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../kernel_params.hpp"

namespace tqdecode::cuda::tensor_core {

template <int kRows>
struct CtaRows {
  int first_head;  ///< the CTA's first kv head
  int group;       ///< Hq / Hk
  int row_tile;    ///< the CTA's tile of each kv head's rows
  int batch;       ///< the sequence
  int max_query_len;
  QueryRows::Span span;  ///< the sequence's query tokens (rows of the query and output)
  int seq_len;           ///< covered length: token j of the span sees positions below seq_len - count + j + 1

  __device__ __forceinline__ int head_row(int row) const { return row_tile * kRows + row % kRows; }
  /// The row's query token within the span.
  __device__ __forceinline__ int token(int row) const {
    return static_cast<int>(static_cast<unsigned>(head_row(row)) / static_cast<unsigned>(group));
  }
  /// Rows past the span's tokens are padding: computed on zero queries, never written.
  __device__ __forceinline__ bool valid(int row) const { return token(row) < span.count; }
  /// The row's query head.
  __device__ __forceinline__ std::int64_t query_head(int row) const {
    return std::int64_t(first_head + row / kRows) * group + (head_row(row) - token(row) * group);
  }
  /// The row's row of the query and output tensors.
  __device__ __forceinline__ std::int64_t output_row(int row) const { return span.first + token(row); }
  /// The row's entry in the partition buffers for query head `hq` and
  /// partition `partition` of the sequence's `count`: its rows start at its
  /// first slot's (balanced_partitions.cuh) x max_query_len x Hq, then
  /// (query token, query head, partition).
  __device__ __forceinline__ std::int64_t partition_entry(int row, std::int64_t hq, int num_q_heads, int first_slot,
                                                          int count, int partition) const {
    return std::int64_t(first_slot) * max_query_len * num_q_heads + (token(row) * num_q_heads + hq) * count + partition;
  }
  /// Positions below this are the row's context (causal).
  __device__ __forceinline__ int limit(int row) const { return seq_len - span.count + 1 + token(row); }
  /// Whether the tile holds a row of the span (a tile past a short span holds none).
  __device__ __forceinline__ bool any_valid() const { return token(0) < span.count; }
  /// Limits of the CTA's first and last valid rows (any_valid()).
  __device__ __forceinline__ int first_limit() const { return limit(0); }
  __device__ __forceinline__ int last_limit() const {
    const int last = min(span.count - 1, token(kRows - 1));
    return seq_len - span.count + 1 + last;
  }
};

}  // namespace tqdecode::cuda::tensor_core
