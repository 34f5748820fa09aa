// The instances of the tensor-core decode kernel (internal): which (head
// size, key format) pairs exist, one file each in instances/, so a change to
// one instance recompiles one file.
#pragma once

#include "../kernel_params.hpp"
#include "tile_layout.cuh"

namespace tqdecode::cuda::tensor_core {

/// Head sizes 64 and 256 have the narrow configuration, every key format.
constexpr bool serves_head_dim(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

template <int HeadDim, CacheFormat Format>
void launch_for_group(const FusedDecodeParams& params, CUstream_st* stream);

// X(head size, key format) for every instance.
#define TQ_TENSOR_CORE_INSTANCES(X)                                                                       \
  X(64, CacheFormat::mse4) X(128, CacheFormat::mse4) X(256, CacheFormat::mse4) X(64, CacheFormat::mse3) \
  X(128, CacheFormat::mse3) X(256, CacheFormat::mse3) X(64, CacheFormat::mse3_v3)                        \
  X(128, CacheFormat::mse3_v3) X(256, CacheFormat::mse3_v3) X(64, CacheFormat::fp8)                      \
  X(128, CacheFormat::fp8) X(256, CacheFormat::fp8)
#define TQ_TENSOR_CORE_EXTERN(D, F) extern template void launch_for_group<D, F>(const FusedDecodeParams&, CUstream_st*);
#define TQ_TENSOR_CORE_INSTANTIATE(D, F) template void launch_for_group<D, F>(const FusedDecodeParams&, CUstream_st*);

TQ_TENSOR_CORE_INSTANCES(TQ_TENSOR_CORE_EXTERN)

}  // namespace tqdecode::cuda::tensor_core
