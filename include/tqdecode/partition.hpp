// Split-KV partitioning (docs/FORMAT.md section 5, docs/LAUNCHER.md): the grid has a
// fixed partition count N chosen from shapes only; each sequence splits its
// actual length into its partitions on the device (N, or on the Hopper kernel
// as many as its share of the batch's tokens gives it), aligned to `align` tokens.
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

/// Length-balanced partitions (the Hopper kernel; docs/LAUNCHER.md): the
/// grid's B x N partition slots go to the batch's sequences in order, one to
/// each and the other B (N - 1) in proportion to their lengths. This is the
/// first slot of the sequence at index `sequence`, whose predecessors' lengths
/// sum to `before` of the batch's `total`; its slots end at the next
/// sequence's first (at least one, B x N past the last). Exact in 64-bit
/// integers for any batch a GPU holds (total < 2^40 tokens); past that in
/// double precision. Non-decreasing in `before` either way (the branch
/// depends on the batch only), so the sequences' slots never overlap; equal
/// lengths give N each.
TQ_HOST_DEVICE long long balanced_first_slot(int sequence, long long before, long long total, long long extra_slots) {
  if (total <= 0) return sequence;
  if (total < (1LL << 40) && extra_slots < (1LL << 22)) return sequence + before * extra_slots / total;
  const long long extra = static_cast<long long>(static_cast<double>(before) * static_cast<double>(extra_slots) /
                                                 static_cast<double>(total));
  return sequence + (extra < extra_slots ? extra : extra_slots);
}

}  // namespace tqdecode
