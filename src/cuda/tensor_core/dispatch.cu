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

// An instance's entry of the shape table.
template <int HeadDim, int HeadTiles, tensor_core::CacheFormat Format, bool Wide, int HeadsPerCta,
          tensor_core::SlotAccess Slots = tensor_core::SlotAccess::none>
constexpr KernelFootprint footprint_of() {
  return {tensor_core::SharedLayout<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>::kBytes,
          tensor_core::KernelShape<HeadDim, HeadTiles, Format, Wide, HeadsPerCta, Slots>::kResidentCtas};
}

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

KernelFootprint tensor_core_footprint(Preset preset, int rows_per_head, int head_dim, bool wide_table,
                                      int kv_heads_per_cta, bool token_slots, bool token_runs, bool whole_rows) {
  using tensor_core::CacheFormat;
  return visit_preset(preset, [&]<Preset P>() -> KernelFootprint {
    constexpr CacheFormat kFormat = tensor_core::cache_format(P);
    return visit_head_dim(head_dim, [&]<int HeadDim>() -> KernelFootprint {
      // The four-head-tile CTA (the launcher's choice) plans one CTA per SM, as two head tiles do.
      const int head_tiles = tensor_core_head_tiles(rows_per_head, HeadDim, false);
      if (token_slots) {  // one kv head per CTA but in the wide shape (launch_for_group)
        constexpr tensor_core::SlotAccess kInPlace = tensor_core::SlotAccess::in_place;
        if constexpr (HeadDim == 128) {  // every kv head's token runs
          constexpr tensor_core::SlotAccess kRuns = tensor_core::SlotAccess::runs;
          if (token_runs) {
            if (kv_heads_per_cta == 4) return footprint_of<HeadDim, 1, kFormat, false, 4, kRuns>();
            if constexpr (kFormat == CacheFormat::fp8) {
              if (kv_heads_per_cta == 1) return footprint_of<HeadDim, 1, kFormat, false, 1, kRuns>();
            }
            return footprint_of<HeadDim, 1, kFormat, false, 2, kRuns>();
          }
        }
        if constexpr (kFormat == CacheFormat::mse4 && HeadDim == 128) {
          if (wide_table) {
            if (head_tiles == 2) return footprint_of<HeadDim, 2, kFormat, true, 1, kInPlace>();
            switch (kv_heads_per_cta) {
              case 8:
                if (whole_rows) return footprint_of<HeadDim, 1, kFormat, true, 8, tensor_core::SlotAccess::rows>();
                return footprint_of<HeadDim, 1, kFormat, true, 8, kInPlace>();
              case 4:
                if (whole_rows) return footprint_of<HeadDim, 1, kFormat, true, 4, tensor_core::SlotAccess::rows>();
                return footprint_of<HeadDim, 1, kFormat, true, 4, kInPlace>();
              case 2: return footprint_of<HeadDim, 1, kFormat, true, 2, kInPlace>();
              default: return footprint_of<HeadDim, 1, kFormat, true, 1, kInPlace>();
            }
          }
        }
        if constexpr (kFormat != CacheFormat::mse4 && HeadDim == 128) {  // whole rows
          if (kv_heads_per_cta == 8) return footprint_of<HeadDim, 1, kFormat, false, 8, tensor_core::SlotAccess::rows>();
          if constexpr (kFormat == CacheFormat::fp8) {
            if (kv_heads_per_cta == 4) return footprint_of<HeadDim, 1, kFormat, false, 4, tensor_core::SlotAccess::rows>();
          }
        }
        // The narrow configuration: the same shared memory whether the slots
        // are read in place (rotated or not) or repacked (the stages hold
        // them as they land).
        constexpr tensor_core::SlotAccess kRepacked = tensor_core::SlotAccess::repacked;
        if constexpr (HeadDim == 128) {
          static_assert(footprint_of<HeadDim, 1, kFormat, false, 1, kInPlace>().shared_bytes ==
                            footprint_of<HeadDim, 1, kFormat, false, 1, kRepacked>().shared_bytes &&
                        footprint_of<HeadDim, 2, kFormat, false, 1, kInPlace>().shared_bytes ==
                            footprint_of<HeadDim, 2, kFormat, false, 1, kRepacked>().shared_bytes);
          if constexpr (kFormat == CacheFormat::fp8) {
            constexpr tensor_core::SlotAccess kRotated = tensor_core::SlotAccess::rotated;
            static_assert(footprint_of<HeadDim, 1, kFormat, false, 1, kRotated>().shared_bytes ==
                              footprint_of<HeadDim, 1, kFormat, false, 1, kRepacked>().shared_bytes &&
                          footprint_of<HeadDim, 2, kFormat, false, 1, kRotated>().shared_bytes ==
                              footprint_of<HeadDim, 2, kFormat, false, 1, kRepacked>().shared_bytes);
          }
        }
        if constexpr (HeadDim != 256) {
          if (head_tiles == 2) return footprint_of<HeadDim, 2, kFormat, false, 1, kRepacked>();
        }
        return footprint_of<HeadDim, 1, kFormat, false, 1, kRepacked>();
      }
      if constexpr (kFormat == CacheFormat::mse4 && HeadDim == 128) {  // the wide-table shapes
        if (wide_table) {
          if (head_tiles == 2) return footprint_of<HeadDim, 2, kFormat, true, 1>();
          switch (kv_heads_per_cta) {
            case 8: return footprint_of<HeadDim, 1, kFormat, true, 8>();
            case 4: return footprint_of<HeadDim, 1, kFormat, true, 4>();
            case 2: return footprint_of<HeadDim, 1, kFormat, true, 2>();
            default: return footprint_of<HeadDim, 1, kFormat, true, 1>();
          }
        }
      }
      if constexpr (kFormat != CacheFormat::mse4 && HeadDim == 128) {  // the other presets' two-kv-head CTA
        if (kv_heads_per_cta == 2 && head_tiles == 1) return footprint_of<HeadDim, 1, kFormat, false, 2>();
      }
      if constexpr (HeadDim != 256) {  // one head tile at D = 256
        if (head_tiles == 2) return footprint_of<HeadDim, 2, kFormat, false, 1>();
      }
      return footprint_of<HeadDim, 1, kFormat, false, 1>();
    });
  });
}

bool tensor_core_kernel_runnable() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, tensor_core_probe_kernel) == cudaSuccess;
}

}  // namespace tqdecode::cuda
