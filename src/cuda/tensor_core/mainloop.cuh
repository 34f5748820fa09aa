// The main loop's products per key format (internal; kernel.cuh's stage 2):
// the key scores S^T = K Q^T of a tile from its keys in a ring stage, and the
// value accumulation O^T += V^T P'^T. Everything between them (fields,
// online softmax, P') is format-independent and stays in kernel.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../device_utils.cuh"
#include "fragments.cuh"
#include "slot_tile.cuh"
#include "tile_layout.cuh"

namespace tqdecode::cuda::tensor_core {

/// 16 key bytes of a lane from a stage: token_slots read in place
/// (SlotReadLayout) only 2-byte aligned, `skew` bytes past the 8-byte
/// boundary `address`, else one aligned load.
template <class Layout>
__device__ __forceinline__ uint4 load_key_chunk(const std::uint8_t* address, int skew) {
  if constexpr (kReadsSlots<Layout>) {
    return load_shared_unaligned_16(address, skew);
  } else {
    return load_shared<uint4>(address);
  }
}

/// A lane's operands in a ring stage, the same for every tile of the stream
/// (offsets from the stage's start, and byte-permute selectors). Keys of
/// tokens g and g + 8 (dims (D/4)c ..): for 4-bit keys one 8-byte load
/// (D = 64), one 16-byte load (D = 128) or two (D = 256); for fp8 keys D/64
/// 16-byte loads; for 3-bit keys two 4-byte words (D = 64), three (D = 128)
/// or three 8-byte loads (D = 256). Values of tokens 2c, 2c + 1, 2c + 8,
/// 2c + 9 (dims (D/8)g ..: D/16 bytes of 4-bit values, 3D/64 bytes of 3-bit
/// values).
template <class Shape, class Layout, CacheFormat Format>
struct LaneOperands {
  static constexpr int HeadDim = Shape::kHeadDim;
  static constexpr bool kBulkCopy = Shape::kBulkCopy;
  static constexpr int kKeyWordLoads = HeadDim == 64 ? 2 : 3;
  static constexpr int kValueWordLoads = HeadDim == 256 ? 3 : 2;
  int key_offset[2][Layout::kKeyLoads];  // key load bases per token
  int value_offset[4];                   // 4-bit values
  // 3-bit values: words 0, 1 (and 2 at D = 256) of tokens 2c and 2c + 1
  // (those of 2c + 8 and 2c + 9 are Layout::kOffset8Tokens further).
  int value_word[2][kValueWordLoads];
  // 3-bit keys: the lane's key loads of token g (token g + 8's are
  // Layout::kOffset8Tokens further).
  int key_word[kKeyWordLoads];
  std::uint32_t low_selector = 0, high_selector = 0, key_low_selector = 0, key_high_selector = 0;
  // token_slots read in place (SlotReadLayout): where token g's slot starts
  // (token g + 8's is Layout::kOffset8Tokens further), for its fields.
  int slot_row;
  // token_slots read in place, not rotated: the bytes past the aligned
  // offsets above (load_shared_unaligned*) of the keys (8-byte boundaries
  // for 16-byte chunks, words for 3-bit keys) and, where kValueSkews, of
  // the values of tokens 2c + j (words; the same for 2c + j + 8,
  // Layout::kOffset8Tokens further). The cp.async shapes take the values'
  // skews from their addresses each tile: held from before the loop there,
  // they make the compiler keep the shared window's base in a vector
  // register and add it to every table lookup.
  static constexpr bool kValueSkews = kBulkCopy;
  int key_skew = 0;
  int value_skew[2] = {0, 0};
  // Rotated slot reads (kReadsRotatedSlots): the bytes of the first key
  // chunk (lane quad 0) and of the value words (lane g = 0) taken from past
  // the key and value data (load_rotated).
  std::uint32_t key_mask[4], value_mask[2];
  bool value_wraps;  // lane g = 0 (lane quad 0's keys: kernel.cuh)

  /// The token of a tile's S^T row or O^T k index `index` (TileLayout<mse4>).
  __device__ __forceinline__ static int token_at(int index) {
    if constexpr (Format == CacheFormat::mse4 || kReadsRotatedSlots<Layout>) {
      return Layout::template token_at<kBulkCopy>(index);
    }
    return index;
  }

  /// `first_lead` and `token_stride`: token_slots read in place (SlotReadLayout::slot_row).
  __device__ __forceinline__ LaneOperands(int g, int c, int head, int num_kv_heads, int first_lead,
                                          std::uint32_t token_stride) {
    if constexpr (kReadsSlots<Layout>) {
      in_slots(g, c, first_lead, token_stride);
    } else {
      in_tile_layout(g, c, head, num_kv_heads);
    }
  }

  /// The lanes' loads where the slots landed: every offset from a slot's
  /// start (SlotReadLayout), the keys and values in their natural order.
  __device__ __forceinline__ void in_slots(int g, int c, int first_lead, std::uint32_t token_stride) {
    const auto row = [&](int token) { return Layout::slot_row(token, first_lead, token_stride); };
    slot_row = row(token_at(g));
    if constexpr (kReadsRotatedSlots<Layout>) {
      // Every slot at lead first_lead: the row's 16-byte units (key_unit), and the 8 bytes from the 8-byte
      // boundary at or below value byte 8g - r (SlotReadLayout).
#pragma unroll
      for (int part = 0; part < Layout::kKeyLoads; ++part) {
        key_offset[0][part] = slot_row - first_lead + Layout::key_unit(c, part);
        key_offset[1][part] = key_offset[0][part] + Layout::kOffset8Tokens;
      }
      const int value_rotation = Layout::value_byte_rotation(first_lead);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        value_offset[j] = row(token_at(2 * c + j)) + Layout::kValueStart - value_rotation + 8 * g;
        value_offset[j + 2] = value_offset[j] + Layout::kOffset8Tokens;
      }
      value_wraps = g == 0;
#pragma unroll
      for (int w = 0; w < 4; ++w) key_mask[w] = prefix_mask(c == 0 ? first_lead : 0, w);
#pragma unroll
      for (int w = 0; w < 2; ++w) value_mask[w] = prefix_mask(g == 0 ? value_rotation : 0, w);
    } else {
      // Offsets from a stage's start, which lies on a 16-byte boundary, so
      // their skews hold for every stage. Token g + 8's slot lies
      // Layout::kOffset8Tokens (a multiple of 8) past token g's.
      const int key_start = slot_row + Layout::key_byte(c, 0);
      key_skew = key_start & (three_bit_keys(Format) ? 3 : 7);
#pragma unroll
      for (int part = 0; part < Layout::kKeyLoads; ++part) {
        key_offset[0][part] = slot_row + Layout::key_byte(c, part) - key_skew;
        key_offset[1][part] = key_offset[0][part] + Layout::kOffset8Tokens;
      }
      key_word[0] = key_start - key_skew;  // 3-bit keys: 12 bytes from 4 words
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        // 4-bit values: 8 bytes of tokens 2c + j and 2c + j + 8 from 3
        // words; 3-bit values: 6 bytes from 2 words (skew 0 or 2).
        const int start = row(2 * c + j) + Layout::value_byte(g);
        value_skew[j] = kValueSkews ? start & 3 : 0;
        value_offset[j] = start - value_skew[j];
        value_offset[j + 2] = value_offset[j] + Layout::kOffset8Tokens;
        value_word[j][0] = value_offset[j];
      }
    }
  }

  __device__ __forceinline__ void in_tile_layout(int g, int c, int head, int num_kv_heads) {
    constexpr bool kFp8 = Format == CacheFormat::fp8;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int token = 8 * j + g;
      if constexpr (kFp8) {
#pragma unroll
        for (int part = 0; part < Layout::kKeyLoads; ++part) key_offset[j][part] = Layout::key_offset(token, c, part);
      } else if constexpr (three_bit_keys(Format)) {
#pragma unroll
        for (int w = 0; w < kKeyWordLoads; ++w) {
          key_word[w] = static_cast<int>(opaque(Layout::key_word_offset(g, c, w, head, num_kv_heads)));
        }
      } else if (j == 0) {  // 4-bit keys: token g + 8's are Layout::kOffset8Tokens further
#pragma unroll
        for (int part = 0; part < Layout::kKeyLoads; ++part) {
          key_offset[0][part] = static_cast<int>(opaque(Layout::template key_offset<kBulkCopy>(token_at(token), c, part)));
        }
      }
    }
    if constexpr (value_bits(Format) == 4) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int token = token_at(2 * c + (k & 1) + 8 * (k >> 1));
        if constexpr (Format == CacheFormat::mse4) {
          value_offset[k] = k < 2 ? Layout::template value_offset<kBulkCopy>(token, g, head)
                                  : value_offset[k - 2] + Layout::kOffset8Tokens;
        } else {
          value_offset[k] = Layout::value_offset(token, g, head, num_kv_heads);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int w = 0; w < kValueWordLoads; ++w) {
          value_word[j][w] = static_cast<int>(opaque(Layout::value_word_offset(2 * c + j, g, w, head, num_kv_heads)));
        }
      }
    }
    // 3-bit values: the byte permutes taking bytes 0..3 and 2..5 of the lane's
    // 6 bytes from the two words at 6g & ~3 (they start at byte 2 (g & 1));
    // at D = 64 bytes 0..3 from its 3 at 3g, (3g) mod 4 into the first word.
    low_selector = HeadDim == 64 ? 0x3210u + 0x1111u * ((3 * g) & 3) : g & 1 ? 0x5432u : 0x3210u;
    high_selector = g & 1 ? 0x7654u : 0x5432u;
    // 3-bit keys at D = 64: the byte permutes putting the lane's 48 key bits in
    // order (bits 0..31, then 32..47) from its two loads
    // (three_bit_key_word_byte_d64: where c is odd the first is the second word).
    key_low_selector = c & 1 ? 0x1076u : 0x3210u;
    key_high_selector = c & 1 ? 0x3232u : 0x7654u;
  }
};

// S^T = K Q^T of one tile into the two accumulator chains (even and odd
// k-steps): rows are tokens g and g + 8, columns heads 2c, 2c + 1. `lut` and
// `lane_lut` are the key lookup table and the lane's byte offset in a row
// (MSE keys); the offsets and the key selectors (3-bit keys at D = 64) are
// the lane's, from the stage (kernel.cuh); query(nt, ks) is the B operand of
// head tile nt and k-step ks (kernel.cuh). SquareSums (token_slots keys
// renormalized at decode, MSE keys): `square` also gets the sums of the
// squared table values of tokens g (elements 0, 1) and g + 8 (2, 3), by one
// more mma per k-step against ones, in fp32.
template <class Shape, class Layout, CacheFormat Format, bool SquareSums, int KeyWordLoads, class Query>
__device__ __forceinline__ void key_scores(const std::uint8_t* stage, const int (&key_offset)[2][Layout::kKeyLoads],
                                           const int (&key_word)[KeyWordLoads], std::uint32_t key_low_selector,
                                           std::uint32_t key_high_selector, int key_skew, bool key_wraps,
                                           const std::uint32_t (&key_mask)[4], const Query& query,
                                           std::uint32_t lane_lut, const std::uint8_t* lut,
                                           float (&score)[Shape::kHeadTiles][4], float (&score_odd)[Shape::kHeadTiles][4],
                                           float (&square)[4]) {
  static_assert(!SquareSums || Format != CacheFormat::fp8, "fp8 keys are not renormalized");
  // k-step ks of head tile nt into `chain`.
  const auto product = [&](float (&chain)[4], const std::uint32_t (&a)[4], int nt, int ks) {
    const uint2 q = query(nt, ks);
    mma_f16(chain, a, q.x, q.y);
  };
  const auto add_squares = [&](const std::uint32_t (&a)[4]) {
    if constexpr (SquareSums) {
      const std::uint32_t squares[4] = {square_f16x2(a[0]), square_f16x2(a[1]), square_f16x2(a[2]), square_f16x2(a[3])};
      mma_f16(square, squares, kHalfOnes, kHalfOnes);
    }
  };
  constexpr bool kFp8 = Format == CacheFormat::fp8;
  constexpr int HeadTiles = Shape::kHeadTiles;
  constexpr int HeadDim = Shape::kHeadDim;
  constexpr int kDimTiles = Shape::kDimTiles;
  constexpr int kKeyLoads = Layout::kKeyLoads;
  if constexpr (kFp8) {
    // Word ks of the lane's D/4 key bytes holds dims (D/4)c + 4ks + {0..3}:
    // its low fp8 pair is a0 / a1 (columns 2c, 2c + 1), its high pair a2 / a3.
    std::uint32_t words[2][kDimTiles];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int part = 0; part < kKeyLoads; ++part) {
        uint4 chunk;
        if constexpr (kReadsRotatedSlots<Layout>) {  // only the first unit takes wrapped bytes
          std::uint32_t w[4];
          if (part == 0) {
            load_rotated<Layout::kKeyBytes>(stage + key_offset[j][part], key_wraps, key_mask, w);
            chunk = make_uint4(w[0], w[1], w[2], w[3]);
          } else {
            chunk = load_shared<uint4>(stage + key_offset[j][part]);
          }
        } else {
          chunk = load_key_chunk<Layout>(stage + key_offset[j][part], key_skew);
        }
        words[j][4 * part + 0] = chunk.x;
        words[j][4 * part + 1] = chunk.y;
        words[j][4 * part + 2] = chunk.z;
        words[j][4 * part + 3] = chunk.w;
      }
    }
#pragma unroll
    for (int ks = 0; ks < kDimTiles; ++ks) {
      // The high pairs from the words' high halves at one head tile; shifted
      // down at two, whose register allocation then spills nothing.
      const auto high_pair = [](std::uint32_t word) {
        return HeadTiles == 1 ? fp8_pair_to_f16<1>(word) : fp8_pair_to_f16<0>(word >> 16);
      };
      const std::uint32_t a[4] = {fp8_pair_to_f16<0>(words[0][ks]), fp8_pair_to_f16<0>(words[1][ks]),
                                  high_pair(words[0][ks]), high_pair(words[1][ks])};
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) product(ks % 2 ? score_odd[nt] : score[nt], a, nt, ks);
    }
  } else if constexpr (three_bit_keys(Format)) {
    // The lane's 3D/4 key bits: code pair p (dims (D/4)c + 2p, + 1) is
    // bits 6p..6p+5; k-step ks takes pairs 2ks (a0 / a1) and 2ks + 1 (a2 /
    // a3). The pair goes to bits 7..12, the table's row index (lookup below).
    static_assert(KeyWordLoads == Layout::kKeyWordLoads);
    constexpr int kKeyWords = Layout::kKeyWords;
    std::uint32_t words[2][kKeyWords];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if constexpr (kReadsSlots<Layout>) {  // token_slots read in place: 12 bytes at once
        load_shared_unaligned<kKeyWords + 1>(stage + key_word[0] + j * Layout::kOffset8Tokens, key_skew, words[j]);
      } else {
#pragma unroll
        for (int w = 0; w < KeyWordLoads; ++w) {
          if constexpr (Layout::kKeyLoadBytes == 8) {
            const uint2 pair = load_shared<uint2>(stage + key_word[w] + j * Layout::kOffset8Tokens);
            words[j][2 * w] = pair.x, words[j][2 * w + 1] = pair.y;
          } else {
            words[j][w] = load_shared<std::uint32_t>(stage + key_word[w] + j * Layout::kOffset8Tokens);
          }
        }
      }
      if constexpr (HeadDim == 64) {
        const std::uint32_t first = words[j][0], second = words[j][1];
        words[j][0] = __byte_perm(first, second, key_low_selector);
        words[j][1] = __byte_perm(first, second, key_high_selector);  // bits 32..47 in 0..15
      }
    }
    // A pair inside one word: masked where it lies, then shifted into the
    // add of the lane's table address (LOP3, then LEA.HI or IMAD), so the
    // shared window's base costs nothing even where ptxas holds it in a
    // vector register (the two-kv-head CTAs), which then adds it to every
    // lookup of a pointer. A pair across two words (2 of 16): funnel-shifted
    // into the row and ORed with the lane's offset from the table pointer,
    // which the other loops fold into the load as a uniform base.
    const std::uint32_t lane_table = static_cast<std::uint32_t>(__cvta_generic_to_shared(lut)) + lane_lut;
    const auto lookup = [&](const std::uint32_t (&bits)[kKeyWords], int first_bit) {
      const int word = first_bit >> 5;
      const int at = first_bit & 31;
      if (at + 6 > 32) {
        const std::uint32_t x = __funnelshift_r(bits[word], bits[word + 1], at - 7);
        return load_shared<std::uint32_t>(lut + ((x & 0x1f80u) | lane_lut));
      }
      const std::uint32_t pair = and_opaque(bits[word], 0x3fu << at);
      return load_shared_u32(lane_table + (at >= 7 ? pair >> (at - 7) : pair << (7 - at)));
    };
#pragma unroll
    for (int ks = 0; ks < kDimTiles; ++ks) {
      const std::uint32_t a[4] = {lookup(words[0], 12 * ks), lookup(words[1], 12 * ks), lookup(words[0], 12 * ks + 6),
                                  lookup(words[1], 12 * ks + 6)};
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) product(ks % 2 ? score_odd[nt] : score[nt], a, nt, ks);
      add_squares(a);
    }
  } else {
    // The lane's D/32 key words of tokens g and g + 8.
    constexpr int kKeyWords = HeadDim / 32;
    std::uint32_t words_g[kKeyWords], words_g8[kKeyWords];
    if constexpr (kKeyWords == 2) {
      const uint2 key_g = load_shared<uint2>(stage + key_offset[0][0]);
      const uint2 key_g8 = load_shared<uint2>(stage + key_offset[0][0] + Layout::kOffset8Tokens);
      words_g[0] = key_g.x, words_g[1] = key_g.y, words_g8[0] = key_g8.x, words_g8[1] = key_g8.y;
    } else {
      if constexpr (kReadsRotatedSlots<Layout>) {
        load_rotated<Layout::kKeyBytes>(stage + key_offset[0][0], key_wraps, key_mask, words_g);
        load_rotated<Layout::kKeyBytes>(stage + key_offset[0][0] + Layout::kOffset8Tokens, key_wraps, key_mask,
                                        words_g8);
      } else {
#pragma unroll
        for (int part = 0; part < kKeyLoads; ++part) {
          const uint4 key_g = load_key_chunk<Layout>(stage + key_offset[0][part], key_skew);
          const uint4 key_g8 = load_key_chunk<Layout>(stage + key_offset[0][part] + Layout::kOffset8Tokens, key_skew);
          words_g[4 * part] = key_g.x, words_g[4 * part + 1] = key_g.y, words_g[4 * part + 2] = key_g.z,
          words_g[4 * part + 3] = key_g.w;
          words_g8[4 * part] = key_g8.x, words_g8[4 * part + 1] = key_g8.y, words_g8[4 * part + 2] = key_g8.z,
          words_g8[4 * part + 3] = key_g8.w;
        }
      }
    }
#pragma unroll
    for (int w = 0; w < kKeyWords; ++w) {
      // Byte b of word w holds dims (D/4)c + 8w + 2b + {0, 1}: k-step 2w takes bytes 0, 1, k-step 2w + 1 bytes 2, 3.
      // The table row of byte b: one permute (256-byte rows) or a shift and a LOP3 (128-byte rows).
      const auto lookup = [&](std::uint32_t word, int byte) {
        std::uint32_t offset;
        if constexpr (Shape::kWideTable) {
          offset = __byte_perm(word, lane_lut, 0x5504u | (byte << 4));
        } else {
          const int shift = 7 - 8 * byte;
          offset = ((shift >= 0 ? (word << shift) : (word >> -shift)) & 0x7f80u) | lane_lut;
        }
        return load_shared<std::uint32_t>(lut + offset);
      };
      const std::uint32_t even[4] = {lookup(words_g[w], 0), lookup(words_g8[w], 0), lookup(words_g[w], 1),
                                     lookup(words_g8[w], 1)};
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) product(score[nt], even, nt, 2 * w);
      add_squares(even);
      const std::uint32_t odd[4] = {lookup(words_g[w], 2), lookup(words_g8[w], 2), lookup(words_g[w], 3),
                                    lookup(words_g8[w], 3)};
#pragma unroll
      for (int nt = 0; nt < HeadTiles; ++nt) product(score_odd[nt], odd, nt, 2 * w + 1);
      add_squares(odd);
    }
  }
}

// O^T += V^T P'^T of one tile: dim tile m takes the value codes of the
// lane's dims and the tile's tokens (the operand windows below); `pb` holds
// P' as the B operand halves of each head tile.
template <class Shape, class Layout, CacheFormat Format, int ValueWordLoads>
__device__ __forceinline__ void accumulate_values(const std::uint8_t* stage, const int (&value_offset)[4],
                                                  const int (&value_word)[2][ValueWordLoads], std::uint32_t low_selector,
                                                  std::uint32_t high_selector, const int (&value_skew)[2],
                                                  bool value_wraps,
                                                  const std::uint32_t (&value_mask)[2],
                                                  const std::uint32_t (&pb)[Shape::kHeadTiles][2],
                                                  float (&acc)[Shape::kHeadTiles][Shape::kDimTiles][4]) {
  constexpr int HeadTiles = Shape::kHeadTiles;
  constexpr int HeadDim = Shape::kHeadDim;
  constexpr int kDimTiles = Shape::kDimTiles;
  // O^T += V^T P'^T. Dim tile m takes the codes of dims 16g + 2m (row g)
  // and 16g + 2m + 1 (row g + 8) of the tokens 2c, 2c + 1 (a0, a1) and
  // 2c + 8, 2c + 9 (a2, a3), each pair of tokens in the two fp16 halves
  // of a window (value_code_position).
  // token_slots read in place: the word at or below the value bytes at
  // `offset` and their skew past it (LaneOperands::kValueSkews).
  const auto value_source = [&](int offset, int j, int& skew) {
    const std::uint8_t* address = stage + offset;
    if constexpr (LaneOperands<Shape, Layout, Format>::kValueSkews) {
      skew = value_skew[j];
      return address;
    }
    skew = static_cast<int>(reinterpret_cast<std::uintptr_t>(address) & 3);
    return address - skew;
  };
  const auto mma_values = [&](int m, const std::uint32_t (&a)[4]) {
#pragma unroll
    for (int nt = 0; nt < HeadTiles; ++nt) mma_f16(acc[nt][m], a, pb[nt][0], pb[nt][1]);
  };
  // The operand of code `Code` from the window holding it at bit `position` of both halves.
  const auto operand = [&]<int Code>(std::uint32_t window) {
    constexpr std::uint32_t kMask = (value_bits(Format) == 4 ? 0x000f000fu : 0x00070007u)
                                    << value_code_position(Format, Code);
    return mask_or<kMask, kHalfOnes>(window);
  };
  if constexpr (value_bits(Format) == 4) {
    // Byte m of each token's D/16 bytes: low nibble dim (D/8)g + 2m, high nibble (D/8)g + 2m + 1.
    constexpr int kValueWords = HeadDim / 64;
    std::uint32_t v[4][kValueWords];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (kReadsRotatedSlots<Layout>) {
        load_rotated<value_bits(Format) * HeadDim / 8>(stage + value_offset[k], value_wraps, value_mask, v[k]);
      } else if constexpr (kReadsSlots<Layout>) {  // token_slots read in place (SlotReadLayout)
        int skew;
        const std::uint8_t* word = value_source(value_offset[k], k & 1, skew);
        const uint2 words = load_shared_unaligned_8(word, skew);
        v[k][0] = words.x, v[k][1] = words.y;
      } else if constexpr (kValueWords == 1) {
        v[k][0] = load_shared<std::uint32_t>(stage + value_offset[k]);
      } else if constexpr (kValueWords == 2) {
        const uint2 words = load_shared<uint2>(stage + value_offset[k]);
        v[k][0] = words.x, v[k][1] = words.y;
      } else {
        const uint4 words = load_shared<uint4>(stage + value_offset[k]);
        v[k][0] = words.x, v[k][1] = words.y, v[k][2] = words.z, v[k][3] = words.w;
      }
    }
    static_for<kDimTiles>([&]<int Tile>() {
      constexpr int b = Tile & 3;
      constexpr std::uint32_t kSelector = b | (b << 4) | ((4 + b) << 8) | ((4 + b) << 12);
      const std::uint32_t first = __byte_perm(v[0][Tile / 4], v[1][Tile / 4], kSelector);   // tokens 2c, 2c + 1
      const std::uint32_t second = __byte_perm(v[2][Tile / 4], v[3][Tile / 4], kSelector);  // 2c + 8, 2c + 9
      mma_values(Tile, {operand.template operator()<2 * Tile>(first), operand.template operator()<2 * Tile + 1>(first),
                        operand.template operator()<2 * Tile>(second), operand.template operator()<2 * Tile + 1>(second)});
    });
  } else {
    // The lane's codes in groups of 16 (6 bytes; D = 256: two, D = 128:
    // one) or at D = 64 one of 8 (3 bytes). Each group's bytes 0..3 go to
    // `low`, bytes 2..5 to `high`. D = 128: the 6 bytes start at byte
    // 2 (g & 1) of the token's first word; D = 256: the 12 bytes are
    // three words; D = 64: the 3 bytes start (3g) mod 4 into the first.
    static_assert(ValueWordLoads == Layout::kValueWordLoads);
    constexpr int kGroups = HeadDim == 256 ? 2 : 1;
    std::uint32_t low[kGroups][4];
    [[maybe_unused]] std::uint32_t high[kGroups][4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int token_offset = (k >> 1) * Layout::kOffset8Tokens;
      if constexpr (kReadsSlots<Layout>) {
        // token_slots read in place (D = 128): the 6 bytes value_skew (0 or
        // 2) into two words; bytes 0..3 and 2..5 by funnel shifts (the
        // clamped one of 32 bits is the second word).
        int skew;
        const std::uint8_t* word = value_source(value_word[k & 1][0] + token_offset, k & 1, skew);
        const std::uint32_t w0 = load_shared<std::uint32_t>(word), w1 = load_shared<std::uint32_t>(word + 4);
        const int shift = 8 * skew;
        low[0][k] = __funnelshift_r(w0, w1, shift);
        high[0][k] = __funnelshift_rc(w0, w1, shift + 16);
      } else {
        const std::uint32_t w0 = load_shared<std::uint32_t>(stage + value_word[k & 1][0] + token_offset);
        const std::uint32_t w1 = load_shared<std::uint32_t>(stage + value_word[k & 1][1] + token_offset);
        if constexpr (HeadDim == 256) {
          const std::uint32_t w2 = load_shared<std::uint32_t>(stage + value_word[k & 1][2] + token_offset);
          low[0][k] = w0;
          high[0][k] = __byte_perm(w0, w1, 0x5432u);
          low[1][k] = __byte_perm(w1, w2, 0x5432u);
          high[1][k] = w2;
        } else {
          low[0][k] = __byte_perm(w0, w1, low_selector);
          if constexpr (HeadDim == 128) high[0][k] = __byte_perm(w0, w1, high_selector);
        }
      }
    }
    // Window b of a token pair: bytes b, b + 1 of the first token, then
    // of the second (D = 64: windows 0..2, the codes of bytes 0..2).
    constexpr int kWindows = HeadDim == 64 ? 3 : 6;
    std::uint32_t window[kGroups][2][kWindows];
#pragma unroll
    for (int group = 0; group < kGroups; ++group) {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const int first = 2 * pair, second = 2 * pair + 1;
        const std::uint32_t(&l)[4] = low[group];
        window[group][pair][0] = __byte_perm(l[first], l[second], 0x5410u);
        window[group][pair][1] = __byte_perm(l[first], l[second], 0x6521u);
        window[group][pair][2] = __byte_perm(l[first], l[second], 0x7632u);
        if constexpr (kWindows == 6) {
          const std::uint32_t(&h)[4] = high[group];
          window[group][pair][3] = __byte_perm(h[first], h[second], 0x6521u);
          window[group][pair][4] = __byte_perm(h[first], h[second], 0x7632u);
          window[group][pair][5] = __byte_perm(h[first], h[second], 0x7733u);  // byte 5 alone: its codes sit at bits 2 and 5
        }
      }
    }
    static_for<kDimTiles>([&]<int Tile>() {
      // Codes 2 Tile, 2 Tile + 1: code 2 Tile mod 16 and the next of group Tile / 8, in windows kEven, kOdd.
      constexpr int kGroup = Tile / 8, kCode = 2 * Tile % 16;
      constexpr int kEven = 3 * kCode / 8, kOdd = 3 * (kCode + 1) / 8;
      mma_values(Tile, {operand.template operator()<2 * Tile>(window[kGroup][0][kEven]),
                        operand.template operator()<2 * Tile + 1>(window[kGroup][0][kOdd]),
                        operand.template operator()<2 * Tile>(window[kGroup][1][kEven]),
                        operand.template operator()<2 * Tile + 1>(window[kGroup][1][kOdd])});
    });
  }
}

}  // namespace tqdecode::cuda::tensor_core
