#include "bench_self_check.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "bench_inputs.hpp"
#include "bench_shapes.hpp"
#include "tqdecode/constants.hpp"
#include "tqdecode/reference.hpp"

namespace tqbench {

namespace {

using tqdecode::Preset;

constexpr std::uint64_t kSeed = 0x5e1fc4ecULL;
constexpr double kLazyRescaleLog2 = 4.0;  // the Hopper kernel's threshold (tensor_core/shape.cuh)

Shape check_shape(const char* name, Preset preset, int batch, int context, int q_heads, int kv_heads, int head_dim,
                  int block_size, Lengths lengths, int max_model_len, Scores scores) {
  Shape shape;
  shape.name = name;
  shape.preset = preset;
  shape.batch = batch;
  shape.context = context;
  shape.num_q_heads = q_heads;
  shape.num_kv_heads = kv_heads;
  shape.head_dim = head_dim;
  shape.block_size = block_size;
  shape.lengths = lengths;
  shape.max_model_len = max_model_len;
  shape.scores = scores;
  return shape;
}

/// One instance of `shape` in host memory, filled as the device fills it.
struct HostInstance {
  InstancePlan plan;
  std::vector<std::uint8_t> cache;
  std::vector<std::int32_t> table;
  std::vector<std::uint16_t> query;
  std::vector<std::uint16_t> output;
  tqdecode::ModelConstants constants;
  tqdecode::DecodeArgs args;

  explicit HostInstance(const Shape& shape)
      : plan(plan_instances(shape)),
        cache(static_cast<std::size_t>(plan.blocks * plan.layout.block_stride)),
        table(block_tables(plan, shape.batch, 1, kSeed)),
        query(static_cast<std::size_t>(plan.query_elements)),
        output(query.size()),
        constants(tqdecode::make_model_constants(shape.preset, shape.head_dim, kSeed + 1)) {
    for (std::int64_t word = 0; word < static_cast<std::int64_t>(cache.size()) / 16; ++word) {
      cache_code_word(word, plan.layout, kSeed + 2, cache.data() + 16 * word);
    }
    for (std::int64_t i = 0; i < plan.blocks * metadata_fields_per_block(plan.layout); ++i) {
      const HalfAt field = metadata_field(i, plan.layout, kSeed + 3);
      cache[field.offset] = static_cast<std::uint8_t>(field.bits & 0xff);
      cache[field.offset + 1] = static_cast<std::uint8_t>(field.bits >> 8);
    }
    for (std::size_t i = 0; i < query.size(); ++i) query[i] = query_element(kSeed + 4, static_cast<std::int64_t>(i));
    args.query = query.data();
    args.batch = shape.batch;
    args.num_q_heads = shape.num_q_heads;
    args.layout = plan.layout;
    args.num_blocks = plan.blocks;
    args.cache = cache.data();
    args.block_table = table.data();
    args.max_blocks_per_seq = plan.table_width;
    args.seq_lens = plan.lengths.data();
    args.centroids = constants.centroids.empty() ? nullptr : constants.centroids.data();
    args.num_centroids = static_cast<int>(constants.centroids.size());
    args.PiT = constants.PiT.empty() ? nullptr : constants.PiT.data();
    args.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
    args.output = output.data();
    if (shape.scores == Scores::peaked) {
      const PeakInputs inputs{plan.layout, cache.data(), table.data(), plan.table_width, plan.lengths.data(), query.data(),
                              shape.num_q_heads, args.PiT, args.centroids, args.num_centroids, args.scale, kSeed + 5};
      for (int b = 0; b < shape.batch; ++b) {
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          for (int p = 0; p < kPeaksPerSequence; ++p) plant_peak(inputs, b, h, p);
        }
      }
    }
  }
};

/// scale * q_rot . khat of one token, read from the cache bytes as docs/FORMAT.md lays them out.
double token_score(const tqdecode::DecodeArgs& args, const float* q_rot, int sequence, int kv_head, int token) {
  const tqdecode::CacheLayout& layout = args.layout;
  const std::uint8_t* block =
      args.cache + layout.block_offset(args.block_table[std::int64_t(sequence) * args.max_blocks_per_seq + token / layout.block_size]);
  const int slot = token % layout.block_size;
  const std::uint8_t* key = block + layout.record_offset(slot, kv_head);
  double dot = 0.0;
  if (layout.key_fp8()) {
    for (int d = 0; d < layout.head_dim; ++d) dot += double(q_rot[d]) * tqdecode::fp8_e4m3_bits_to_float(key[d]);
    return args.scale * dot;
  }
  for (int d = 0; d < layout.head_dim; ++d) dot += double(q_rot[d]) * args.centroids[tqdecode::unpack_code(key, d, layout.info().key_bits)];
  const std::uint8_t* norm = block + layout.field_offset(slot, kv_head, layout.key_norm_field());
  return args.scale * dot * tqdecode::half_bits_to_float(static_cast<std::uint16_t>(norm[0] | (norm[1] << 8)));
}

/// Checks one shape; prints its statistics; returns the number of failures.
int check(const Shape& shape) {
  int failures = 0;
  const auto fail = [&](const std::string& what) {
    std::printf("  FAILED %s: %s\n", shape.name.c_str(), what.c_str());
    ++failures;
  };
  HostInstance instance(shape);
  const InstancePlan& plan = instance.plan;
  const tqdecode::DecodeArgs& args = instance.args;

  if (sequence_lengths(shape) != plan.lengths) fail("sequence_lengths is not a pure function of the shape");
  for (const std::int32_t length : plan.lengths) {
    const int low = shape.lengths == Lengths::ragged ? shape.context / 4 : shape.context;
    const int high = shape.lengths == Lengths::ragged ? shape.context / 4 + 3 * shape.context / 2 : shape.context;
    if (length < low || length > high) fail("length " + std::to_string(length) + " outside [" + std::to_string(low) + ", " + std::to_string(high) + "]");
  }
  const int table_tokens = shape.max_model_len > 0 ? shape.max_model_len : plan.max_len;
  if (plan.table_width != (table_tokens + shape.block_size - 1) / shape.block_size) fail("table width");
  try {
    tqdecode::validate_decode_host_contents(args);
  } catch (const std::exception& error) {
    fail(std::string("validate_decode_host_contents: ") + error.what());
    return failures;
  }

  std::vector<float> q_rot(static_cast<std::size_t>(plan.query_elements));
  tqdecode::rotate_queries_reference(args, q_rot.data());
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int dim = shape.head_dim;
  const double tolerance = 0.01;
  double bulk_max = -std::numeric_limits<double>::infinity(), bulk_sum = 0, bulk_sq = 0, others_max = 0, planted_mass = 0;
  std::int64_t bulk_count = 0, rows = 0, moves = 0, planted = 0;
  for (int b = 0; b < shape.batch; ++b) {
    const int length = plan.lengths[b];
    for (int h = 0; h < shape.num_kv_heads; ++h) {
      std::vector<int> peaks;
      if (shape.scores == Scores::peaked) {
        for (int p = 0; p < peak_count(length); ++p) peaks.push_back(peak_position(length, p, b, h, kSeed + 5));
      }
      for (std::size_t p = 1; p < peaks.size(); ++p) {
        if (peaks[p] <= peaks[p - 1]) fail("planted positions do not rise");
      }
      const float* first_head = q_rot.data() + (std::int64_t(b) * shape.num_q_heads + h * group) * dim;
      std::vector<double> scores(static_cast<std::size_t>(length));
      for (int t = 0; t < length; ++t) scores[t] = token_score(args, first_head, b, h, t);
      for (std::size_t p = 0; p < peaks.size(); ++p) {
        const double target = peak_score(static_cast<int>(p));
        const double got = scores[peaks[p]];
        ++planted;
        if (std::fabs(got - target) > tolerance * target) {
          fail("sequence " + std::to_string(b) + " head " + std::to_string(h) + " planted token " + std::to_string(p) + " scores " +
               std::to_string(got) + ", target " + std::to_string(target));
        }
        for (int g = 1; g < group; ++g) {
          const float* other = q_rot.data() + (std::int64_t(b) * shape.num_q_heads + h * group + g) * dim;
          others_max = std::max(others_max, std::fabs(token_score(args, other, b, h, peaks[p])));
        }
      }
      // Statistics of the first head's row: the bulk, the planted share of
      // the softmax, and how often a sequential scan moves a lazy reference.
      const double top = *std::max_element(scores.begin(), scores.end());
      double total = 0, on_peaks = 0, reference = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < length; ++t) {
        const double weight = std::exp(scores[t] - top);
        total += weight;
        const bool is_peak = std::find(peaks.begin(), peaks.end(), t) != peaks.end();
        if (is_peak) {
          on_peaks += weight;
        } else {
          bulk_max = std::max(bulk_max, scores[t]);
          bulk_sum += scores[t];
          bulk_sq += scores[t] * scores[t];
          ++bulk_count;
        }
        const double log2_score = scores[t] * 1.4426950408889634;
        if (t == 0) {
          reference = log2_score;
        } else if (log2_score > reference + kLazyRescaleLog2) {
          reference = log2_score;
          ++moves;
        }
      }
      planted_mass += on_peaks / total;
      ++rows;
    }
  }
  std::vector<float> out(static_cast<std::size_t>(plan.query_elements));
  tqdecode::decode_reference(args, out.data());
  const auto nonfinite = std::count_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); });
  if (nonfinite != 0) fail(std::to_string(nonfinite) + " non-finite reference outputs");

  char bulk[96] = "bulk scores: none (every token planted)";
  if (bulk_count > 0) {
    const double mean = bulk_sum / bulk_count;
    std::snprintf(bulk, sizeof bulk, "bulk scores mean %+.2f sd %.2f max %.2f", mean,
                  std::sqrt(std::max(0.0, bulk_sq / bulk_count - mean * mean)), bulk_max);
  }
  std::printf("%-34s %-18s tokens %6lld width %5d | %s | planted %3lld, %.3f of the softmax, other heads |s| <= %.1f | "
              "lazy moves per row %.2f | %s\n",
              shape.name.c_str(), tqdecode::preset_info(shape.preset).name, static_cast<long long>(plan.tokens), plan.table_width,
              bulk, static_cast<long long>(planted), planted_mass / rows, others_max, double(moves) / rows,
              failures ? "FAILED" : "ok");
  return failures;
}

}  // namespace

int run_self_check() {
  const Shape shapes[] = {
      check_shape("4bit_nc d128 g4 ragged mml peaked", Preset::turboquant_4bit_nc, 3, 300, 8, 2, 128, 16, Lengths::ragged, 1024, Scores::peaked),
      check_shape("4bit_nc d128 g4 ragged flat", Preset::turboquant_4bit_nc, 3, 300, 8, 2, 128, 16, Lengths::ragged, 0, Scores::flat),
      check_shape("k3v4_nc d128 g8 bs32 ragged peaked", Preset::turboquant_k3v4_nc, 2, 200, 16, 2, 128, 32, Lengths::ragged, 0, Scores::peaked),
      check_shape("3bit_nc d256 g4 uniform peaked", Preset::turboquant_3bit_nc, 2, 150, 4, 1, 256, 16, Lengths::uniform, 0, Scores::peaked),
      check_shape("k8v4 d128 g4 ragged peaked", Preset::turboquant_k8v4, 2, 200, 8, 2, 128, 16, Lengths::ragged, 512, Scores::peaked),
      check_shape("k8v4 d128 g4 uniform flat", Preset::turboquant_k8v4, 2, 200, 8, 2, 128, 16, Lengths::uniform, 0, Scores::flat),
      check_shape("4bit_nc d64 g3 bs128 short peaked", Preset::turboquant_4bit_nc, 2, 5, 6, 2, 64, 128, Lengths::uniform, 0, Scores::peaked),
      check_shape("4bit_nc d256 g6 long peaked", Preset::turboquant_4bit_nc, 1, 4096, 12, 2, 256, 16, Lengths::uniform, 0, Scores::peaked),
  };
  std::printf("tqdecode_bench --self-check: input generators against the CPU reference (scores in natural-log units; "
              "planted targets %.0f, %.0f, ..., %.0f)\n",
              double(peak_score(0)), double(peak_score(1)), double(peak_score(kPeaksPerSequence - 1)));
  int failures = 0;
  for (const Shape& shape : shapes) {
    try {
      failures += check(shape);
    } catch (const std::exception& error) {
      std::printf("  FAILED %s: %s\n", shape.name.c_str(), error.what());
      ++failures;
    }
  }
  std::printf("self-check: %s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}

}  // namespace tqbench
