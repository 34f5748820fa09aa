// The one place where runtime values become template arguments of the
// kernels (internal): every kernel family dispatches through these visitors,
// so a preset or head size added here reaches every family's switch.
#pragma once

#include "tqdecode/format.hpp"

namespace tqdecode::cuda {

/// visit.template operator()<P>() for the runtime preset.
template <class Visit>
auto visit_preset(Preset preset, Visit&& visit) {
  switch (preset) {
    case Preset::turboquant_k8v4: return visit.template operator()<Preset::turboquant_k8v4>();
    case Preset::turboquant_k3v4_nc: return visit.template operator()<Preset::turboquant_k3v4_nc>();
    case Preset::turboquant_3bit_nc: return visit.template operator()<Preset::turboquant_3bit_nc>();
    default: return visit.template operator()<Preset::turboquant_4bit_nc>();
  }
}

/// visit.template operator()<D>() for a head size of kHeadDims (validated
/// before dispatch; 128 otherwise).
template <class Visit>
auto visit_head_dim(int head_dim, Visit&& visit) {
  switch (head_dim) {
    case 64: return visit.template operator()<64>();
    case 256: return visit.template operator()<256>();
    default: return visit.template operator()<128>();
  }
}

}  // namespace tqdecode::cuda
