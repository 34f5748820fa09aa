// CPU reference of the decode math (docs/FORMAT.md section 5, and 4b for
// the token_slots order). Accumulates in double so it is an oracle for the
// fp32 GPU paths, and reads the cache only through CacheLayout offsets so it
// checks the byte layout too.
#include "parallel.hpp"
#include "tqdecode/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"
#include "tqdecode/partition.hpp"

namespace tqdecode {

using cpu::parallel_for;

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

float read_half(const std::uint8_t* at) {  // little-endian fp16, any alignment
  return half_bits_to_float(static_cast<std::uint16_t>(at[0] | (at[1] << 8)));
}

// Reads the cache of one (sequence, kv head): scores and values of its tokens.
class SequenceHead {
 public:
  SequenceHead(const DecodeArgs& args, int batch_index, int kv_head)
      : args_(args),
        layout_(args.layout),
        info_(args.layout.info()),
        table_row_(args.block_table + std::int64_t(batch_index) * args.table_stride()),
        head_(kv_head),
        renormalize_(args.layout.token_slots() && args.layout.renormalize_keys) {}

  /// scale * dot(q, khat_t); khat = knorm * centroids[idx] (the knorm factor is
  /// pulled out of the sum), divided by ||c_t|| = ||centroids[idx]|| when a
  /// token_slots layout renormalizes keys (a zero centroid vector gives a
  /// zero key), or the fp8 key.
  double score(const float* q, int token) const {
    const std::uint8_t* block = block_of(token);
    const int slot = token % layout_.block_size;
    const std::uint8_t* key = block + layout_.key_offset(slot, head_);
    double dot = 0.0;
    if (info_.key_fp8) {
      for (int d = 0; d < layout_.head_dim; ++d) dot += double(q[d]) * fp8_e4m3_bits_to_float(key[d]);
      return args_.scale * dot;
    }
    double centroid_square = 0.0;
    for (int d = 0; d < layout_.head_dim; ++d) {
      const double c = args_.centroids[unpack_code(key, d, info_.key_bits)];
      dot += double(q[d]) * c;
      centroid_square += c * c;
    }
    double norm = read_half(block + layout_.field_offset(slot, head_, layout_.key_norm_field()));
    if (renormalize_) {
      if (centroid_square == 0.0) return 0.0;
      norm /= std::sqrt(centroid_square);
    }
    return args_.scale * norm * dot;
  }

  /// acc += weight * vhat_t, vhat = code * vscale + vzero.
  void add_value(int token, double weight, double* acc) const {
    const std::uint8_t* block = block_of(token);
    const int slot = token % layout_.block_size;
    const std::uint8_t* codes = block + layout_.value_offset(slot, head_);
    const double scale = read_half(block + layout_.field_offset(slot, head_, layout_.value_scale_field()));
    const double zero = read_half(block + layout_.field_offset(slot, head_, layout_.value_zero_field()));
    for (int d = 0; d < layout_.head_dim; ++d) {
      acc[d] += weight * (unpack_code(codes, d, info_.value_bits) * scale + zero);
    }
  }

 private:
  const std::uint8_t* block_of(int token) const {
    return args_.cache + layout_.block_offset(table_row_[token / layout_.block_size]);
  }

  const DecodeArgs& args_;
  const CacheLayout& layout_;
  const PresetInfo info_;
  const std::int32_t* table_row_;
  int head_;
  bool renormalize_;
};

// Softmax state of one query head over a non-empty token range: `max` is the
// largest score rounded to fp32 (the value a partition stores), `sum` =
// sum_t exp(s_t - max), and acc (D entries, zeroed by the caller) =
// sum_t exp(s_t - max) vhat_t.
struct RangeState {
  double max;
  double sum;
};

RangeState attend(const SequenceHead& head, const float* q, TokenRange range, double* acc) {
  std::vector<double> scores(range.end - range.begin);
  for (int t = range.begin; t < range.end; ++t) scores[t - range.begin] = head.score(q, t);
  const double max = static_cast<float>(*std::max_element(scores.begin(), scores.end()));
  double sum = 0.0;
  for (int t = range.begin; t < range.end; ++t) {
    const double weight = std::exp(scores[t - range.begin] - max);
    sum += weight;
    head.add_value(t, weight, acc);
  }
  return {max, sum};
}

// Step 1 without validation: [query rows, Hq, D] contiguous.
void rotate_queries(const DecodeArgs& args, float* q_rot) {
  const int D = args.layout.head_dim;
  const bool rotate = !args.layout.key_fp8();
  const std::int64_t rows = std::int64_t(args.query_rows()) * args.num_q_heads;
  parallel_for(rows, [&](std::int64_t row) {
    const std::int64_t base = (row / args.num_q_heads) * args.q_stride_b() + (row % args.num_q_heads) * args.q_stride_h();
    float* out = q_rot + row * D;
    if (!rotate) {
      for (int i = 0; i < D; ++i) out[i] = load_as_float(args.query, args.query_dtype, base + i);
      return;
    }
    // q_rot[j] = sum_i q[i] * PiT[i][j], accumulated in fp32 in order of i.
    std::fill(out, out + D, 0.0f);
    for (int i = 0; i < D; ++i) {
      const float q = load_as_float(args.query, args.query_dtype, base + i);
      const float* PiT_row = args.PiT + std::int64_t(i) * D;
      for (int j = 0; j < D; ++j) out[j] += q * PiT_row[j];
    }
    for (int j = 0; j < D; ++j) out[j] = round_to_bf16(out[j]);
  });
}

std::vector<float> rotated_queries(const DecodeArgs& args) {
  std::vector<float> q_rot(std::size_t(args.query_rows()) * args.num_q_heads * args.layout.head_dim);
  rotate_queries(args, q_rot.data());
  return q_rot;
}

// What one query row attends to: positions 0 .. context - 1 of `sequence`.
struct QueryToken {
  int sequence;
  int context;
};

// Per query row: row b is sequence b with its whole length; with
// query_start_loc, token j of a sequence's q_len new tokens sits at position
// seq_len - q_len + j and sees seq_len - q_len + j + 1 positions
// (docs/FORMAT.md section 5b).
std::vector<QueryToken> query_tokens(const DecodeArgs& args) {
  std::vector<QueryToken> tokens(args.query_rows());
  for (int b = 0; b < args.batch; ++b) {
    if (!args.varlen()) {
      tokens[b] = {b, args.seq_lens[b]};
      continue;
    }
    const int first = args.query_start_loc[b];
    const int query_len = args.query_start_loc[b + 1] - first;
    for (int j = 0; j < query_len; ++j) tokens[first + j] = {b, args.seq_lens[b] - query_len + j + 1};
  }
  return tokens;
}

// The whole decode of already validated arguments: out [query rows, Hq, D] fp32.
void decode_validated(const DecodeArgs& args, float* out) {
  const std::vector<float> q_rot = rotated_queries(args);
  const std::vector<QueryToken> tokens = query_tokens(args);
  const int D = args.layout.head_dim;
  const std::int64_t rows = std::int64_t(args.query_rows()) * args.num_q_heads;
  parallel_for(rows, [&](std::int64_t row) {
    const QueryToken token = tokens[row / args.num_q_heads];
    const int hq = static_cast<int>(row % args.num_q_heads);
    float* o = out + row * D;
    // seq_len 0 gives zeros even with a sink: the output is a weighted sum
    // over no tokens; the sink only adds mass to the denominator.
    if (token.context == 0) {
      std::fill(o, o + D, 0.0f);
      return;
    }
    std::vector<double> acc(D, 0.0);
    const SequenceHead head(args, token.sequence, hq / args.group_size());
    const RangeState state = attend(head, q_rot.data() + row * D, {0, token.context}, acc.data());
    // m = max(max_t s_t, sink); rescale the state from its own max to m.
    const double m = args.sinks ? std::max(state.max, double(args.sinks[hq])) : state.max;
    const double rescale = std::exp(state.max - m);
    const double denominator = state.sum * rescale + (args.sinks ? std::exp(double(args.sinks[hq]) - m) : 0.0);
    for (int d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d] * rescale / denominator);
  });
}

// The reference steps write their own contiguous fp32 buffers, not
// args.output: validate as if args.output were that buffer, whose rows the
// caller's output strides do not describe.
DecodeArgs writing_to(const DecodeArgs& args, void* destination) {
  DecodeArgs copy = args;
  copy.output = destination;
  copy.output_stride_batch = 0;
  copy.output_stride_head = 0;
  return copy;
}

// Bounds that keep partition_range's int arithmetic (seq_len + N - 1,
// per + align - 1) from overflowing for every valid seq_len.
constexpr int kMaxPartitions = 1 << 16;
constexpr int kMaxAlign = 1 << 16;

void validate_partition_buffers(const DecodeArgs& args, int num_partitions, const PartitionBuffers& partitions) {
  TQ_REQUIRE(!args.varlen(), "query_start_loc",
             "is set; the split-KV reference steps take one query token per sequence (decode_reference and "
             "decode_cpu take several); accepted: null");
  TQ_REQUIRE(num_partitions >= 1 && num_partitions <= kMaxPartitions, "num_partitions",
          std::to_string(num_partitions) + " is out of range; accepted: 1 to " + std::to_string(kMaxPartitions));
  if (args.batch <= 0) return;  // nothing to write (a negative batch is reported by the shape checks)
  TQ_REQUIRE(partitions.max != nullptr, "partitions.max", "is null; a [B, Hq, N] buffer is required");
  TQ_REQUIRE(partitions.sum != nullptr, "partitions.sum", "is null; a [B, Hq, N] buffer is required");
  TQ_REQUIRE(partitions.out != nullptr, "partitions.out", "is null; a [B, Hq, N, D] buffer is required");
}

}  // namespace

void rotate_queries_reference(const DecodeArgs& args, float* q_rot) {
  TQ_REQUIRE(q_rot != nullptr || args.batch == 0 || args.query_rows() == 0, "q_rot",
             "is null; a [rows, Hq, D] fp32 buffer is required");
  validate_decode_shapes(writing_to(args, q_rot));
  rotate_queries(args, q_rot);
}

void decode_reference(const DecodeArgs& args, float* out) {
  validate_decode_host_contents(writing_to(args, out));
  decode_validated(args, out);
}

void decode_partitions_reference(const DecodeArgs& args, int num_partitions, int align,
                                 const PartitionBuffers& partitions) {
  validate_partition_buffers(args, num_partitions, partitions);
  validate_decode_host_contents(writing_to(args, partitions.out));
  TQ_REQUIRE(align >= 1 && align <= kMaxAlign, "align",
          std::to_string(align) + " is out of range; accepted: 1 to " + std::to_string(kMaxAlign));
  for (int b = 0; b < args.batch; ++b) {
    if (args.seq_lens[b] > std::numeric_limits<std::int32_t>::max() - kMaxPartitions - kMaxAlign) {
      fail("seq_lens[" + std::to_string(b) + "]",
           std::to_string(args.seq_lens[b]) + " is too long to partition; accepted: up to 2^31 - 2^17");
    }
  }
  const std::vector<float> q_rot = rotated_queries(args);
  const int D = args.layout.head_dim;
  const std::int64_t rows = std::int64_t(args.batch) * args.num_q_heads;
  parallel_for(rows, [&](std::int64_t row) {
    const int b = static_cast<int>(row / args.num_q_heads);
    const SequenceHead head(args, b, static_cast<int>(row % args.num_q_heads) / args.group_size());
    std::vector<double> acc(D);
    for (int p = 0; p < num_partitions; ++p) {
      const std::int64_t index = row * num_partitions + p;
      float* o = partitions.out + index * D;
      const TokenRange range = partition_range(args.seq_lens[b], num_partitions, align, p);
      if (range.begin >= range.end) {
        partitions.max[index] = -std::numeric_limits<float>::infinity();
        partitions.sum[index] = 0.0f;
        std::fill(o, o + D, 0.0f);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      const RangeState state = attend(head, q_rot.data() + row * D, range, acc.data());
      partitions.max[index] = static_cast<float>(state.max);  // exact: attend rounds max to fp32
      partitions.sum[index] = static_cast<float>(state.sum);
      for (int d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d] / state.sum);
    }
  });
}

void reduce_partitions_reference(const DecodeArgs& args, int num_partitions, const PartitionBuffers& partitions,
                                 float* out) {
  validate_partition_buffers(args, num_partitions, partitions);
  validate_decode_shapes(writing_to(args, out));
  const int D = args.layout.head_dim;
  const std::int64_t rows = std::int64_t(args.batch) * args.num_q_heads;
  parallel_for(rows, [&](std::int64_t row) {
    const int hq = static_cast<int>(row % args.num_q_heads);
    const float* max = partitions.max + row * num_partitions;
    const float* sum = partitions.sum + row * num_partitions;
    float* o = out + row * D;
    double m = args.sinks ? double(args.sinks[hq]) : kNegInf;
    bool any_tokens = false;  // an empty partition holds (-inf, 0)
    bool not_a_number = false;
    for (int p = 0; p < num_partitions; ++p) {
      any_tokens |= !(max[p] == kNegInf && sum[p] == 0.0f);
      not_a_number |= std::isnan(max[p]) || std::isnan(sum[p]);
      m = std::max(m, double(max[p]));
    }
    // No tokens: an all-zero row, sink or not (as decode_reference for seq_len 0), never 0/0.
    if (!any_tokens) {
      std::fill(o, o + D, 0.0f);
      return;
    }
    // A NaN partition (a non-finite query) makes the whole row NaN, as in
    // decode_reference; std::max above would silently drop it.
    if (not_a_number) {
      std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN());
      return;
    }
    std::vector<double> numerator(D, 0.0);
    double denominator = args.sinks ? std::exp(double(args.sinks[hq]) - m) : 0.0;
    for (int p = 0; p < num_partitions; ++p) {
      const double weight = sum[p] * std::exp(double(max[p]) - m);  // empty: 0 * exp(-inf) = 0
      if (weight == 0.0) continue;
      const float* partial = partitions.out + (row * num_partitions + p) * D;
      for (int d = 0; d < D; ++d) numerator[d] += weight * partial[d];
      denominator += weight;
    }
    for (int d = 0; d < D; ++d) o[d] = static_cast<float>(numerator[d] / denominator);
  });
}

void decode_cpu(const DecodeArgs& args) {
  validate_decode_host_contents(args);  // before anything is allocated or written
  const int D = args.layout.head_dim;
  // NaN until written: a row decode_validated left unwritten reaches the caller as NaN, not as zeros.
  std::vector<float> out(std::size_t(args.query_rows()) * args.num_q_heads * D,
                         std::numeric_limits<float>::quiet_NaN());
  decode_validated(args, out.data());
  for (int b = 0; b < args.query_rows(); ++b) {
    for (int hq = 0; hq < args.num_q_heads; ++hq) {
      const std::int64_t base = b * args.out_stride_b() + hq * args.out_stride_h();
      const float* row = out.data() + (std::int64_t(b) * args.num_q_heads + hq) * D;
      for (int d = 0; d < D; ++d) store_from_float(args.output, args.query_dtype, base + d, row[d]);
    }
  }
}

void exact_attention(const float* query, const float* keys, const float* values, const std::int64_t* token_offsets,
                     int batch, int num_q_heads, int num_kv_heads, int head_dim, float scale, const float* sinks,
                     float* out) {
  TQ_REQUIRE(batch >= 0, "batch", std::to_string(batch) + " is negative; accepted: >= 0");
  TQ_REQUIRE(head_dim >= 1, "head_dim", std::to_string(head_dim) + " is out of range; accepted: >= 1");
  validate_group_size(num_q_heads, num_kv_heads);
  if (batch == 0) return;
  TQ_REQUIRE(query != nullptr, "query", "is null; a [B, Hq, D] buffer is required when batch > 0");
  TQ_REQUIRE(token_offsets != nullptr, "token_offsets", "is null; B + 1 offsets are required when batch > 0");
  TQ_REQUIRE(out != nullptr, "out", "is null; a [B, Hq, D] buffer is required when batch > 0");
  TQ_REQUIRE(token_offsets[0] >= 0, "token_offsets[0]",
             std::to_string(token_offsets[0]) + " is negative; accepted: non-negative, non-decreasing offsets");
  for (int b = 0; b < batch; ++b) {
    if (token_offsets[b + 1] < token_offsets[b]) {
      fail("token_offsets[" + std::to_string(b + 1) + "]", std::to_string(token_offsets[b + 1]) +
                                                               " is less than token_offsets[" + std::to_string(b) +
                                                               "]; accepted: non-decreasing offsets");
    }
  }
  TQ_REQUIRE(token_offsets[batch] == 0 || (keys != nullptr && values != nullptr), keys == nullptr ? "keys" : "values",
             "is null; [token_offsets[B], Hk, D] buffers are required when there are tokens");
  const int group = num_q_heads / num_kv_heads;
  const int D = head_dim;
  const std::int64_t rows = std::int64_t(batch) * num_q_heads;
  parallel_for(rows, [&](std::int64_t row) {
    const std::int64_t b = row / num_q_heads;
    const int hq = static_cast<int>(row % num_q_heads);
    const int hk = hq / group;
    const float* q = query + row * D;
    float* o = out + row * D;
    const std::int64_t begin = token_offsets[b];
    const std::int64_t count = token_offsets[b + 1] - begin;
    if (count <= 0) {
      std::fill(o, o + D, 0.0f);
      return;
    }
    std::vector<double> scores(count);
    double m = sinks ? double(sinks[hq]) : kNegInf;
    for (std::int64_t t = 0; t < count; ++t) {
      const float* k = keys + ((begin + t) * num_kv_heads + hk) * D;
      double dot = 0.0;
      for (int d = 0; d < D; ++d) dot += double(q[d]) * k[d];
      scores[t] = scale * dot;
      m = std::max(m, scores[t]);
    }
    std::vector<double> acc(D, 0.0);
    double denominator = sinks ? std::exp(double(sinks[hq]) - m) : 0.0;
    for (std::int64_t t = 0; t < count; ++t) {
      const double weight = std::exp(scores[t] - m);
      const float* v = values + ((begin + t) * num_kv_heads + hk) * D;
      for (int d = 0; d < D; ++d) acc[d] += weight * v[d];
      denominator += weight;
    }
    for (int d = 0; d < D; ++d) o[d] = static_cast<float>(acc[d] / denominator);
  });
}

}  // namespace tqdecode
