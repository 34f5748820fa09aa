// Split-KV partitioning (docs/FORMAT.md section 5, docs/LAUNCHER.md): the grid has a
// fixed partition count N chosen from shapes only; each sequence splits its
// actual length into N ranges on the device, aligned to `align` tokens.
#pragma once

#include <cstdint>

#include "tqdecode/common.hpp"

namespace tqdecode {

struct TokenRange {
  int begin;
  int end;  ///< exclusive; begin >= end means the partition is empty
};

/// Tokens per partition for a sequence of `seq_len` tokens over `num_partitions`.
TQ_HOST_DEVICE int partition_tokens(int seq_len, int num_partitions, int align) {
  const int per = (seq_len + num_partitions - 1) / num_partitions;
  return ((per + align - 1) / align) * align;
}

/// Token range of partition `p` (0 <= p < num_partitions).
TQ_HOST_DEVICE TokenRange partition_range(int seq_len, int num_partitions, int align, int p) {
  const int per = partition_tokens(seq_len, num_partitions, align);
  const long long begin = static_cast<long long>(per) * p;
  const long long end = begin + per < seq_len ? begin + per : seq_len;
  return {static_cast<int>(begin < seq_len ? begin : seq_len), static_cast<int>(end)};
}

}  // namespace tqdecode
