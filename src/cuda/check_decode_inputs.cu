// Device-side input checks (DecodeWorkspace::set_device_checks), launched
// before the decode kernels when the workspace asks for them.
//
// One CTA per sequence b. It checks seq_lens[b] against the block table's
// coverage and, when that passes, every entry the length uses (columns
// 0 .. ceil(seq_len / block_size) - 1) against num_blocks, then writes the
// checked length: seq_lens[b], or 0 when a check failed, so that the decode
// kernels, which read this copy, give the sequence an all-zero row and read
// nothing of it. A failing CTA adds to the counters with atomics and, under a
// lock that only failing CTAs take, keeps the lowest failure's details, so
// the report does not depend on the order in which CTAs run.
//
// Cost: one launch, and at most B * max_blocks_per_seq * 4 bytes of block
// table read (only the used entries are); each thread keeps kLoadsInFlight
// independent loads in flight, so a CTA covers 2048 entries (32K tokens at
// block size 16) per round trip to memory.

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda_check.hpp"
#include "kernel_params.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLoadsInFlight = 8;

/// Records a failing sequence's details when they are lower than the ones
/// held. One thread per failing CTA; `volatile` keeps the fields out of L1,
/// where another CTA's write may not be visible.
__device__ void record_lowest_failure(DeviceCheckState* state, int sequence, bool length_ok, std::int32_t seq_len,
                                      int bad_column, std::int32_t bad_entry) {
  while (atomicCAS(&state->lock, 0u, 1u) != 0u) {
  }
  __threadfence();
  volatile DeviceCheckState* held = state;
  if (!length_ok) {
    if (!held->has_bad_seq_len || sequence < held->bad_seq_len_sequence) {
      held->has_bad_seq_len = 1;
      held->bad_seq_len_sequence = sequence;
      held->bad_seq_len_value = seq_len;
    }
  } else if (!held->has_bad_block_entry || sequence < held->bad_block_entry_sequence ||
             (sequence == held->bad_block_entry_sequence && bad_column < held->bad_block_entry_column)) {
    held->has_bad_block_entry = 1;
    held->bad_block_entry_sequence = sequence;
    held->bad_block_entry_column = bad_column;
    held->bad_block_entry_value = bad_entry;
  }
  __threadfence();
  atomicExch(&state->lock, 0u);
}

__global__ void __launch_bounds__(kThreads) check_decode_inputs_kernel(const __grid_constant__ CheckInputsParams p) {
  __shared__ int bad_entries;
  __shared__ int first_bad_column;
  if (threadIdx.x == 0) {
    bad_entries = 0;
    first_bad_column = INT_MAX;
  }
  __syncthreads();

  const int sequence = blockIdx.x;
  const std::int32_t seq_len = p.seq_lens[sequence];
  const std::int64_t coverage = static_cast<std::int64_t>(p.max_blocks_per_seq) * p.block_size;
  const bool length_ok = seq_len >= 0 && seq_len <= coverage;
  if (length_ok) {
    // Entries past the used ones may hold anything (engines leave junk there).
    const int used = static_cast<int>((static_cast<std::int64_t>(seq_len) + p.block_size - 1) / p.block_size);
    const std::int32_t* row = p.block_table + sequence * p.block_table_stride;
    int my_bad = 0;
    int my_first = INT_MAX;
    for (int base = threadIdx.x; base < used; base += kThreads * kLoadsInFlight) {
      std::int32_t entry[kLoadsInFlight];
#pragma unroll
      for (int k = 0; k < kLoadsInFlight; ++k) {
        const int column = base + k * kThreads;
        entry[k] = column < used ? __ldg(row + column) : 0;
      }
#pragma unroll
      for (int k = 0; k < kLoadsInFlight; ++k) {
        const int column = base + k * kThreads;
        if (column < used && (entry[k] < 0 || entry[k] >= p.num_blocks)) {
          ++my_bad;
          my_first = min(my_first, column);
        }
      }
    }
    if (my_bad > 0) {
      atomicAdd(&bad_entries, my_bad);
      atomicMin(&first_bad_column, my_first);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;

  DeviceCheckState* state = p.state;
  if (sequence == 0) atomicAdd(&state->checked_calls, 1ull);
  const bool passed = length_ok && bad_entries == 0;
  p.checked_seq_lens[sequence] = passed ? seq_len : 0;
  if (passed) return;
  atomicAdd(&state->failed_sequences, 1ull);
  if (length_ok) {
    atomicAdd(&state->bad_block_entries, static_cast<unsigned long long>(bad_entries));
  } else {
    atomicAdd(&state->bad_seq_lens, 1ull);
  }
  const std::int32_t bad_entry = length_ok ? p.block_table[sequence * p.block_table_stride + first_bad_column] : 0;
  record_lowest_failure(state, sequence, length_ok, seq_len, first_bad_column, bad_entry);
}

}  // namespace

void launch_check_decode_inputs(const CheckInputsParams& params, CUstream_st* stream) {
  if (params.batch == 0) return;
  check_decode_inputs_kernel<<<params.batch, kThreads, 0, stream>>>(params);
  TQ_CUDA_CHECK_LAUNCH();
}

}  // namespace tqdecode::cuda
