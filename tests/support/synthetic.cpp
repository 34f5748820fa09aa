#include "support/synthetic.hpp"

#include "random.hpp"
#include "tqdecode/numeric.hpp"

namespace tqdecode {

namespace {

// Channel statistics shared by keys and queries of one kv head: the same
// seed gives the same outlier channels, as in a real layer.
struct ChannelProfile {
  std::vector<float> mean;   // [Hk, D]
  std::vector<float> gain;   // [Hk, D]
};

ChannelProfile key_profile(const SyntheticShape& shape, std::uint64_t seed) {
  Rng rng(seed ^ 0x6b65795f70726f66ull);
  const int D = shape.head_dim;
  ChannelProfile profile{std::vector<float>(std::size_t(shape.num_kv_heads) * D),
                         std::vector<float>(std::size_t(shape.num_kv_heads) * D)};
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    for (int d = 0; d < D; ++d) {
      profile.mean[std::size_t(h) * D + d] = static_cast<float>(0.5 * rng.normal());
      profile.gain[std::size_t(h) * D + d] = static_cast<float>(0.5 + rng.uniform());
    }
    // Four outlier channels per head, 8 to 16 times the typical magnitude.
    for (int k = 0; k < 4; ++k) {
      const int d = static_cast<int>(rng.below(D));
      profile.gain[std::size_t(h) * D + d] = static_cast<float>(8.0 + 8.0 * rng.uniform());
      profile.mean[std::size_t(h) * D + d] = static_cast<float>(6.0 * rng.normal());
    }
  }
  return profile;
}

}  // namespace

std::vector<float> synthetic_keys(std::int64_t tokens, const SyntheticShape& shape, std::uint64_t seed) {
  const ChannelProfile profile = key_profile(shape, seed);
  const std::size_t row = std::size_t(shape.num_kv_heads) * shape.head_dim;
  std::vector<float> keys(std::size_t(tokens) * row);
  Rng rng(seed ^ 0x6b657973ull);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::size_t i = 0; i < row; ++i) {
      keys[std::size_t(t) * row + i] = round_to_bf16(profile.mean[i] + profile.gain[i] * static_cast<float>(rng.normal()));
    }
  }
  return keys;
}

std::vector<float> synthetic_values(std::int64_t tokens, const SyntheticShape& shape, std::uint64_t seed) {
  const std::size_t row = std::size_t(shape.num_kv_heads) * shape.head_dim;
  std::vector<float> channel_mean(row);
  Rng rng(seed ^ 0x76616c75ull);
  for (float& mean : channel_mean) mean = static_cast<float>(0.3 * rng.normal());
  std::vector<float> values(std::size_t(tokens) * row);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::size_t i = 0; i < row; ++i) {
      values[std::size_t(t) * row + i] = round_to_bf16(channel_mean[i] + static_cast<float>(rng.normal()));
    }
  }
  return values;
}

std::vector<float> synthetic_queries(int batch, const SyntheticShape& shape, std::uint64_t seed) {
  const ChannelProfile profile = key_profile(shape, seed);
  const int D = shape.head_dim;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  std::vector<float> queries(std::size_t(batch) * shape.num_q_heads * D);
  Rng rng(seed ^ 0x71756572ull);
  for (int b = 0; b < batch; ++b) {
    for (int hq = 0; hq < shape.num_q_heads; ++hq) {
      const std::size_t kv = std::size_t(hq / group) * D;
      for (int d = 0; d < D; ++d) {
        // Queries lean on the outlier channels (as trained queries do), which
        // makes scores spread and softmax peaked.
        const float lean = profile.gain[kv + d] > 4.0f ? 0.25f * profile.gain[kv + d] : 0.0f;
        queries[(std::size_t(b) * shape.num_q_heads + hq) * D + d] =
            round_to_bf16(lean * (rng.uniform() < 0.5 ? -1.0f : 1.0f) + static_cast<float>(rng.normal()));
      }
    }
  }
  return queries;
}

}  // namespace tqdecode
