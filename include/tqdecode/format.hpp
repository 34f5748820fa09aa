// The TurboQuant paged KV-cache format (docs/FORMAT.md sections 1, 4 and
// 4b): presets and the byte layout of one cache block in either order.
// Usable from host and device code.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "tqdecode/common.hpp"
#include "tqdecode/packing.hpp"

namespace tqdecode {

enum class Preset : std::uint8_t {
  turboquant_4bit_nc,  ///< 4-bit MSE keys, 4-bit values, norm correction (headline profile)
  turboquant_k3v4_nc,  ///< 3-bit MSE keys, 4-bit values, norm correction
  turboquant_3bit_nc,  ///< 3-bit MSE keys, 3-bit values, norm correction
  turboquant_k8v4,     ///< fp8 e4m3 keys (not rotated), 4-bit values
};

inline constexpr std::array<Preset, 4> kAllPresets = {
    Preset::turboquant_4bit_nc, Preset::turboquant_k3v4_nc, Preset::turboquant_3bit_nc,
    Preset::turboquant_k8v4};

struct PresetInfo {
  const char* name;
  int key_bits;          ///< bits per key element: MSE codebook bits, or 8 for fp8
  int value_bits;        ///< bits per value code
  bool key_fp8;          ///< keys stored as fp8 e4m3, unrotated
  bool norm_correction;  ///< stored key norm divided by the norm of its centroid vector
};

TQ_HOST_DEVICE constexpr PresetInfo preset_info(Preset preset) {
  switch (preset) {
    case Preset::turboquant_4bit_nc: return {"turboquant_4bit_nc", 4, 4, false, true};
    case Preset::turboquant_k3v4_nc: return {"turboquant_k3v4_nc", 3, 4, false, true};
    case Preset::turboquant_3bit_nc: return {"turboquant_3bit_nc", 3, 3, false, true};
    default: return {"turboquant_k8v4", 8, 4, true, false};
  }
}

/// Parses a preset name; throws Error naming `argument` with the accepted names.
Preset parse_preset(std::string_view name, std::string_view argument = "preset");

/// Finds the preset with these engine-side parameters (the launcher's
/// mse_bits / value_quant_bits / key_fp8 arguments). The launcher's
/// norm_correction does not take part: in the blocks layout the correction
/// is folded into the stored key norm at store time, so decode is the same
/// function with or without it.
Preset preset_from_parameters(int mse_bits, int value_bits, bool key_fp8);

/// Supported geometry values (validated by make_layout).
inline constexpr std::array<int, 3> kHeadDims = {64, 128, 256};
inline constexpr std::array<int, 4> kBlockSizes = {16, 32, 64, 128};
inline constexpr int kMaxGroupSize = 16;
inline constexpr int kMaxKvHeads = 1024;

/// How a cache block arranges its (slot, kv head) entries.
enum class CacheOrder : std::uint8_t {
  /// docs/FORMAT.md section 4: per block, the records (key data then value
  /// data) of every (slot, head), then the fp16 fields grouped by head and field.
  blocks,
  /// docs/FORMAT.md section 4b (vLLM's TurboQuant cache on CUDA): one slot
  /// per (slot, head), [key data | key norm (MSE keys) | value data | value
  /// scale | value zero], at slot * token_stride + head * head_stride.
  token_slots,
};

inline constexpr std::array<CacheOrder, 2> kAllCacheOrders = {CacheOrder::blocks, CacheOrder::token_slots};

/// Name of a cache order as users write it ("blocks", "token_slots").
const char* cache_order_name(CacheOrder order);

/// Parses a cache order's name; throws Error naming `argument` with the accepted names.
CacheOrder parse_cache_order(std::string_view name, std::string_view argument = "order");

/// Byte layout of one cache block (docs/FORMAT.md sections 4 and 4b).
/// Offsets are 64-bit; a cache may exceed 4 GiB. The accessors key_offset,
/// value_offset and field_offset serve both orders; record_offset and
/// metadata_region_offset exist in the blocks order only.
struct CacheLayout {
  Preset preset;
  int head_dim;
  int block_size;
  int num_kv_heads;
  std::int64_t block_stride;  ///< bytes between consecutive blocks (>= natural_block_bytes() for blocks)
  CacheOrder order = CacheOrder::blocks;
  /// token_slots: decode divides each token's key by the norm of its
  /// centroid vector (docs/FORMAT.md section 4b, norm correction at decode
  /// time); the blocks order folds that into the stored norm and ignores
  /// this flag.
  bool renormalize_keys = false;
  std::int64_t token_stride = 0;  ///< token_slots: bytes between the slots of consecutive tokens
  std::int64_t head_stride = 0;   ///< token_slots: bytes between the slots of consecutive kv heads

  TQ_HOST_DEVICE constexpr PresetInfo info() const { return preset_info(preset); }
  TQ_HOST_DEVICE constexpr bool key_fp8() const { return info().key_fp8; }
  TQ_HOST_DEVICE constexpr bool token_slots() const { return order == CacheOrder::token_slots; }
  /// KD: key data bytes per record.
  TQ_HOST_DEVICE constexpr int key_bytes() const { return packed_bytes(head_dim, info().key_bits); }
  /// VD: value data bytes per record.
  TQ_HOST_DEVICE constexpr int value_bytes() const { return packed_bytes(head_dim, info().value_bits); }
  /// F: fp16 metadata fields per (slot, head).
  TQ_HOST_DEVICE constexpr int fields() const { return key_fp8() ? 2 : 3; }
  TQ_HOST_DEVICE constexpr int record_bytes() const { return key_bytes() + value_bytes(); }
  /// Field index of the key norm (MSE presets only).
  TQ_HOST_DEVICE constexpr int key_norm_field() const { return 0; }
  TQ_HOST_DEVICE constexpr int value_scale_field() const { return key_fp8() ? 0 : 1; }
  TQ_HOST_DEVICE constexpr int value_zero_field() const { return key_fp8() ? 1 : 2; }

  /// token_slots: bytes of one slot, KD + 2 (MSE keys) + VD + 4 rounded up to even.
  TQ_HOST_DEVICE constexpr int slot_bytes() const {
    const int bytes = record_bytes() + 2 * fields();
    return bytes + (bytes & 1);
  }
  /// token_slots: offset within a slot of the value data (after the key
  /// data and, for MSE keys, the key norm).
  TQ_HOST_DEVICE constexpr int slot_value_offset() const { return key_bytes() + (key_fp8() ? 0 : 2); }
  /// token_slots: offset within a slot of fp16 `field` (field indices as in
  /// the blocks order: the key norm after the key data, the value scale and
  /// zero after the value data).
  TQ_HOST_DEVICE constexpr int slot_field_offset(int field) const {
    if (!key_fp8() && field == key_norm_field()) return key_bytes();
    return slot_value_offset() + value_bytes() + 2 * (field - value_scale_field());
  }
  /// token_slots: offset, from the block start, of the slot of (slot, head).
  TQ_HOST_DEVICE constexpr std::int64_t slot_offset(int slot, int head) const {
    return static_cast<std::int64_t>(slot) * token_stride + static_cast<std::int64_t>(head) * head_stride;
  }

  /// blocks: offset, from the block start, of the record (key data then value data) of (slot, head).
  TQ_HOST_DEVICE constexpr std::int64_t record_offset(int slot, int head) const {
    return (static_cast<std::int64_t>(slot) * num_kv_heads + head) * record_bytes();
  }
  /// blocks: offset, from the block start, of the fp16 metadata region.
  TQ_HOST_DEVICE constexpr std::int64_t metadata_region_offset() const {
    return static_cast<std::int64_t>(block_size) * num_kv_heads * record_bytes();
  }

  /// Offset, from the block start, of the key data (KD bytes) of (slot, head).
  TQ_HOST_DEVICE constexpr std::int64_t key_offset(int slot, int head) const {
    return token_slots() ? slot_offset(slot, head) : record_offset(slot, head);
  }
  /// Offset, from the block start, of the value data (VD bytes) of (slot, head).
  TQ_HOST_DEVICE constexpr std::int64_t value_offset(int slot, int head) const {
    return token_slots() ? slot_offset(slot, head) + slot_value_offset() : record_offset(slot, head) + key_bytes();
  }
  /// Offset, from the block start, of fp16 metadata `field` of (slot, head).
  TQ_HOST_DEVICE constexpr std::int64_t field_offset(int slot, int head, int field) const {
    if (token_slots()) return slot_offset(slot, head) + slot_field_offset(field);
    return metadata_region_offset() +
           2 * ((static_cast<std::int64_t>(head) * fields() + field) * block_size + slot);
  }
  /// Bytes of one block with nothing between its entries: the blocks
  /// order's natural size, or block_size * Hk dense slots.
  TQ_HOST_DEVICE constexpr std::int64_t natural_block_bytes() const {
    const int per_entry = token_slots() ? slot_bytes() : record_bytes() + 2 * fields();
    return static_cast<std::int64_t>(block_size) * num_kv_heads * per_entry;
  }
  /// Bytes of cache read per (token, kv head).
  TQ_HOST_DEVICE constexpr int bytes_per_token_head() const { return record_bytes() + 2 * fields(); }
  TQ_HOST_DEVICE constexpr std::int64_t block_offset(std::int64_t block) const { return block * block_stride; }
};

/// Builds and validates a layout in the blocks order. `block_stride` 0
/// means the natural size. Throws Error naming the argument (preset,
/// head_dim, block_size, num_kv_heads, block_stride) when a value is not
/// supported.
CacheLayout make_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                        std::int64_t block_stride = 0);

/// Builds and validates a layout in the token_slots order with the strides
/// of a uint8 tensor [num_blocks, block_size, Hk, slot] in bytes: stride(0),
/// stride(1) and stride(2). Any order of the token and head strides is
/// accepted, and padding between slots and after a block's last slot, as
/// long as the slots of a block do not overlap (one of the two strides nests
/// the other: the inner one at least slot_bytes(), the outer one at least
/// the inner dimension's extent), lie inside the block stride, and every
/// fp16 field is 2-byte aligned (every stride even). Throws Error naming the
/// argument (preset, head_dim, block_size, num_kv_heads, block_stride,
/// token_stride, head_stride, renormalize_keys).
CacheLayout make_token_slots_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                                    std::int64_t block_stride, std::int64_t token_stride, std::int64_t head_stride,
                                    bool renormalize_keys);

/// The token_slots layout with vLLM's dense memory order: the heads of a
/// token side by side (head_stride = slot_bytes()), the tokens of a block
/// one after another, blocks unpadded.
CacheLayout make_token_slots_layout(Preset preset, int head_dim, int block_size, int num_kv_heads,
                                    bool renormalize_keys);

/// Re-validates a layout built by hand (same checks as make_layout or
/// make_token_slots_layout, by its order).
void validate_layout(const CacheLayout& layout);

/// Validates the number of codebook levels for the layout's preset
/// (2^key_bits for MSE keys; anything for fp8 keys, which use none).
void validate_codebook_size(const CacheLayout& layout, int num_centroids);

/// Validates a query-heads-per-kv-head group size (1 to kMaxGroupSize).
void validate_group_size(int num_q_heads, int num_kv_heads);

/// "16, 32, 64, 128"-style list of accepted values, for error messages.
template <std::size_t N>
std::string accepted_list(const std::array<int, N>& values) {
  std::string text;
  for (std::size_t i = 0; i < N; ++i) {
    if (i) text += ", ";
    text += std::to_string(values[i]);
  }
  return text;
}

}  // namespace tqdecode
