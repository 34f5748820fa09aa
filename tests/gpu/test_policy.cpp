// The launch policy (src/cuda/policy.cpp): the partition count, the resident
// CTAs it plans for and the pool size that bounds every call. Host arithmetic
// only, so these run without a device, and the device facts the policy reads
// (skipped without one).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>

#include "cuda/kernel_params.hpp"
#include "cuda/policy.hpp"
#include "gpu_test_support.hpp"

namespace tqdecode::cuda {
namespace {

constexpr int kH200Sms = 132;

double utilization(int batch, int num_kv_heads, int partitions, int sm_count, int resident) {
  const long long ctas = static_cast<long long>(batch) * num_kv_heads * partitions;
  const long long slots = static_cast<long long>(resident) * sm_count;
  const long long waves = (ctas + slots - 1) / slots;
  return static_cast<double>(ctas) / static_cast<double>(slots * waves);
}

TEST(PartitionPolicy, BenchmarkShapesOnAnH200) {
  // Hopper kernel, group 8: 2 resident CTAs per SM, 264 slots.
  EXPECT_EQ(choose_num_partitions(16, 8, 32768, kH200Sms, 2), 2);    // 256 CTAs: one wave, 97 %
  EXPECT_EQ(choose_num_partitions(64, 8, 8192, kH200Sms, 2), 1);     // 512 CTAs: 1.94 waves
  EXPECT_EQ(choose_num_partitions(128, 8, 4096, kH200Sms, 2), 1);    // 1024 CTAs: 3.88 waves
  EXPECT_EQ(choose_num_partitions(32, 8, 131072, kH200Sms, 2), 1);   // 256 CTAs
  EXPECT_EQ(choose_num_partitions(1, 8, 32768, kH200Sms, 2), kMaxPartitions);
  EXPECT_EQ(choose_num_partitions(1, 8, 4096, kH200Sms, 2), 4096 / kMinPartitionTokens);
  // Group 16: one resident CTA per SM, 132 slots.
  EXPECT_EQ(choose_num_partitions(16, 8, 32768, kH200Sms, 1), 1);
}

TEST(PartitionPolicy, SmallestCountThatFillsItsWavesElseTheFullest) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20000; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 300);
    const int num_kv_heads = 1 + static_cast<int>(rng() % 16);
    const int context = 1 + static_cast<int>(rng() % 200000);
    const int sm_count = 1 + static_cast<int>(rng() % 200);
    const int resident = 1 + static_cast<int>(rng() % kMaxResidentCtasPerSm);
    const int chosen = choose_num_partitions(batch, num_kv_heads, context, sm_count, resident);
    const int cap = std::max(1, std::min(kMaxPartitions, (context + kMinPartitionTokens - 1) / kMinPartitionTokens));
    SCOPED_TRACE(testing::Message() << "B=" << batch << " Hk=" << num_kv_heads << " context=" << context
                                    << " SMs=" << sm_count << " resident=" << resident << " N=" << chosen);
    ASSERT_GE(chosen, 1);
    ASSERT_LE(chosen, cap);
    const double chosen_utilization = utilization(batch, num_kv_heads, chosen, sm_count, resident);
    for (int smaller = 1; smaller < chosen; ++smaller) {
      ASSERT_LT(utilization(batch, num_kv_heads, smaller, sm_count, resident), kGoodWaveUtilization);
    }
    if (chosen_utilization < kGoodWaveUtilization) {
      for (int other = 1; other <= cap; ++other) {
        ASSERT_LE(utilization(batch, num_kv_heads, other, sm_count, resident), chosen_utilization);
      }
    }
  }
}

TEST(PartitionPolicy, PoolRowsBoundEveryCallUpToTheMaximumBatch) {
  for (const int max_batch : {1, 7, 64, 512}) {
    for (const int num_kv_heads : {1, 2, 8}) {
      const int rows = max_partition_rows(max_batch, num_kv_heads, kH200Sms);
      for (int batch = 1; batch <= max_batch; ++batch) {
        for (int resident = 1; resident <= kMaxResidentCtasPerSm; ++resident) {
          for (const int context : {16, 4096, 1 << 20}) {
            ASSERT_LE(batch * choose_num_partitions(batch, num_kv_heads, context, kH200Sms, resident), rows)
                << "max_batch " << max_batch << " B " << batch << " Hk " << num_kv_heads;
          }
        }
        // Every grid the Hopper path plans, the two-kv-heads-per-CTA one included.
        for (const int group : {1, 8, 16}) {
          for (const int context : {16, 4096, 1 << 20}) {
            const GridChoice grid =
                choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, group, batch, num_kv_heads, context, kH200Sms);
            ASSERT_LE(batch * grid.num_partitions, rows) << "max_batch " << max_batch << " B " << batch << " Hk "
                                                         << num_kv_heads << " group " << group;
          }
        }
      }
    }
  }
}

// Several query tokens per sequence on the scalar kernel: the fewest query
// tiles whose rows (group x tokens) fit 32, the tokens spread evenly.
TEST(QueryTokensPolicy, FewestTilesOfAtMost32RowsEvenlyFilled) {
  EXPECT_EQ(generic_query_tokens_per_cta(8, 1), 1);
  EXPECT_EQ(generic_query_tokens_per_cta(8, 4), 4);    // the q_len 4 at Hq 64, Hk 8: one tile
  EXPECT_EQ(generic_query_tokens_per_cta(8, 8), 4);    // two tiles of 32 rows
  EXPECT_EQ(generic_query_tokens_per_cta(8, 128), 4);  // 32 tiles
  EXPECT_EQ(generic_query_tokens_per_cta(1, 33), 17);  // two tiles of 17 and 16, not 32 and 1
  EXPECT_EQ(generic_query_tokens_per_cta(3, 5), 5);    // 15 rows
  EXPECT_EQ(generic_query_tokens_per_cta(16, 3), 2);   // two tiles: 32 rows and 16
  for (int group = 1; group <= 16; ++group) {
    for (int max_query_len = 1; max_query_len <= 300; ++max_query_len) {
      const int tokens = generic_query_tokens_per_cta(group, max_query_len);
      const int tiles = (max_query_len + tokens - 1) / tokens;
      const int fitting = std::max(1, kGenericMaxRows / group);
      ASSERT_LE(group * tokens, std::max(kGenericMaxRows, group)) << group << " " << max_query_len;
      ASSERT_EQ(tiles, (max_query_len + fitting - 1) / fitting) << group << " " << max_query_len;  // fewest tiles
      ASSERT_LT(tiles * tokens - max_query_len, tiles) << group << " " << max_query_len;  // even: < one token per tile idle
    }
  }
}

TEST(PartitionPolicy, ResidentCtasOfEachPath) {
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, true), 1);  // 16 warps
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, false), 2);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 16, false), 1);  // two head tiles
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_k8v4, 8, true), 2);  // no wide shape
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_k3v4_nc, 4, false), 2);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_k3v4_nc, 16, false), 1);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::cuda_generic, Preset::turboquant_4bit_nc, 16, true), 2);
}

// The generic path's tensor-core kernel: as many narrow-configuration CTAs per SM as its
// launch bounds plan for and the device's shared memory holds (opt-in
// maximum per CTA, and per SM with 1 KB reserved per CTA).
TEST(PartitionPolicy, NarrowConfigurationResidentCtasFollowTheDevicesSharedMemory) {
  const DeviceInfo h200{0, 132, 9, 0, 232448, 233472};
  const DeviceInfo a100{0, 108, 8, 0, 166912, 167936};
  const DeviceInfo sm86{0, 84, 8, 6, 101376, 102400};
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 8).shared_bytes, 107808);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k3v4_nc, 8).shared_bytes, 82208);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 8, h200), 2);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 16, h200), 1);  // two head tiles: planned for one
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 8, a100), 1);   // 2 x 108672 > 167936
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 8, a100), 2);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 8, sm86), 0);   // 107808 > 101376: the scalar kernel
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 8, sm86), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_3bit_nc, 4, sm86), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k8v4, 8, sm86), 0);
  // Two head tiles: one CTA of 12 warps.
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 16).shared_bytes, 147008);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k8v4, 16).shared_bytes, 156480);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k8v4, 16, a100), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 16, sm86), 0);  // 120896 > 101376
  // Head sizes 64 (two CTAs of 8 warps, one or two head tiles) and 256 (one
  // CTA of 8 warps and one head tile; larger groups in row tiles), every preset.
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 8, 64).shared_bytes, 72992);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 16, 64).shared_bytes, 75328);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 8, 256).shared_bytes, 177952);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k8v4, 8, 256).shared_bytes, 204448);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 16, h200, 64), 2);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k8v4, 8, sm86, 64), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 8, h200, 256), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_4bit_nc, 16, h200, 256), 1);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 16, 256).shared_bytes, 177952);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k3v4_nc, 8, 64).shared_bytes, 80672);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k3v4_nc, 16, 64).shared_bytes, 83008);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_3bit_nc, 8, 64).shared_bytes, 47392);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_3bit_nc, 16, 64).shared_bytes, 49728);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k3v4_nc, 8, 256).shared_bytes, 153376);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_3bit_nc, 8, 256).shared_bytes, 152864);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_3bit_nc, 16, 256).shared_bytes, 152864);  // one head tile, two row tiles
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 8, h200, 64), 2);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 16, sm86, 64), 1);  // 82688 + 1024: one per 100 KB
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_3bit_nc, 16, sm86, 64), 2);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 8, h200, 256), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_3bit_nc, 8, a100, 256), 1);
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k3v4_nc, 8, sm86, 256), 0);  // 153376 > 101376
  EXPECT_EQ(narrow_resident_ctas(Preset::turboquant_k8v4, 8, a100, 256), 0);  // 204288 > 166912
  const GridChoice d256 = choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 6, 16, 2, 32768, 132, 256);
  EXPECT_FALSE(d256.wide_table);
  EXPECT_EQ(d256.kv_heads_per_cta, 1);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 6, false, 256), 1);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 4, false, 64), 2);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_3bit_nc, 16, false, 64), 2);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_k3v4_nc, 8, false, 256), 1);
  // 3-bit keys at D = 64 and 256: one kv head per CTA (the two-kv-head CTA is D = 128's).
  const GridChoice three_bit_d64 = choose_grid(DecodePath::hopper, Preset::turboquant_k3v4_nc, 8, 2, 8, 4096, 132, 64);
  EXPECT_FALSE(three_bit_d64.wide_table);
  EXPECT_EQ(three_bit_d64.kv_heads_per_cta, 1);
}

// The shape table gives the policy every instance's shared memory and CTAs
// per SM, the wide-table and two-kv-head shapes included.
TEST(PartitionPolicy, ShapeTableGivesEveryInstancesFootprint) {
  const KernelFootprint wide = tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 1);
  EXPECT_EQ(wide.shared_bytes, 208544);
  EXPECT_EQ(wide.planned_ctas_per_sm, 1);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 8).shared_bytes, 224000);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 16, 128, true, 1).shared_bytes, 175808);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k3v4_nc, 8, 128, false, 2).shared_bytes, 156224);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k3v4_nc, 8, 128, false, 2).planned_ctas_per_sm, 1);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, false, 1).planned_ctas_per_sm, 2);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, true), 1);
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, false), 2);
}

// The tensor-core kernel's query rows per kv head (the group x the query
// tokens of a sequence) in row tiles of one or two head tiles (one at D = 256),
// or four on the Hopper kernel's 4-bit blocks order at D = 128 where those
// CTAs fill a wave.
TEST(PartitionPolicy, QueryRowsFoldIntoRowTilesOfOneTwoOrFourHeadTiles) {
  for (const bool four : {false, true}) {
    EXPECT_EQ(tensor_core_head_tiles(8, 128, four), 1);
    EXPECT_EQ(tensor_core_head_tiles(9, 128, four), 2);
    EXPECT_EQ(tensor_core_head_tiles(16, 128, four), 2);
    EXPECT_EQ(tensor_core_head_tiles(16, 64, four), 2);
    EXPECT_EQ(tensor_core_head_tiles(16, 256, four), 1);
    EXPECT_EQ(tensor_core_head_tiles(40, 256, four), 1);
  }
  EXPECT_EQ(tensor_core_head_tiles(17, 128, false), 2);
  EXPECT_EQ(tensor_core_head_tiles(17, 128, true), 4);
  EXPECT_EQ(tensor_core_row_tiles(8, 1), 1);    // group 8, one token
  EXPECT_EQ(tensor_core_row_tiles(16, 2), 1);   // group 8, two tokens (or group 16)
  EXPECT_EQ(tensor_core_row_tiles(32, 2), 2);   // group 8, four tokens
  EXPECT_EQ(tensor_core_row_tiles(32, 4), 1);
  EXPECT_EQ(tensor_core_row_tiles(24, 4), 1);   // group 8, three tokens
  EXPECT_EQ(tensor_core_row_tiles(1024, 2), 64);
  EXPECT_EQ(tensor_core_row_tiles(1024, 4), 32);
  EXPECT_EQ(tensor_core_row_tiles(15, 2), 1);   // group 5, three tokens
  EXPECT_EQ(tensor_core_row_tiles(16, 1), 2);   // group 16 at D = 256
  EXPECT_EQ(tensor_core_row_tiles(3, 1), 1);

  // Four head tiles: the 4-bit blocks order at D = 128 on the Hopper path, more
  // than 16 rows, and B Hk row tiles filling a wave of 132 SMs.
  const CacheLayout blocks = make_layout(Preset::turboquant_4bit_nc, 128, 16, 8);
  EXPECT_TRUE(tensor_core_four_head_tiles(DecodePath::hopper, blocks, 32, 16, 132));    // (16, L), q_len 4
  EXPECT_TRUE(tensor_core_four_head_tiles(DecodePath::hopper, blocks, 1024, 1, 132));   // 128-token chunk
  EXPECT_FALSE(tensor_core_four_head_tiles(DecodePath::hopper, blocks, 32, 1, 132));    // (1, L): partitions
  EXPECT_FALSE(tensor_core_four_head_tiles(DecodePath::hopper, blocks, 16, 64, 132));   // two head tiles' rows
  EXPECT_FALSE(tensor_core_four_head_tiles(DecodePath::cuda_generic, blocks, 32, 16, 132));
  EXPECT_FALSE(tensor_core_four_head_tiles(DecodePath::hopper, make_layout(Preset::turboquant_k8v4, 128, 16, 8), 32,
                                           16, 132));
  EXPECT_FALSE(tensor_core_four_head_tiles(DecodePath::hopper, make_layout(Preset::turboquant_4bit_nc, 64, 16, 8), 32,
                                           16, 132));
  EXPECT_FALSE(tensor_core_four_head_tiles(
      DecodePath::hopper, make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 8, true), 32, 16, 132));
}

// The warp-specialized kernel: several query tokens per sequence (varlen)
// of 4-bit keys at D = 128 on the Hopper path with more than two head
// tiles' rows, in the blocks order or in token_slots rows of 16-byte
// multiples, in builds with sm_90a code; its CTAs take as many tokens as fit
// 64 rows, or 128 where a kv head has more rows.
TEST(PartitionPolicy, WarpSpecializedKernelServesManyRowsOf4BitKeys) {
  const CacheLayout blocks = make_layout(Preset::turboquant_4bit_nc, 128, 16, 8);
  // Built with sm_90a (the default architectures): served.
  EXPECT_EQ(warp_specialized_serves(DecodePath::hopper, blocks, true, 32), warp_specialized_built());    // q_len 4
  EXPECT_EQ(warp_specialized_serves(DecodePath::hopper, blocks, true, 1024), warp_specialized_built());  // chunks
  EXPECT_FALSE(warp_specialized_serves(DecodePath::hopper, blocks, true, 16));   // two head tiles
  EXPECT_FALSE(warp_specialized_serves(DecodePath::hopper, blocks, false, 32));  // one token per sequence
  EXPECT_FALSE(warp_specialized_serves(DecodePath::cuda_generic, blocks, true, 32));
  EXPECT_FALSE(warp_specialized_serves(DecodePath::hopper, make_layout(Preset::turboquant_k8v4, 128, 16, 8), true, 32));
  EXPECT_FALSE(
      warp_specialized_serves(DecodePath::hopper, make_layout(Preset::turboquant_4bit_nc, 256, 16, 8), true, 32));
  // token_slots: vLLM's rows of 8 kv heads (1072 bytes) by bulk copies, with or without norm correction; not
  // rows of 4 kv heads (536 bytes, no 16-byte multiple).
  for (const bool renormalize : {true, false}) {
    EXPECT_EQ(
        warp_specialized_serves(DecodePath::hopper,
                                make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 8, renormalize), true, 64),
        warp_specialized_built());
  }
  EXPECT_FALSE(warp_specialized_serves(
      DecodePath::hopper, make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 4, true), true, 64));
  EXPECT_FALSE(warp_specialized_serves(DecodePath::hopper,
                                       make_token_slots_layout(Preset::turboquant_k8v4, 128, 16, 8, false), true, 64));
  for (int group = 1; group <= 16; ++group) {
    for (int max_query_len = 1; max_query_len <= 300; ++max_query_len) {
      const int tokens = warp_specialized_tokens_per_cta(group, max_query_len);
      ASSERT_GE(tokens, 1);
      ASSERT_LE(tokens, max_query_len);
      // 64 rows (the consumers on alternate tiles) where the call's rows fit, else 128 (a consumer's 64 each).
      const int cta_rows = group * max_query_len > kWarpSpecializedRows ? 2 * kWarpSpecializedRows
                                                                        : kWarpSpecializedRows;
      ASSERT_LE(group * tokens, cta_rows) << group << " " << max_query_len;
      // The most that fit: one more token would pass the CTA's rows or the query length.
      ASSERT_TRUE(tokens == max_query_len || group * (tokens + 1) > cta_rows) << group << " " << max_query_len;
    }
  }
  EXPECT_EQ(warp_specialized_tokens_per_cta(8, 4), 4);    // 32 rows: a 64-row CTA
  EXPECT_EQ(warp_specialized_tokens_per_cta(8, 8), 8);    // 64 rows
  EXPECT_EQ(warp_specialized_tokens_per_cta(8, 128), 16);  // 128-token chunks: 128 rows a CTA
  EXPECT_EQ(warp_specialized_tokens_per_cta(3, 128), 42);
  EXPECT_EQ(warp_specialized_tokens_per_cta(16, 5), 5);   // 80 rows: one 128-row CTA
  EXPECT_EQ(warp_specialized_tokens_per_cta(16, 12), 8);
  EXPECT_EQ(kWarpSpecializedAlign % 64, 0);  // whole 64-token tiles per partition
}

// The automatic path takes the warp-specialized kernel where it serves more
// rows per kv head than one four-head-tile CTA holds (32); at 32 rows and
// below the row tiles measure faster, but for the token_slots order with
// norm correction on grids whose (sequence, kv head) pairs fill a wave.
TEST(PartitionPolicy, AutomaticPathTakesTheWarpSpecializedKernelPast32Rows) {
  constexpr int kSms = 132;
  const auto automatic = [](const CacheLayout& layout, bool varlen, int rows, int batch = 16,
                            DecodePath path = DecodePath::hopper) {
    return warp_specialized_automatic(path, layout, varlen, rows, batch, kSms);
  };
  const CacheLayout blocks = make_layout(Preset::turboquant_4bit_nc, 128, 16, 8);
  for (const int rows : {17, 24, 32}) {  // q_len 3-4 at group 8, 2 at group 16
    EXPECT_FALSE(automatic(blocks, true, rows)) << rows;
    EXPECT_FALSE(automatic(blocks, true, rows, 64)) << rows;
  }
  for (const int rows : {33, 40, 48, 64, 65, 80, 128, 1024}) {  // q_len 5-8 and 9 at group 8, 5 at group 16, chunks
    EXPECT_EQ(automatic(blocks, true, rows), warp_specialized_built()) << rows;
    EXPECT_EQ(automatic(blocks, true, rows, 1), warp_specialized_built()) << rows;
  }
  EXPECT_FALSE(automatic(blocks, false, 128));  // one token per sequence
  EXPECT_FALSE(automatic(blocks, true, 128, 16, DecodePath::cuda_generic));
  EXPECT_FALSE(automatic(make_layout(Preset::turboquant_k8v4, 128, 16, 8), true, 128));
  // vLLM's token_slots rows of 8 kv heads (bulk copies) as the blocks order past 32 rows; rows of 4 (536 bytes) keep
  // the row tiles.
  const CacheLayout slots = make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 8, true);
  EXPECT_EQ(automatic(slots, true, 128, 1), warp_specialized_built());
  EXPECT_FALSE(automatic(make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 4, true), true, 128));
  // 17-32 rows over token_slots with norm correction: where batch x Hk CTAs fill a wave (16 x 8 = 128 of 132 SMs at
  // 95 %), not on smaller grids, nor without norm correction.
  const CacheLayout raw_slots = make_token_slots_layout(Preset::turboquant_4bit_nc, 128, 16, 8, false);
  for (const int rows : {17, 24, 32}) {
    EXPECT_EQ(automatic(slots, true, rows, 16), warp_specialized_built()) << rows;
    EXPECT_EQ(automatic(slots, true, rows, 64), warp_specialized_built()) << rows;
    EXPECT_FALSE(automatic(slots, true, rows, 15)) << rows;
    EXPECT_FALSE(automatic(slots, true, rows, 8)) << rows;
    EXPECT_FALSE(automatic(raw_slots, true, rows, 64)) << rows;
  }
  EXPECT_FALSE(automatic(slots, true, 16, 64));  // two head tiles' rows: the row tiles read each token once
}

// The benchmark shapes (Hq 64, Hk 8 unless stated): the wide shape with one
// (grids of at most two waves), two, four or eight kv heads per CTA,
// whichever grid has the fewest waves (the fewest heads on a tie), or for
// odd Hk beyond two waves the two-CTA shape.
TEST(PartitionPolicy, WideTableForGridsOfAtMostTwoWaves) {
  const auto grid = [](Preset preset, int group, int batch, int hk, int context) {
    return choose_grid(DecodePath::hopper, preset, group, batch, hk, context, kH200Sms);
  };
  const GridChoice b16 = grid(Preset::turboquant_4bit_nc, 8, 16, 8, 32768);
  EXPECT_TRUE(b16.wide_table);
  EXPECT_EQ(b16.num_partitions, 1);  // 128 CTAs, one per SM
  const GridChoice b32 = grid(Preset::turboquant_4bit_nc, 8, 32, 8, 131072);
  EXPECT_TRUE(b32.wide_table);  // 256 CTAs of one kv head: two waves; 128 of two: one
  EXPECT_EQ(b32.num_partitions, 1);
  const GridChoice b1 = grid(Preset::turboquant_4bit_nc, 8, 1, 8, 32768);
  EXPECT_TRUE(b1.wide_table);
  EXPECT_EQ(b1.num_partitions, 16);  // 128 CTAs
  EXPECT_TRUE(grid(Preset::turboquant_4bit_nc, 4, 16, 16, 32768).wide_table);  // group 4: 256 CTAs
  EXPECT_EQ(b16.kv_heads_per_cta, 1);
  EXPECT_EQ(b32.kv_heads_per_cta, 2);
  const GridChoice b64 = grid(Preset::turboquant_4bit_nc, 8, 64, 8, 8192);
  EXPECT_TRUE(b64.wide_table);  // 512 CTAs of one kv head: four waves; 256 of two: two; 128 of four: one (eight: one, N = 2)
  EXPECT_EQ(b64.kv_heads_per_cta, 4);
  EXPECT_EQ(b64.num_partitions, 1);
  const GridChoice b128 = grid(Preset::turboquant_4bit_nc, 8, 128, 8, 4096);
  EXPECT_EQ(b128.kv_heads_per_cta, 8);  // 128 CTAs: one wave (four kv heads: two, two: four)
  EXPECT_EQ(b128.num_partitions, 1);
  const GridChoice b40 = grid(Preset::turboquant_4bit_nc, 8, 40, 8, 3008);  // q4_b40_split_waves
  EXPECT_EQ(b40.kv_heads_per_cta, 8);  // N = 3: one wave (two or four kv heads: five)
  EXPECT_EQ(b40.num_partitions, 3);
  // The other test cases of the shapes with several kv heads per CTA (test_decode_gpu.cpp).
  const GridChoice b48 = grid(Preset::turboquant_4bit_nc, 6, 48, 8, 2500);  // q4_g6_b48_paired_split_sinks_f16
  EXPECT_EQ(b48.kv_heads_per_cta, 2);  // N = 2: three waves; four and eight kv heads take three too
  EXPECT_EQ(b48.num_partitions, 2);
  const GridChoice b38 = grid(Preset::turboquant_4bit_nc, 6, 38, 8, 4000);  // q4_g6_b38_quad_split_sinks_f16
  EXPECT_EQ(b38.kv_heads_per_cta, 4);  // N = 5: three waves (two kv heads: six; eight: three, N = 10)
  EXPECT_EQ(b38.num_partitions, 5);
  EXPECT_EQ(grid(Preset::turboquant_4bit_nc, 8, 128, 8, 1200).kv_heads_per_cta, 8);  // q4_b128_octo_1200
  const GridChoice b32_long = grid(Preset::turboquant_4bit_nc, 8, 32, 8, 5008);  // q4_b32_paired_long
  EXPECT_EQ(b32_long.kv_heads_per_cta, 2);
  EXPECT_EQ(b32_long.num_partitions, 1);
  const GridChoice odd = grid(Preset::turboquant_4bit_nc, 3, 700, 1, 64);  // Hk odd: the two-CTA shape
  EXPECT_FALSE(odd.wide_table);
  EXPECT_EQ(odd.kv_heads_per_cta, 1);
  EXPECT_EQ(odd.num_partitions, choose_num_partitions(700, 1, 64, kH200Sms, 2));
  // Two head tiles: the wide table (12 warps) on every grid, one kv head per CTA.
  const GridChoice g16 = grid(Preset::turboquant_4bit_nc, 16, 16, 8, 32768);
  EXPECT_TRUE(g16.wide_table);
  EXPECT_EQ(g16.num_partitions, 1);
  EXPECT_EQ(g16.kv_heads_per_cta, 1);
  const GridChoice g16_waves = grid(Preset::turboquant_4bit_nc, 16, 101, 2, 1500);  // q4_g16_b101_waves_sinks: 202 CTAs
  EXPECT_TRUE(g16_waves.wide_table);
  EXPECT_EQ(g16_waves.kv_heads_per_cta, 1);
  EXPECT_EQ(g16_waves.num_partitions, choose_num_partitions(101, 2, 1500, kH200Sms, 1));
  EXPECT_EQ(resident_ctas_per_sm(DecodePath::hopper, Preset::turboquant_4bit_nc, 16, true), 1);
  EXPECT_FALSE(grid(Preset::turboquant_k3v4_nc, 16, 16, 8, 32768).wide_table);
  EXPECT_FALSE(grid(Preset::turboquant_k8v4, 8, 16, 8, 32768).wide_table);
  EXPECT_FALSE(choose_grid(DecodePath::cuda_generic, Preset::turboquant_4bit_nc, 8, 16, 8, 32768, kH200Sms).wide_table);
}

// The other presets up to group 8: two kv heads per 16-warp CTA where that
// grid takes at most two waves (docs/DESIGN.md), else two 8-warp
// CTAs per SM; the decode tests' b48 cases keep the latter on the Hopper path.
TEST(PartitionPolicy, TwoKvHeadsPerCtaForTheOtherPresetsOnGridsOfAtMostTwoWaves) {
  const auto grid = [](Preset preset, int group, int batch, int hk, int context) {
    return choose_grid(DecodePath::hopper, preset, group, batch, hk, context, kH200Sms);
  };
  for (const Preset preset : {Preset::turboquant_k3v4_nc, Preset::turboquant_3bit_nc, Preset::turboquant_k8v4}) {
    const GridChoice b16 = grid(preset, 8, 16, 8, 32768);  // 64 work items, N = 2: 128 CTAs, one wave
    EXPECT_FALSE(b16.wide_table);
    EXPECT_EQ(b16.kv_heads_per_cta, 2);
    EXPECT_EQ(b16.num_partitions, 2);
    const GridChoice b64 = grid(preset, 8, 64, 8, 8192);  // N = 1: 256 CTAs, two waves
    EXPECT_EQ(b64.kv_heads_per_cta, 2);
    EXPECT_EQ(b64.num_partitions, 1);
    const GridChoice b128 = grid(preset, 8, 128, 8, 4096);  // two kv heads: 512 CTAs, four waves
    EXPECT_EQ(b128.kv_heads_per_cta, 1);
    EXPECT_EQ(b128.num_partitions, choose_num_partitions(128, 8, 4096, kH200Sms, 2));
    const GridChoice b48 = grid(preset, 8, 48, 8, 2016);  // the b48 decode cases: two kv heads, N = 2: three waves
    EXPECT_EQ(b48.kv_heads_per_cta, 1);
    EXPECT_EQ(b48.num_partitions, choose_num_partitions(48, 8, 2016, kH200Sms, 2));
    EXPECT_EQ(grid(preset, 8, 16, 3, 32768).kv_heads_per_cta, 1);   // Hk odd
    EXPECT_EQ(grid(preset, 16, 16, 8, 32768).kv_heads_per_cta, 1);  // two head tiles: one 12-warp CTA per SM already
    EXPECT_EQ(grid(preset, 4, 5, 4, 2064).kv_heads_per_cta, 2);     // the decode tests' _d128 cases
    EXPECT_EQ(choose_grid(DecodePath::cuda_generic, preset, 8, 16, 8, 32768, kH200Sms).kv_heads_per_cta, 1);
  }
}

// Long partitions on the wide shape: q4_b66_quad_long and q4_long_128k's plans.
TEST(PartitionPolicy, WideTableLongPartitions) {
  const auto grid = [](int batch, int context) {
    return choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, batch, 8, context, kH200Sms);
  };
  const GridChoice long_quad = grid(66, 9040);  // 132 CTAs of four kv heads
  EXPECT_EQ(long_quad.kv_heads_per_cta, 4);
  EXPECT_EQ(long_quad.num_partitions, 1);
  const GridChoice long_single = grid(1, 131072 + 7 + 16 * 2);  // N = 16, over 8192 tokens each
  EXPECT_EQ(long_single.kv_heads_per_cta, 1);
  EXPECT_EQ(long_single.num_partitions, 16);
}

// token_slots caches (docs/FORMAT.md section 4b): bulk tensor copies in the
// wide shape where the token rows are 16-byte multiples holding every kv
// head's slot (4-bit keys at D = 128: vLLM's dense layout at Hk 8, slot 134,
// rows of 1072 bytes), else the narrow configuration, one kv head per CTA,
// reading the slots where they land at D = 128 or repacking them; the
// footprints are the token_slots instances'.
TEST(TokenSlotsPolicy, BulkCopiesWhereTokenRowsAre16ByteMultiplesElseTheNarrowConfiguration) {
  const auto args_of = [](Preset preset, int num_kv_heads, std::uintptr_t cache, std::int64_t slot_padding = 0,
                          bool heads_major = false) {
    const CacheLayout dense = make_token_slots_layout(preset, 128, 16, num_kv_heads, false);
    const std::int64_t slot = dense.slot_bytes() + slot_padding;
    const std::int64_t token_stride = heads_major ? slot : num_kv_heads * slot;
    const std::int64_t head_stride = heads_major ? 16 * slot : slot;
    DecodeArgs args;
    args.layout = make_token_slots_layout(preset, 128, 16, num_kv_heads, 16 * num_kv_heads * slot, token_stride,
                                          head_stride, false);
    args.cache = reinterpret_cast<const std::uint8_t*>(cache);
    return args;
  };
  constexpr std::uintptr_t kAligned = 0x10000;
  EXPECT_TRUE(token_slots_bulk_copy(args_of(Preset::turboquant_4bit_nc, 8, kAligned)));     // rows of 1072 bytes
  EXPECT_TRUE(token_slots_bulk_copy(args_of(Preset::turboquant_4bit_nc, 8, kAligned, 2)));  // padded slots, 1088
  EXPECT_FALSE(token_slots_bulk_copy(args_of(Preset::turboquant_4bit_nc, 4, kAligned)));    // 536
  EXPECT_FALSE(token_slots_bulk_copy(args_of(Preset::turboquant_4bit_nc, 8, kAligned + 2)));
  EXPECT_FALSE(token_slots_bulk_copy(args_of(Preset::turboquant_4bit_nc, 8, kAligned, 2, true)));  // heads major
  EXPECT_FALSE(token_slots_bulk_copy(args_of(Preset::turboquant_k8v4, 8, kAligned)));
  EXPECT_FALSE(token_slots_bulk_copy(args_of(Preset::turboquant_k3v4_nc, 8, kAligned)));
  // Every preset's slots are read where they land at D = 128 when the blocks
  // start on 16-byte boundaries (any token stride: vLLM's shards too).
  EXPECT_TRUE(token_slots_read_in_place(args_of(Preset::turboquant_k3v4_nc, 8, kAligned).layout));
  EXPECT_TRUE(token_slots_read_in_place(args_of(Preset::turboquant_4bit_nc, 1, kAligned).layout));  // rows of 134 bytes
  EXPECT_TRUE(token_slots_read_in_place(args_of(Preset::turboquant_k8v4, 8, kAligned, 2, true).layout));
  CacheLayout padded_page = args_of(Preset::turboquant_3bit_nc, 2, kAligned).layout;
  padded_page.block_stride += 2;
  EXPECT_FALSE(token_slots_read_in_place(padded_page));
  EXPECT_FALSE(token_slots_read_in_place(make_token_slots_layout(Preset::turboquant_4bit_nc, 64, 16, 8, false)));
  EXPECT_FALSE(token_slots_read_in_place(make_layout(Preset::turboquant_4bit_nc, 128, 16, 8)));
  // The narrow configuration's aligned loads of rotated data: fp8 keys in
  // token rows of 16-byte multiples (4 kv heads of 196-byte slots).
  EXPECT_FALSE(token_slots_read_rotated(args_of(Preset::turboquant_4bit_nc, 8, kAligned).layout));
  EXPECT_TRUE(token_slots_read_rotated(args_of(Preset::turboquant_k8v4, 4, kAligned).layout));
  EXPECT_FALSE(token_slots_read_rotated(args_of(Preset::turboquant_k8v4, 2, kAligned).layout));
  EXPECT_FALSE(token_slots_read_rotated(args_of(Preset::turboquant_k3v4_nc, 8, kAligned).layout));
  EXPECT_FALSE(token_slots_read_rotated(padded_page));

  // Whole token rows of 4 or 8 kv heads (one bulk copy per tile for a CTA):
  // fp8 keys side by side in 16-byte rows, Hk a multiple of 4, up to group 8.
  const auto with_group = [](DecodeArgs args, int group) {
    args.num_q_heads = group * args.layout.num_kv_heads;
    return args;
  };
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 8, kAligned), 8)), SlotRead::rows);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 4, kAligned), 1)), SlotRead::rows);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 8, kAligned), 16)), SlotRead::rotated);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 8, kAligned, 2), 8)), SlotRead::rotated);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 8, kAligned, 0, true), 8)),
            SlotRead::in_place);
  // Token runs: 2 or 4 kv heads of any preset in dense rows (the shards
  // whose rows the boxes above do not take), up to group 8; one for fp8 keys only.
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 2, kAligned), 8)), SlotRead::runs);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_4bit_nc, 2, kAligned), 8)), SlotRead::runs);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_4bit_nc, 1, kAligned), 8)), SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_3bit_nc, 1, kAligned), 8)), SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k8v4, 1, kAligned), 4)), SlotRead::runs);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k3v4_nc, 4, kAligned), 4)), SlotRead::runs);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_3bit_nc, 2, kAligned), 8)), SlotRead::runs);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_4bit_nc, 2, kAligned), 16)), SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_3bit_nc, 2, kAligned, 2), 8)), SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_3bit_nc, 2, kAligned, 0, true), 8)),
            SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k3v4_nc, 3, kAligned), 8)), SlotRead::in_place);
  EXPECT_EQ(token_slots_read(with_group(args_of(Preset::turboquant_k3v4_nc, 4, kAligned + 2), 8)), SlotRead::in_place);
  // The runs where the grid fills the GPU with at least 2048 tokens a CTA,
  // else one kv head per CTA in the narrow configuration.
  const GridChoice runs_b16 =
      choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 16, 2, 32768, kH200Sms, 128, SlotRead::runs);
  EXPECT_TRUE(runs_b16.token_runs);
  EXPECT_EQ(runs_b16.kv_heads_per_cta, 2);
  EXPECT_EQ(runs_b16.num_partitions, 8);  // 128 CTAs of 4096 tokens
  const GridChoice runs_hk4 =
      choose_grid(DecodePath::hopper, Preset::turboquant_k3v4_nc, 8, 64, 4, 8192, kH200Sms, 128, SlotRead::runs);
  EXPECT_TRUE(runs_hk4.token_runs);
  EXPECT_EQ(runs_hk4.kv_heads_per_cta, 4);
  EXPECT_EQ(runs_hk4.num_partitions, 2);
  const GridChoice runs_hk1 =
      choose_grid(DecodePath::hopper, Preset::turboquant_k8v4, 8, 16, 1, 32768, kH200Sms, 128, SlotRead::runs);
  EXPECT_TRUE(runs_hk1.token_runs);
  EXPECT_EQ(runs_hk1.kv_heads_per_cta, 1);
  EXPECT_EQ(runs_hk1.num_partitions, 16);  // 256 CTAs of 2048 tokens, two 8-warp CTAs per SM
  EXPECT_FALSE(
      choose_grid(DecodePath::hopper, Preset::turboquant_k8v4, 8, 1, 1, 32768, kH200Sms, 128, SlotRead::runs)
          .token_runs);
  const GridChoice runs_b1 =
      choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 1, 2, 32768, kH200Sms, 128, SlotRead::runs);
  EXPECT_FALSE(runs_b1.token_runs);
  EXPECT_EQ(runs_b1.kv_heads_per_cta, 1);
  const GridChoice rows_hk8 =
      choose_grid(DecodePath::hopper, Preset::turboquant_k8v4, 8, 16, 8, 32768, kH200Sms, 128, SlotRead::rows);
  EXPECT_FALSE(rows_hk8.wide_table);
  EXPECT_EQ(rows_hk8.kv_heads_per_cta, 8);  // a tie in waves: whole rows
  EXPECT_EQ(rows_hk8.num_partitions, 8);    // 128 CTAs
  EXPECT_EQ(choose_grid(DecodePath::hopper, Preset::turboquant_k8v4, 4, 16, 12, 32768, kH200Sms, 128, SlotRead::rows)
                .kv_heads_per_cta,
            4);

  const auto grid = [](int batch, bool bulk, bool renormalized = true) {
    return choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, batch, 8, 32768, kH200Sms, 128,
                       bulk ? SlotRead::bulk_copies : SlotRead::in_place, renormalized);
  };
  const GridChoice one_wave = grid(16, true);  // 128 CTAs of one kv head
  EXPECT_TRUE(one_wave.wide_table);
  EXPECT_EQ(one_wave.kv_heads_per_cta, 1);
  EXPECT_GT(grid(64, true).kv_heads_per_cta, 1);  // 512 work items: several kv heads per CTA, as the blocks order
  // Without norm correction: eight kv heads per CTA where one-kv-head CTAs
  // would stream more than 8192 tokens.
  const GridChoice unnormalized = grid(16, true, false);  // one kv head per CTA: 32768 tokens each
  EXPECT_EQ(unnormalized.kv_heads_per_cta, 8);
  EXPECT_EQ(unnormalized.num_partitions, 8);  // 128 CTAs of 4096 tokens
  EXPECT_TRUE(unnormalized.whole_rows);       // without norm correction: whole rows on any stream
  EXPECT_FALSE(one_wave.whole_rows);
  EXPECT_EQ(grid(8, true, false).kv_heads_per_cta, 8);  // 16384 tokens each
  EXPECT_EQ(grid(4, true, false).kv_heads_per_cta, 1);  // 8192 tokens each
  const auto b64_l8192 = [](bool renormalized) {
    return choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 64, 8, 8192, kH200Sms, 128,
                       SlotRead::bulk_copies, renormalized);
  };
  EXPECT_EQ(b64_l8192(false).kv_heads_per_cta, b64_l8192(true).kv_heads_per_cta);  // 8192 tokens: the same choice
  // Streams past kSlotsLongStreamTokens: every kv head of a token row in one
  // CTA (the L2 lines the heads' boxes share fetched once), partitions filling the GPU.
  const GridChoice long_rows = choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 32, 8, 131072, kH200Sms,
                                           128, SlotRead::bulk_copies, true);
  EXPECT_EQ(long_rows.kv_heads_per_cta, 8);
  EXPECT_EQ(long_rows.num_partitions, 4);  // 128 CTAs
  EXPECT_TRUE(long_rows.whole_rows);       // of 32768 tokens: whole rows, with norm correction too
  // With norm correction, eight kv heads on shorter streams keep a box per
  // kv head: 131072-token tables at 16 sequences (N = 8, 16384 tokens a CTA).
  const GridChoice shorter_rows = choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 16, 8, 131072,
                                              kH200Sms, 128, SlotRead::bulk_copies, true);
  EXPECT_EQ(shorter_rows.kv_heads_per_cta, 8);
  EXPECT_EQ(shorter_rows.num_partitions, 8);
  EXPECT_FALSE(shorter_rows.whole_rows);
  // A device of little DRAM bandwidth per SM cycle (an H100 SXM's 12.8): with norm correction too, whole rows from
  // 8192-token streams, of four kv heads with fewer partitions where they stream at most 8192 tokens a CTA and fill
  // no more waves than eight; at 18.8 (an H200's) or unknown (0), the choices above.
  const auto on_device = [](int batch, int num_kv_heads, int context, double bytes_per_cycle) {
    return choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, batch, num_kv_heads, context, kH200Sms, 128,
                       SlotRead::bulk_copies, true, bytes_per_cycle);
  };
  for (const auto& [batch, context, heads, partitions] : {std::tuple{16, 32768, 4, 4}, std::tuple{64, 8192, 4, 1}}) {
    const GridChoice low = on_device(batch, 8, context, 12.8);
    EXPECT_EQ(low.kv_heads_per_cta, heads) << batch;
    EXPECT_EQ(low.num_partitions, partitions) << batch;  // 128 CTAs
    EXPECT_TRUE(low.whole_rows) << batch;
    const GridChoice high = on_device(batch, 8, context, 18.8);
    EXPECT_FALSE(high.whole_rows) << batch;
    EXPECT_EQ(high.kv_heads_per_cta, on_device(batch, 8, context, 0.0).kv_heads_per_cta) << batch;
  }
  EXPECT_EQ(on_device(16, 8, 32768, 18.8).kv_heads_per_cta, 1);
  EXPECT_FALSE(on_device(1, 8, 32768, 12.8).whole_rows);  // 16 partitions of 2048 tokens: the boxes
  EXPECT_EQ(on_device(16, 4, 32768, 12.8).kv_heads_per_cta, on_device(16, 4, 32768, 0.0).kv_heads_per_cta);  // no rows
  EXPECT_TRUE(on_device(16, 8, 131072, 12.8).whole_rows);  // shorter_rows above, in whole rows here
  EXPECT_EQ(on_device(16, 8, 54064, 12.8).kv_heads_per_cta, 8);   // half rows would stream 13516 tokens a CTA
  EXPECT_EQ(on_device(32, 8, 131072, 12.8).kv_heads_per_cta, 8);  // and 65536 here
  EXPECT_EQ(on_device(32, 8, 131072, 12.8).num_partitions, 4);
  const GridChoice one_wave_rows = on_device(132, 8, 33024, 12.8);  // four kv heads would take two waves
  EXPECT_EQ(one_wave_rows.kv_heads_per_cta, 8);
  EXPECT_EQ(one_wave_rows.num_partitions, 1);
  EXPECT_TRUE(one_wave_rows.whole_rows);
  const GridChoice blocks = choose_grid(DecodePath::hopper, Preset::turboquant_4bit_nc, 8, 32, 8, 131072, kH200Sms);
  EXPECT_EQ(blocks.kv_heads_per_cta, 2);  // the blocks order: the fewest waves
  const GridChoice narrow = grid(64, false);
  EXPECT_FALSE(narrow.wide_table);
  EXPECT_EQ(narrow.kv_heads_per_cta, 1);
  // The other presets: one kv head per CTA (the blocks order has two here).
  for (const SlotRead slots : {SlotRead::in_place, SlotRead::repacked}) {
    EXPECT_EQ(choose_grid(DecodePath::hopper, Preset::turboquant_k3v4_nc, 8, 16, 8, 32768, kH200Sms, 128, slots)
                  .kv_heads_per_cta,
              1);
  }
  EXPECT_EQ(choose_grid(DecodePath::hopper, Preset::turboquant_k3v4_nc, 8, 16, 8, 32768, kH200Sms).kv_heads_per_cta, 2);

  // Footprints (shape.cuh): the wide shape's three-stage rings of 160-byte
  // rows (token_slots_box_bytes), eight kv heads' four-stage ring of whole
  // rows of 1120 bytes, and the narrow configuration's stages of 176-byte
  // rows (token_slots_stage_pitch).
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 1, true).shared_bytes, 192032);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 8, true).shared_bytes, 207488);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 8, true, false, true).shared_bytes, 228608);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, true, 4, true, false, true).planned_ctas_per_sm,
            1);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 16, 128, true, 1, true).shared_bytes, 194240);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 8, 128, true).shared_bytes, 107040);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_4bit_nc, 8, 128, true).planned_ctas_per_sm, 2);
  EXPECT_EQ(narrow_footprint(Preset::turboquant_k8v4, 8, 256, true).shared_bytes, 230048);
  // Whole rows: four stages of one tile per warp of a kv head (rows of 1568 and 800 bytes).
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k8v4, 8, 128, false, 8, true).shared_bytes, 220416);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k8v4, 8, 128, false, 4, true).shared_bytes, 215680);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k8v4, 8, 128, false, 8, true).planned_ctas_per_sm, 1);
  // Token runs: four stages of 16 tiles of 16 slots whatever Hk (and the 4-bit table of 128-byte rows).
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_4bit_nc, 8, 128, false, 2, true, true).shared_bytes, 176448);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k8v4, 8, 128, false, 2, true, true).shared_bytes, 207168);
  EXPECT_EQ(tensor_core_footprint(Preset::turboquant_k3v4_nc, 8, 128, false, 4, true, true).planned_ctas_per_sm, 1);
}

// The device's DRAM bandwidth per SM cycle, which the token_slots grid rule reads: reported on every
// Hopper GPU (an H100 SXM 12.8, an H200 18.8).
TEST(DevicePolicy, ReportsTheMemoryBytesPerSmCycle) {
  TQ_SKIP_WITHOUT_GPU();
  const DeviceInfo& device = current_device_info();
  std::printf("[ measure  ] %d SMs, %.2f DRAM bytes per SM cycle\n", device.sm_count, device.memory_bytes_per_sm_cycle);
  if (device.cc_major == 9) {
    EXPECT_GT(device.memory_bytes_per_sm_cycle, 5.0);
    EXPECT_LT(device.memory_bytes_per_sm_cycle, 40.0);
  }
}

}  // namespace
}  // namespace tqdecode::cuda
