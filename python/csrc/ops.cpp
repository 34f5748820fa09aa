// The PyTorch binding of tqdecode: custom ops in the `tqdecode` namespace,
// loaded by python/tqdecode/__init__.py (torch.ops.load_library), which also
// registers their fake implementations for torch.compile.
//
// Only torch's C++ op API is used (no pybind11, no Python.h), so the library
// builds without Python headers and one build serves every Python version of
// the same torch.
//
// Errors: tqdecode::Error (a bad argument) becomes a Python ValueError and
// tqdecode::CudaError a RuntimeError; both keep the library's message, which
// names the argument ("tqdecode: block_table: ...").
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "tqdecode/constants.hpp"
#include "tqdecode/continuation.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/decode_args.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/reference.hpp"
#include "tqdecode/store.hpp"
#include "tqdecode/version.hpp"

#if defined(TQDECODE_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace tqdecode_torch {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using tqdecode::fail;

// Runs an op body, turning the library's exceptions into the c10 exceptions
// that torch maps to Python ValueError / RuntimeError.
template <class Body>
auto translating_errors(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const tqdecode::Error& error) {
    TORCH_CHECK_VALUE(false, error.what());
  } catch (const tqdecode::CudaError& error) {
    TORCH_CHECK(false, error.what());
  }
}

// ---- argument checks (each names the Python argument) ----------------------

std::string dtype_text(at::ScalarType type) { return "torch." + c10::getDtypeNames(type).first; }

// "[2, 8, 128]". Built with std::to_string, not iostreams: the binding's own
// instantiations of the stream templates crashed inside a PyTorch process
// whose libstdc++ differs from the build compiler's (seen on the H200 image).
std::string shape_text(at::IntArrayRef sizes) {
  std::string text = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

void check_dtype(const Tensor& tensor, const char* argument, at::ScalarType expected) {
  TQ_REQUIRE(tensor.scalar_type() == expected, argument,
          "dtype " + dtype_text(tensor.scalar_type()) + " is not supported; accepted: " + dtype_text(expected));
}

void check_dim(const Tensor& tensor, const char* argument, int64_t dim, const char* shape) {
  TQ_REQUIRE(tensor.dim() == dim, argument,
          "has " + std::to_string(tensor.dim()) + " dimensions; expected " + std::to_string(dim) + ": " + shape);
}

void check_size(const Tensor& tensor, const char* argument, int64_t dim, int64_t expected, const char* what) {
  TQ_REQUIRE(tensor.size(dim) == expected, argument,
          "size " + std::to_string(tensor.size(dim)) + " in dimension " + std::to_string(dim) + " does not match " +
              what + " = " + std::to_string(expected));
}

void check_device(const Tensor& tensor, const char* argument, const at::Device& device) {
  TQ_REQUIRE(tensor.device() == device, argument,
          "is on " + tensor.device().str() + "; every tensor of the call must be on " + device.str());
}

void check_contiguous(const Tensor& tensor, const char* argument) {
  TQ_REQUIRE(tensor.is_contiguous(), argument, "must be contiguous");
}

// A Python int the library takes as an int: refused outside int's range, not truncated into it.
int int_argument(int64_t value, const char* argument) {
  TQ_REQUIRE(value >= std::numeric_limits<int>::min() && value <= std::numeric_limits<int>::max(), argument,
             std::to_string(value) + " is outside the range of a 32-bit int");
  return static_cast<int>(value);
}

// Whether no two elements share memory (tqdecode::strided_elements_distinct).
bool elements_distinct(const Tensor& tensor) {
  return tqdecode::strided_elements_distinct(tensor.sizes(), tensor.strides());
}


// An fp32 model constant (centroids, Pi, PiT) that MSE presets need.
const Tensor& required_constant(const OptionalTensor& tensor, const char* argument, const tqdecode::CacheLayout& layout,
                                const at::Device& device) {
  TQ_REQUIRE(tensor.has_value(), argument,
          std::string("is required by preset ") + layout.info().name + " (MSE keys)");
  check_device(*tensor, argument, device);
  check_dtype(*tensor, argument, at::kFloat);
  check_contiguous(*tensor, argument);
  return *tensor;
}

void check_square(const Tensor& matrix, const char* argument, int head_dim) {
  check_dim(matrix, argument, 2, "[head_dim, head_dim]");
  check_size(matrix, argument, 0, head_dim, "head_dim");
  check_size(matrix, argument, 1, head_dim, "head_dim");
}

void check_codebook(const Tensor& centroids, const tqdecode::CacheLayout& layout) {
  check_dim(centroids, "centroids", 1, "[2^mse_bits]");
  check_size(centroids, "centroids", 0, int64_t{1} << layout.info().key_bits, "2^mse_bits");
}

// A stride the library refused is the cache tensor's: names kv_cache, with
// the library's reason; any other refusal as it is.
[[noreturn]] void refuse_cache_strides(const Tensor& kv_cache, const tqdecode::Error& reason) {
  const std::string& field = reason.argument();
  if (field != "block_stride" && field != "token_stride" && field != "head_stride") throw reason;
  fail("kv_cache", "strides " + shape_text(kv_cache.strides()) + " are not a token_slots cache: " +
                       std::string(reason.what()).substr(std::string_view("tqdecode: ").size()));
}

// kv_cache is uint8 [num_blocks, block_size, num_kv_heads, slot_bytes].
// blocks (docs/FORMAT.md section 4): only stride(0), the block stride, may be
// padded; the rest of a block is one byte range, which must hold the natural
// block of the layout. token_slots (section 4b): every stride comes from the
// tensor (any order of tokens and heads, padded pages and slots), checked by
// make_token_slots_layout; `norm_correction` is the decode-time
// renormalisation of that order.
tqdecode::CacheLayout cache_layout_of(const Tensor& kv_cache, tqdecode::Preset preset, int head_dim,
                                      tqdecode::CacheOrder order, bool norm_correction) {
  check_dtype(kv_cache, "kv_cache", at::kByte);
  check_dim(kv_cache, "kv_cache", 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]");
  TQ_REQUIRE(kv_cache.size(0) >= 1, "kv_cache", "has no blocks");
  const int block_size = int_argument(kv_cache.size(1), "kv_cache");
  const int num_kv_heads = int_argument(kv_cache.size(2), "kv_cache");
  if (order == tqdecode::CacheOrder::token_slots) {
    TQ_REQUIRE(kv_cache.stride(3) == 1, "kv_cache", "the slot dimension must have stride 1");
    // fp8 keys have no centroid vector: the engine's norm_correction does not apply to them.
    const bool renormalize = norm_correction && !tqdecode::preset_info(preset).key_fp8;
    // The slot size first: a small slot would otherwise read as overlapping strides.
    const tqdecode::CacheLayout dense =
        tqdecode::make_token_slots_layout(preset, head_dim, block_size, num_kv_heads, renormalize);
    TQ_REQUIRE(kv_cache.size(3) >= dense.slot_bytes(), "kv_cache",
               "slot size " + std::to_string(kv_cache.size(3)) + " is smaller than the " +
                   std::to_string(dense.slot_bytes()) + " bytes of a " + dense.info().name +
                   " slot with head_dim " + std::to_string(head_dim));
    const auto layout_with = [&](int64_t block_stride, int64_t token_stride, int64_t head_stride) {
      return tqdecode::make_token_slots_layout(preset, head_dim, block_size, num_kv_heads, block_stride, token_stride,
                                               head_stride, renormalize);
    };
    // Strides valid as given are kept (the kernels' choices read them). A
    // dimension of one entry has no step and torch gives it any stride (a
    // permuted view): where the given ones are refused, such a stride is
    // replaced by one that nests the others.
    const bool one_block = kv_cache.size(0) == 1, one_head = num_kv_heads == 1;
    try {
      return layout_with(kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2));
    } catch (const tqdecode::Error& error) {
      if (!one_block && !one_head) refuse_cache_strides(kv_cache, error);
    }
    const int64_t token_stride = kv_cache.stride(1);
    const int64_t head_stride = one_head ? kv_cache.size(3) : kv_cache.stride(2);
    try {
      return layout_with(one_block ? token_stride * block_size + head_stride * num_kv_heads : kv_cache.stride(0),
                         token_stride, head_stride);
    } catch (const tqdecode::Error& error) {
      refuse_cache_strides(kv_cache, error);
    }
  }
  // is_contiguous ignores the strides of dimensions of one entry, which have no step.
  TQ_REQUIRE(kv_cache[0].is_contiguous(), "kv_cache",
             "a block [block_size, num_kv_heads, slot_bytes] must be contiguous; only stride(0) may be padded");
  tqdecode::CacheLayout layout = tqdecode::make_layout(preset, head_dim, block_size, num_kv_heads);
  const int64_t block_bytes = kv_cache.size(1) * kv_cache.size(2) * kv_cache.size(3);
  TQ_REQUIRE(block_bytes >= layout.natural_block_bytes(), "kv_cache",
          "slot_bytes " + std::to_string(kv_cache.size(3)) + " is smaller than the " +
              std::to_string(layout.bytes_per_token_head()) + " bytes per (token, kv head) of " + layout.info().name +
              " with head_dim " + std::to_string(head_dim));
  // One block's stride has no step (torch gives it any): kept where valid, else the block's bytes.
  const int64_t block_stride = kv_cache.size(0) > 1 || kv_cache.stride(0) >= block_bytes ? kv_cache.stride(0) : block_bytes;
  TQ_REQUIRE(block_stride >= block_bytes, "kv_cache",
          "stride(0) " + std::to_string(block_stride) + " is smaller than a block of " +
              std::to_string(block_bytes) + " bytes: blocks would overlap");
  layout.block_stride = block_stride;
  return layout;
}

// ---- decode ------------------------------------------------------------------

// The engine-side arguments of one decode call, as the ops receive them.
struct DecodeInputs {
  const Tensor& query;
  const Tensor& kv_cache;
  const Tensor& block_table;
  const Tensor& seq_lens;
  const OptionalTensor& centroids;
  const OptionalTensor& PiT;
  double scale;
  int64_t mse_bits;
  int64_t value_quant_bits;
  bool key_fp8;
  const OptionalTensor& sinks;
  bool constants_stable;
  std::string_view cache_order;
  bool norm_correction;
  // Several query tokens per sequence (docs/FORMAT.md section 5b): int32
  // [batch + 1]; null for one token per sequence.
  const Tensor* query_start_loc = nullptr;
  int64_t max_query_len = 0;
};

// The library's arguments of one call, and the query they point into where
// that is a copy (alive for the call).
struct DecodeCall {
  tqdecode::DecodeArgs args;
  Tensor query;
};

// `tensor`, or a contiguous copy where rows repeat: a stride of 0 on a
// dimension of several elements (an expanded view), which the library's
// element strides cannot express (there 0 means contiguous). The last
// dimension is contiguous already. Block tables are not copied: an expanded
// table row is DecodeArgs::block_table_one_row.
Tensor without_repeated_rows(const Tensor& tensor) {
  for (int64_t dim = 0; dim + 1 < tensor.dim(); ++dim) {
    if (tensor.stride(dim) == 0 && tensor.size(dim) > 1) return tensor.contiguous();
  }
  return tensor;
}

// Checks the tensors and builds the library's arguments; output left unset.
DecodeCall decode_call(const DecodeInputs& in) {
  DecodeCall call;
  tqdecode::DecodeArgs& args = call.args;
  const Tensor& query = in.query;
  const at::Device device = query.device();
  const bool varlen = in.query_start_loc != nullptr;
  TQ_REQUIRE(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf, "query",
          "dtype " + dtype_text(query.scalar_type()) + " is not supported; accepted: torch.bfloat16, torch.float16");
  check_dim(query, "query", 3, varlen ? "[num_tokens, num_q_heads, head_dim]" : "[batch, num_q_heads, head_dim]");
  TQ_REQUIRE(query.stride(2) == 1, "query", "the head_dim dimension must have stride 1");
  check_device(in.kv_cache, "kv_cache", device);

  const tqdecode::Preset preset = tqdecode::preset_from_parameters(
      int_argument(in.mse_bits, "mse_bits"), int_argument(in.value_quant_bits, "value_quant_bits"), in.key_fp8);
  const int head_dim = int_argument(query.size(2), "query");
  const tqdecode::CacheLayout layout = cache_layout_of(
      in.kv_cache, preset, head_dim, tqdecode::parse_cache_order(in.cache_order, "cache_order"), in.norm_correction);
  TQ_REQUIRE(query.size(1) >= 1 && query.size(1) % layout.num_kv_heads == 0, "query",
             "num_q_heads query.shape[1] = " + std::to_string(query.size(1)) +
                 " is not a positive multiple of num_kv_heads kv_cache.shape[2] = " +
                 std::to_string(layout.num_kv_heads));

  int64_t batch = query.size(0);
  const char* batch_source = "the batch size query.shape[0]";
  if (varlen) {
    const Tensor& starts = *in.query_start_loc;
    check_device(starts, "query_start_loc", device);
    check_dtype(starts, "query_start_loc", at::kInt);
    check_dim(starts, "query_start_loc", 1, "[batch + 1]");
    TQ_REQUIRE(starts.size(0) >= 1, "query_start_loc", "is empty; expected [batch + 1] offsets starting at 0");
    check_contiguous(starts, "query_start_loc");
    TQ_REQUIRE(in.max_query_len >= 1 && in.max_query_len <= tqdecode::kMaxQueryLen, "max_query_len",
               std::to_string(in.max_query_len) + " is out of range; accepted: 1 to " +
                   std::to_string(tqdecode::kMaxQueryLen));
    batch = starts.size(0) - 1;
    batch_source = "the batch size query_start_loc.shape[0] - 1";
    TQ_REQUIRE(query.size(0) <= batch * in.max_query_len, "query",
               std::to_string(query.size(0)) + " tokens (shape[0]) do not fit " + std::to_string(batch) +
                   " sequences of at most max_query_len = " + std::to_string(in.max_query_len) +
                   " tokens; accepted: the query_start_loc[batch] tokens it describes, at most batch * max_query_len");
  }
  check_device(in.block_table, "block_table", device);
  check_dtype(in.block_table, "block_table", at::kInt);
  check_dim(in.block_table, "block_table", 2, "[batch, max_blocks_per_seq]");
  check_size(in.block_table, "block_table", 0, batch, batch_source);
  TQ_REQUIRE(in.block_table.size(1) >= 1, "block_table",
             "has no columns; accepted: [batch, max_blocks_per_seq] with max_blocks_per_seq >= 1");
  TQ_REQUIRE(in.block_table.stride(1) == 1 || in.block_table.size(1) == 1, "block_table",
             "rows must be contiguous (stride(1) == 1)");
  check_device(in.seq_lens, "seq_lens", device);
  check_dtype(in.seq_lens, "seq_lens", at::kInt);
  check_dim(in.seq_lens, "seq_lens", 1, "[batch]");
  check_size(in.seq_lens, "seq_lens", 0, batch, batch_source);
  check_contiguous(in.seq_lens, "seq_lens");

  call.query = without_repeated_rows(query);
  args.query = call.query.data_ptr();
  args.query_dtype = query.scalar_type() == at::kBFloat16 ? tqdecode::DType::bf16 : tqdecode::DType::f16;
  args.batch = static_cast<int>(batch);
  if (varlen) {
    args.query_start_loc = in.query_start_loc->data_ptr<int32_t>();
    args.num_tokens = static_cast<int>(query.size(0));
    args.max_query_len = static_cast<int>(in.max_query_len);
  }
  args.num_q_heads = static_cast<int>(query.size(1));
  args.query_stride_batch = call.query.stride(0);
  args.query_stride_head = call.query.stride(1);
  args.layout = layout;
  args.num_blocks = in.kv_cache.size(0);
  args.cache = in.kv_cache.data_ptr<uint8_t>();
  args.block_table = in.block_table.data_ptr<int32_t>();
  args.max_blocks_per_seq = static_cast<int>(in.block_table.size(1));
  // One row expanded over the batch (vLLM's continuation chunks) is read as it is.
  args.block_table_one_row = batch > 1 && in.block_table.stride(0) == 0;
  args.block_table_stride = args.block_table_one_row ? 0 : in.block_table.stride(0);
  args.seq_lens = in.seq_lens.data_ptr<int32_t>();
  args.scale = static_cast<float>(in.scale);
  if (!layout.key_fp8()) {  // fp8 keys are neither rotated nor codebook-quantized: both are ignored
    const Tensor& centroids = required_constant(in.centroids, "centroids", layout, device);
    check_codebook(centroids, layout);
    const Tensor& PiT = required_constant(in.PiT, "PiT", layout, device);
    check_square(PiT, "PiT", head_dim);
    args.centroids = centroids.data_ptr<float>();
    args.num_centroids = static_cast<int>(centroids.numel());
    args.PiT = PiT.data_ptr<float>();
  }
  if (in.sinks) {
    check_device(*in.sinks, "sinks", device);
    check_dtype(*in.sinks, "sinks", at::kFloat);
    check_dim(*in.sinks, "sinks", 1, "[num_q_heads]");
    check_size(*in.sinks, "sinks", 0, args.num_q_heads, "num_q_heads query.shape[1]");
    check_contiguous(*in.sinks, "sinks");
    args.sinks = in.sinks->data_ptr<float>();
  }
  args.constants_stable = in.constants_stable;
  return call;
}

void set_output(tqdecode::DecodeArgs& args, const Tensor& out, const Tensor& query) {
  check_device(out, "out", query.device());
  check_dtype(out, "out", query.scalar_type());
  if (out.sizes() != query.sizes()) {
    fail("out", "shape " + shape_text(out.sizes()) + " does not match the query shape " + shape_text(query.sizes()));
  }
  TQ_REQUIRE(out.stride(2) == 1, "out", "the head_dim dimension must have stride 1");
  TQ_REQUIRE(elements_distinct(out), "out",
             "elements overlap (strides " + shape_text(out.strides()) +
                 "); accepted: distinct rows, heads and dims, e.g. stride(1) >= head_dim");
  args.output = out.data_ptr();
  args.output_stride_batch = out.stride(0);
  args.output_stride_head = out.stride(1);
}

// A single-token call of rows whose block-table rows are one row (vLLM's
// continuation chunk: the request's row expanded), checked, output set.
DecodeCall continuation_rows_call(const DecodeInputs& in, const Tensor& out) {
  DecodeCall call = decode_call(in);
  TQ_REQUIRE(in.block_table.size(0) == 1 || in.block_table.stride(0) == 0, "block_table",
             "rows are not one row (stride(0) = " + std::to_string(in.block_table.stride(0)) +
                 "); accepted: one table row for every query row, [1, max_blocks_per_seq] expanded (stride(0) == 0)");
  set_output(call.args, out, in.query);
  return call;
}

// plan_decode reads no tensor memory; a non-null output satisfies its check
// that an output exists (the same placeholder the launcher uses).
void* const kPlanningOutput = reinterpret_cast<void*>(std::uintptr_t{1});

#define TQ_DECODE_PARAMS                                                                                          \
  const Tensor &query, const Tensor &kv_cache, const Tensor &block_table, const Tensor &seq_lens,                 \
      const OptionalTensor &centroids, const OptionalTensor &PiT, double scale, int64_t mse_bits,                 \
      int64_t value_quant_bits, bool key_fp8, const OptionalTensor &sinks, bool constants_stable,                 \
      std::string_view cache_order, bool norm_correction
#define TQ_DECODE_INPUTS                                                                                          \
  DecodeInputs {                                                                                                  \
    query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits, key_fp8, sinks,    \
        constants_stable, cache_order, norm_correction                                                            \
  }
#define TQ_DECODE_INPUTS_FORWARDED                                                                                \
  query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits, key_fp8, sinks,      \
      constants_stable, cache_order, norm_correction

void decode_into_cpu(const DecodeInputs& in, Tensor& out) {
  translating_errors([&] {
    DecodeCall call = decode_call(in);
    set_output(call.args, out, in.query);
    tqdecode::decode_cpu(call.args);  // validates seq_lens, block_table and query_start_loc contents first
  });
}

void decode_out_cpu(TQ_DECODE_PARAMS, Tensor& out) { decode_into_cpu(TQ_DECODE_INPUTS, out); }

Tensor decode_cpu(TQ_DECODE_PARAMS) {
  Tensor out = at::empty(query.sizes(), query.options());
  decode_out_cpu(TQ_DECODE_INPUTS_FORWARDED, out);
  return out;
}

std::tuple<std::string, std::string> decode_path_cpu(TQ_DECODE_PARAMS) {
  return translating_errors([&] {
    DecodeCall call = decode_call(TQ_DECODE_INPUTS);
    call.args.output = kPlanningOutput;
    tqdecode::validate_decode_shapes(call.args);
    return std::tuple<std::string, std::string>{tqdecode::decode_path_name(tqdecode::DecodePath::cpu_reference),
                                                "the tensors are in host memory"};
  });
}

// ---- several query tokens per sequence ----------------------------------------

// The decode ops' arguments with query_start_loc and max_query_len after
// seq_lens; query and output [num_tokens, Hq, D].
#define TQ_VARLEN_PARAMS                                                                                          \
  const Tensor &query, const Tensor &kv_cache, const Tensor &block_table, const Tensor &seq_lens,                 \
      const Tensor &query_start_loc, int64_t max_query_len, const OptionalTensor &centroids,                      \
      const OptionalTensor &PiT, double scale, int64_t mse_bits, int64_t value_quant_bits, bool key_fp8,          \
      const OptionalTensor &sinks, bool constants_stable, std::string_view cache_order, bool norm_correction
#define TQ_VARLEN_INPUTS                                                                                          \
  DecodeInputs {                                                                                                  \
    query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits, key_fp8, sinks,    \
        constants_stable, cache_order, norm_correction, &query_start_loc, max_query_len                           \
  }

void varlen_decode_out_cpu(TQ_VARLEN_PARAMS, Tensor& out) { decode_into_cpu(TQ_VARLEN_INPUTS, out); }

Tensor varlen_decode_cpu(TQ_VARLEN_PARAMS) {
  Tensor out = at::empty(query.sizes(), query.options());
  decode_into_cpu(TQ_VARLEN_INPUTS, out);
  return out;
}

// The rows as one varlen call where they are one request's consecutive
// positions (tqdecode/continuation.hpp), else as rows: on the host the route
// is read here, so only the call that writes the rows runs.
void continuation_decode_out_cpu(TQ_DECODE_PARAMS, Tensor& out) {
  translating_errors([&] {
    const DecodeCall call = continuation_rows_call(TQ_DECODE_INPUTS, out);
    const int rows = call.args.batch;
    std::vector<std::int32_t> route(tqdecode::continuation_route_size(rows));
    tqdecode::continuation_route_host(call.args.seq_lens, rows, tqdecode::continuation_capacity(call.args),
                                      route.data());
    const tqdecode::ContinuationCalls calls = tqdecode::continuation_calls(call.args, route.data());
    tqdecode::decode_cpu(route[rows + 1] > 0 ? calls.chunk : call.args);
  });
}

// ---- store -------------------------------------------------------------------

tqdecode::StoreArgs store_args(const Tensor& key, const Tensor& value, const Tensor& kv_cache,
                               const Tensor& slot_mapping, const OptionalTensor& Pi, const OptionalTensor& centroids,
                               std::string_view preset_name, std::string_view cache_order) {
  const at::Device device = key.device();
  const tqdecode::Preset preset = tqdecode::parse_preset(preset_name, "preset");
  TQ_REQUIRE(key.scalar_type() == at::kFloat || key.scalar_type() == at::kHalf || key.scalar_type() == at::kBFloat16,
          "key",
          "dtype " + dtype_text(key.scalar_type()) +
              " is not supported; accepted: torch.float32, torch.float16, torch.bfloat16");
  check_dim(key, "key", 3, "[num_tokens, num_kv_heads, head_dim]");
  check_contiguous(key, "key");
  check_device(value, "value", device);
  check_dtype(value, "value", key.scalar_type());
  if (value.sizes() != key.sizes()) {
    fail("value", "shape " + shape_text(value.sizes()) + " does not match the key shape " + shape_text(key.sizes()));
  }
  check_contiguous(value, "value");
  check_device(kv_cache, "kv_cache", device);
  const int head_dim = static_cast<int>(key.size(2));
  // The store of the token_slots order writes the raw key norm whatever the
  // decode-time norm correction (docs/FORMAT.md section 4b).
  const tqdecode::CacheLayout layout =
      cache_layout_of(kv_cache, preset, head_dim, tqdecode::parse_cache_order(cache_order, "cache_order"), false);
  check_size(key, "key", 1, layout.num_kv_heads, "num_kv_heads kv_cache.shape[2]");
  check_device(slot_mapping, "slot_mapping", device);
  check_dtype(slot_mapping, "slot_mapping", at::kLong);
  check_dim(slot_mapping, "slot_mapping", 1, "[num_tokens]");
  check_size(slot_mapping, "slot_mapping", 0, key.size(0), "num_tokens key.shape[0]");
  check_contiguous(slot_mapping, "slot_mapping");

  tqdecode::StoreArgs args;
  args.layout = layout;
  args.num_blocks = kv_cache.size(0);
  args.cache = kv_cache.data_ptr<uint8_t>();
  args.key = key.data_ptr();
  args.value = value.data_ptr();
  args.kv_dtype = key.scalar_type() == at::kFloat  ? tqdecode::DType::f32
                  : key.scalar_type() == at::kHalf ? tqdecode::DType::f16
                                                   : tqdecode::DType::bf16;
  args.num_tokens = key.size(0);
  args.slot_mapping = slot_mapping.data_ptr<int64_t>();
  if (!layout.key_fp8()) {
    const Tensor& rotation = required_constant(Pi, "Pi", layout, device);
    check_square(rotation, "Pi", head_dim);
    const Tensor& codebook = required_constant(centroids, "centroids", layout, device);
    check_codebook(codebook, layout);
    args.Pi = rotation.data_ptr<float>();
    args.centroids = codebook.data_ptr<float>();
    args.num_centroids = static_cast<int>(codebook.numel());
  }
  return args;
}

void store_cpu(const Tensor& key, const Tensor& value, Tensor& kv_cache, const Tensor& slot_mapping,
               const OptionalTensor& Pi, const OptionalTensor& centroids, std::string_view preset, bool /*check*/,
               std::string_view cache_order) {
  // The CPU store always validates every input before writing (it is free there).
  translating_errors(
      [&] { tqdecode::store_cpu(store_args(key, value, kv_cache, slot_mapping, Pi, centroids, preset, cache_order)); });
}

// ---- host-side helpers (no device work; CompositeExplicitAutograd) ---------

std::tuple<Tensor, Tensor, Tensor> make_model_constants(std::string_view preset, int64_t head_dim, int64_t seed,
                                                        std::string_view rotation) {
  return translating_errors([&] {
    TQ_REQUIRE(rotation == "hadamard" || rotation == "dense", "rotation",
            "'" + std::string(rotation) + "' is not a rotation; accepted: hadamard, dense");
    const tqdecode::ModelConstants constants = tqdecode::make_model_constants(
        tqdecode::parse_preset(preset, "preset"), int_argument(head_dim, "head_dim"), static_cast<std::uint64_t>(seed),
        rotation == "hadamard" ? tqdecode::RotationKind::hadamard : tqdecode::RotationKind::dense);
    // fp8 keys use no constants: empty vectors give [0] and [0, 0] tensors.
    const int64_t side = constants.Pi.empty() ? 0 : head_dim;
    auto to_tensor = [](const std::vector<float>& values, at::IntArrayRef shape) {
      return at::tensor(values, at::kFloat).reshape(shape);
    };
    return std::tuple<Tensor, Tensor, Tensor>{to_tensor(constants.centroids, {int64_t(constants.centroids.size())}),
                                              to_tensor(constants.Pi, {side, side}),
                                              to_tensor(constants.PiT, {side, side})};
  });
}

// [key_bits, value_bits, key_fp8, norm_correction, key_packed_size (KD),
//  value_packed_size (VD), fields (F), slot_bytes, block_bytes] of the
// natural layout of a cache order (token_slots: vLLM's dense order).
std::vector<int64_t> cache_layout(std::string_view preset, int64_t head_dim, int64_t block_size, int64_t num_kv_heads,
                                  std::string_view cache_order) {
  return translating_errors([&] {
    const tqdecode::Preset parsed = tqdecode::parse_preset(preset, "preset");
    const tqdecode::CacheLayout layout =
        tqdecode::parse_cache_order(cache_order, "cache_order") == tqdecode::CacheOrder::token_slots
            ? tqdecode::make_token_slots_layout(parsed, int_argument(head_dim, "head_dim"),
                                                int_argument(block_size, "block_size"),
                                                int_argument(num_kv_heads, "num_kv_heads"), false)
            : tqdecode::make_layout(parsed, int_argument(head_dim, "head_dim"), int_argument(block_size, "block_size"),
                                    int_argument(num_kv_heads, "num_kv_heads"));
    const tqdecode::PresetInfo info = layout.info();
    return std::vector<int64_t>{info.key_bits,      info.value_bits,         info.key_fp8,
                                info.norm_correction, layout.key_bytes(),    layout.value_bytes(),
                                layout.fields(),
                                layout.token_slots() ? layout.slot_bytes() : layout.bytes_per_token_head(),
                                layout.natural_block_bytes()};
  });
}

// One DecodeWorkspace (buffer pool) per CUDA device for the whole process.
// Decode calls hold a shared_ptr for their duration, so set_max_batch can
// replace the workspaces while another thread is inside a call. Leaked on
// purpose: freeing device memory during interpreter exit, after the CUDA
// runtime may have shut down, would fail.
class Workspaces {
 public:
  std::shared_ptr<tqdecode::DecodeWorkspace> for_device(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<tqdecode::DecodeWorkspace>& workspace = by_device_[device];
    if (!workspace) {
      workspace = std::make_shared<tqdecode::DecodeWorkspace>(max_batch_);
      if (device_checks_) workspace->set_device_checks(*device_checks_);
    }
    return workspace;
  }

  // Device-side input checks for every workspace, present and future
  // (until set, each follows TQDECODE_DEVICE_CHECKS).
  void set_device_checks(bool enabled) {
    std::lock_guard<std::mutex> lock(mutex_);
    device_checks_ = enabled;
    for (const auto& [device, workspace] : by_device_) workspace->set_device_checks(enabled);
  }

  // New pools get `max_batch` rows (DecodeWorkspace: TQDECODE_MAX_BATCH
  // overrides it; 0 means 512). Existing pools are released (once no call
  // uses them), like a pool growth: CUDA graphs captured earlier become invalid.
  void set_max_batch(int64_t max_batch) {
    TQ_REQUIRE(max_batch >= 0 && max_batch <= std::numeric_limits<int>::max(), "max_batch",
               std::to_string(max_batch) + " is out of range; accepted: 0 (default) or 1 to 1048576");
    tqdecode::DecodeWorkspace{static_cast<int>(max_batch)};  // validates it (and TQDECODE_MAX_BATCH), allocates nothing
    std::lock_guard<std::mutex> lock(mutex_);
    if (max_batch == max_batch_) return;
    max_batch_ = static_cast<int>(max_batch);
    by_device_.clear();
  }

  // (bucket rows of new pools, per pool: signature, bucket rows, partition rows, bytes)
  std::tuple<int64_t, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>
  stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::tuple<int64_t, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>
        result;
    std::get<0>(result) = tqdecode::DecodeWorkspace(max_batch_).max_batch();  // resolves the environment default
    for (const auto& [device, workspace] : by_device_) {
      for (const tqdecode::DecodeWorkspace::Entry& entry : workspace->stats().entries) {
        std::get<1>(result).push_back(entry.signature);
        std::get<2>(result).push_back(entry.bucket_batch);
        std::get<3>(result).push_back(entry.partition_rows);
        std::get<4>(result).push_back(entry.bytes);
      }
    }
    return result;
  }

 private:
  std::mutex mutex_;
  int max_batch_ = 0;
  std::optional<bool> device_checks_;
  std::map<int, std::shared_ptr<tqdecode::DecodeWorkspace>> by_device_;
};

Workspaces& workspaces() {
  static Workspaces* const instance = new Workspaces();
  return *instance;
}

void set_max_batch(int64_t max_batch) {
  translating_errors([&] { workspaces().set_max_batch(max_batch); });
}

std::tuple<int64_t, std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>
pool_stats() {
  return translating_errors([&] { return workspaces().stats(); });
}

bool is_available() {
  return translating_errors([] { return tqdecode::is_available(); });
}

// Whether CUDA device `device` exists and this build has kernels for it.
bool runs_on_device([[maybe_unused]] int64_t device) {
  return translating_errors([&] {
#if defined(TQDECODE_WITH_CUDA)
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) return false;
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return tqdecode::cuda_available();
#else
    return false;
#endif
  });
}

std::string version() { return TQDECODE_VERSION_STRING; }

void set_device_checks(bool enabled) {
  translating_errors([&] { workspaces().set_device_checks(enabled); });
}

// The rows' lengths of a continuation route (tqdecode/continuation.hpp):
// int32 [rows >= 1], contiguous.
void check_route_lengths(const Tensor& seq_lens) {
  if (seq_lens.scalar_type() != at::kInt || seq_lens.dim() != 1 || seq_lens.size(0) < 1 || !seq_lens.is_contiguous()) {
    fail("seq_lens", dtype_text(seq_lens.scalar_type()) + " " + shape_text(seq_lens.sizes()) +
                         "; accepted: a contiguous torch.int32 tensor [rows], rows >= 1");
  }
}

Tensor continuation_route_cpu(const Tensor& seq_lens, int64_t capacity) {
  return translating_errors([&] {
    check_route_lengths(seq_lens);
    const int rows = static_cast<int>(seq_lens.size(0));
    Tensor route = at::empty({tqdecode::continuation_route_size(rows)}, seq_lens.options());
    tqdecode::continuation_route_host(seq_lens.data_ptr<std::int32_t>(), rows, capacity,
                                      route.data_ptr<std::int32_t>());
    return route;
  });
}

// ---- CUDA kernels of the ops ---------------------------------------------------

#if defined(TQDECODE_WITH_CUDA)

// A device index the reports are read from: one of the CUDA devices present.
void check_cuda_device_index(int64_t device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  TQ_REQUIRE(device >= 0 && device < count, "device",
             std::to_string(device) + " is not a CUDA device here; accepted: 0 to " + std::to_string(count - 1));
}

CUstream_st* current_stream(const at::Device& device) {
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
}

// The CUDA ops run where any tensor argument is on a CUDA device: the query's
// device is the call's (decode_call checks the others against it).
at::Device cuda_call_device(const Tensor& query) {
  TQ_REQUIRE(query.is_cuda(), "query",
             "is on " + query.device().str() + " while another tensor of the call is on a CUDA device; every tensor "
             "of the call must be on one device");
  return query.device();
}

void decode_into_cuda(const DecodeInputs& in, Tensor& out) {
  translating_errors([&] {
    const c10::cuda::CUDAGuard guard(cuda_call_device(in.query));
    DecodeCall call = decode_call(in);
    set_output(call.args, out, in.query);
    const auto workspace = workspaces().for_device(in.query.device().index());
    tqdecode::decode(call.args, *workspace, current_stream(in.query.device()));
  });
}

void decode_out_cuda(TQ_DECODE_PARAMS, Tensor& out) { decode_into_cuda(TQ_DECODE_INPUTS, out); }

// A new output tensor from torch's allocator (the graph's pool under CUDA-graph
// capture), so results own their memory: the workspace pools only the
// intermediate buffers (rotated queries, partitions).
Tensor decode_cuda(TQ_DECODE_PARAMS) {
  Tensor out = at::empty(query.sizes(), query.options());
  decode_out_cuda(TQ_DECODE_INPUTS_FORWARDED, out);
  return out;
}

std::tuple<std::string, std::string> decode_path_cuda(TQ_DECODE_PARAMS) {
  return translating_errors([&] {
    const c10::cuda::CUDAGuard guard(cuda_call_device(query));
    DecodeCall call = decode_call(TQ_DECODE_INPUTS);
    call.args.output = kPlanningOutput;
    tqdecode::PathChoice choice = tqdecode::choose_decode_path(call.args);
    return std::tuple<std::string, std::string>{tqdecode::decode_path_name(choice.path), std::move(choice.reason)};
  });
}

Tensor continuation_route_cuda(const Tensor& seq_lens, int64_t capacity) {
  return translating_errors([&] {
    check_route_lengths(seq_lens);
    const c10::cuda::CUDAGuard guard(seq_lens.device());
    const int rows = static_cast<int>(seq_lens.size(0));
    Tensor route = at::empty({tqdecode::continuation_route_size(rows)}, seq_lens.options());
    tqdecode::continuation_route(seq_lens.data_ptr<std::int32_t>(), rows, capacity, route.data_ptr<std::int32_t>(),
                                 current_stream(seq_lens.device()));
    return route;
  });
}

// The same on the device, without a synchronisation: the route's kernel, the
// per-row call (every length 0 where the rows are one chunk), then the chunk's
// varlen call (no token where they are not), in one op so that an eager call
// pays one dispatch.
void continuation_decode_out_cuda(TQ_DECODE_PARAMS, Tensor& out) {
  translating_errors([&] {
    const c10::cuda::CUDAGuard guard(cuda_call_device(query));
    const DecodeCall call = continuation_rows_call(TQ_DECODE_INPUTS, out);
    const int rows = call.args.batch;
    Tensor route = at::empty({tqdecode::continuation_route_size(rows)}, seq_lens.options());
    const tqdecode::ContinuationCalls calls = tqdecode::continuation_calls(call.args, route.data_ptr<std::int32_t>());
    tqdecode::validate_decode_shapes(calls.per_row);
    tqdecode::validate_decode_shapes(calls.chunk);
    CUstream_st* const stream = current_stream(query.device());
    const auto workspace = workspaces().for_device(query.device().index());
    tqdecode::continuation_route(call.args.seq_lens, rows, tqdecode::continuation_capacity(call.args),
                                 route.data_ptr<std::int32_t>(), stream);
    tqdecode::decode(calls.per_row, *workspace, stream);
    tqdecode::decode(calls.chunk, *workspace, stream);
  });
}

void varlen_decode_out_cuda(TQ_VARLEN_PARAMS, Tensor& out) { decode_into_cuda(TQ_VARLEN_INPUTS, out); }

Tensor varlen_decode_cuda(TQ_VARLEN_PARAMS) {
  Tensor out = at::empty(query.sizes(), query.options());
  decode_into_cuda(TQ_VARLEN_INPUTS, out);
  return out;
}

// Without check (the default) the store synchronises nothing and works in
// CUDA graphs: a failed device-side check writes nothing and is counted in
// the device's report (store_check_report). With check it synchronises and
// raises ValueError. The call's status word comes from torch's allocator, so
// stores on several streams do not share one.
void store_cuda(const Tensor& key, const Tensor& value, Tensor& kv_cache, const Tensor& slot_mapping,
                const OptionalTensor& Pi, const OptionalTensor& centroids, std::string_view preset, bool check,
                std::string_view cache_order) {
  translating_errors([&] {
    const c10::cuda::CUDAGuard guard(key.device());
    const tqdecode::StoreArgs args = store_args(key, value, kv_cache, slot_mapping, Pi, centroids, preset, cache_order);
    Tensor status = at::empty({1}, key.options().dtype(at::kInt));
    tqdecode::store_cuda(args, current_stream(key.device()),
                         check ? tqdecode::StoreChecking::raise : tqdecode::StoreChecking::record,
                         status.data_ptr<int>());
  });
}

#endif  // TQDECODE_WITH_CUDA

// (checked_calls, failed_sequences, bad_seq_lens, bad_block_entries,
//  first bad seq_len: sequence, value; first bad block-table entry:
//  sequence, column, value) of `device`'s workspace, read and cleared on the
//  device's current stream. Empty without a CUDA device or in a build
//  without CUDA (the CPU op validates on the host instead).
using CheckReportTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

CheckReportTuple device_check_report([[maybe_unused]] int64_t device) {
  return translating_errors([&] {
    tqdecode::DeviceCheckReport report;
#if defined(TQDECODE_WITH_CUDA)
    if (tqdecode::cuda_available()) {
      check_cuda_device_index(device);
      const at::Device cuda_device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
      const c10::cuda::CUDAGuard guard(cuda_device);
      report = workspaces().for_device(static_cast<int>(device))->device_check_report(current_stream(cuda_device));
    }
#endif
    return CheckReportTuple{report.checked_calls,
                            report.failed_sequences,
                            report.bad_seq_lens,
                            report.bad_block_entries,
                            report.first_bad_seq_len.sequence,
                            report.first_bad_seq_len.value,
                            report.first_bad_block_entry.sequence,
                            report.first_bad_block_entry.column,
                            report.first_bad_block_entry.value};
  });
}

// (checked_calls, failed_calls, slot_out_of_range, duplicate_slot,
//  non_finite_key, non_finite_value, invalid_centroids, non_finite_rotation,
//  first failure's StoreStatus) of the GPU
// stores on `device`, read and cleared on its current stream; zeros without
// a CUDA device or in a build without CUDA (the CPU store raises instead).
using StoreReportTuple = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

StoreReportTuple store_check_report([[maybe_unused]] int64_t device) {
  return translating_errors([&] {
    tqdecode::StoreCheckReport report;
#if defined(TQDECODE_WITH_CUDA)
    if (tqdecode::cuda_available()) {
      check_cuda_device_index(device);
      const at::Device cuda_device(at::kCUDA, static_cast<c10::DeviceIndex>(device));
      const c10::cuda::CUDAGuard guard(cuda_device);
      report = tqdecode::store_check_report(current_stream(cuda_device));
    }
#endif
    using tqdecode::StoreStatus;
    const auto failures = [&](StoreStatus status) { return report.failures[static_cast<int>(status)]; };
    return StoreReportTuple{report.checked_calls,
                            report.failed_calls,
                            failures(StoreStatus::slot_out_of_range),
                            failures(StoreStatus::duplicate_slot),
                            failures(StoreStatus::non_finite_key),
                            failures(StoreStatus::non_finite_value),
                            failures(StoreStatus::invalid_centroids),
                            failures(StoreStatus::non_finite_rotation),
                            static_cast<int64_t>(report.first_failure)};
  });
}

}  // namespace tqdecode_torch

// Schemas. Mutated arguments are annotated (a!) so functionalization and
// torch.compile see the writes. `decode` returns a new tensor; `decode_out`
// writes a caller's tensor (output_buf).
#define TQ_DECODE_SCHEMA_ARGS                                                                                   \
  "Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor? centroids, Tensor? PiT, "       \
  "float scale, int mse_bits, int value_quant_bits, bool key_fp8=False, Tensor? sinks=None, "                  \
  "bool constants_stable=True, str cache_order=\"blocks\", bool norm_correction=False"
// Several query tokens per sequence: query [num_tokens, Hq, D], output the same.
#define TQ_VARLEN_SCHEMA_ARGS                                                                                   \
  "Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor query_start_loc, "               \
  "int max_query_len, Tensor? centroids, Tensor? PiT, float scale, int mse_bits, int value_quant_bits, "       \
  "bool key_fp8=False, Tensor? sinks=None, bool constants_stable=True, str cache_order=\"blocks\", "             \
  "bool norm_correction=False"
TORCH_LIBRARY(tqdecode, m) {
  m.def(
      "store(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? Pi, Tensor? centroids, "
      "str preset, bool check=False, str cache_order=\"blocks\") -> ()");
  m.def("decode(" TQ_DECODE_SCHEMA_ARGS ") -> Tensor");
  m.def("decode_out(" TQ_DECODE_SCHEMA_ARGS ", *, Tensor(a!) out) -> ()");
  m.def("decode_path(" TQ_DECODE_SCHEMA_ARGS ") -> (str path, str reason)");
  m.def("varlen_decode(" TQ_VARLEN_SCHEMA_ARGS ") -> Tensor");
  m.def("varlen_decode_out(" TQ_VARLEN_SCHEMA_ARGS ", *, Tensor(a!) out) -> ()");
  m.def(
      "make_model_constants(str preset, int head_dim, int seed=0, str rotation=\"hadamard\") "
      "-> (Tensor centroids, Tensor Pi, Tensor PiT)");
  m.def("continuation_route(Tensor seq_lens, int capacity) -> Tensor");
  m.def("continuation_decode_out(" TQ_DECODE_SCHEMA_ARGS ", *, Tensor(a!) out) -> ()");
  m.def("cache_layout(str preset, int head_dim, int block_size, int num_kv_heads, str cache_order=\"blocks\") -> int[]");
  m.def("is_available() -> bool");
  m.def("runs_on_device(int device) -> bool");
  m.def("version() -> str");
  m.def("set_max_batch(int max_batch) -> ()");
  m.def("pool_stats() -> (int max_batch, str[] signatures, int[] bucket_batch, int[] partition_rows, int[] bytes)");
  m.def("set_device_checks(bool enabled) -> ()");
  m.def(
      "device_check_report(int device) -> (int checked_calls, int failed_sequences, int bad_seq_lens, "
      "int bad_block_entries, int bad_seq_len_sequence, int bad_seq_len_value, int bad_block_entry_sequence, "
      "int bad_block_entry_column, int bad_block_entry_value)");
  m.def(
      "store_check_report(int device) -> (int checked_calls, int failed_calls, int slot_out_of_range, "
      "int duplicate_slot, int non_finite_key, int non_finite_value, int invalid_centroids, "
      "int non_finite_rotation, int first_failure)");
}

TORCH_LIBRARY_IMPL(tqdecode, CPU, m) {
  m.impl("store", &tqdecode_torch::store_cpu);
  m.impl("decode", &tqdecode_torch::decode_cpu);
  m.impl("decode_out", &tqdecode_torch::decode_out_cpu);
  m.impl("decode_path", &tqdecode_torch::decode_path_cpu);
  m.impl("varlen_decode", &tqdecode_torch::varlen_decode_cpu);
  m.impl("varlen_decode_out", &tqdecode_torch::varlen_decode_out_cpu);
  m.impl("continuation_route", &tqdecode_torch::continuation_route_cpu);
  m.impl("continuation_decode_out", &tqdecode_torch::continuation_decode_out_cpu);
}

#if defined(TQDECODE_WITH_CUDA)
TORCH_LIBRARY_IMPL(tqdecode, CUDA, m) {
  m.impl("store", &tqdecode_torch::store_cuda);
  m.impl("decode", &tqdecode_torch::decode_cuda);
  m.impl("decode_out", &tqdecode_torch::decode_out_cuda);
  m.impl("decode_path", &tqdecode_torch::decode_path_cuda);
  m.impl("varlen_decode", &tqdecode_torch::varlen_decode_cuda);
  m.impl("varlen_decode_out", &tqdecode_torch::varlen_decode_out_cuda);
  m.impl("continuation_route", &tqdecode_torch::continuation_route_cuda);
  m.impl("continuation_decode_out", &tqdecode_torch::continuation_decode_out_cuda);
}
#endif

// Ops without tensor inputs dispatch to CompositeExplicitAutograd; being
// below the Python key, fake-tensor mode sees them (their fakes are in Python).
TORCH_LIBRARY_IMPL(tqdecode, CompositeExplicitAutograd, m) {
  m.impl("make_model_constants", &tqdecode_torch::make_model_constants);
  m.impl("cache_layout", &tqdecode_torch::cache_layout);
  m.impl("is_available", &tqdecode_torch::is_available);
  m.impl("runs_on_device", &tqdecode_torch::runs_on_device);
  m.impl("version", &tqdecode_torch::version);
  m.impl("set_max_batch", &tqdecode_torch::set_max_batch);
  m.impl("pool_stats", &tqdecode_torch::pool_stats);
  m.impl("set_device_checks", &tqdecode_torch::set_device_checks);
  m.impl("device_check_report", &tqdecode_torch::device_check_report);
  m.impl("store_check_report", &tqdecode_torch::store_check_report);
}
