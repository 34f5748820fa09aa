// Dispatch of the generic partition kernel: runtime (preset, head dim) to
// template arguments through dispatch.hpp's visitors, then query rows per CTA
// to a compiled instance. The rows
// (group size x query tokens per CTA) are served by the smallest bucket 1,
// 2, 4, 8, 16 or 32 that holds them; rows past them inside a bucket compute
// zeros that are never stored.

#include <string>

#include "decode_generic.cuh"
#include "dispatch.hpp"
#include "policy.hpp"
#include "tqdecode/error.hpp"

namespace tqdecode::cuda {
namespace generic {

// Compiled in src/cuda/instances/, one file per preset.
TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_EXTERN, Preset::turboquant_4bit_nc)
TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_EXTERN, Preset::turboquant_k3v4_nc)
TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_EXTERN, Preset::turboquant_3bit_nc)
TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_EXTERN, Preset::turboquant_k8v4)

namespace {

template <Preset P, int D>
void dispatch_rows(const PartitionParams& params, const QueryRows& query_rows, cudaStream_t stream, int rows) {
  if (rows <= 1) return launch_instance<P, D, 1>(params, query_rows, stream);
  if (rows <= 2) return launch_instance<P, D, 2>(params, query_rows, stream);
  if (rows <= 4) return launch_instance<P, D, 4>(params, query_rows, stream);
  if (rows <= 8) return launch_instance<P, D, 8>(params, query_rows, stream);
  if (rows <= 16) return launch_instance<P, D, 16>(params, query_rows, stream);
  return launch_instance<P, D, 32>(params, query_rows, stream);
}

}  // namespace
}  // namespace generic

void launch_partitions_generic(const PartitionParams& params, const QueryRows& query_rows, CUstream_st* stream) {
  validate_layout(params.layout);
  validate_group_size(params.num_q_heads, params.layout.num_kv_heads);
  TQ_REQUIRE(params.num_partitions >= 1, "num_partitions",
          std::to_string(params.num_partitions) + " is out of range; accepted: >= 1");
  TQ_REQUIRE(params.partition_align >= 1, "partition_align",
          std::to_string(params.partition_align) + " is out of range; accepted: >= 1");
  TQ_REQUIRE(params.max_blocks_per_seq >= 1, "max_blocks_per_seq",
          std::to_string(params.max_blocks_per_seq) + " is out of range; accepted: >= 1");
  TQ_REQUIRE(params.batch >= 0 && params.batch <= kMaxGridSequences, "batch",
             std::to_string(params.batch) + " is out of range for the generic kernel; accepted: 0 to " +
                 std::to_string(kMaxGridSequences));
  const bool key_fp8 = params.layout.key_fp8();
  TQ_REQUIRE(key_fp8 || params.centroids != nullptr, "centroids", "is null; MSE presets need the codebook");
  const int group = params.num_q_heads / params.layout.num_kv_heads;
  TQ_REQUIRE(query_rows.max_query_len >= 1 && query_rows.tokens_per_cta >= 1 &&
                 query_rows.tokens_per_cta <= query_rows.max_query_len &&
                 group * query_rows.tokens_per_cta <= kGenericMaxRows,
             "tokens_per_cta",
             std::to_string(query_rows.tokens_per_cta) + " with group " + std::to_string(group) + " and max_query_len " +
                 std::to_string(query_rows.max_query_len) + " is out of range; accepted: 1 to max_query_len, at most " +
                 std::to_string(kGenericMaxRows) + " rows (group x tokens)");
  if (params.batch == 0) return;

  const int rows = group * query_rows.tokens_per_cta;
  // validate_layout accepted the preset and head size.
  visit_preset(params.layout.preset, [&]<Preset P>() {
    visit_head_dim(params.layout.head_dim, [&]<int D>() { generic::dispatch_rows<P, D>(params, query_rows, stream, rows); });
  });
}

}  // namespace tqdecode::cuda
