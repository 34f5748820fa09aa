// The tensor-core decode kernel's entry points (internal, kernel_params.hpp):
// the one dispatch of a call to its instance, and what the policy asks of
// the kernel's shapes.
#include <cuda_runtime.h>

#include <string>

#include "../dispatch.hpp"
#include "../kernel_params.hpp"
#include "../policy.hpp"
#include "launch.hpp"
#include "shape.cuh"
#include "tqdecode/error.hpp"

namespace tqdecode::cuda {

namespace {

// Compiled with the same targets as the instances: if the device can run it, it can run them.
__global__ void tensor_core_probe_kernel() {}

}  // namespace

bool tensor_core_serves(int head_dim) { return tensor_core::serves_head_dim(head_dim); }

// The one dispatch point: key format (preset), head size, then (in the
// instance) group size and the plan's shape.
void launch_decode_tensor_core(const FusedDecodeParams& params, CUstream_st* stream) {
  const CacheLayout& layout = params.partitions.layout;
  TQ_REQUIRE(tensor_core_serves(layout.head_dim), "head_dim",
             std::to_string(layout.head_dim) + " has no tensor-core kernel (64, 128 and 256 have one)");
  visit_preset(layout.preset, [&]<Preset P>() {
    visit_head_dim(layout.head_dim, [&]<int HeadDim>() {
      tensor_core::launch_for_group<HeadDim, tensor_core::cache_format(P)>(params, stream);
    });
  });
}

NarrowFootprint narrow_footprint(Preset preset, int group_size, int head_dim) {
  using tensor_core::KernelShape;
  using tensor_core::SharedLayout;
  return visit_preset(preset, [&]<Preset P>() -> NarrowFootprint {
    constexpr tensor_core::CacheFormat kFormat = tensor_core::cache_format(P);
    return visit_head_dim(head_dim, [&]<int HeadDim>() -> NarrowFootprint {
      if constexpr (HeadDim != 256) {  // one head tile at D = 256
        if (tensor_core_head_tiles(group_size, HeadDim) == 2) {
          return {SharedLayout<HeadDim, 2, kFormat, false>::kBytes, KernelShape<HeadDim, 2, kFormat, false>::kResidentCtas};
        }
      }
      return {SharedLayout<HeadDim, 1, kFormat, false>::kBytes, KernelShape<HeadDim, 1, kFormat, false>::kResidentCtas};
    });
  });
}

bool tensor_core_kernel_runnable() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, tensor_core_probe_kernel) == cudaSuccess;
}

}  // namespace tqdecode::cuda
