// The byte-level contract of docs/FORMAT.md: bit packing, the fp16 / bf16 /
// fp8 conversions and the block layout offsets.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "random.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"
#include "tqdecode/packing.hpp"

namespace tqdecode {
namespace {

std::vector<std::uint8_t> random_codes(int count, int bits, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::uint8_t> codes(count);
  for (std::uint8_t& code : codes) code = static_cast<std::uint8_t>(rng.below(1u << bits));
  return codes;
}

// ---------------------------------------------------------------- packing

TEST(Packing, RoundTripsEveryWidthAndWritesOnlyItsBytes) {
  for (int bits : {1, 2, 3, 4, 8}) {
    for (int count : {1, 5, 7, 8, 63, 64, 128, 256}) {
      const std::vector<std::uint8_t> codes = random_codes(count, bits, 31 * bits + count);
      const int bytes = packed_bytes(count, bits);
      EXPECT_EQ(bytes, (count * bits + 7) / 8);
      std::vector<std::uint8_t> packed(bytes + 4, 0xa5);  // 4 canary bytes after the string
      pack_codes(codes.data(), count, bits, packed.data());
      for (int d = 0; d < count; ++d) ASSERT_EQ(unpack_code(packed.data(), d, bits), codes[d]) << bits << " bits, d " << d;
      for (int i = bytes; i < bytes + 4; ++i) EXPECT_EQ(packed[i], 0xa5) << "wrote past the packed string";
      const int used_bits = (count * bits) % 8;
      if (used_bits) {
        EXPECT_EQ(packed[bytes - 1] >> used_bits, 0) << "padding bits are zero";
      }
    }
  }
}

TEST(Packing, ThreeBitsFollowsTheFormatFormula) {
  const int count = 128;
  const std::vector<std::uint8_t> codes = random_codes(count, 3, 7);
  std::vector<std::uint8_t> b(packed_bytes(count, 3) + 1, 0);  // + 1: the formula may read one byte past the end
  pack_codes(codes.data(), count, 3, b.data());
  for (int d = 0; d < count; ++d) {
    EXPECT_EQ(((b[3 * d / 8] | b[3 * d / 8 + 1] << 8) >> (3 * d % 8)) & 7, codes[d]) << "d " << d;
  }
  // Codes 0..7, LSB first: 000 100 010 110 001 101 011 111 read as bits 0..23.
  const std::uint8_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  std::uint8_t packed[3];
  pack_codes(ramp, 8, 3, packed);
  EXPECT_EQ(packed[0], 0x88);
  EXPECT_EQ(packed[1], 0xc6);
  EXPECT_EQ(packed[2], 0xfa);
}

TEST(Packing, FourBitsPutEvenElementsInTheLowNibble) {
  const int count = 64;
  const std::vector<std::uint8_t> codes = random_codes(count, 4, 9);
  std::vector<std::uint8_t> packed(packed_bytes(count, 4));
  pack_codes(codes.data(), count, 4, packed.data());
  for (int d = 0; d < count; ++d) {
    EXPECT_EQ(d % 2 == 0 ? packed[d / 2] & 0xf : packed[d / 2] >> 4, codes[d]) << "d " << d;
  }
}

TEST(Packing, OneAndTwoBitsAreLsbFirst) {
  const std::uint8_t one[8] = {1, 0, 1, 1, 0, 0, 0, 1};
  const std::uint8_t two[4] = {3, 0, 1, 2};
  std::uint8_t packed = 0;
  pack_codes(one, 8, 1, &packed);
  EXPECT_EQ(packed, 0x8d);  // 0b1000'1101
  pack_codes(two, 4, 2, &packed);
  EXPECT_EQ(packed, 0x93);  // 0b10'01'00'11
}

// ---------------------------------------------------------------- fp16

TEST(Fp16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_half_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half_bits(1.0f + 0x1p-11f), 0x3c00);                 // tie, even stays
  EXPECT_EQ(float_to_half_bits(1.0f + 3 * 0x1p-11f), 0x3c02);             // tie, odd rounds up
  EXPECT_EQ(float_to_half_bits(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);      // above the tie
  EXPECT_EQ(float_to_half_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_half_bits(0.199951171875f), 0x3266);
}

TEST(Fp16, Subnormals) {
  EXPECT_EQ(float_to_half_bits(0x1p-14f), 0x0400);              // smallest normal
  EXPECT_EQ(float_to_half_bits(1023 * 0x1p-24f), 0x03ff);       // largest subnormal
  EXPECT_EQ(float_to_half_bits(0x1p-24f), 0x0001);              // smallest subnormal
  EXPECT_EQ(float_to_half_bits(0x1p-25f), 0x0000);              // tie with 0: even
  EXPECT_EQ(float_to_half_bits(0x1p-25f + 0x1p-35f), 0x0001);   // just above the tie
  EXPECT_EQ(float_to_half_bits(3 * 0x1p-25f), 0x0002);          // 1.5 ulp: tie to even 2
  EXPECT_EQ(float_to_half_bits(-0x1p-24f), 0x8001);
  EXPECT_EQ(half_bits_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(half_bits_to_float(0x03ff), 1023 * 0x1p-24f);
}

TEST(Fp16, OverflowAndNan) {
  EXPECT_EQ(float_to_half_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half_bits(65519.99f), 0x7bff);  // below the tie with 65536
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7c00);   // the tie rounds to infinity
  EXPECT_EQ(float_to_half_bits(-1e10f), 0xfc00);
  EXPECT_EQ(float_to_half_bits(std::numeric_limits<float>::infinity()), 0x7c00);
  const std::uint16_t nan = float_to_half_bits(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7c00, 0x7c00);
  EXPECT_NE(nan & 0x03ff, 0);
  EXPECT_TRUE(std::isnan(half_bits_to_float(0x7e00)));
  EXPECT_EQ(half_bits_to_float(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(Fp16, EveryNonNanValueRoundTrips) {
  for (unsigned bits = 0; bits <= 0xffff; ++bits) {
    const std::uint16_t half = static_cast<std::uint16_t>(bits);
    if ((half & 0x7c00) == 0x7c00 && (half & 0x3ff)) continue;  // NaN payloads need not survive
    ASSERT_EQ(float_to_half_bits(half_bits_to_float(half)), half) << std::hex << bits;
  }
}

// ---------------------------------------------------------------- bf16

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f), 0x3f80);             // tie, even stays
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3f82);         // tie, odd rounds up
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(0x1p-130f), 0x0008);  // fp32 subnormal 2^-130 = bits 0x00080000
  EXPECT_EQ(round_to_bf16(3.14159265f), 3.140625f);
}

TEST(Bf16, OverflowAndNan) {
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to infinity
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xff80);
  // A signalling NaN whose payload sits in the low bits must stay a NaN, not
  // round into infinity.
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x7f800001u)), 0x7fc0);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Bf16, EveryNonNanValueRoundTrips) {
  for (unsigned bits = 0; bits <= 0xffff; ++bits) {
    const std::uint16_t bf16 = static_cast<std::uint16_t>(bits);
    if ((bf16 & 0x7f80) == 0x7f80 && (bf16 & 0x7f)) continue;
    ASSERT_EQ(float_to_bf16_bits(bf16_bits_to_float(bf16)), bf16) << std::hex << bits;
  }
}

// ---------------------------------------------------------------- fp8 e4m3

TEST(Fp8E4m3, RoundsToNearestEven) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0625f), 0x38);  // 1 + 2^-4: tie between 1 and 1.125, even stays
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.1875f), 0x3a);  // 1 + 3 * 2^-4: tie, odd rounds up to 1.25
  EXPECT_EQ(float_to_fp8_e4m3_bits(-2.5f), 0xc2);
  EXPECT_EQ(float_to_fp8_e4m3_bits(240.0f), 0x77);
  EXPECT_EQ(float_to_fp8_e4m3_bits(256.0f), 0x78);
  EXPECT_EQ(float_to_fp8_e4m3_bits(416.0f), 0x7d);
}

TEST(Fp8E4m3, Subnormals) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(0x1p-6f), 0x08);               // smallest normal
  EXPECT_EQ(float_to_fp8_e4m3_bits(7 * 0x1p-9f), 0x07);           // largest subnormal
  EXPECT_EQ(float_to_fp8_e4m3_bits(0x1p-9f), 0x01);               // smallest subnormal
  EXPECT_EQ(float_to_fp8_e4m3_bits(0x1p-10f), 0x00);              // tie with 0: even
  EXPECT_EQ(float_to_fp8_e4m3_bits(0x1p-10f + 0x1p-20f), 0x01);
  EXPECT_EQ(float_to_fp8_e4m3_bits(3 * 0x1p-10f), 0x02);          // 1.5 ulp: tie to even 2
  EXPECT_EQ(float_to_fp8_e4m3_bits(-0x1p-9f), 0x81);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x01), 0x1p-9f);
}

TEST(Fp8E4m3, SaturatesAndKeepsNan) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3_bits(464.0f), 0x7e);  // the tie with 480 (not representable) saturates
  EXPECT_EQ(float_to_fp8_e4m3_bits(1e9f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-1e9f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3_bits(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0xff)));
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0xfe), -448.0f);
}

TEST(Fp8E4m3, EveryNonNanValueRoundTrips) {
  for (unsigned bits = 0; bits <= 0xff; ++bits) {
    if ((bits & 0x7f) == 0x7f) continue;
    EXPECT_EQ(float_to_fp8_e4m3_bits(fp8_e4m3_bits_to_float(static_cast<std::uint8_t>(bits))), bits) << std::hex << bits;
  }
}

// ---------------------------------------------------------------- layout

TEST(Layout, Headline4BitNcOffsets) {
  // D = 128, block 16, 8 kv heads: KD = 128 * 4 / 8 = 64, VD = 64, F = 3,
  // record 128 bytes; data region 16 * 8 * 128 = 16384 bytes; natural block
  // 16 * 8 * (128 + 2 * 3) = 17152 bytes, 134 bytes per (token, head).
  const CacheLayout layout = make_layout(Preset::turboquant_4bit_nc, 128, 16, 8);
  EXPECT_EQ(layout.key_bytes(), 64);
  EXPECT_EQ(layout.value_bytes(), 64);
  EXPECT_EQ(layout.fields(), 3);
  EXPECT_EQ(layout.record_bytes(), 128);
  EXPECT_EQ(layout.metadata_region_offset(), 16384);
  EXPECT_EQ(layout.natural_block_bytes(), 17152);
  EXPECT_EQ(layout.block_stride, 17152);
  EXPECT_EQ(layout.bytes_per_token_head(), 134);
  EXPECT_EQ(layout.key_norm_field(), 0);
  EXPECT_EQ(layout.value_scale_field(), 1);
  EXPECT_EQ(layout.value_zero_field(), 2);
  // Slot 5, head 3: record (5 * 8 + 3) * 128 = 5504; value zero (field 2) at
  // 16384 + 2 * ((3 * 3 + 2) * 16 + 5) = 16384 + 362.
  EXPECT_EQ(layout.record_offset(5, 3), 5504);
  EXPECT_EQ(layout.field_offset(5, 3, 2), 16746);
  EXPECT_EQ(layout.field_offset(0, 0, 0), 16384);
  EXPECT_EQ(layout.field_offset(15, 7, 2), 17152 - 2);  // the last fp16 of the block
}

TEST(Layout, K8v4Offsets) {
  // D = 128, block 16, 8 kv heads: fp8 keys KD = 128, VD = 64, F = 2 (value
  // scale 0, value zero 1), record 192; data region 16 * 8 * 192 = 24576;
  // natural block 16 * 8 * (192 + 4) = 25088, 196 bytes per (token, head).
  const CacheLayout layout = make_layout(Preset::turboquant_k8v4, 128, 16, 8);
  EXPECT_EQ(layout.key_bytes(), 128);
  EXPECT_EQ(layout.value_bytes(), 64);
  EXPECT_EQ(layout.fields(), 2);
  EXPECT_EQ(layout.record_bytes(), 192);
  EXPECT_EQ(layout.metadata_region_offset(), 24576);
  EXPECT_EQ(layout.natural_block_bytes(), 25088);
  EXPECT_EQ(layout.bytes_per_token_head(), 196);
  EXPECT_EQ(layout.value_scale_field(), 0);
  EXPECT_EQ(layout.value_zero_field(), 1);
  // Slot 5, head 3: record (5 * 8 + 3) * 192 = 8256; value zero (field 1) at
  // 24576 + 2 * ((3 * 2 + 1) * 16 + 5) = 24576 + 234.
  EXPECT_EQ(layout.record_offset(5, 3), 8256);
  EXPECT_EQ(layout.field_offset(5, 3, 1), 24810);
}

TEST(Layout, ThreeBitSizesAndPaddedStride) {
  // 3-bit: D = 64 packs into 24 bytes; D = 256 into 96 (keys), 4-bit values 128.
  const CacheLayout small = make_layout(Preset::turboquant_3bit_nc, 64, 32, 2);
  EXPECT_EQ(small.key_bytes(), 24);
  EXPECT_EQ(small.value_bytes(), 24);
  EXPECT_EQ(small.natural_block_bytes(), 32 * 2 * (48 + 6));
  const CacheLayout large = make_layout(Preset::turboquant_k3v4_nc, 256, 128, 1, 70000);
  EXPECT_EQ(large.key_bytes(), 96);
  EXPECT_EQ(large.value_bytes(), 128);
  EXPECT_EQ(large.natural_block_bytes(), 128 * (224 + 6));
  EXPECT_EQ(large.block_stride, 70000);
  // Block offsets are 64-bit: block 100000 starts past 4 GiB.
  EXPECT_EQ(large.block_offset(100000), 7000000000LL);
}

}  // namespace
}  // namespace tqdecode
