// Built-in synthetic data that looks like real attention inputs: keys with a
// few large-magnitude outlier channels and non-zero per-channel means, values
// with non-zero means, queries aligned with the key outliers so softmax is
// not flat. The scenarios (the demo and the tests) are built from it.
#pragma once

#include <cstdint>
#include <vector>

namespace tqdecode {

struct SyntheticShape {
  int num_kv_heads;
  int num_q_heads;
  int head_dim;
};

/// Keys [tokens, Hk, D] fp32.
std::vector<float> synthetic_keys(std::int64_t tokens, const SyntheticShape& shape, std::uint64_t seed);
/// Values [tokens, Hk, D] fp32.
std::vector<float> synthetic_values(std::int64_t tokens, const SyntheticShape& shape, std::uint64_t seed);
/// Queries [batch, Hq, D] fp32 (already representable in bf16).
std::vector<float> synthetic_queries(int batch, const SyntheticShape& shape, std::uint64_t seed);

}  // namespace tqdecode
