#include "tqdecode/decode_args.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "tqdecode/error.hpp"
#include "workspace_defaults.hpp"

namespace tqdecode {

namespace {

void require_non_negative_stride(std::int64_t stride, const char* argument) {
  TQ_REQUIRE(stride >= 0, argument,
          std::to_string(stride) + " is negative; accepted: 0 (contiguous) or a positive element stride");
}

// A caller's output [rows, Hq, D] whose strides give two rows, heads or dims
// one element would be written racily on the GPU paths.
void require_distinct_output_elements(const DecodeArgs& args) {
  const std::int64_t D = args.layout.head_dim, head_stride = args.out_stride_h(), batch_stride = args.out_stride_b();
  const std::int64_t row[] = {args.num_q_heads, D}, row_strides[] = {head_stride, 1};
  TQ_REQUIRE(strided_elements_distinct(row, row_strides), "output_stride_head",
             std::to_string(head_stride) +
                 " makes a row's heads overlap; accepted: 0 (contiguous) or >= head_dim = " + std::to_string(D));
  const std::int64_t all[] = {args.query_rows(), args.num_q_heads, D}, all_strides[] = {batch_stride, head_stride, 1};
  TQ_REQUIRE(strided_elements_distinct(all, all_strides), "output_stride_batch",
             std::to_string(batch_stride) + " makes rows overlap (head stride " + std::to_string(head_stride) +
                 "); accepted: 0 (contiguous) or a stride past a row's heads, e.g. >= num_q_heads * head_dim");
}

void require_pointer(const void* pointer, const char* argument) {
  TQ_REQUIRE(pointer != nullptr, argument, "is null; a tensor is required when batch > 0");
}

// The varlen shapes (docs/FORMAT.md section 5b); with query_start_loc null
// the fields that only it gives meaning to must be unset, so a forgotten
// pointer is not read as a one-token step.
void validate_query_shapes(const DecodeArgs& args) {
  if (!args.varlen()) {
    TQ_REQUIRE(args.max_query_len == 0 && args.num_tokens == 0, "query_start_loc",
               "is null (one query token per sequence) but max_query_len is " + std::to_string(args.max_query_len) +
                   " and num_tokens " + std::to_string(args.num_tokens) +
                   "; accepted: a [batch + 1] int32 tensor with them, or both 0 without it");
    return;
  }
  TQ_REQUIRE(args.max_query_len >= 1 && args.max_query_len <= kMaxQueryLen, "max_query_len",
             std::to_string(args.max_query_len) + " is out of range; accepted: 1 to " + std::to_string(kMaxQueryLen));
  // Pools hold a row per query slot (sequence, token): as many as a batch may have.
  const std::int64_t slots = std::int64_t(args.batch) * args.max_query_len;
  TQ_REQUIRE(slots <= kMaxBatchLimit, "max_query_len",
             std::to_string(args.max_query_len) + " with batch " + std::to_string(args.batch) + " gives " +
                 std::to_string(slots) + " query slots; accepted: batch * max_query_len <= " +
                 std::to_string(kMaxBatchLimit));
  TQ_REQUIRE(args.num_tokens >= 0 && args.num_tokens <= slots, "num_tokens",
             std::to_string(args.num_tokens) + " is out of range; accepted: 0 to batch * max_query_len = " +
                 std::to_string(slots));
}

}  // namespace

bool strided_elements_distinct(std::span<const std::int64_t> sizes, std::span<const std::int64_t> strides) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of the dimensions of several elements
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > 1) dims.emplace_back(strides[i], sizes[i]);
  }
  std::sort(dims.begin(), dims.end());
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  std::int64_t extent = 1;
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return false;
    // An extent past int64 saturates: no stride then steps past it.
    extent = stride > (kMax - extent) / (size - 1) ? kMax : extent + stride * (size - 1);
  }
  return true;
}

void validate_decode_shapes(const DecodeArgs& args, bool output_required) {
  TQ_REQUIRE(args.batch >= 0, "batch", std::to_string(args.batch) + " is negative; accepted: >= 0");
  validate_layout(args.layout);
  validate_group_size(args.num_q_heads, args.layout.num_kv_heads);
  TQ_REQUIRE(args.query_dtype == DType::bf16 || args.query_dtype == DType::f16, "query_dtype",
          std::string(dtype_name(args.query_dtype)) + " is not supported; accepted: bfloat16, float16");
  TQ_REQUIRE(args.num_blocks >= 1, "num_blocks",
          std::to_string(args.num_blocks) + " is out of range; accepted: >= 1");
  TQ_REQUIRE(args.max_blocks_per_seq >= 1, "max_blocks_per_seq",
          std::to_string(args.max_blocks_per_seq) + " is out of range; accepted: >= 1");
  // The kernels take a sequence's positions, up to the table's coverage, as int.
  TQ_REQUIRE(std::int64_t{args.max_blocks_per_seq} * args.layout.block_size <= std::numeric_limits<int>::max(),
             "max_blocks_per_seq",
             std::to_string(args.max_blocks_per_seq) + " blocks of " + std::to_string(args.layout.block_size) +
                 " tokens pass 2^31 - 1 positions; accepted: max_blocks_per_seq * block_size < 2^31");
  require_non_negative_stride(args.query_stride_batch, "query_stride_batch");
  require_non_negative_stride(args.query_stride_head, "query_stride_head");
  require_non_negative_stride(args.block_table_stride, "block_table_stride");
  TQ_REQUIRE(
      !args.block_table_one_row || args.block_table_stride == 0, "block_table_stride",
      std::to_string(args.block_table_stride) + " with block_table_one_row; accepted: 0 (every sequence reads row 0)");
  require_non_negative_stride(args.output_stride_batch, "output_stride_batch");
  require_non_negative_stride(args.output_stride_head, "output_stride_head");
  TQ_REQUIRE(std::isfinite(args.scale), "scale",
          std::to_string(args.scale) + " is not finite; accepted: a finite softmax scale");

  const PresetInfo info = args.layout.info();
  validate_codebook_size(args.layout, args.num_centroids);
  validate_query_shapes(args);
  if (args.output != nullptr) require_distinct_output_elements(args);

  // With batch 0 the call is a no-op, so engines may pass empty tensors; so
  // may a varlen call without tokens for the query and output.
  if (args.batch == 0) return;
  if (args.query_rows() > 0) require_pointer(args.query, "query");
  require_pointer(args.cache, "cache");
  require_pointer(args.block_table, "block_table");
  require_pointer(args.seq_lens, "seq_lens");
  if (output_required && args.query_rows() > 0) require_pointer(args.output, "output");
  if (!info.key_fp8) {
    require_pointer(args.centroids, "centroids");
    require_pointer(args.PiT, "PiT");
  }
}

// Validates the shapes first, so one call covers everything a host-memory
// path (the CPU reference, decode_cpu) needs checked.
void validate_decode_host_contents(const DecodeArgs& args) {
  validate_decode_shapes(args);
  const int block_size = args.layout.block_size;
  const std::int64_t max_len = std::int64_t(args.max_blocks_per_seq) * block_size;
  for (int i = 0; i < args.batch; ++i) {
    const std::int32_t seq_len = args.seq_lens[i];
    // Messages are built only on failure: these loops run on every call.
    if (seq_len < 0 || seq_len > max_len) {
      fail("seq_lens[" + std::to_string(i) + "]",
           std::to_string(seq_len) + " is out of range; accepted: 0 to max_blocks_per_seq * block_size = " +
               std::to_string(max_len));
    }
    const std::int64_t used_blocks = (std::int64_t(seq_len) + block_size - 1) / block_size;  // no int overflow
    const std::int32_t* row = args.block_table + std::int64_t(i) * args.table_stride();
    for (std::int64_t j = 0; j < used_blocks; ++j) {
      if (row[j] < 0 || row[j] >= args.num_blocks) {
        fail("block_table[" + std::to_string(i) + "][" + std::to_string(j) + "]",
             std::to_string(row[j]) + " is out of range; accepted: 0 to num_blocks - 1 = " +
                 std::to_string(args.num_blocks - 1));
      }
    }
  }
  if (!args.varlen()) return;
  const std::int32_t* starts = args.query_start_loc;
  if (starts[0] != 0) fail("query_start_loc[0]", std::to_string(starts[0]) + " is not 0; accepted: 0");
  for (int i = 0; i < args.batch; ++i) {
    const std::int64_t query_len = std::int64_t(starts[i + 1]) - starts[i];
    if (query_len < 0) {
      fail("query_start_loc[" + std::to_string(i + 1) + "]",
           std::to_string(starts[i + 1]) + " is less than query_start_loc[" + std::to_string(i) +
               "] = " + std::to_string(starts[i]) + "; accepted: non-decreasing offsets");
    }
    if (query_len > args.max_query_len) {
      fail("max_query_len", std::to_string(args.max_query_len) + " is less than the " + std::to_string(query_len) +
                                " query tokens of sequence " + std::to_string(i) +
                                " (query_start_loc[" + std::to_string(i + 1) + "] - query_start_loc[" +
                                std::to_string(i) + "]); accepted: at least every sequence's query length");
    }
    if (query_len > args.seq_lens[i]) {
      fail("seq_lens[" + std::to_string(i) + "]",
           std::to_string(args.seq_lens[i]) + " is less than the sequence's " + std::to_string(query_len) +
               " query tokens; accepted: the context length including the new tokens (>= the query length)");
    }
  }
  if (starts[args.batch] != args.num_tokens) {
    fail("query_start_loc[" + std::to_string(args.batch) + "]",
         std::to_string(starts[args.batch]) + " does not match num_tokens (the query's rows) = " +
             std::to_string(args.num_tokens) + "; accepted: the total number of query tokens");
  }
}

}  // namespace tqdecode
