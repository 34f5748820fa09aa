// Tensor maps of the cache for the bulk tensor copies of the wide shape
// (tensor_core/kernel.cuh). Encoding is host-only work (no device call), so it is
// done per launch and is safe during graph capture; the driver function is
// looked up once.
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_check.hpp"
#include "kernel_params.hpp"

namespace tqdecode::cuda {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TQ_CUDA_CHECK(
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || function == nullptr) {
      throw CudaError("tqdecode: the CUDA driver has no cuTensorMapEncodeTiled (the Hopper kernel's bulk copies need it)");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encoder;
}

void check_encoded(CUresult status, const char* map) {
  if (status != CUDA_SUCCESS) {
    throw CudaError(std::string("tqdecode: cuTensorMapEncodeTiled rejected the cache's ") + map + " map (CUresult " +
                    std::to_string(static_cast<int>(status)) + ")");
  }
}

}  // namespace

CacheTensorMaps encode_cache_tensor_maps(const PartitionParams& params, int row_box_bytes) {
  constexpr auto kTileTokens = static_cast<cuuint32_t>(kHopperTileTokens);
  const CacheLayout& layout = params.layout;
  const auto record_bytes = static_cast<cuuint32_t>(layout.record_bytes());  // 128 for 4-bit keys and values, D = 128
  const auto fields = static_cast<cuuint32_t>(layout.fields());
  // Dimensions are 32-bit; a cache of 2^32 blocks does not fit in memory anyway.
  const auto blocks = static_cast<cuuint64_t>(std::clamp<std::int64_t>(params.num_blocks, 1, std::int64_t{0xffffffff}));
  const auto heads = static_cast<cuuint64_t>(layout.num_kv_heads);
  const auto slots = static_cast<cuuint64_t>(layout.block_size);
  const auto block_stride = static_cast<cuuint64_t>(layout.block_stride);
  const cuuint32_t unit_strides[4] = {1, 1, 1, 1};
  auto* cache = const_cast<std::uint8_t*>(params.cache);
  const auto encode = tensor_map_encoder();
  CacheTensorMaps maps{};

  if (layout.token_slots()) {
    // A token's row of token_stride bytes (its kv heads' slots), box: from
    // the 16-byte boundary at or below a slot (the copy engine's box starts
    // on one) to past its end, 16 tokens of one block; bytes past the row
    // read as zeros (token_slots_bulk_copy, SlotReadLayout).
    if (row_box_bytes > 0) {
      // Whole rows (SlotRead::rows): 8-byte elements, so a box of up to 2048
      // bytes (256 elements) holds the row of every kv head of a CTA; bytes
      // past the row read as zeros.
      const cuuint64_t row_dims[3] = {static_cast<cuuint64_t>(layout.token_stride / 8), slots, blocks};
      const cuuint64_t row_strides[2] = {static_cast<cuuint64_t>(layout.token_stride), block_stride};
      const cuuint32_t row_box[3] = {static_cast<cuuint32_t>(row_box_bytes / 8), kTileTokens, 1};
      check_encoded(encode(&maps.records, CU_TENSOR_MAP_DATA_TYPE_UINT64, 3, cache, row_dims, row_strides, row_box,
                           unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                    "token_slots rows");
      return maps;
    }
    const auto row_bytes = static_cast<cuuint64_t>(layout.token_stride);
    const auto box_bytes = static_cast<cuuint32_t>(token_slots_box_bytes(static_cast<int>(layout.slot_bytes())));
    const cuuint64_t slot_dims[3] = {row_bytes, slots, blocks};
    const cuuint64_t slot_strides[2] = {row_bytes, block_stride};
    const cuuint32_t slot_box[3] = {box_bytes, kTileTokens, 1};
    check_encoded(encode(&maps.records, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, cache, slot_dims, slot_strides, slot_box,
                         unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                         CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                  "token_slots");
    return maps;
  }

  const cuuint64_t record_dims[4] = {record_bytes, heads, slots, blocks};
  const cuuint64_t record_strides[3] = {record_bytes, heads * record_bytes, block_stride};  // bytes, dims 1..3
  const cuuint32_t record_box[4] = {record_bytes, 1, kTileTokens, 1};
  check_encoded(encode(&maps.records, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, cache, record_dims, record_strides, record_box,
                       unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                       CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "records");

  const cuuint64_t field_dims[3] = {slots, heads * fields, blocks};
  const cuuint64_t field_strides[2] = {slots * 2, block_stride};
  const cuuint32_t field_box[3] = {kTileTokens, fields, 1};
  check_encoded(encode(&maps.fields, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, cache + layout.metadata_region_offset(), field_dims,
                       field_strides, field_box, unit_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                       CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
                "fields");
  return maps;
}

}  // namespace tqdecode::cuda
