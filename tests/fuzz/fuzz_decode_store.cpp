// libFuzzer target (docs/RELIABILITY.md): arbitrary bytes become a cache
// geometry (preset, head_dim, block_size, Hk, Hq, block stride, num_blocks,
// cache order: blocks, or token_slots with token and head strides in either
// order, padded or not, keys renormalized or not; supported values mostly,
// any int sometimes), a store (slot mapping, K/V with NaN, infinities and
// huge values) and a decode (block table, seq_lens, queries, sinks,
// strides, partition count), and a decode of several query tokens per
// sequence (query_start_loc, num_tokens, max_query_len: mostly consistent,
// sometimes not), driven through the public API: make_layout,
// make_token_slots_layout, store_cpu, rotate_queries_reference, decode_reference,
// decode_partitions_reference + reduce_partitions_reference and decode_cpu.
// tqdecode::Error is the expected answer to bad input; everything else is a
// finding:
//   - any crash, ASan or UBSan report (the build aborts on either);
//   - an Error that leaves the cache or an output buffer written;
//   - a successful store writing any byte but its slots' key data, value
//     data and fields;
//   - a decode reading a cache byte other than the key data, value data and
//     fields of the blocks its used block-table entries name (everything
//     else is ASan-poisoned while it runs), or writing output padding;
//   - an output or partition buffer element left unwritten by a success;
//   - decode_cpu and decode_reference disagreeing on validity or on bits;
//   - the split-KV result differing from the direct one beyond rounding,
//     where the inputs are realistic enough for rounding to be the only
//     difference;
//   - a row whose query is not finite not coming out all NaN (seq_len > 0)
//     or all zero (seq_len 0);
//   - a varlen token row differing in any bit from the one-token decode of
//     its query over its prefix (seq_len - q_len + j + 1 positions).
// Every buffer is allocated at exactly the size its claimed shape implies,
// so a read past what the arguments promise is an ASan report. Sizes are
// bounded so one input runs in milliseconds; inputs asking for more are
// skipped (never a finding).
#include <fuzzer/FuzzedDataProvider.h>
#include <sanitizer/asan_interface.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "random.hpp"
#include "tqdecode/constants.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"
#include "tqdecode/reference.hpp"
#include "tqdecode/store.hpp"

namespace {

using namespace tqdecode;

constexpr std::int64_t kMaxCacheBytes = std::int64_t(1) << 20;
constexpr std::int64_t kMaxElements = std::int64_t(1) << 17;  // any one tensor
// Multiply-adds of one call, roughly: the coverage callbacks on every loop
// compare make the library ~10x slower than plain, so these keep one input
// in the millisecond range.
constexpr std::int64_t kMaxWork = std::int64_t(1) << 19;
constexpr std::int64_t kMaxStoreWork = std::int64_t(1) << 18;

const char* last_error_message();

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "fuzz_decode_store: %s (last Error: %s)\n", what, last_error_message());
  std::abort();
}

void check(bool ok, const char* what) {
  if (!ok) finding(what);
}

// What the run reached, printed at exit when TQDECODE_FUZZ_STATS is set:
// stores and decodes accepted and refused, and rows checked by each oracle.
struct Stats {
  long stores_ok = 0, stores_refused = 0;
  long decodes_ok = 0, decodes_refused = 0, splits_ok = 0, varlen_ok = 0, varlen_refused = 0;
  long rows_compared = 0, rows_non_finite_query = 0, rows_empty = 0;
  ~Stats() {
    if (std::getenv("TQDECODE_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr,
                 "fuzz_decode_store stats: stores %ld ok / %ld refused; decodes %ld ok / %ld refused; split-KV %ld ok;"
                 " rows compared direct vs split %ld, non-finite query %ld, empty %ld; varlen decodes %ld ok / %ld "
                 "refused\n",
                 stores_ok, stores_refused, decodes_ok, decodes_refused, splits_ok, rows_compared,
                 rows_non_finite_query, rows_empty, varlen_ok, varlen_refused);
  }
} stats;

// Product of non-negative factors, or nullopt when any factor is negative or
// the product exceeds `limit` (including int64 overflow).
std::optional<std::int64_t> bounded_product(std::initializer_list<std::int64_t> factors, std::int64_t limit) {
  std::int64_t product = 1;
  for (std::int64_t factor : factors) {
    if (factor < 0) return std::nullopt;
    if (factor == 0) return 0;
  }
  for (std::int64_t factor : factors) {
    if (__builtin_mul_overflow(product, factor, &product) || product > limit) return std::nullopt;
  }
  return product;
}

// Elements a strided [rows, cols, inner] tensor spans: (rows - 1) * s0 +
// (cols - 1) * s1 + inner, 0 when any extent is below 1; nullopt past the limit.
std::optional<std::int64_t> strided_span(std::int64_t rows, std::int64_t s0, std::int64_t cols, std::int64_t s1,
                                         std::int64_t inner) {
  // Nothing to hold, or a negative stride the API must reject before reading.
  if (rows < 1 || cols < 1 || inner < 1 || s0 < 0 || s1 < 0) return 0;
  const auto a = bounded_product({rows - 1, s0}, kMaxElements);
  const auto b = bounded_product({cols - 1, s1}, kMaxElements);
  if (!a || !b || *a + *b + inner > kMaxElements) return std::nullopt;
  return *a + *b + inner;
}

// Mostly one of the usual values, sometimes any int.
int usual_or_any(FuzzedDataProvider& in, std::initializer_list<int> usual) {
  const std::uint8_t selector = in.ConsumeIntegral<std::uint8_t>();
  if (selector < 240) return usual.begin()[selector % usual.size()];
  return in.ConsumeIntegral<int>();
}

std::int64_t small_or_any(FuzzedDataProvider& in, std::int64_t lo, std::int64_t hi) {
  const std::uint8_t selector = in.ConsumeIntegral<std::uint8_t>();
  if (selector < 244) return in.ConsumeIntegralInRange<std::int64_t>(lo, hi);
  return in.ConsumeIntegral<std::int64_t>();
}

float special_float(FuzzedDataProvider& in) {
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 65504.0f, -70000.0f, 3.0e38f, 1e-40f, 0.0f};
  return specials[in.ConsumeIntegralInRange<int>(0, 7)];
}

// How a tensor's values are made: realistic (finite, normal), raw random
// bits (any float, NaN and infinities included) or realistic with a few
// special values at fuzzed positions.
enum class Fill : std::uint8_t { normal, raw_bits, specials };

struct Values {
  Fill fill = Fill::normal;
  std::uint64_t seed = 0;
  double amplitude = 1.0;
  std::vector<std::pair<std::int64_t, float>> specials;  // (index modulo size, value)
};

Values consume_values(FuzzedDataProvider& in) {
  Values v;
  const std::uint8_t mode = in.ConsumeIntegral<std::uint8_t>();
  v.fill = mode < 160 ? Fill::normal : (mode < 200 ? Fill::raw_bits : Fill::specials);
  v.seed = in.ConsumeIntegral<std::uint64_t>();
  const double amplitudes[] = {1.0, 1.0, 0.01, 100.0, 1e4};
  v.amplitude = amplitudes[in.ConsumeIntegralInRange<int>(0, 4)];
  if (v.fill == Fill::specials) {
    const int count = in.ConsumeIntegralInRange<int>(1, 4);
    for (int i = 0; i < count; ++i) {
      const std::int64_t index = in.ConsumeIntegral<std::uint16_t>();
      v.specials.emplace_back(index, special_float(in));
    }
  }
  return v;
}

// `count` elements of `dtype` (an invalid dtype is 2 bytes wide, as
// dtype_size says) made as `values` says.
std::vector<std::uint8_t> make_tensor(std::int64_t count, DType dtype, const Values& values) {
  const int width = dtype_size(dtype);
  const DType writable = dtype == DType::f32 || dtype == DType::f16 ? dtype : DType::bf16;
  std::vector<std::uint8_t> data(std::size_t(count) * width);
  Rng rng(values.seed);
  for (std::int64_t i = 0; i < count; ++i) {
    if (values.fill == Fill::raw_bits) {
      const std::uint64_t bits = rng.next_u64();
      std::memcpy(data.data() + i * width, &bits, width);  // little-endian: the low bytes
    } else {
      store_from_float(data.data(), writable, i, static_cast<float>(values.amplitude * rng.normal()));
    }
  }
  if (count > 0) {
    for (const auto& [index, value] : values.specials) store_from_float(data.data(), writable, index % count, value);
  }
  return data;
}

std::vector<float> make_floats(std::int64_t count, const Values& values) {
  const std::vector<std::uint8_t> bytes = make_tensor(count, DType::f32, values);
  std::vector<float> floats(count);
  if (count > 0) std::memcpy(floats.data(), bytes.data(), bytes.size());
  return floats;
}

bool supported(const CacheLayout& layout) {
  return std::find(kAllPresets.begin(), kAllPresets.end(), layout.preset) != kAllPresets.end() &&
         std::find(kHeadDims.begin(), kHeadDims.end(), layout.head_dim) != kHeadDims.end() &&
         std::find(kBlockSizes.begin(), kBlockSizes.end(), layout.block_size) != kBlockSizes.end() &&
         layout.num_kv_heads >= 1 && layout.num_kv_heads <= kMaxKvHeads;
}

// Model constants per (preset, head_dim), built once.
const ModelConstants* constants_for(const CacheLayout& layout) {
  static std::map<std::pair<int, int>, ModelConstants> cache;
  if (!supported(layout)) return nullptr;
  const auto key = std::make_pair(static_cast<int>(layout.preset), layout.head_dim);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_model_constants(layout.preset, layout.head_dim, 7)).first;
  return &it->second;
}

// A codebook and a rotation as the caller passes them: the real ones, or
// corrupted (unsorted, NaN, raw bits), with a possibly wrong claimed size.
// Buffers hold exactly what the claimed sizes promise.
struct Constants {
  std::vector<float> centroids;
  int num_centroids = 0;
  std::vector<float> rotation;  // Pi for the store, PiT for the decode
  bool realistic = false;       // the real, finite constants
};

Constants consume_constants(FuzzedDataProvider& in, const CacheLayout& layout, bool transpose) {
  Constants c;
  const ModelConstants* real = constants_for(layout);
  const std::uint8_t mode = in.ConsumeIntegral<std::uint8_t>();
  if (real != nullptr) {  // fp8 keys: no codebook, no rotation (null pointers)
    c.centroids = real->centroids;
    c.rotation = transpose ? real->PiT : real->Pi;
    c.realistic = true;
  } else {
    // fp8 keys or an unsupported geometry: the expected number of levels
    // (if any) and a D x D matrix if D is small enough to hold one.
    const int bits = preset_info(layout.preset).key_bits;
    c.centroids.assign(bits <= 4 ? std::size_t(1) << bits : 0, 0.5f);
    if (const auto elements = bounded_product({layout.head_dim, layout.head_dim}, kMaxElements)) {
      c.rotation.assign(*elements, 0.0f);
    }
  }
  if (mode >= 200 && !c.centroids.empty()) {  // corrupt the codebook
    c.realistic = false;
    const std::size_t i = in.ConsumeIntegralInRange<std::size_t>(0, c.centroids.size() - 1);
    if (mode & 1) c.centroids[i] = special_float(in);
    else std::swap(c.centroids[i], c.centroids[(i + 1) % c.centroids.size()]);
  }
  if (mode >= 180 && mode < 200 && !c.rotation.empty()) {  // corrupt the rotation
    c.realistic = false;
    c.rotation[in.ConsumeIntegralInRange<std::size_t>(0, c.rotation.size() - 1)] = special_float(in);
  }
  c.num_centroids = static_cast<int>(c.centroids.size());
  if (in.ConsumeIntegral<std::uint8_t>() >= 248) {  // a wrong claimed size, buffer to match when small
    c.num_centroids = in.ConsumeIntegral<int>();
    if (c.num_centroids >= 0 && c.num_centroids <= 1024) c.centroids.resize(c.num_centroids, 1.0f);
  }
  return c;
}

const float* data_or_null(const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); }

// Calls range(begin, bytes) for the key data, the value data and every fp16
// field of each kv head of slot `slot` in block `block` (offsets from the
// cache start): every byte a store may write or a decode may read there.
template <typename Range>
void for_each_entry_byte_range(const CacheLayout& layout, std::int64_t block, int slot, Range&& range) {
  const std::int64_t base = layout.block_offset(block);
  for (int h = 0; h < layout.num_kv_heads; ++h) {
    range(base + layout.key_offset(slot, h), layout.key_bytes());
    range(base + layout.value_offset(slot, h), layout.value_bytes());
    for (int f = 0; f < layout.fields(); ++f) range(base + layout.field_offset(slot, h, f), 2);
  }
}

bool valid_layout(const CacheLayout& layout) {
  try {
    validate_layout(layout);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// ---------------------------------------------------------------- the store

void fuzz_store(FuzzedDataProvider& in, const CacheLayout& layout, std::int64_t num_blocks,
                std::vector<std::uint8_t>& cache) {
  StoreArgs args;
  args.layout = layout;
  args.num_blocks = num_blocks;
  args.cache = cache.empty() ? nullptr : cache.data();
  args.num_tokens = small_or_any(in, 0, 20);
  const std::uint8_t dtype = in.ConsumeIntegral<std::uint8_t>();
  args.kv_dtype = dtype < 80 ? DType::bf16 : dtype < 160 ? DType::f16 : dtype < 250 ? DType::f32 : static_cast<DType>(dtype);

  const auto elements = bounded_product({args.num_tokens, layout.num_kv_heads, layout.head_dim}, kMaxElements);
  const auto work = bounded_product({args.num_tokens, layout.num_kv_heads, layout.head_dim, layout.head_dim},
                                    kMaxStoreWork);
  if (!elements || !work || args.num_tokens > 4096) return;  // a store this large is skipped
  const std::vector<std::uint8_t> key = make_tensor(*elements, args.kv_dtype, consume_values(in));
  const std::vector<std::uint8_t> value = make_tensor(*elements, args.kv_dtype, consume_values(in));
  args.key = key.empty() ? nullptr : key.data();
  args.value = value.empty() ? nullptr : value.data();

  // Slots: mostly distinct valid ones, with skips, repeats and strays.
  const auto slots_in_cache = bounded_product({num_blocks, layout.block_size}, std::int64_t(1) << 40);
  const std::int64_t num_slots = slots_in_cache && *slots_in_cache > 0 ? *slots_in_cache : 1;
  std::vector<std::int64_t> slots(std::max<std::int64_t>(args.num_tokens, 0));
  const std::int64_t first = in.ConsumeIntegral<std::uint32_t>() % std::max<std::int64_t>(num_slots, 1);
  for (std::size_t t = 0; t < slots.size(); ++t) {
    const std::uint8_t kind = in.ConsumeIntegral<std::uint8_t>();
    if (kind < 200) slots[t] = (first + std::int64_t(t) * 7) % num_slots;
    else if (kind < 220) slots[t] = -1 - kind % 3;
    else if (kind < 235) slots[t] = t > 0 ? slots[t - 1] : 0;
    else if (kind < 245) slots[t] = num_slots;
    else slots[t] = in.ConsumeIntegral<std::int64_t>();
  }
  args.slot_mapping = slots.empty() ? nullptr : slots.data();

  const Constants constants = consume_constants(in, layout, false);
  args.Pi = data_or_null(constants.rotation);
  args.centroids = data_or_null(constants.centroids);
  args.num_centroids = constants.num_centroids;

  const std::vector<std::uint8_t> before = cache;
  try {
    store_cpu(args);
    ++stats.stores_ok;
  } catch (const Error&) {
    ++stats.stores_refused;
    check(cache == before, "store_cpu threw Error but wrote the cache");
    return;
  }
  // A store writes the key data, value data and fields of its slots and no other byte.
  std::vector<bool> written(cache.size(), false);
  for (const std::int64_t slot : slots) {
    if (slot < 0) continue;
    for_each_entry_byte_range(layout, slot / layout.block_size, static_cast<int>(slot % layout.block_size),
                              [&](std::int64_t begin, int bytes) {
                                std::fill(written.begin() + begin, written.begin() + begin + bytes, true);
                              });
  }
  for (std::size_t i = 0; i < cache.size(); ++i) {
    check(written[i] || cache[i] == before[i], "store_cpu wrote a byte outside its slots' data and fields");
  }
}

// ---------------------------------------------------------------- the decode

constexpr std::uint32_t kSentinelBits = 0x7fa5a5a5u;  // a NaN no computation produces

float sentinel() { return bits_float(kSentinelBits); }
bool is_sentinel(float x) { return float_bits(x) == kSentinelBits; }

const char* last_error = "";  // the message of the last Error, for a finding's report
const char* last_error_message() { return last_error; }

template <typename Call>
bool succeeds(Call&& call) {
  static std::string message;
  try {
    call();
    return true;
  } catch (const Error& error) {
    message = error.what();
    last_error = message.c_str();
    return false;
  }
}

bool all_sentinel(const std::vector<float>& v) { return std::all_of(v.begin(), v.end(), is_sentinel); }

// The largest |vhat| and whether every key norm, value field and fp8 key
// byte the row reads is finite: the inputs under which direct and split-KV
// decodes may differ by rounding only.
struct RowInputs {
  bool finite = true;
  double value_peak = 0.0;
};

RowInputs row_inputs(const DecodeArgs& args, int b, int kv_head) {
  const CacheLayout& layout = args.layout;
  const PresetInfo info = layout.info();
  const std::int32_t* row = args.block_table + std::int64_t(b) * args.table_stride();
  RowInputs r;
  for (int t = 0; t < args.seq_lens[b]; ++t) {
    const std::uint8_t* block = args.cache + layout.block_offset(row[t / layout.block_size]);
    const int slot = t % layout.block_size;
    auto field = [&](int f) {
      const std::uint8_t* at = block + layout.field_offset(slot, kv_head, f);
      return double(half_bits_to_float(static_cast<std::uint16_t>(at[0] | at[1] << 8)));
    };
    const double scale = field(layout.value_scale_field());
    const double zero = field(layout.value_zero_field());
    r.finite &= std::isfinite(scale) && std::isfinite(zero);
    r.value_peak = std::max(r.value_peak, std::abs(scale) * ((1 << info.value_bits) - 1) + std::abs(zero));
    if (info.key_fp8) {
      const std::uint8_t* key = block + layout.key_offset(slot, kv_head);
      for (int d = 0; d < layout.head_dim; ++d) r.finite &= (key[d] & 0x7f) != 0x7f;
    } else {
      r.finite &= std::isfinite(field(layout.key_norm_field()));
    }
  }
  return r;
}

bool query_row_finite(const DecodeArgs& args, int b, int hq) {
  const std::int64_t base = b * args.q_stride_b() + hq * args.q_stride_h();
  for (int d = 0; d < args.layout.head_dim; ++d) {
    if (!std::isfinite(load_as_float(args.query, args.query_dtype, base + d))) return false;
  }
  return true;
}

// Checks that hold for every row of a successful direct and split-KV pair.
void check_rows(const DecodeArgs& args, bool realistic, const std::vector<float>& direct,
                const std::vector<float>& reduced) {
  const int D = args.layout.head_dim;
  for (int b = 0; b < args.batch; ++b) {
    for (int hq = 0; hq < args.num_q_heads; ++hq) {
      const std::size_t at = (std::size_t(b) * args.num_q_heads + hq) * D;
      const auto first = direct.begin() + at, split = reduced.begin() + at;
      if (args.seq_lens[b] == 0) {
        check(std::all_of(first, first + D, [](float x) { return x == 0.0f; }), "seq_len 0: direct row not zero");
        check(std::all_of(split, split + D, [](float x) { return x == 0.0f; }), "seq_len 0: split row not zero");
        ++stats.rows_empty;
        continue;
      }
      if (!query_row_finite(args, b, hq)) {
        check(std::all_of(first, first + D, [](float x) { return std::isnan(x); }), "non-finite query: direct row not NaN");
        check(std::all_of(split, split + D, [](float x) { return std::isnan(x); }), "non-finite query: split row not NaN");
        ++stats.rows_non_finite_query;
        continue;
      }
      if (!realistic) continue;
      if (args.sinks && !(std::abs(args.sinks[hq]) < 1e4f)) continue;
      const RowInputs inputs = row_inputs(args, b, hq / args.group_size());
      if (!inputs.finite) continue;
      const double tolerance = 1e-5 * inputs.value_peak + 1e-30;
      ++stats.rows_compared;
      for (int d = 0; d < D; ++d) {
        check(std::isfinite(first[d]) && std::isfinite(split[d]), "finite inputs gave a non-finite output");
        check(std::abs(double(first[d]) - split[d]) <= tolerance, "split-KV result differs from the direct one");
      }
    }
  }
}

// While alive, every cache byte a valid decode of these arguments has no
// business reading is ASan-poisoned: blocks no sequence's used block-table
// entries name (junk entries past a sequence's end, spare blocks), and in
// the named ones every byte that is not some (slot, head)'s key data, value
// data or field (the padding after a block's natural size, and in the
// token_slots order the padding between slots). A read there is a report.
class PoisonUnreadBlocks {
 public:
  PoisonUnreadBlocks(const DecodeArgs& args, const std::vector<std::uint8_t>& cache) : cache_(cache) {
    ASAN_POISON_MEMORY_REGION(cache.data(), cache.size());
    const CacheLayout& layout = args.layout;
    // Arguments the decode must reject read nothing at all: all stays poisoned.
    if (args.block_table == nullptr || args.seq_lens == nullptr || !valid_layout(layout) ||
        !bounded_product({args.num_blocks, layout.block_stride}, std::int64_t(cache.size()))) {
      return;
    }
    const std::int64_t max_len = std::int64_t(std::max(args.max_blocks_per_seq, 0)) * layout.block_size;
    for (int b = 0; b < args.batch; ++b) {
      const std::int64_t length = std::clamp<std::int64_t>(args.seq_lens[b], 0, max_len);
      for (std::int64_t j = 0; j < (length + layout.block_size - 1) / layout.block_size; ++j) {
        const std::int64_t block = args.block_table[b * args.table_stride() + j];
        if (block < 0 || block >= args.num_blocks) continue;
        for (int slot = 0; slot < layout.block_size; ++slot) {
          for_each_entry_byte_range(layout, block, slot, [&](std::int64_t begin, int bytes) {
            ASAN_UNPOISON_MEMORY_REGION(cache.data() + begin, bytes);
          });
        }
      }
    }
  }
  ~PoisonUnreadBlocks() { ASAN_UNPOISON_MEMORY_REGION(cache_.data(), cache_.size()); }
  PoisonUnreadBlocks(const PoisonUnreadBlocks&) = delete;
  PoisonUnreadBlocks& operator=(const PoisonUnreadBlocks&) = delete;

 private:
  const std::vector<std::uint8_t>& cache_;
};

void fuzz_decode(FuzzedDataProvider& in, const CacheLayout& layout, std::int64_t num_blocks,
                 const std::vector<std::uint8_t>& cache) {
  DecodeArgs args;
  args.layout = layout;
  args.num_blocks = num_blocks;
  args.cache = cache.empty() ? nullptr : cache.data();
  const int Hk = layout.num_kv_heads;
  const int D = layout.head_dim;
  args.batch = static_cast<int>(small_or_any(in, -1, 5));
  const std::uint8_t heads = in.ConsumeIntegral<std::uint8_t>();
  if (heads < 248) {
    const int groups[] = {1, 2, 3, 4, 5, 8, 16, 17};
    args.num_q_heads = static_cast<int>(static_cast<std::int64_t>(Hk) * groups[heads % 8]);  // wraps: fine, rejected
  } else {
    args.num_q_heads = in.ConsumeIntegral<int>();
  }
  args.max_blocks_per_seq = static_cast<int>(small_or_any(in, -1, 5));
  const std::uint8_t dtype = in.ConsumeIntegral<std::uint8_t>();
  args.query_dtype = dtype < 120 ? DType::bf16 : dtype < 245 ? DType::f16 : dtype < 250 ? DType::f32 : static_cast<DType>(dtype);
  const std::uint8_t strides = in.ConsumeIntegral<std::uint8_t>();
  if (strides >= 200) {
    args.query_stride_batch = small_or_any(in, -1, 600);
    args.query_stride_head = small_or_any(in, -1, 300);
    args.block_table_stride = small_or_any(in, -1, 8);
    args.output_stride_batch = small_or_any(in, -1, 600);
    args.output_stride_head = small_or_any(in, -1, 300);
    args.block_table_one_row = strides >= 250;  // refused with a block_table_stride other than 0
  }

  // Bound the work before building anything: direct + partitions + rotation.
  const std::int64_t max_tokens = std::int64_t(std::max(args.max_blocks_per_seq, 0)) * std::max(layout.block_size, 0);
  const auto tokens_work = bounded_product({std::max(args.batch, 0), std::max(args.num_q_heads, 0), max_tokens,
                                            std::max(D, 0), 3}, kMaxWork);
  const auto rotate_work = bounded_product({std::max(args.batch, 0), std::max(args.num_q_heads, 0), std::max(D, 0),
                                            std::max(D, 0)}, kMaxWork);
  if (!tokens_work || !rotate_work) return;

  const auto query_span = strided_span(args.batch, args.q_stride_b(), args.num_q_heads, args.q_stride_h(), D);
  const auto table_span = strided_span(args.batch, args.table_stride(), 1, 0, args.max_blocks_per_seq);
  const auto output_span = strided_span(args.batch, args.out_stride_b(), args.num_q_heads, args.out_stride_h(), D);
  const auto rows = bounded_product({std::max(args.batch, 0), std::max(args.num_q_heads, 0)}, kMaxElements);
  const auto out_elements = bounded_product({std::max(args.batch, 0), std::max(args.num_q_heads, 0), std::max(D, 0)},
                                            kMaxElements);
  if (!query_span || !table_span || !output_span || !rows || !out_elements) return;
  if (args.batch > 4096) return;  // seq_lens alone would be large (Hq <= 0 makes the bounds above 0)

  // Query, sinks, scale.
  const Values query_values = consume_values(in);
  const std::vector<std::uint8_t> query = make_tensor(*query_span, args.query_dtype, query_values);
  args.query = query.empty() ? nullptr : query.data();
  std::vector<float> sinks;
  if (in.ConsumeBool()) sinks = make_floats(std::max(args.num_q_heads, 0) <= kMaxElements ? std::max(args.num_q_heads, 0) : 0,
                                            consume_values(in));
  args.sinks = sinks.empty() ? nullptr : sinks.data();
  const bool usual_scale = in.ConsumeIntegral<std::uint8_t>() < 224;
  args.scale = usual_scale ? 1.0f / std::sqrt(static_cast<float>(std::max(D, 1))) : bits_float(in.ConsumeIntegral<std::uint32_t>());
  const Constants constants = consume_constants(in, layout, true);
  args.PiT = data_or_null(constants.rotation);
  args.centroids = data_or_null(constants.centroids);
  args.num_centroids = constants.num_centroids;

  // Block table and lengths: mostly valid, with junk past the end and strays.
  std::vector<std::int32_t> table(*table_span);
  for (std::int32_t& entry : table) {
    const std::uint8_t kind = in.ConsumeIntegral<std::uint8_t>();
    if (kind < 220) entry = static_cast<std::int32_t>(in.ConsumeIntegral<std::uint32_t>() % std::max<std::int64_t>(num_blocks, 1));
    else if (kind < 235) entry = -1;
    else if (kind < 245) entry = static_cast<std::int32_t>(std::min<std::int64_t>(num_blocks, INT32_MAX));
    else entry = in.ConsumeIntegral<std::int32_t>();
  }
  args.block_table = table.empty() ? nullptr : table.data();
  std::vector<std::int32_t> seq_lens(std::max(args.batch, 0));
  for (std::int32_t& length : seq_lens) {
    const std::uint8_t kind = in.ConsumeIntegral<std::uint8_t>();
    if (kind < 220) length = static_cast<std::int32_t>(in.ConsumeIntegralInRange<std::int64_t>(0, max_tokens));
    else if (kind < 235) length = 0;
    else if (kind < 245) length = static_cast<std::int32_t>(std::min<std::int64_t>(max_tokens + 1, INT32_MAX));
    else length = in.ConsumeIntegral<std::int32_t>();
  }
  args.seq_lens = seq_lens.empty() ? nullptr : seq_lens.data();

  // The rotation step alone (reads query and PiT only).
  std::vector<float> q_rot(*out_elements, sentinel());
  const bool rotate_ok = succeeds([&] { rotate_queries_reference(args, q_rot.empty() ? nullptr : q_rot.data()); });
  check(rotate_ok ? std::none_of(q_rot.begin(), q_rot.end(), is_sentinel) : all_sentinel(q_rot),
        "rotate_queries_reference wrote too little, or something on Error");

  std::optional<PoisonUnreadBlocks> poison;  // until the decodes are done
  poison.emplace(args, cache);

  // The direct decode.
  std::vector<float> direct(*out_elements, sentinel());
  const bool direct_ok = succeeds([&] { decode_reference(args, direct.empty() ? nullptr : direct.data()); });
  ++(direct_ok ? stats.decodes_ok : stats.decodes_refused);
  if (!direct_ok) check(all_sentinel(direct), "decode_reference threw Error but wrote its output");
  if (direct_ok) check(std::none_of(direct.begin(), direct.end(), is_sentinel), "decode_reference left output unwritten");

  // decode_cpu: the same validation, and the direct result in the query dtype.
  std::vector<std::uint8_t> output(std::size_t(*output_span) * dtype_size(args.query_dtype), 0xa5);
  DecodeArgs cpu = args;
  cpu.output = output.empty() ? nullptr : output.data();
  const std::vector<std::uint8_t> untouched = output;
  const bool cpu_ok = succeeds([&] { decode_cpu(cpu); });
  // decode_cpu also refuses an output whose strides overlap (the reference steps write contiguous rows).
  const std::int64_t output_sizes[] = {args.batch, args.num_q_heads, D};
  const std::int64_t output_strides[] = {cpu.out_stride_b(), cpu.out_stride_h(), 1};
  const bool distinct_output = strided_elements_distinct(output_sizes, output_strides);
  check(cpu_ok == direct_ok || (direct_ok && (cpu.output == nullptr || !distinct_output)),
        "decode_cpu and decode_reference disagree on validity");
  if (!cpu_ok) check(output == untouched, "decode_cpu threw Error but wrote its output");
  const auto row_block = bounded_product({args.num_q_heads, cpu.out_stride_h()}, std::numeric_limits<std::int64_t>::max());
  const bool disjoint_rows = cpu.out_stride_h() >= D && row_block && cpu.out_stride_b() >= *row_block;
  if (cpu_ok && disjoint_rows && args.batch >= 1) {
    std::vector<bool> element(*output_span, false);  // row elements; the rest is padding
    for (std::int64_t row = 0; row < *rows; ++row) {
      for (int d = 0; d < D; ++d) {
        const std::int64_t at = (row / args.num_q_heads) * cpu.out_stride_b() + (row % args.num_q_heads) * cpu.out_stride_h() + d;
        element[at] = true;
        const float got = load_as_float(output.data(), args.query_dtype, at);
        const float want = direct[row * D + d];
        std::vector<std::uint8_t> rounded(4);
        store_from_float(rounded.data(), args.query_dtype, 0, want);
        const float expected = load_as_float(rounded.data(), args.query_dtype, 0);
        check(std::isnan(got) ? std::isnan(expected) : got == expected, "decode_cpu differs from decode_reference");
      }
    }
    const int width = dtype_size(args.query_dtype);
    for (std::size_t i = 0; i < output.size(); ++i) {
      check(element[i / width] || output[i] == 0xa5, "decode_cpu wrote output padding");
    }
  }

  // Split-KV: partitions, then the reducer.
  const int num_partitions = static_cast<int>(small_or_any(in, -1, 12));
  const int align = usual_or_any(in, {16, 1, 7, layout.block_size, 64, 0});
  const auto part_rows = bounded_product({*rows, std::max(num_partitions, 0)}, kMaxElements);
  const auto part_elements = bounded_product({*rows, std::max(num_partitions, 0), std::max(D, 0)}, kMaxElements);
  if (!part_rows || !part_elements || num_partitions > 64) return;
  std::vector<float> max(*part_rows, sentinel()), sum(*part_rows, sentinel()), partial(*part_elements, sentinel());
  const PartitionBuffers buffers{max.empty() ? nullptr : max.data(), sum.empty() ? nullptr : sum.data(),
                                 partial.empty() ? nullptr : partial.data()};
  const bool partitions_ok = succeeds([&] { decode_partitions_reference(args, num_partitions, align, buffers); });
  if (!partitions_ok) {
    check(all_sentinel(max) && all_sentinel(sum) && all_sentinel(partial), "partitions threw Error but wrote a buffer");
    check(!direct_ok || num_partitions < 1 || align < 1 || align > (1 << 16) || *rows == 0,
          "partitions rejected what decode_reference took");
    return;
  }
  for (const std::vector<float>* buffer : {&max, &sum, &partial}) {
    check(std::none_of(buffer->begin(), buffer->end(), is_sentinel), "a partition buffer element was not written");
  }
  poison.reset();  // the reducer reads partition buffers only
  std::vector<float> reduced(*out_elements, sentinel());
  const bool reduce_ok =
      succeeds([&] { reduce_partitions_reference(args, num_partitions, buffers, reduced.empty() ? nullptr : reduced.data()); });
  check(reduce_ok || *out_elements == 0, "reduce rejected what the partition step took");
  if (!reduce_ok) return;
  stats.splits_ok += direct_ok;
  const bool realistic = constants.realistic && query_values.fill == Fill::normal && query_values.amplitude <= 1.0 &&
                         usual_scale;
  if (direct_ok) check_rows(args, realistic, direct, reduced);
}

// Several query tokens per sequence: contiguous [T, Hq, D] query and
// output, query_start_loc and lengths mostly consistent (q_len up to
// max_query_len and seq_len), sometimes anything. decode_reference and
// decode_cpu must agree on validity and bits, write nothing on Error, and a
// success must give every token row the one-token decode of its prefix.
void fuzz_varlen_decode(FuzzedDataProvider& in, const CacheLayout& layout, std::int64_t num_blocks,
                        const std::vector<std::uint8_t>& cache) {
  DecodeArgs args;
  args.layout = layout;
  args.num_blocks = num_blocks;
  args.cache = cache.empty() ? nullptr : cache.data();
  const int D = layout.head_dim;
  args.batch = static_cast<int>(small_or_any(in, -1, 4));
  args.num_q_heads =  // wraps: fine, rejected
      static_cast<int>(static_cast<std::int64_t>(layout.num_kv_heads) * usual_or_any(in, {1, 2, 3, 4, 8, 16}));
  args.max_blocks_per_seq = static_cast<int>(small_or_any(in, -1, 4));
  args.query_dtype = in.ConsumeBool() ? DType::bf16 : DType::f16;
  args.max_query_len = usual_or_any(in, {1, 2, 4, 8, 17, 0});
  if (args.batch < 0 || args.batch > 64 || args.num_q_heads < 1 || args.num_q_heads > kMaxElements ||
      !bounded_product({args.batch, args.max_blocks_per_seq}, kMaxElements)) {
    // Nothing sensible to allocate. Without query_start_loc, num_tokens
    // must be refused whatever else is wrong.
    args.num_tokens = 1;
    check(!succeeds([&] { validate_decode_shapes(args); }), "num_tokens without query_start_loc was accepted");
    return;
  }
  const std::int64_t max_tokens = std::int64_t(args.max_blocks_per_seq) * std::max(layout.block_size, 0);

  // Offsets: consistent query lengths, or any values.
  std::vector<std::int32_t> starts(args.batch + 1, 0), seq_lens(args.batch);
  const bool consistent = in.ConsumeIntegral<std::uint8_t>() < 200;
  for (int b = 0; b < args.batch; ++b) {
    const int query_len = consistent ? in.ConsumeIntegralInRange<int>(0, std::clamp(args.max_query_len, 0, 17))
                                     : in.ConsumeIntegralInRange<int>(-3, 20);
    starts[b + 1] = starts[b] + query_len;
    const std::uint8_t kind = in.ConsumeIntegral<std::uint8_t>();
    seq_lens[b] = kind < 230 ? static_cast<std::int32_t>(in.ConsumeIntegralInRange<std::int64_t>(
                                   std::min<std::int64_t>(std::max(query_len, 0), max_tokens), max_tokens))
                             : in.ConsumeIntegral<std::int32_t>();
  }
  if (!consistent && in.ConsumeBool()) starts[0] = in.ConsumeIntegralInRange<int>(-2, 2);
  args.num_tokens = consistent ? starts[args.batch] : static_cast<int>(small_or_any(in, -1, 40));
  args.query_start_loc = starts.data();
  args.seq_lens = seq_lens.empty() ? nullptr : seq_lens.data();
  const int rows = std::max(args.num_tokens, 0);
  const auto work = bounded_product({rows, args.num_q_heads, max_tokens, std::max(D, 0), 2}, kMaxWork);
  const auto elements = bounded_product({rows, args.num_q_heads, std::max(D, 0)}, kMaxElements);
  if (!work || !elements) return;

  const std::vector<std::uint8_t> query = make_tensor(*elements, args.query_dtype, consume_values(in));
  args.query = query.empty() ? nullptr : query.data();
  std::vector<float> sinks;
  if (in.ConsumeBool()) sinks = make_floats(args.num_q_heads, consume_values(in));
  args.sinks = data_or_null(sinks);
  args.scale = 1.0f / std::sqrt(static_cast<float>(std::max(D, 1)));
  const Constants constants = consume_constants(in, layout, true);
  args.PiT = data_or_null(constants.rotation);
  args.centroids = data_or_null(constants.centroids);
  args.num_centroids = constants.num_centroids;
  std::vector<std::int32_t> table(std::size_t(args.batch) * args.max_blocks_per_seq);
  for (std::int32_t& entry : table) {
    entry = in.ConsumeIntegral<std::uint8_t>() < 245
                ? static_cast<std::int32_t>(in.ConsumeIntegral<std::uint32_t>() % std::max<std::int64_t>(num_blocks, 1))
                : in.ConsumeIntegral<std::int32_t>();
  }
  args.block_table = table.empty() ? nullptr : table.data();

  std::optional<PoisonUnreadBlocks> poison;
  poison.emplace(args, cache);
  std::vector<float> direct(*elements, sentinel());
  const bool direct_ok = succeeds([&] { decode_reference(args, direct.empty() ? nullptr : direct.data()); });
  ++(direct_ok ? stats.varlen_ok : stats.varlen_refused);
  check(direct_ok ? std::none_of(direct.begin(), direct.end(), is_sentinel) : all_sentinel(direct),
        "varlen decode_reference left output unwritten, or wrote it on Error");
  std::vector<std::uint8_t> output(std::size_t(*elements) * dtype_size(args.query_dtype), 0xa5);
  DecodeArgs cpu = args;
  cpu.output = output.empty() ? nullptr : output.data();
  const bool cpu_ok = succeeds([&] { decode_cpu(cpu); });
  check(cpu_ok == direct_ok || (direct_ok && cpu.output == nullptr), "varlen decode_cpu and decode_reference disagree");
  if (!cpu_ok) check(std::all_of(output.begin(), output.end(), [](std::uint8_t x) { return x == 0xa5; }),
                     "varlen decode_cpu threw Error but wrote its output");
  if (!direct_ok) return;
  for (std::int64_t i = 0; cpu_ok && i < *elements; ++i) {
    std::vector<std::uint8_t> rounded(4);
    store_from_float(rounded.data(), args.query_dtype, 0, direct[i]);
    const float expected = load_as_float(rounded.data(), args.query_dtype, 0);
    const float got = load_as_float(output.data(), args.query_dtype, i);
    check(std::isnan(got) ? std::isnan(expected) : got == expected, "varlen decode_cpu differs from decode_reference");
  }

  // Each token row: the one-token decode of its query over its prefix.
  const std::int64_t row = std::int64_t(args.num_q_heads) * D;
  for (int b = 0; b < args.batch; ++b) {
    const int query_len = starts[b + 1] - starts[b];
    for (int j = 0; j < query_len; ++j) {
      DecodeArgs one = args;
      one.query_start_loc = nullptr;
      one.num_tokens = 0;
      one.max_query_len = 0;
      one.batch = 1;
      one.query = query.data() + (starts[b] + j) * row * dtype_size(args.query_dtype);
      one.block_table = table.data() + std::size_t(b) * args.max_blocks_per_seq;
      const std::int32_t prefix = seq_lens[b] - query_len + j + 1;
      one.seq_lens = &prefix;
      std::vector<float> expected(row);
      check(succeeds([&] { decode_reference(one, expected.data()); }), "a valid varlen token's prefix was refused");
      for (std::int64_t e = 0; e < row; ++e) {
        const float got = direct[(starts[b] + j) * row + e];
        check(float_bits(got) == float_bits(expected[e]) || (std::isnan(got) && std::isnan(expected[e])),
              "a varlen token differs from the one-token decode of its prefix");
      }
    }
  }
}

// The token_slots order's strides: mostly a valid arrangement (vLLM's dense
// order or heads-major, slots padded by an even amount, pages padded by
// `padding`), sometimes any values (odd, overlapping, negative, huge), or an
// unknown order value, which the API must reject. False when the slots'
// extent plus `padding` is too large for a cache this target allocates (or
// for int64).
bool token_slots_geometry(FuzzedDataProvider& in, std::uint8_t order, std::int64_t padding, CacheLayout& layout) {
  layout.order = order == 255 ? static_cast<CacheOrder>(in.ConsumeIntegral<std::uint8_t>()) : CacheOrder::token_slots;
  layout.renormalize_keys = in.ConsumeBool();
  const bool heads_major = (order & 1) != 0;
  if (order >= 240 || !supported(layout)) {
    layout.token_stride = small_or_any(in, -2, 400);
    layout.head_stride = small_or_any(in, -2, 400);
    layout.block_stride = small_or_any(in, -2, 40000);
  } else {
    const std::int64_t pitch = layout.slot_bytes() + 2 * in.ConsumeIntegralInRange<int>(0, 4);
    const auto inner = bounded_product({pitch, heads_major ? layout.block_size : layout.num_kv_heads}, kMaxCacheBytes);
    const auto extent =
        inner ? bounded_product({*inner, heads_major ? layout.num_kv_heads : layout.block_size}, kMaxCacheBytes)
              : std::nullopt;
    if (!extent || __builtin_add_overflow(*extent, padding, &layout.block_stride)) return false;
    layout.token_stride = heads_major ? pitch : *inner;
    layout.head_stride = heads_major ? *inner : pitch;
  }
  try {  // the layout builder on the same values
    make_token_slots_layout(layout.preset, layout.head_dim, layout.block_size, layout.num_kv_heads,
                            layout.block_stride, layout.token_stride, layout.head_stride, layout.renormalize_keys);
  } catch (const Error&) {
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);

  // Geometry: supported values mostly, anything sometimes.
  const std::uint8_t preset = in.ConsumeIntegral<std::uint8_t>();
  CacheLayout layout{};
  layout.preset = preset < 250 ? kAllPresets[preset % 4] : static_cast<Preset>(preset);
  layout.head_dim = usual_or_any(in, {64, 128, 256, 64});
  layout.block_size = usual_or_any(in, {16, 32, 64, 128});
  layout.num_kv_heads = usual_or_any(in, {1, 2, 3, 4});
  const std::int64_t padding = small_or_any(in, -2, 40);
  const std::int64_t num_blocks = small_or_any(in, -1, 9);
  const std::uint8_t order = in.ConsumeIntegral<std::uint8_t>();
  if (order < 128) {
    try {  // the layout builder on the same values
      make_layout(layout.preset, layout.head_dim, layout.block_size, layout.num_kv_heads, padding < 0 ? padding : 0);
    } catch (const Error&) {
    }
    // The natural size is only defined for a supported geometry; otherwise the
    // stride is whatever the input says (the API must reject the geometry).
    layout.block_stride = padding;
    if (supported(layout) && __builtin_add_overflow(layout.natural_block_bytes(), padding, &layout.block_stride)) return 0;
  } else if (!token_slots_geometry(in, order, padding, layout)) {
    return 0;
  }

  const auto cache_bytes = bounded_product({std::max<std::int64_t>(num_blocks, 0), std::max<std::int64_t>(layout.block_stride, 0)},
                                           kMaxCacheBytes);
  if (!cache_bytes) return 0;
  std::vector<std::uint8_t> cache(*cache_bytes);  // junk, as a reused cache holds
  Rng rng(in.ConsumeIntegral<std::uint64_t>());
  for (std::size_t i = 0; i < cache.size(); i += 8) {
    const std::uint64_t word = rng.next_u64();
    std::memcpy(cache.data() + i, &word, std::min<std::size_t>(8, cache.size() - i));
  }

  fuzz_store(in, layout, num_blocks, cache);
  fuzz_decode(in, layout, num_blocks, cache);
  fuzz_varlen_decode(in, layout, num_blocks, cache);
  return 0;
}
