// The warp-specialized partition kernel's launch (internal,
// kernel_params.hpp; the kernel: warp_specialized.cuh).
#include <cuda_runtime.h>

#include <string>

#include "../cuda_check.hpp"
#include "../dynamic_shared_memory.hpp"
#include "../kernel_params.hpp"
#include "../policy.hpp"
#include "tqdecode/error.hpp"
#include "warp_specialized.cuh"

namespace tqdecode::cuda {

void launch_partitions_warp_specialized(const PartitionParams& params, const QueryRows& query_rows,
                                        CUstream_st* stream) {
  namespace ws = tensor_core::specialized;
  const CacheLayout& layout = params.layout;
  TQ_REQUIRE(layout.preset == Preset::turboquant_4bit_nc && layout.head_dim == ws::kHeadDim &&
                 layout.block_size % ws::kBoxTokens == 0 && (!layout.token_slots() || token_slots_box_copies(layout)),
             "layout",
             "the warp-specialized kernel serves turboquant_4bit_nc at D = 128 with block sizes that are multiples "
             "of 16, in the blocks order or in the token_slots order with token rows and blocks of 16-byte multiples");
  const int group = params.num_q_heads / layout.num_kv_heads;
  const int cta_rows = group * query_rows.tokens_per_cta;
  TQ_REQUIRE(query_rows.tokens_per_cta >= 1 && cta_rows <= 2 * ws::kConsumerRows, "tokens_per_cta",
             std::to_string(query_rows.tokens_per_cta) + " with group " + std::to_string(group) +
                 " is out of range; accepted: 1 to " + std::to_string(2 * ws::kConsumerRows) +
                 " rows (group x tokens)");
  TQ_REQUIRE(params.partition_align % ws::kTileTokens == 0, "partition_align",
             std::to_string(params.partition_align) + " is out of range; accepted: multiples of 64");
  TQ_REQUIRE(params.batch >= 0 && params.batch <= kMaxGridSequences, "batch",
             std::to_string(params.batch) + " is out of range; accepted: 0 to " + std::to_string(kMaxGridSequences));
  if (params.batch == 0) return;
  const int query_tiles = (query_rows.max_query_len + query_rows.tokens_per_cta - 1) / query_rows.tokens_per_cta;
  const dim3 grid(params.num_partitions * query_tiles, layout.num_kv_heads, params.batch);
  const CacheTensorMaps maps = encode_cache_tensor_maps(params);
  const auto launch = [&]<int CtaRows, bool Slots>() {
    constexpr auto kernel = ws::warp_specialized_partitions<CtaRows, Slots>;
    allow_dynamic_shared_memory<kernel>(ws::SharedLayout::kAllocationBytes);
    kernel<<<grid, ws::kThreads, ws::SharedLayout::kAllocationBytes, stream>>>(params, query_rows, maps);
  };
  const auto launch_rows = [&]<bool Slots>() {
    if (cta_rows > ws::kConsumerRows) {
      launch.template operator()<2 * ws::kConsumerRows, Slots>();
    } else {
      launch.template operator()<ws::kConsumerRows, Slots>();
    }
  };
  if (layout.token_slots()) {
    launch_rows.template operator()<true>();
  } else {
    launch_rows.template operator()<false>();
  }
  TQ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tqdecode::cuda
