#include "tqdecode/format.hpp"

#include <algorithm>

#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

// "a, b, c": the names of every item, for the accepted values of an error.
template <typename Item, std::size_t N, typename NameOf>
std::string joined_names(const std::array<Item, N>& items, NameOf name_of) {
  std::string names;
  for (Item item : items) {
    if (!names.empty()) names += ", ";
    names += name_of(item);
  }
  return names;
}

// 'name' for an error message; the quoted string comes first so that the
// message grows by appends (GCC 12 warns, -Wrestrict, on "literal" + string&&).
std::string quoted(std::string_view name) {
  std::string text(1, '\'');
  text += name;
  text += '\'';
  return text;
}

std::string preset_names() {
  return joined_names(kAllPresets, [](Preset preset) { return preset_info(preset).name; });
}

std::string cache_order_names() { return joined_names(kAllCacheOrders, cache_order_name); }

template <typename Value, std::size_t N>
bool contains(const std::array<Value, N>& values, Value value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

}  // namespace

Preset parse_preset(std::string_view name, std::string_view argument) {
  for (Preset preset : kAllPresets) {
    if (name == preset_info(preset).name) return preset;
  }
  fail(argument, quoted(name) + " is not a preset; accepted: " + preset_names());
}

Preset preset_from_parameters(int mse_bits, int value_bits, bool key_fp8) {
  for (Preset preset : kAllPresets) {
    const PresetInfo info = preset_info(preset);
    const bool same_keys = key_fp8 ? info.key_fp8 : (!info.key_fp8 && info.key_bits == mse_bits);
    if (same_keys && info.value_bits == value_bits) return preset;
  }
  const std::string parameters =
      std::to_string(mse_bits) + ", " + std::to_string(value_bits) + ", " + (key_fp8 ? "true" : "false");
  fail("mse_bits/value_quant_bits/key_fp8",
       "(" + parameters + ") names no preset; accepted: (4, 4, false), (3, 4, false), (3, 3, false), (any, 4, true)");
}

namespace {

// Everything but the stride; natural_block_bytes() is only meaningful (and
// free of integer overflow) once these pass.
void validate_geometry(const CacheLayout& layout) {
  TQ_REQUIRE(contains(kAllPresets, layout.preset), "preset", "unknown preset value; accepted: " + preset_names());
  TQ_REQUIRE(contains(kHeadDims, layout.head_dim), "head_dim",
          std::to_string(layout.head_dim) + " is not supported; accepted: " + accepted_list(kHeadDims));
  TQ_REQUIRE(contains(kBlockSizes, layout.block_size), "block_size",
          std::to_string(layout.block_size) + " is not supported; accepted: " + accepted_list(kBlockSizes));
  TQ_REQUIRE(layout.num_kv_heads >= 1 && layout.num_kv_heads <= kMaxKvHeads, "num_kv_heads",
          std::to_string(layout.num_kv_heads) + " is out of range; accepted: 1 to " +
              std::to_string(kMaxKvHeads));
}

// Extent of `count` entries `stride` apart, each `bytes` long: (count - 1)
// * stride + bytes, or -1 when that overflows int64.
std::int64_t extent(int count, std::int64_t stride, std::int64_t bytes) {
  std::int64_t span = 0;
  if (__builtin_mul_overflow(static_cast<std::int64_t>(count - 1), stride, &span) ||
      __builtin_add_overflow(span, bytes, &span)) {
    return -1;
  }
  return span;
}

void require_even_positive_stride(std::int64_t stride, const char* argument) {
  TQ_REQUIRE(stride > 0 && stride % 2 == 0, argument,
             std::to_string(stride) + " bytes is not accepted; accepted: a positive even byte stride "
             "(every fp16 field of a slot must be 2-byte aligned)");
}

// token_slots: strides and the renormalization flag. The slots of a block
// form a token x head grid. One stride must nest the other (the inner one at
// least a slot, the outer one at least the inner dimension's extent) so no
// two slots overlap, and the grid's extent must fit in the block stride. A
// dimension of one entry nests in anything. Every check is O(1):
// validate_layout runs on every decode call.
void validate_token_slots(const CacheLayout& layout) {
  require_even_positive_stride(layout.block_stride, "block_stride");
  require_even_positive_stride(layout.token_stride, "token_stride");
  require_even_positive_stride(layout.head_stride, "head_stride");
  const int slot = layout.slot_bytes();
  const bool tokens_inner = layout.num_kv_heads == 1 || layout.token_stride < layout.head_stride;
  const char* inner_name = tokens_inner ? "token_stride" : "head_stride";
  const char* outer_name = tokens_inner ? "head_stride" : "token_stride";
  const std::int64_t inner = tokens_inner ? layout.token_stride : layout.head_stride;
  const std::int64_t outer = tokens_inner ? layout.head_stride : layout.token_stride;
  const int inner_count = tokens_inner ? layout.block_size : layout.num_kv_heads;
  const int outer_count = tokens_inner ? layout.num_kv_heads : layout.block_size;
  TQ_REQUIRE(inner >= slot, inner_name,
             std::to_string(inner) + " bytes makes slots overlap; accepted: at least the slot size " +
                 std::to_string(slot) + " bytes of " + layout.info().name + " with head_dim " +
                 std::to_string(layout.head_dim));
  const std::int64_t inner_extent = extent(inner_count, inner, slot);
  TQ_REQUIRE(inner_extent >= 0, inner_name,
             std::to_string(inner) + " bytes is too large: the slots of a block would span more than 2^63 bytes");
  if (outer_count > 1) {
    TQ_REQUIRE(outer >= inner_extent, outer_name,
               std::to_string(outer) + " bytes makes slots overlap; accepted: at least " +
                   std::to_string(inner_extent) + " bytes, the extent of the " + std::to_string(inner_count) +
                   (tokens_inner ? " tokens " : " kv heads ") + "at " + inner_name + " " + std::to_string(inner));
  }
  const std::int64_t block_extent = extent(outer_count, outer, inner_extent);
  TQ_REQUIRE(block_extent >= 0 && layout.block_stride >= block_extent, "block_stride",
             std::to_string(layout.block_stride) + " bytes is smaller than the " +
                 (block_extent < 0 ? std::string("int64-overflowing") : std::to_string(block_extent)) +
                 " bytes the slots of a block span at token_stride " + std::to_string(layout.token_stride) +
                 " and head_stride " + std::to_string(layout.head_stride));
  TQ_REQUIRE(!layout.renormalize_keys || !layout.key_fp8(), "renormalize_keys",
             std::string("true is not accepted for ") + layout.info().name +
                 ": fp8 keys have no centroid vector to renormalize; accepted: false");
}

}  // namespace

const char* cache_order_name(CacheOrder order) {
  return order == CacheOrder::token_slots ? "token_slots" : "blocks";
}

CacheOrder parse_cache_order(std::string_view name, std::string_view argument) {
  for (CacheOrder order : kAllCacheOrders) {
    if (name == cache_order_name(order)) return order;
  }
  fail(argument, quoted(name) + " is not a cache order; accepted: " + cache_order_names());
}

void validate_layout(const CacheLayout& layout) {
  validate_geometry(layout);
  TQ_REQUIRE(contains(kAllCacheOrders, layout.order), "order",
             "value " + std::to_string(static_cast<int>(layout.order)) +
                 " is not a cache order; accepted: " + cache_order_names());
  if (layout.token_slots()) {
    validate_token_slots(layout);
    return;
  }
  TQ_REQUIRE(layout.block_stride >= layout.natural_block_bytes(), "block_stride",
          std::to_string(layout.block_stride) + " bytes is smaller than the natural block size " +
              std::to_string(layout.natural_block_bytes()) + " bytes of this geometry");
}

CacheLayout make_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                        std::int64_t block_stride) {
  CacheLayout layout{preset, head_dim, block_size, num_kv_heads, 0};
  validate_geometry(layout);  // before natural_block_bytes(), which assumes a supported geometry
  TQ_REQUIRE(block_stride >= 0, "block_stride", std::to_string(block_stride) + " is negative; accepted: 0 (natural) or >= the natural block size");
  layout.block_stride = block_stride == 0 ? layout.natural_block_bytes() : block_stride;
  validate_layout(layout);
  return layout;
}

CacheLayout make_token_slots_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                                    std::int64_t block_stride, std::int64_t token_stride, std::int64_t head_stride,
                                    bool renormalize_keys) {
  const CacheLayout layout{preset,       head_dim,         block_size,   num_kv_heads, block_stride,
                           CacheOrder::token_slots, renormalize_keys, token_stride, head_stride};
  validate_layout(layout);
  return layout;
}

CacheLayout make_token_slots_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                                    bool renormalize_keys) {
  CacheLayout layout{preset, head_dim, block_size, num_kv_heads, 0, CacheOrder::token_slots, renormalize_keys};
  validate_geometry(layout);  // before slot_bytes(), which assumes a supported geometry
  layout.head_stride = layout.slot_bytes();
  layout.token_stride = layout.head_stride * num_kv_heads;
  layout.block_stride = layout.token_stride * block_size;
  validate_layout(layout);
  return layout;
}

void validate_codebook_size(const CacheLayout& layout, int num_centroids) {
  const PresetInfo info = layout.info();
  if (info.key_fp8) return;
  const int levels = 1 << info.key_bits;
  TQ_REQUIRE(num_centroids == levels, "num_centroids",
          std::to_string(num_centroids) + " does not match " + info.name + "; accepted: " + std::to_string(levels) +
              " (2^" + std::to_string(info.key_bits) + ")");
}

void validate_group_size(int num_q_heads, int num_kv_heads) {
  TQ_REQUIRE(num_kv_heads >= 1, "num_kv_heads", std::to_string(num_kv_heads) + " must be >= 1");
  TQ_REQUIRE(num_q_heads >= 1 && num_q_heads % num_kv_heads == 0, "num_q_heads",
          std::to_string(num_q_heads) + " is not a positive multiple of num_kv_heads " +
              std::to_string(num_kv_heads));
  const int group = num_q_heads / num_kv_heads;
  TQ_REQUIRE(group <= kMaxGroupSize, "num_q_heads",
          "group size num_q_heads / num_kv_heads = " + std::to_string(group) +
              " is not supported; accepted: 1 to " + std::to_string(kMaxGroupSize));
}

}  // namespace tqdecode
