#include "support/scenario.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>

#include "random.hpp"
#include "support/synthetic.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"
#include "tqdecode/reference.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode {

namespace {

// The query a caller holds: `values` times the configured amplitude, rounded
// to the query dtype, and its raw elements.
void set_query(Scenario& s, std::vector<float> values) {
  for (float& value : values) value *= s.config.query_amplitude;
  const std::vector<std::uint8_t> data = round_through_dtype(values, s.config.query_dtype);
  s.query = std::move(values);
  s.query_bits.resize(s.query.size());  // 2-byte elements: bf16 or fp16
  if (!data.empty()) std::memcpy(s.query_bits.data(), data.data(), data.size());
}

// Sinks near each head's typical largest score, so they take a visible
// share of the softmax (a sink far below the scores would test nothing).
std::vector<float> comparable_sinks(const Scenario& s, Rng& rng) {
  const int D = s.config.head_dim;
  const int Hq = s.config.num_q_heads;
  const int group = Hq / s.config.num_kv_heads;
  std::vector<float> sinks(Hq);
  for (int hq = 0; hq < Hq; ++hq) {
    double total = 0.0;
    int sequences = 0;
    for (int b = 0; b < s.batch(); ++b) {
      if (s.seq_lens[b] == 0) continue;
      const float* q = s.query.data() + (std::size_t(b) * Hq + hq) * D;
      double max_score = -std::numeric_limits<double>::infinity();
      for (std::int64_t t = s.token_offsets[b]; t < s.token_offsets[b + 1]; ++t) {
        const float* k = s.keys.data() + (t * s.config.num_kv_heads + hq / group) * D;
        double dot = 0.0;
        for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
        max_score = std::max(max_score, s.scale * dot);
      }
      total += max_score;
      ++sequences;
    }
    sinks[hq] = static_cast<float>((sequences ? total / sequences : 0.0) + rng.normal());
  }
  return sinks;
}

// Physical blocks in random order, spare ones left junk; block-table entries
// past a sequence's end are -1 or out of range; slots sequence-major.
void place_blocks(Scenario& s, Rng& rng) {
  const ScenarioConfig& config = s.config;
  const int bs = config.block_size;
  const int batch = static_cast<int>(config.seq_lens.size());
  std::vector<int> blocks_used(batch);
  int max_used = 0;
  for (int i = 0; i < batch; ++i) {
    if (config.seq_lens[i] < 0) fail("seq_lens[" + std::to_string(i) + "]", "negative length");
    blocks_used[i] = (config.seq_lens[i] + bs - 1) / bs;
    max_used = std::max(max_used, blocks_used[i]);
  }
  s.num_blocks = std::max<std::int64_t>(1, std::accumulate(blocks_used.begin(), blocks_used.end(), std::int64_t(0)) +
                                               config.spare_blocks);
  std::vector<std::int32_t> physical(s.num_blocks);
  std::iota(physical.begin(), physical.end(), 0);
  for (std::size_t i = physical.size(); i > 1; --i) std::swap(physical[i - 1], physical[rng.below(i)]);

  s.max_blocks_per_seq = std::max(1, max_used + config.spare_table_columns);
  s.block_table.resize(std::size_t(batch) * s.max_blocks_per_seq);
  std::size_t next_block = 0;
  for (int i = 0; i < batch; ++i) {
    for (int j = 0; j < s.max_blocks_per_seq; ++j) {
      const std::int32_t junk = rng.below(2) ? -1 : static_cast<std::int32_t>(s.num_blocks + rng.below(1 << 20));
      s.block_table[std::size_t(i) * s.max_blocks_per_seq + j] = j < blocks_used[i] ? physical[next_block++] : junk;
    }
  }

  s.seq_lens.assign(config.seq_lens.begin(), config.seq_lens.end());
  s.token_offsets.assign(batch + 1, 0);
  for (int i = 0; i < batch; ++i) s.token_offsets[i + 1] = s.token_offsets[i] + config.seq_lens[i];
  s.slot_mapping.reserve(s.token_offsets[batch]);
  for (int i = 0; i < batch; ++i) {
    for (int t = 0; t < config.seq_lens[i]; ++t) {
      const std::int64_t block = s.block_table[std::size_t(i) * s.max_blocks_per_seq + t / bs];
      s.slot_mapping.push_back(block * bs + t % bs);
    }
  }
}

// The varlen form: query_start_loc from config.query_lens and a query of
// that many rows (the sinks, set from one query per sequence, stay comparable).
void set_query_tokens(Scenario& s) {
  const ScenarioConfig& config = s.config;
  TQ_REQUIRE(config.query_lens.size() == config.seq_lens.size(), "query_lens", "needs one length per sequence");
  s.query_start_loc.assign(1, 0);
  int longest = 1;
  for (std::size_t b = 0; b < config.query_lens.size(); ++b) {
    TQ_REQUIRE(config.query_lens[b] >= 0 && config.query_lens[b] <= config.seq_lens[b], "query_lens",
               "a length is negative or over its seq_len");
    s.query_start_loc.push_back(s.query_start_loc.back() + config.query_lens[b]);
    longest = std::max(longest, config.query_lens[b]);
  }
  s.max_query_len = config.max_query_len > 0 ? config.max_query_len : longest;
  const SyntheticShape shape{config.num_kv_heads, config.num_q_heads, config.head_dim};
  set_query(s, synthetic_queries(s.query_start_loc.back(), shape, config.seed ^ 0x746f6b656e73ull));
}

}  // namespace

std::vector<std::uint8_t> round_through_dtype(std::vector<float>& values, DType dtype) {
  std::vector<std::uint8_t> data(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    store_from_float(data.data(), dtype, std::int64_t(i), values[i]);
    values[i] = load_as_float(data.data(), dtype, std::int64_t(i));
  }
  return data;
}

CacheLayout scenario_layout(const ScenarioConfig& config) {
  if (config.order == CacheOrder::blocks) {
    CacheLayout layout = make_layout(config.preset, config.head_dim, config.block_size, config.num_kv_heads);
    layout.block_stride += config.block_stride_padding;
    return layout;
  }
  const CacheLayout dense = make_token_slots_layout(config.preset, config.head_dim, config.block_size,
                                                    config.num_kv_heads, config.renormalize_keys);
  const std::int64_t pitch = dense.slot_bytes() + config.slot_padding;
  const std::int64_t inner = pitch * (config.heads_major ? config.block_size : config.num_kv_heads);
  return make_token_slots_layout(config.preset, config.head_dim, config.block_size, config.num_kv_heads,
                                 inner * (config.heads_major ? config.num_kv_heads : config.block_size) +
                                     config.block_stride_padding,
                                 config.heads_major ? pitch : inner, config.heads_major ? inner : pitch,
                                 config.renormalize_keys);
}

Scenario make_scenario(const ScenarioConfig& config) {
  Scenario s;
  s.config = config;
  const int D = config.head_dim;
  const int Hk = config.num_kv_heads;
  const int batch = static_cast<int>(config.seq_lens.size());
  validate_group_size(config.num_q_heads, Hk);
  TQ_REQUIRE(config.query_dtype == DType::bf16 || config.query_dtype == DType::f16, "query_dtype",
          std::string(dtype_name(config.query_dtype)) + " is not supported; accepted: bfloat16, float16");
  s.layout = scenario_layout(config);
  s.constants = make_model_constants(config.preset, D, config.seed, config.rotation);
  if (config.identity_rotation && !s.constants.Pi.empty()) {
    s.constants.Pi.assign(std::size_t(D) * D, 0.0f);
    for (int i = 0; i < D; ++i) s.constants.Pi[std::size_t(i) * D + i] = 1.0f;
    s.constants.PiT = s.constants.Pi;
  }
  s.scale = 1.0f / std::sqrt(static_cast<float>(D));
  Rng rng(config.seed ^ 0x7363656e6172696full);
  place_blocks(s, rng);

  const std::int64_t total = s.total_tokens();
  const SyntheticShape shape{Hk, config.num_q_heads, D};
  s.keys = synthetic_keys(total, shape, config.seed);
  s.values = synthetic_values(total, shape, config.seed);
  for (float& value : s.values) value *= config.value_amplitude;
  set_query(s, synthetic_queries(batch, shape, config.seed));  // same seed as the keys: shared outlier channels
  const std::vector<std::uint8_t> key_data = round_through_dtype(s.keys, config.kv_dtype);
  const std::vector<std::uint8_t> value_data = round_through_dtype(s.values, config.kv_dtype);
  if (config.sinks) s.sinks = comparable_sinks(s, rng);
  if (!config.query_lens.empty()) set_query_tokens(s);

  s.cache = random_bytes(std::size_t(s.num_blocks * s.layout.block_stride), config.seed ^ 0x6a756e6bull);
  store_cpu(s.store_args(s.cache.data(), key_data.data(), value_data.data(), config.kv_dtype));
  if (!config.keep_unquantized) {
    s.keys = {};
    s.values = {};
  }
  return s;
}

DecodeArgs Scenario::host_args(void* output) const {
  DecodeArgs args;
  args.query = query_bits.data();
  args.query_dtype = config.query_dtype;
  args.batch = batch();
  args.num_q_heads = config.num_q_heads;
  args.layout = layout;
  args.num_blocks = num_blocks;
  args.cache = cache.data();
  args.block_table = block_table.data();
  args.max_blocks_per_seq = max_blocks_per_seq;
  args.seq_lens = seq_lens.data();
  args.centroids = constants.centroids.empty() ? nullptr : constants.centroids.data();
  args.num_centroids = static_cast<int>(constants.centroids.size());
  args.PiT = constants.PiT.empty() ? nullptr : constants.PiT.data();
  args.scale = scale;
  args.sinks = sinks.empty() ? nullptr : sinks.data();
  args.output = output;
  if (varlen()) {
    args.query_start_loc = query_start_loc.data();
    args.num_tokens = query_rows();
    args.max_query_len = max_query_len;
  }
  return args;
}

StoreArgs Scenario::store_args(std::uint8_t* cache_bytes, const void* key, const void* value, DType kv_dtype) const {
  return {.layout = layout,
          .num_blocks = num_blocks,
          .cache = cache_bytes,
          .key = key,
          .value = value,
          .kv_dtype = kv_dtype,
          .num_tokens = total_tokens(),
          .slot_mapping = slot_mapping.data(),
          .Pi = constants.Pi.empty() ? nullptr : constants.Pi.data(),
          .centroids = constants.centroids.empty() ? nullptr : constants.centroids.data(),
          .num_centroids = static_cast<int>(constants.centroids.size())};
}

std::vector<float> Scenario::reference_output() const {
  std::vector<float> out(query.size(), std::numeric_limits<float>::quiet_NaN());  // an unwritten element shows
  decode_reference(host_args(nullptr), out.data());
  return out;
}

std::vector<float> Scenario::exact_output() const {
  TQ_REQUIRE(!keys.empty() || total_tokens() == 0, "scenario", "built with keep_unquantized = false");
  std::vector<float> out(query.size());
  const float* sink_data = sinks.empty() ? nullptr : sinks.data();
  if (!varlen()) {
    exact_attention(query.data(), keys.data(), values.data(), token_offsets.data(), batch(), config.num_q_heads,
                    config.num_kv_heads, config.head_dim, scale, sink_data, out.data());
    return out;
  }
  // Token j of a sequence's q new tokens: one sequence of the first
  // seq_len - q + j + 1 positions.
  const std::size_t row = std::size_t(config.num_q_heads) * config.head_dim;
  for (int b = 0; b < batch(); ++b) {
    const int query_len = query_start_loc[b + 1] - query_start_loc[b];
    for (int j = 0; j < query_len; ++j) {
      const std::int64_t prefix[2] = {token_offsets[b], token_offsets[b] + seq_lens[b] - query_len + j + 1};
      const std::size_t at = (query_start_loc[b] + j) * row;
      exact_attention(query.data() + at, keys.data(), values.data(), prefix, 1, config.num_q_heads,
                      config.num_kv_heads, config.head_dim, scale, sink_data, out.data() + at);
    }
  }
  return out;
}

DequantizedKv dequantize(const Scenario& scenario) {
  const CacheLayout& layout = scenario.layout;
  const PresetInfo info = layout.info();
  const int D = layout.head_dim;
  const int Hk = layout.num_kv_heads;
  const int bs = layout.block_size;
  const std::size_t elements = std::size_t(scenario.total_tokens()) * Hk * D;
  DequantizedKv kv{std::vector<float>(elements), std::vector<float>(elements)};
  std::vector<float> rotated(D);
  for (int i = 0; i < scenario.batch(); ++i) {
    for (int t = 0; t < scenario.seq_lens[i]; ++t) {
      const std::int64_t block = scenario.block_table[std::size_t(i) * scenario.max_blocks_per_seq + t / bs];
      const std::uint8_t* base = scenario.cache.data() + layout.block_offset(block);
      const int slot = t % bs;
      for (int h = 0; h < Hk; ++h) {
        const std::int64_t row = ((scenario.token_offsets[i] + t) * Hk + h) * D;
        const std::uint8_t* key = base + layout.key_offset(slot, h);
        auto field = [&](int f) { return half_bits_to_float(read_field_bits(base, layout, slot, h, f)); };
        if (info.key_fp8) {
          for (int d = 0; d < D; ++d) kv.keys[row + d] = fp8_e4m3_bits_to_float(key[d]);
        } else {
          double centroid_square = 0.0;
          for (int j = 0; j < D; ++j) {
            rotated[j] = scenario.constants.centroids[unpack_code(key, j, info.key_bits)];
            centroid_square += double(rotated[j]) * rotated[j];
          }
          // A token_slots cache that renormalizes keys stores ||k||; khat = ||k|| c / ||c||.
          double norm = field(layout.key_norm_field());
          if (layout.token_slots() && layout.renormalize_keys) {
            norm = centroid_square == 0.0 ? 0.0 : norm / std::sqrt(centroid_square);
          }
          for (int j = 0; j < D; ++j) rotated[j] = static_cast<float>(norm * rotated[j]);
          for (int d = 0; d < D; ++d) {  // k = Pi^T khat
            double sum = 0.0;
            for (int j = 0; j < D; ++j) sum += double(scenario.constants.Pi[std::size_t(j) * D + d]) * rotated[j];
            kv.keys[row + d] = static_cast<float>(sum);
          }
        }
        const float scale = field(layout.value_scale_field());
        const float zero = field(layout.value_zero_field());
        for (int d = 0; d < D; ++d) {
          kv.values[row + d] = unpack_code(base + layout.value_offset(slot, h), d, info.value_bits) * scale + zero;
        }
      }
    }
  }
  return kv;
}

std::uint16_t read_field_bits(const std::uint8_t* block, const CacheLayout& layout, int slot, int head, int field) {
  const std::uint8_t* at = block + layout.field_offset(slot, head, field);
  return static_cast<std::uint16_t>(at[0] | at[1] << 8);
}

void write_field_bits(std::uint8_t* block, const CacheLayout& layout, int slot, int head, int field,
                      std::uint16_t bits) {
  std::uint8_t* at = block + layout.field_offset(slot, head, field);
  at[0] = static_cast<std::uint8_t>(bits & 0xffu);
  at[1] = static_cast<std::uint8_t>(bits >> 8);
}

std::vector<std::uint8_t> random_bytes(std::size_t count, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::uint8_t> bytes(count);
  for (std::size_t i = 0; i < count; i += 8) {
    const std::uint64_t word = rng.next_u64();
    for (std::size_t j = 0; j < 8 && i + j < count; ++j) bytes[i + j] = static_cast<std::uint8_t>(word >> (8 * j));
  }
  return bytes;
}

double cosine_similarity(const std::vector<float>& a, const std::vector<float>& b) {
  double dot = 0.0, aa = 0.0, bb = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    dot += double(a[i]) * b[i];
    aa += double(a[i]) * a[i];
    bb += double(b[i]) * b[i];
  }
  if (aa == 0.0 && bb == 0.0) return 1.0;
  return dot / std::sqrt(aa * bb);
}

double relative_l2(const std::vector<float>& actual, const std::vector<float>& expected) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    diff += (double(actual[i]) - expected[i]) * (double(actual[i]) - expected[i]);
    norm += double(expected[i]) * expected[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(diff / norm);
}

namespace {

struct Peaks {
  double max_abs_diff = 0.0;
  double max_abs_expected = 0.0;
};

Peaks peaks(const std::vector<float>& actual, const std::vector<float>& expected) {
  Peaks p;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    // A NaN difference (an element unwritten into a NaN-filled output, or a NaN result) stays the maximum.
    const double diff = std::abs(double(actual[i]) - expected[i]);
    p.max_abs_diff = std::isnan(diff) ? diff : std::max(p.max_abs_diff, diff);
    p.max_abs_expected = std::max(p.max_abs_expected, std::abs(double(expected[i])));
  }
  return p;
}

}  // namespace

double peak_relative_error(const std::vector<float>& actual, const std::vector<float>& expected, double floor) {
  const Peaks p = peaks(actual, expected);
  return p.max_abs_diff / std::max(p.max_abs_expected, floor);
}

ErrorStats compare_outputs(const std::vector<float>& actual, const std::vector<float>& expected) {
  TQ_REQUIRE(actual.size() == expected.size(), "actual",
          "size " + std::to_string(actual.size()) + " differs from expected size " + std::to_string(expected.size()));
  const Peaks p = peaks(actual, expected);
  return {cosine_similarity(actual, expected), relative_l2(actual, expected), p.max_abs_diff,
          p.max_abs_diff / std::max(p.max_abs_expected, 1e-6)};
}

}  // namespace tqdecode
