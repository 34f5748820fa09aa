// DecodeWorkspace settings and their environment-variable defaults
// (internal), shared by the CUDA build and the CPU-only build.
#pragma once

namespace tqdecode {

/// The rows a workspace's pools are sized for: `requested` when positive;
/// for 0, the TQDECODE_MAX_BATCH environment variable, else 512. Throws
/// Error naming `max_batch` when negative, or the variable when it is set to
/// anything but an integer in 1..1048576.
int resolve_max_batch(int requested);

/// A switch from the environment variable `variable`: "1" on, "0" off, empty
/// or unset `unset_value`. Throws Error naming the variable otherwise.
bool switch_from_environment(const char* variable, bool unset_value);

}  // namespace tqdecode
