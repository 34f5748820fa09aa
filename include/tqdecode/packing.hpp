// Bit packing of codes, LSB first within little-endian bytes (docs/FORMAT.md
// section 4): element d of a b-bit string occupies bits [b*d, b*d + b).
#pragma once

#include <cstdint>

#include "tqdecode/common.hpp"

namespace tqdecode {

/// Bytes that hold `count` codes of `bits` bits.
TQ_HOST_DEVICE constexpr int packed_bytes(int count, int bits) { return (count * bits + 7) / 8; }

/// Code `index` of a packed string of `bits`-bit codes (bits 1..8). Reads the
/// second byte only when the code straddles it, so a packed string is never
/// read past its end.
TQ_HOST_DEVICE int unpack_code(const std::uint8_t* packed, int index, int bits) {
  const int bit = index * bits;
  const int byte = bit >> 3;
  const int shift = bit & 7;
  unsigned window = packed[byte];
  if (shift + bits > 8) window |= static_cast<unsigned>(packed[byte + 1]) << 8;
  return static_cast<int>((window >> shift) & ((1u << bits) - 1u));
}

/// Packs `count` codes (each < 2^bits) into packed_bytes(count, bits) bytes.
TQ_HOST_DEVICE void pack_codes(const std::uint8_t* codes, int count, int bits, std::uint8_t* packed) {
  const int bytes = packed_bytes(count, bits);
  for (int i = 0; i < bytes; ++i) packed[i] = 0;
  for (int index = 0; index < count; ++index) {
    const int bit = index * bits;
    const unsigned shifted = static_cast<unsigned>(codes[index]) << (bit & 7);
    packed[bit >> 3] |= static_cast<std::uint8_t>(shifted & 0xffu);
    if ((bit & 7) + bits > 8) packed[(bit >> 3) + 1] |= static_cast<std::uint8_t>(shifted >> 8);
  }
}

}  // namespace tqdecode
