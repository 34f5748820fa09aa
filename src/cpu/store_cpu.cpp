#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "encode.hpp"
#include "parallel.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"
#include "tqdecode/store.hpp"

namespace tqdecode {

using cpu::parallel_for;

namespace cpu {

std::uint16_t encode_key_mse(const float* key, int head_dim, const float* Pi, const float* centroids,
                             int bits, bool norm_correction, std::uint8_t* key_data) {
  std::array<std::uint8_t, kMaxHeadDim> indices{};  // all 0: the encoding of a zero key
  const float norm = sqrt_rn(dot_sequential(key, key, head_dim));
  if (norm == 0.0f) {
    pack_codes(indices.data(), head_dim, bits, key_data);
    return float_to_half_bits(0.0f);
  }
  std::array<float, kMaxHeadDim> levels{};  // c[d] = centroids[idx[d]]
  for (int j = 0; j < head_dim; ++j) {
    const float rotated = dot_sequential(Pi + std::int64_t(j) * head_dim, key, head_dim);  // r = Pi k
    indices[j] = static_cast<std::uint8_t>(nearest_centroid_index(centroids, 1 << bits, div_rn(rotated, norm)));
    levels[j] = centroids[indices[j]];
  }
  pack_codes(indices.data(), head_dim, bits, key_data);
  // Norm correction makes ||khat|| = ||k||: the decoder scales the centroid
  // vector, whose norm is not 1, by the stored norm.
  return stored_key_norm_bits(norm, sqrt_rn(dot_sequential(levels.data(), levels.data(), head_dim)),
                              norm_correction);
}

std::uint16_t encode_key_mse_slot(const float* key, int head_dim, const float* Pi, const float* midpoints, int bits,
                                  std::uint8_t* key_data) {
  std::array<std::uint8_t, kMaxHeadDim> indices{};
  const float norm = sqrt_rn(dot_sequential(key, key, head_dim));
  for (int j = 0; j < head_dim; ++j) {
    const float rotated = dot_sequential(Pi + std::int64_t(j) * head_dim, key, head_dim);  // r = Pi k
    const float unit = norm == 0.0f ? 0.0f : div_rn(rotated, norm);
    indices[j] = static_cast<std::uint8_t>(midpoint_bucket(midpoints, (1 << bits) - 1, unit));
  }
  pack_codes(indices.data(), head_dim, bits, key_data);
  return float_to_half_bits(norm);
}

void encode_key_fp8(const float* key, int head_dim, std::uint8_t* key_data) {
  for (int d = 0; d < head_dim; ++d) key_data[d] = float_to_fp8_e4m3_bits(key[d]);
}

ValueQuantParams encode_value(const float* value, int head_dim, int bits, std::uint8_t* value_data) {
  const ValueRange range = value_range(value, head_dim);
  const ValueQuantParams params = value_quant_params(range.lo, range.hi, bits);
  std::array<std::uint8_t, kMaxHeadDim> codes{};
  // value_code rounds (v - zero) / scale half to even in fp32 (std::nearbyint
  // in the default rounding mode), with the fp16-rounded scale and zero the
  // decoder reads. Non-finite parameters are rejected by the caller; skipping
  // them here keeps NaN out of the float-to-integer conversion.
  if (std::isfinite(params.scale) && std::isfinite(params.zero)) {
    for (int d = 0; d < head_dim; ++d) codes[d] = static_cast<std::uint8_t>(value_code(value[d], params, bits));
  }
  pack_codes(codes.data(), head_dim, bits, value_data);
  return params;
}

SlotValueQuant encode_value_slot(const float* value, int head_dim, int bits, std::uint8_t* value_data) {
  const ValueRange range = value_range(value, head_dim);
  const SlotValueQuant quant = slot_value_quant(range.lo, range.hi, bits);
  std::array<std::uint8_t, kMaxHeadDim> codes{};
  for (int d = 0; d < head_dim; ++d) codes[d] = static_cast<std::uint8_t>(slot_value_code(value[d], quant, bits));
  pack_codes(codes.data(), head_dim, bits, value_data);
  return quant;
}

}  // namespace cpu

namespace {

void require_pointer(const void* pointer, const char* argument) {
  TQ_REQUIRE(pointer != nullptr, argument, "is null; a tensor is required when num_tokens > 0");
}

// Below this many (token, head) pairs a parallel region costs more than it
// saves (a decode step stores one token per sequence).
constexpr std::int64_t kMinParallelItems = 64;

bool half_is_finite(std::uint16_t bits) { return (bits & 0x7c00u) != 0x7c00u; }

// What, if anything, makes one (token, head) pair unstorable. Found during
// the parallel encode; reported afterwards, first in (token, head) order.
enum class Issue : std::uint8_t { none, key_not_finite, value_not_finite, key_norm_range, value_range };

struct Staging {
  std::vector<std::uint8_t> records;  // [tokens * Hk, record_bytes]: key data, then value data
  std::vector<std::uint16_t> fields;  // [tokens * Hk, F] fp16 bits
  std::vector<Issue> issues;          // [tokens * Hk]
};

// The model constants must be usable: a NaN in Pi or an unsorted codebook
// would silently write wrong codes. (Messages are built only on failure:
// these loops run on every store.)
void validate_constants(const StoreArgs& args) {
  for (int i = 0; i < args.num_centroids; ++i) {
    const float level = args.centroids[i];
    if (!std::isfinite(level) || (i > 0 && !(level >= args.centroids[i - 1]))) {
      fail("centroids[" + std::to_string(i) + "]",
           std::to_string(level) + " breaks the codebook; accepted: finite levels sorted ascending");
    }
  }
  const std::int64_t elements = std::int64_t(args.layout.head_dim) * args.layout.head_dim;
  for (std::int64_t i = 0; i < elements; ++i) {
    if (!std::isfinite(args.Pi[i])) {
      fail("Pi", "element " + std::to_string(i) + " is " + std::to_string(args.Pi[i]) + "; accepted: finite values");
    }
  }
}

// Every slot must be inside the cache, and written at most once per call so
// the parallel write is deterministic.
void validate_slots(const StoreArgs& args) {
  const std::int64_t num_slots = args.num_blocks * args.layout.block_size;
  std::vector<std::pair<std::int64_t, std::int64_t>> slot_tokens;  // (slot, token)
  for (std::int64_t t = 0; t < args.num_tokens; ++t) {
    const std::int64_t slot = args.slot_mapping[t];
    if (slot < 0) continue;
    if (slot >= num_slots) {
      fail("slot_mapping[" + std::to_string(t) + "]",
           std::to_string(slot) + " is out of range; accepted: negative (skip) or 0 to num_blocks * block_size - 1 = " +
               std::to_string(num_slots - 1));
    }
    slot_tokens.emplace_back(slot, t);
  }
  std::sort(slot_tokens.begin(), slot_tokens.end());
  for (std::size_t i = 1; i < slot_tokens.size(); ++i) {
    if (slot_tokens[i].first == slot_tokens[i - 1].first) {
      fail("slot_mapping[" + std::to_string(slot_tokens[i].second) + "]",
           std::to_string(slot_tokens[i].first) + " is also the slot of token " +
               std::to_string(slot_tokens[i - 1].second) + "; accepted: each slot at most once per call");
    }
  }
}

// Encodes (token, head) pair `item` into its staging record and fields.
// `midpoints`: the centroid midpoints (token_slots order, MSE keys).
Issue encode_item(const StoreArgs& args, const float* midpoints, std::int64_t item, std::uint8_t* record,
                  std::uint16_t* fields) {
  const CacheLayout& layout = args.layout;
  const PresetInfo info = layout.info();
  const int D = layout.head_dim;
  std::array<float, cpu::kMaxHeadDim> key{};
  std::array<float, cpu::kMaxHeadDim> value{};
  bool key_finite = true;
  bool value_finite = true;
  for (int d = 0; d < D; ++d) {
    key[d] = load_as_float(args.key, args.kv_dtype, item * D + d);
    value[d] = load_as_float(args.value, args.kv_dtype, item * D + d);
    key_finite &= std::isfinite(key[d]);
    value_finite &= std::isfinite(value[d]);
  }
  if (!key_finite) return Issue::key_not_finite;
  if (!value_finite) return Issue::value_not_finite;

  if (info.key_fp8) {
    cpu::encode_key_fp8(key.data(), D, record);
  } else {
    fields[layout.key_norm_field()] =
        layout.token_slots()
            ? cpu::encode_key_mse_slot(key.data(), D, args.Pi, midpoints, info.key_bits, record)
            : cpu::encode_key_mse(key.data(), D, args.Pi, args.centroids, info.key_bits, info.norm_correction, record);
    if (!half_is_finite(fields[layout.key_norm_field()])) return Issue::key_norm_range;
  }
  std::uint8_t* value_data = record + layout.key_bytes();
  if (layout.token_slots()) {
    const SlotValueQuant quant = cpu::encode_value_slot(value.data(), D, info.value_bits, value_data);
    fields[layout.value_scale_field()] = quant.scale_bits;
    fields[layout.value_zero_field()] = quant.zero_bits;
  } else {
    const ValueQuantParams params = cpu::encode_value(value.data(), D, info.value_bits, value_data);
    fields[layout.value_scale_field()] = params.scale_bits;
    fields[layout.value_zero_field()] = params.zero_bits;
  }
  if (!half_is_finite(fields[layout.value_scale_field()]) || !half_is_finite(fields[layout.value_zero_field()])) {
    return Issue::value_range;
  }
  return Issue::none;
}

// The midpoints between neighbouring centroids (token_slots order, MSE keys; else empty).
std::vector<float> centroid_midpoints(const StoreArgs& args) {
  std::vector<float> midpoints;
  if (!args.layout.token_slots() || args.layout.key_fp8()) return midpoints;
  for (int i = 0; i + 1 < args.num_centroids; ++i) {
    midpoints.push_back(centroid_midpoint(args.centroids[i], args.centroids[i + 1]));
  }
  return midpoints;
}

// Throws the error of the first unstorable (token, head) pair, if any.
void report_first_issue(const StoreArgs& args, const std::vector<Issue>& issues) {
  const auto first = std::find_if(issues.begin(), issues.end(), [](Issue issue) { return issue != Issue::none; });
  if (first == issues.end()) return;
  const std::int64_t item = first - issues.begin();
  const int Hk = args.layout.num_kv_heads;
  const int D = args.layout.head_dim;
  const std::string where = "token " + std::to_string(item / Hk) + ", kv head " + std::to_string(item % Hk);
  const bool is_key = *first == Issue::key_not_finite || *first == Issue::key_norm_range;
  const void* tensor = is_key ? args.key : args.value;
  std::vector<float> vector(D);
  for (int d = 0; d < D; ++d) vector[d] = load_as_float(tensor, args.kv_dtype, item * D + d);

  switch (*first) {
    case Issue::key_not_finite:
    case Issue::value_not_finite: {
      const int d = static_cast<int>(std::find_if(vector.begin(), vector.end(), [](float x) { return !std::isfinite(x); }) -
                                     vector.begin());
      fail(is_key ? "key" : "value", where + ", element " + std::to_string(d) + " is " + std::to_string(vector[d]) +
                                         "; accepted: finite values");
    }
    case Issue::key_norm_range:
      fail("key", where + ": norm " + std::to_string(sqrt_rn(dot_sequential(vector.data(), vector.data(), D))) +
                      " makes the stored fp16 key norm overflow; accepted: stored norm <= 65504");
    default: {
      const ValueRange range = value_range(vector.data(), D);
      fail("value", where + ": range [" + std::to_string(range.lo) + ", " + std::to_string(range.hi) +
                        "] makes the fp16 value scale or zero overflow; accepted: |value| and range within fp16 (65504)");
    }
  }
}

void write_half(std::uint8_t* at, std::uint16_t bits) {  // little-endian, any alignment
  at[0] = static_cast<std::uint8_t>(bits & 0xffu);
  at[1] = static_cast<std::uint8_t>(bits >> 8);
}

}  // namespace

void validate_store_shapes(const StoreArgs& args) {
  validate_layout(args.layout);
  TQ_REQUIRE(args.num_blocks >= 1, "num_blocks", std::to_string(args.num_blocks) + " is out of range; accepted: >= 1");
  TQ_REQUIRE(args.num_tokens >= 0, "num_tokens", std::to_string(args.num_tokens) + " is negative; accepted: >= 0");
  TQ_REQUIRE(args.kv_dtype == DType::f32 || args.kv_dtype == DType::f16 || args.kv_dtype == DType::bf16, "kv_dtype",
          "value " + std::to_string(static_cast<int>(args.kv_dtype)) + " is not a dtype; accepted: float32, float16, bfloat16");
  const PresetInfo info = args.layout.info();
  validate_codebook_size(args.layout, args.num_centroids);
  if (args.num_tokens == 0) return;
  require_pointer(args.cache, "cache");
  require_pointer(args.key, "key");
  require_pointer(args.value, "value");
  require_pointer(args.slot_mapping, "slot_mapping");
  if (!info.key_fp8) {
    require_pointer(args.Pi, "Pi");
    require_pointer(args.centroids, "centroids");
  }
}

void store_cpu(const StoreArgs& args) {
  validate_store_shapes(args);
  if (args.num_tokens == 0) return;
  const CacheLayout& layout = args.layout;
  if (!layout.key_fp8()) validate_constants(args);
  validate_slots(args);

  // Encode everything into staging first: nothing reaches the cache until
  // every pair is known to be storable.
  const int Hk = layout.num_kv_heads;
  const int F = layout.fields();
  const int record_bytes = layout.record_bytes();
  const std::int64_t items = args.num_tokens * Hk;
  Staging staging{std::vector<std::uint8_t>(items * record_bytes), std::vector<std::uint16_t>(items * F),
                  std::vector<Issue>(items, Issue::none)};
  const std::vector<float> midpoints = centroid_midpoints(args);
  parallel_for(items, [&](std::int64_t item) {
    if (args.slot_mapping[item / Hk] < 0) return;  // skipped tokens are not read
    staging.issues[item] = encode_item(args, midpoints.data(), item, staging.records.data() + item * record_bytes,
                                       staging.fields.data() + item * F);
  }, kMinParallelItems);
  report_first_issue(args, staging.issues);

  // Slots are distinct (validate_slots), so every item writes its own bytes.
  parallel_for(items, [&](std::int64_t item) {
    const std::int64_t slot_id = args.slot_mapping[item / Hk];
    if (slot_id < 0) return;
    const int slot = static_cast<int>(slot_id % layout.block_size);
    const int head = static_cast<int>(item % Hk);
    std::uint8_t* block = args.cache + layout.block_offset(slot_id / layout.block_size);
    const std::uint8_t* record = staging.records.data() + item * record_bytes;
    std::memcpy(block + layout.key_offset(slot, head), record, layout.key_bytes());
    std::memcpy(block + layout.value_offset(slot, head), record + layout.key_bytes(), layout.value_bytes());
    for (int f = 0; f < F; ++f) write_half(block + layout.field_offset(slot, head, f), staging.fields[item * F + f]);
  }, kMinParallelItems);
}

}  // namespace tqdecode
