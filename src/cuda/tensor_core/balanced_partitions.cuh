// Which sequence and partition a CTA of the tensor-core kernel serves
// (internal; docs/LAUNCHER.md "Partitioning"). The grid's (partition,
// sequence) coordinates name one of B x N partition slots; the slots go to
// the sequences by covered length (balanced_first_slot), so the CTAs of a
// ragged batch stream about equal token counts, and a uniform batch keeps N
// partitions per sequence. Each warp deals them from seq_lens after the grid
// dependency wait (warp scans, no barrier).
#pragma once

#include <cuda_runtime.h>

#include "../device_utils.cuh"
#include "../kernel_params.hpp"
#include "../policy.hpp"
#include "tqdecode/partition.hpp"

namespace tqdecode::cuda::tensor_core {

struct SequencePartition {
  int sequence;    ///< -1: an idle slot (past its sequence's kMaxPartitions)
  int partition;   ///< the CTA's, of the sequence's
  int count;       ///< the sequence's partitions (at most kMaxPartitions)
  int first_slot;  ///< the sequence's first slot: its partition rows start at first_slot x max_query_len x Hq
  int seq_len;     ///< the sequence's covered length (PartitionParams::covered_length)

  __device__ __forceinline__ bool idle() const { return sequence < 0; }
};

/// The slot (grid_sequence, grid_partition)'s sequence and partition. Every
/// warp deals on its own (the lengths' loads hit L1 after the first warp's),
/// so no barrier holds the CTA's warps back before their first tiles. With
/// N = 1 or one sequence the grid's coordinates are the answer: only that
/// sequence's length is loaded. Every thread of the warp must call it.
__device__ __forceinline__ SequencePartition deal_partition(const PartitionParams& p, int grid_sequence,
                                                            int grid_partition) {
  const int num_partitions = p.num_partitions;
  if (num_partitions == 1 || p.batch == 1) {
    return {grid_sequence, grid_partition, num_partitions, grid_sequence * num_partitions,
            p.covered_length(__ldg(p.seq_lens + grid_sequence))};
  }
  const int lane = static_cast<int>(threadIdx.x & 31);
  const auto length = [&](int s) { return s < p.batch ? p.covered_length(__ldg(p.seq_lens + s)) : 0; };
  // Equal lengths get N slots each, the grid's coordinates (balanced_first_slot
  // is exact there): no scan or division on the way to the first tiles.
  const int own_length = length(grid_sequence);
  long long total = 0;
  bool equal_lengths = true;
  for (int base = 0; base < p.batch; base += 32) {
    const int seq_len = length(base + lane);
    total += seq_len;
    equal_lengths &= base + lane >= p.batch || seq_len == own_length;
  }
  if (__all_sync(kFullMask, equal_lengths) && own_length > 0) {
    return {grid_sequence, grid_partition, num_partitions, grid_sequence * num_partitions, own_length};
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) total += __shfl_xor_sync(kFullMask, total, offset);
  const long long slot = static_cast<long long>(grid_sequence) * num_partitions + grid_partition;
  const long long extra_slots = static_cast<long long>(p.batch) * (num_partitions - 1);
  long long before = 0;  // the lengths of the sequences before the lanes' chunk
  for (int base = 0; base < p.batch; base += 32) {
    const int s = base + lane;
    const int seq_len = length(s);
    long long through = seq_len;  // inclusive prefix within the chunk
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      const long long below = __shfl_up_sync(kFullMask, through, offset);
      if (lane >= offset) through += below;
    }
    const long long first = balanced_first_slot(s, before + through - seq_len, total, extra_slots);
    const long long next = balanced_first_slot(s + 1, before + through, total, extra_slots);
    const unsigned owner = __ballot_sync(kFullMask, s < p.batch && first <= slot && slot < next);
    if (owner != 0u) {
      const int source = __ffs(owner) - 1;
      const int partition = static_cast<int>(slot - __shfl_sync(kFullMask, first, source));
      const int count = static_cast<int>(__shfl_sync(kFullMask, next - first, source));
      return {partition < kMaxPartitions ? base + source : -1, partition, min(count, kMaxPartitions),
              static_cast<int>(__shfl_sync(kFullMask, first, source)), __shfl_sync(kFullMask, seq_len, source)};
    }
    before += __shfl_sync(kFullMask, through, 31);
  }
  return {-1, 0, 0, 0, 0};  // no tokens at all: the slots past one per sequence are idle
}

}  // namespace tqdecode::cuda::tensor_core
