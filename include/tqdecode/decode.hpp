// The decode launcher (docs/LAUNCHER.md): one entry point per decode step that
// picks the Hopper kernel, the generic CUDA kernel or the CPU reference,
// with buffers from a pool so the call is allocation-free and safe inside
// CUDA graphs in steady state.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tqdecode/decode_args.hpp"

struct CUstream_st;

namespace tqdecode {

enum class DecodePath : std::uint8_t {
  hopper,         ///< tensor-core kernel (every preset at D = 64, 128 and 256), blocks cache order, on sm_90
  cuda_generic,   ///< CUDA kernels for every preset and supported shape on any CUDA GPU (GenericKernel)
  cpu_reference,  ///< host memory, no GPU (slow; tests and tools)
};

const char* decode_path_name(DecodePath path);

/// What a request for a path means: `automatic` picks the fastest that
/// applies; `cuda_generic_scalar` is the generic path with its scalar kernel
/// even where the tensor-core kernel could serve (tests, comparisons);
/// `hopper_warp_specialized` is the Hopper path with the warp-specialized
/// kernel for several query tokens per sequence (LaunchPlan::warp_specialized),
/// an error naming what it serves where it cannot serve the call; `automatic`
/// takes that kernel for more than 32 query rows per kv head (speculation
/// past 4 tokens at group 8, continuation chunks), `hopper` always the
/// tensor-core kernel's row tiles.
enum class PathRequest : std::uint8_t {
  automatic,
  hopper,
  cuda_generic,
  cuda_generic_scalar,
  cpu_reference,
  hopper_warp_specialized,
};

/// The kernel of the generic path.
enum class GenericKernel : std::uint8_t {
  /// The Hopper path's tensor-core kernel in its narrow configuration (8
  /// warps, 12 for groups 9..16 at D = 128), no programmatic launch: sm_80
  /// and newer, D = 64, 128 or 256 (every preset; groups over 8 at D = 256
  /// in two row tiles), 16-byte aligned cache in the blocks order, group up
  /// to 16, where the device's shared memory holds its CTA (at D = 64 at
  /// most 81 KB: every sm_80 and newer part; at D = 128 at most 153 KB:
  /// every sm_80 / sm_90 part, sm_86 / sm_89 take the 3-bit-key presets up
  /// to group 8; at D = 256 150 KB for 3-bit keys, sm_80 and sm_90, up to
  /// 200 KB: sm_90).
  tensor_core,
  scalar,  ///< CUDA cores: any CUDA GPU, every preset and supported shape, both cache orders
};

const char* generic_kernel_name(GenericKernel kernel);

struct PathChoice {
  DecodePath path;
  std::string reason;  ///< why this path (and why not a faster one)
};

/// The launch configuration of one shape signature, as cached.
struct LaunchPlan {
  DecodePath path;
  std::string reason;
  int num_partitions;   ///< N: fixed by shapes, never by seq_lens values
  int partition_align;  ///< tokens; partition ranges are multiples of it
  /// Hopper path, turboquant_4bit_nc: one CTA of 16 warps per SM sharing a
  /// 64 KB key table (up to group 8 serving one kv head on grids of at most
  /// two waves, else several: kv_heads_per_cta) instead of two CTAs of 8
  /// warps (odd Hk on larger grids, where one CTA's prologue then overlaps
  /// the other's streaming); for groups over 8 always, one kv head per CTA
  /// of 12 warps (the same shape with a 128-byte-row table otherwise).
  bool wide_table = false;
  /// With wide_table: the kv heads each CTA serves, 16 / kv_heads_per_cta
  /// warps each: 1 (grids of at most two waves), 2, 4 or 8 (heads
  /// hy .. hy + h - 1 of one sequence, Hk a multiple of h), whichever gives
  /// the grid the fewest waves (the fewest heads on a tie): with several, an
  /// SM streams several work items at once, as the two-CTA shape does, with
  /// the wide table's shorter loop, and each wave's prologue and merge are
  /// paid fewer times. The grid is (N, Hk / h, B).
  /// Without wide_table, Hopper path, the other presets up to group 8: 2
  /// (one CTA of 16 warps per SM, 8 per kv head, even Hk) where that grid
  /// takes at most two waves, instead of two CTAs of 8 warps per SM, which
  /// do not share an SM evenly; else 1. For their token_slots caches with
  /// the kv heads' slots side by side in 16-byte token rows: 8 (else 4,
  /// k8v4 with Hk a multiple of 4), one CTA of 16 warps reading whole token
  /// rows by one bulk copy per tile, where that grid fills the GPU and
  /// each CTA streams at least 2048 tokens; else 1.
  /// The 16-warp CTAs (wide_table with one head tile, or two kv heads per
  /// CTA) of the MSE presets load their share of PiT before anything else,
  /// while the previous kernel may still run, rather than after issuing
  /// their first tiles.
  int kv_heads_per_cta = 1;
  /// Hopper path, token_slots caches of 2 or 4 kv heads (tensor-parallel
  /// shards; turboquant_k8v4 also of 1) up to group 8: one CTA of 16 warps
  /// (8 for one kv head) reads the whole token rows of every kv head
  /// (kv_heads_per_cta = Hk), one bulk copy per tile of the tile's
  /// contiguous run of rows, where that grid fills the GPU and each CTA
  /// streams at least 2048 tokens.
  bool token_runs = false;
  /// Hopper path, token_slots, turboquant_4bit_nc with eight kv heads per
  /// CTA (wide_table): the CTA's token rows by one bulk copy per tile
  /// rather than a box per kv head and warp; without norm correction, and
  /// with it where a CTA streams at least 32768 tokens.
  bool whole_rows = false;
  /// The tensor-core kernels (Hopper path, and the generic path's
  /// tensor-core kernel): query rows per kv head and sequence (the group x
  /// the most query tokens of a sequence) a CTA serves, in head tiles of 8:
  /// 1, 2 for more rows (their other rows in further row tiles of the grid,
  /// which read the same tokens), or on the Hopper path 4 for more than 16
  /// rows of turboquant_4bit_nc in the blocks order at D = 128 where those
  /// CTAs fill a wave without partitions (one CTA of 8 warps per SM).
  int head_tiles = 1;
  /// PathRequest::hopper_warp_specialized (several query tokens per
  /// sequence of turboquant_4bit_nc at D = 128, in the blocks order or in
  /// token_slots rows and blocks of 16-byte multiples, with more than 16
  /// query rows per kv head, sm_90 and a build with sm_90a code),
  /// or the automatic path with more than 32 query rows per kv head:
  /// the warp-specialized partition kernel (two producer warpgroups
  /// dequantize each 64-token tile once into shared memory, two consumer
  /// warpgroups multiply it with up to 64 query rows on warpgroup MMA)
  /// between the query rotation and the reducer, query_tokens_per_cta
  /// tokens per CTA, partitions aligned to 64 tokens.
  bool warp_specialized = false;
  /// The generic path's kernel (path cuda_generic only).
  GenericKernel generic_kernel = GenericKernel::scalar;
  /// Query tokens of a sequence each CTA of the scalar kernel (or of the
  /// warp-specialized one: up to 64 rows) serves from
  /// one read of its kv head's cache: 1, or with query_start_loc as many as
  /// fit 32 query rows (tokens x group), the max_query_len tokens spread
  /// evenly over ceil(max_query_len / this) query tiles. The grid is then
  /// (N x query tiles, Hk, B).
  int query_tokens_per_cta = 1;
};

/// True when a CUDA device is present and this build has kernels for the
/// current one (its architecture built, or PTX it can compile).
bool cuda_available();

/// True when the fast Hopper kernel can run on the current device.
bool is_available();

/// What the device-side input checks (DecodeWorkspace::set_device_checks)
/// found since the report was last read. Counts add up over every checked
/// call (graph replays included); the `first_*` fields describe the
/// lowest-indexed failure (by sequence, then block-table column) over those calls.
struct DeviceCheckReport {
  std::int64_t checked_calls = 0;      ///< decode calls whose inputs were checked on the device
  std::int64_t failed_sequences = 0;   ///< sequences decoded as seq_len 0 (all-zero rows) because a check failed
  std::int64_t bad_seq_lens = 0;       ///< of those, lengths outside [0, max_blocks_per_seq * block_size]
  std::int64_t bad_block_entries = 0;  ///< entries an in-range length uses that are outside [0, num_blocks)

  struct BadSeqLen {
    int sequence = -1;  ///< -1: none
    std::int32_t value = 0;
  };
  struct BadBlockEntry {
    int sequence = -1;  ///< -1: none
    int column = -1;    ///< block-table column (logical block) of the entry
    std::int32_t value = 0;
  };
  BadSeqLen first_bad_seq_len;
  BadBlockEntry first_bad_block_entry;

  /// The lowest-indexed failing sequence, or -1 when every check passed.
  int first_failed_sequence() const {
    const int by_length = first_bad_seq_len.sequence, by_entry = first_bad_block_entry.sequence;
    if (by_length < 0) return by_entry;
    return by_entry < 0 ? by_length : std::min(by_length, by_entry);
  }
};

/// Buffer pool (docs/LAUNCHER.md "Workspace / buffer pool"): per shape signature
/// one device allocation sized for `max_batch` rows, of which a call with
/// batch B uses the first rows, so pointers are the same for every B and
/// across capture and replay. A batch larger than the bucket grows it to the
/// next power of two (at least B, at most 2^20 rows), once, with a warning on
/// stderr naming the pool and its new size; the replaced buffers stay
/// allocated until the workspace is destroyed, so graphs captured earlier
/// and calls of other threads that acquired them still run on them (they
/// count in Stats::total_bytes). The first allocation of a signature and every growth
/// synchronise the device, so they cannot happen while the stream captures a
/// CUDA graph: decode() then throws Error naming max_batch (run one decode of
/// each shape before capture, with max_batch at least the largest batch
/// captured). Thread-safe (one mutex around the map; the
/// returned buffers of a signature must not be used by two streams at once:
/// give each concurrent stream its own workspace).
class DecodeWorkspace {
 public:
  /// Rows of every pool: the TQDECODE_MAX_BATCH environment variable when it
  /// is set (an override, docs/LAUNCHER.md), else `max_batch`, else (0) 512.
  explicit DecodeWorkspace(int max_batch = 0);
  ~DecodeWorkspace();
  DecodeWorkspace(const DecodeWorkspace&) = delete;
  DecodeWorkspace& operator=(const DecodeWorkspace&) = delete;

  int max_batch() const;

  /// Device-side input checks, off by default (on when the environment
  /// variable TQDECODE_DEVICE_CHECKS is 1 when the workspace is made). When
  /// on, every CUDA decode first runs a small kernel that checks each
  /// seq_len against the block table's coverage [0, max_blocks_per_seq *
  /// block_size] and each entry that length uses against [0, num_blocks);
  /// a sequence that fails is decoded as seq_len 0 (an all-zero row, none of
  /// its cache read) and recorded in device_check_report(). One extra launch
  /// per call, no synchronisation: safe in CUDA graphs, where the setting at
  /// capture time is the one replays keep. The CPU path always validates on
  /// the host and throws Error instead.
  void set_device_checks(bool enabled);
  bool device_checks() const;

  /// Programmatic dependent launch of the Hopper kernel, on by default (off
  /// when the environment variable TQDECODE_PROGRAMMATIC_LAUNCH is 0 when the
  /// workspace is made). When on, the decode's CTAs may start while the
  /// previous kernel of the stream finishes: they read PiT and the centroids
  /// and build their tables, then wait for that kernel to complete before
  /// reading anything else. So PiT and the centroids must not be written by
  /// the kernel immediately before the decode on its stream (model constants
  /// never are; a copy or any earlier kernel is fine); switch this off if
  /// they are, for every call, or pass DecodeArgs::constants_stable = false
  /// for one call. Every other input may come from that kernel. Results are
  /// bitwise the same either way; CUDA graphs keep the setting they were
  /// captured with. The generic kernels always wait.
  void set_programmatic_launch(bool enabled);
  bool programmatic_launch() const;

  /// Reads and clears the report of this workspace's device-side checks on
  /// the current device. Ordered on `stream` and waits for it only: checks
  /// enqueued on it before the call are included (checks on other streams
  /// must be complete), decodes enqueued after it start a new report. Throws
  /// Error when `stream` is capturing a CUDA graph. Empty when no decode ran
  /// on a device.
  DeviceCheckReport device_check_report(CUstream_st* stream = nullptr);

  struct Entry {
    std::string signature;  ///< "Hk=8 Hq=64 D=128 dtype=bfloat16 device=0"
    int bucket_batch;       ///< rows allocated for
    int partition_rows;     ///< rows of partition buffers (max over batch of B * N)
    std::int64_t bytes;
  };
  struct Stats {
    std::vector<Entry> entries;
    std::int64_t total_bytes = 0;  ///< every pool and the allocations growths replaced
  };
  Stats stats() const;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// The launch plan decode() would use for these arguments (cached per shape
/// signature). Throws Error for invalid shapes or an impossible request.
LaunchPlan plan_decode(const DecodeArgs& args, PathRequest request = PathRequest::automatic);

/// Which path decode() takes for these arguments, with the reason.
PathChoice choose_decode_path(const DecodeArgs& args, PathRequest request = PathRequest::automatic);

/// One decode step: writes args.output [B, Hq, D] (query dtype). Device
/// pointers on the CUDA paths, host pointers on the CPU path. When
/// args.output is null the pooled output buffer is written and returned:
/// the workspace owns it, the next call of the same shape signature on the
/// workspace overwrites it, and it stays allocated (also past a growth)
/// until the workspace is destroyed. Asynchronous on `stream` for CUDA
/// paths; throws Error (nothing written) for invalid arguments.
void* decode(const DecodeArgs& args, DecodeWorkspace& workspace, CUstream_st* stream = nullptr,
             PathRequest request = PathRequest::automatic);

}  // namespace tqdecode
