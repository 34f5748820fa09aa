// The decode launcher (LAUNCHER.md): one entry point per decode step that
// picks the Hopper kernel, the generic CUDA kernel or the CPU reference,
// with buffers from a pool so the call is allocation-free and safe inside
// CUDA graphs in steady state.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tqdecode/decode_args.hpp"

struct CUstream_st;

namespace tqdecode {

enum class DecodePath : std::uint8_t {
  hopper,         ///< tensor-core kernel for turboquant_4bit_nc, D = 128, on sm_90
  cuda_generic,   ///< CUDA kernel for every preset and supported shape
  cpu_reference,  ///< host memory, no GPU (slow; tests and tools)
};

const char* decode_path_name(DecodePath path);

/// What a request for a path means: `automatic` picks the fastest that applies.
enum class PathRequest : std::uint8_t { automatic, hopper, cuda_generic, cpu_reference };

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
};

/// True when a CUDA device is present and this build has CUDA.
bool cuda_available();

/// True when the fast Hopper kernel can run on the current device.
bool is_available();

/// Buffer pool (LAUNCHER.md "Workspace / buffer pool"): per shape signature
/// one device allocation sized for `max_batch` rows, of which a call with
/// batch B uses the first rows, so pointers are the same for every B and
/// across capture and replay. Thread-safe (one mutex around the map; the
/// returned buffers of a signature must not be used by two streams at once:
/// give each concurrent stream its own workspace).
class DecodeWorkspace {
 public:
  /// max_batch 0 means: the TQDECODE_MAX_BATCH environment variable, else 512.
  explicit DecodeWorkspace(int max_batch = 0);
  ~DecodeWorkspace();
  DecodeWorkspace(const DecodeWorkspace&) = delete;
  DecodeWorkspace& operator=(const DecodeWorkspace&) = delete;

  int max_batch() const;

  struct Entry {
    std::string signature;  ///< "Hk=8 Hq=64 D=128 dtype=bfloat16 device=0"
    int bucket_batch;       ///< rows allocated for
    int partition_rows;     ///< rows of partition buffers (max over batch of B * N)
    std::int64_t bytes;
  };
  struct Stats {
    std::vector<Entry> entries;
    std::int64_t total_bytes = 0;
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
/// args.output is null the pooled output buffer is written and returned.
/// Asynchronous on `stream` for CUDA paths; throws Error (nothing written)
/// for invalid arguments.
void* decode(const DecodeArgs& args, DecodeWorkspace& workspace, CUstream_st* stream = nullptr,
             PathRequest request = PathRequest::automatic);

}  // namespace tqdecode
