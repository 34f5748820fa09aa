// Which sequence and partition a CTA of the tensor-core kernel serves
// (internal; docs/LAUNCHER.md "Partitioning"). The grid's (partition,
// sequence) coordinates name one of B x N partition slots; the slots go to
// the sequences by covered length (balanced_first_slot), so the CTAs of a
// ragged batch stream about equal token counts, and a uniform batch keeps N
// partitions per sequence. Each CTA deals them from seq_lens after the grid
// dependency wait, in one block-wide scan.
#pragma once

#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

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

/// The slot (grid_sequence, grid_partition)'s sequence and partition, the
/// same in every thread. `scratch`: kScratchBytes of dynamic shared memory
/// nothing else uses until the next barrier after the call (the scan's
/// storage); `dealt`: a static shared slot for the answer. With N = 1 or one
/// sequence the grid's coordinates are the answer: only that sequence's
/// length is loaded, and no barrier is passed.
template <int kThreads, int kScratchBytes>
__device__ SequencePartition deal_partition(const PartitionParams& p, int grid_sequence, int grid_partition,
                                            void* scratch, SequencePartition& dealt) {
  const int num_partitions = p.num_partitions;
  if (num_partitions == 1 || p.batch == 1) {
    return {grid_sequence, grid_partition, num_partitions, grid_sequence * num_partitions,
            p.covered_length(__ldg(p.seq_lens + grid_sequence))};
  }
  // Warp scans: storage of one value per warp (the raking form keeps one per thread).
  using Scan = cub::BlockScan<long long, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  static_assert(sizeof(typename Scan::TempStorage) <= kScratchBytes, "the scan's storage fits the scratch area");
  // Thread t: sequences t k .. t k + k - 1, k = ceil(B / threads).
  const int per_thread = (p.batch + kThreads - 1) / kThreads;
  const int first = min(static_cast<int>(threadIdx.x) * per_thread, p.batch);
  const int end = min(first + per_thread, p.batch);
  long long own = 0;
  for (int s = first; s < end; ++s) own += p.covered_length(__ldg(p.seq_lens + s));
  if (threadIdx.x == 0) dealt.sequence = -1;  // an idle slot unless a thread finds its sequence
  long long before = 0, total = 0;
  Scan(*static_cast<typename Scan::TempStorage*>(scratch)).ExclusiveSum(own, before, total);
  const long long slot = static_cast<long long>(grid_sequence) * num_partitions + grid_partition;
  const long long extra_slots = static_cast<long long>(p.batch) * (num_partitions - 1);
  long long first_slot = balanced_first_slot(first, before, total, extra_slots);
  for (int s = first; s < end; ++s) {
    const int seq_len = p.covered_length(__ldg(p.seq_lens + s));
    before += seq_len;
    const long long next = balanced_first_slot(s + 1, before, total, extra_slots);
    if (first_slot <= slot && slot < next) {
      const int partition = static_cast<int>(slot - first_slot);
      dealt = {partition < kMaxPartitions ? s : -1, partition,
               static_cast<int>(min(next - first_slot, static_cast<long long>(kMaxPartitions))),
               static_cast<int>(first_slot), seq_len};
    }
    first_slot = next;
  }
  __syncthreads();
  return dealt;
}

}  // namespace tqdecode::cuda::tensor_core
