// Explicit instantiations of the generic partition kernel for turboquant_k8v4
// (one file per preset so the instances compile in parallel).
#include "../decode_generic.cuh"

namespace tqdecode::cuda::generic {

TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_INSTANTIATE, Preset::turboquant_k8v4)

}  // namespace tqdecode::cuda::generic
