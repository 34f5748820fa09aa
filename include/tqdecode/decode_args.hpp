// Inputs of one decode step (docs/FORMAT.md section 5), shared by the CPU
// reference, the CUDA launcher and the bindings.
#pragma once

#include <cstdint>

#include "tqdecode/common.hpp"
#include "tqdecode/format.hpp"

namespace tqdecode {

/// One decode step: one query token per sequence. Pointers are host memory
/// for the CPU paths and device memory for the CUDA paths. Strides are in
/// elements; 0 means contiguous.
struct DecodeArgs {
  const void* query = nullptr;  ///< [B, Hq, D] bf16 or fp16
  DType query_dtype = DType::bf16;
  int batch = 0;        ///< B
  int num_q_heads = 0;  ///< Hq = QG * Hk
  std::int64_t query_stride_batch = 0;
  std::int64_t query_stride_head = 0;

  CacheLayout layout;
  std::int64_t num_blocks = 0;
  const std::uint8_t* cache = nullptr;

  const std::int32_t* block_table = nullptr;  ///< [B, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  std::int64_t block_table_stride = 0;
  const std::int32_t* seq_lens = nullptr;  ///< [B]; 0 gives an all-zero output row

  const float* centroids = nullptr;  ///< [2^key_bits] (MSE presets)
  int num_centroids = 0;
  const float* PiT = nullptr;  ///< [D, D], transpose of the rotation (MSE presets)
  float scale = 1.0f;          ///< softmax scale
  const float* sinks = nullptr;  ///< [Hq] or null
  /// PiT and the centroids were not written by the kernel just before this
  /// decode on its stream. false launches the Hopper kernel without
  /// programmatic dependent launch for this call, so it reads them only after
  /// that kernel has finished (DecodeWorkspace::set_programmatic_launch).
  bool constants_stable = true;

  void* output = nullptr;  ///< [B, Hq, D], dtype = query dtype
  std::int64_t output_stride_batch = 0;
  std::int64_t output_stride_head = 0;

  int group_size() const { return layout.num_kv_heads ? num_q_heads / layout.num_kv_heads : 0; }
  std::int64_t q_stride_b() const { return query_stride_batch ? query_stride_batch : std::int64_t(num_q_heads) * layout.head_dim; }
  std::int64_t q_stride_h() const { return query_stride_head ? query_stride_head : layout.head_dim; }
  std::int64_t out_stride_b() const { return output_stride_batch ? output_stride_batch : std::int64_t(num_q_heads) * layout.head_dim; }
  std::int64_t out_stride_h() const { return output_stride_head ? output_stride_head : layout.head_dim; }
  std::int64_t table_stride() const { return block_table_stride ? block_table_stride : max_blocks_per_seq; }
};

/// Checks shapes, dtypes, strides, layout, codebook size and null pointers;
/// reads no tensor memory. Throws Error naming the argument. With
/// `output_required` false a null output passes (the CUDA launcher then
/// writes its pooled output).
void validate_decode_shapes(const DecodeArgs& args, bool output_required = true);

/// Also checks tensor contents that live in host memory: every seq_len in
/// [0, max_blocks_per_seq * block_size] and every block-table entry a
/// sequence uses in [0, num_blocks). Throws Error naming the element.
void validate_decode_host_contents(const DecodeArgs& args);

}  // namespace tqdecode
