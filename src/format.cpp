#include "tqdecode/format.hpp"

#include <algorithm>

#include "tqdecode/error.hpp"

namespace tqdecode {

namespace {

std::string preset_names() {
  std::string names;
  for (Preset preset : kAllPresets) {
    if (!names.empty()) names += ", ";
    names += preset_info(preset).name;
  }
  return names;
}

template <std::size_t N>
bool contains(const std::array<int, N>& values, int value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

}  // namespace

Preset parse_preset(std::string_view name, std::string_view argument) {
  for (Preset preset : kAllPresets) {
    if (name == preset_info(preset).name) return preset;
  }
  fail(argument, "'" + std::string(name) + "' is not a preset; accepted: " + preset_names());
}

Preset preset_from_parameters(int mse_bits, int value_bits, bool key_fp8) {
  for (Preset preset : kAllPresets) {
    const PresetInfo info = preset_info(preset);
    const bool same_keys = key_fp8 ? info.key_fp8 : (!info.key_fp8 && info.key_bits == mse_bits);
    if (same_keys && info.value_bits == value_bits) return preset;
  }
  fail("mse_bits/value_quant_bits/key_fp8",
       "(" + std::to_string(mse_bits) + ", " + std::to_string(value_bits) + ", " + (key_fp8 ? "true" : "false") +
           ") names no preset; accepted: (4, 4, false), (3, 4, false), (3, 3, false), (any, 4, true)");
}

namespace {

// Everything but the stride; natural_block_bytes() is only meaningful (and
// free of integer overflow) once these pass.
void validate_geometry(const CacheLayout& layout) {
  bool known_preset = false;
  for (Preset preset : kAllPresets) known_preset |= preset == layout.preset;
  TQ_REQUIRE(known_preset, "preset", "unknown preset value; accepted: " + preset_names());
  TQ_REQUIRE(contains(kHeadDims, layout.head_dim), "head_dim",
          std::to_string(layout.head_dim) + " is not supported; accepted: " + accepted_list(kHeadDims));
  TQ_REQUIRE(contains(kBlockSizes, layout.block_size), "block_size",
          std::to_string(layout.block_size) + " is not supported; accepted: " + accepted_list(kBlockSizes));
  TQ_REQUIRE(layout.num_kv_heads >= 1 && layout.num_kv_heads <= kMaxKvHeads, "num_kv_heads",
          std::to_string(layout.num_kv_heads) + " is out of range; accepted: 1 to " +
              std::to_string(kMaxKvHeads));
}

}  // namespace

void validate_layout(const CacheLayout& layout) {
  validate_geometry(layout);
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
