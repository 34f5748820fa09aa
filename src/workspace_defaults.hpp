// DecodeWorkspace settings and their environment-variable defaults
// (internal), shared by the CUDA build and the CPU-only build.
#pragma once

namespace tqdecode {

/// The largest max_batch (and pool bucket) a workspace accepts.
inline constexpr int kMaxBatchLimit = 1 << 20;

/// The rows a workspace's pools are sized for (docs/LAUNCHER.md: the caller's
/// value with an environment override): the TQDECODE_MAX_BATCH environment
/// variable when set, else `requested` when positive, else 512. Throws Error
/// naming `max_batch` when `requested` is outside 0..kMaxBatchLimit, or the
/// variable when it is set to anything but an integer in 1..kMaxBatchLimit.
int resolve_max_batch(int requested);

/// A switch from the environment variable `variable`: "1" on, "0" off, empty
/// or unset `unset_value`. Throws Error naming the variable otherwise.
bool switch_from_environment(const char* variable, bool unset_value);

}  // namespace tqdecode
