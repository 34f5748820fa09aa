// Explicit instantiations of the generic partition kernel for turboquant_4bit_nc
// (one file per preset so the instances compile in parallel).
#include "../decode_generic.cuh"

namespace tqdecode::cuda::generic {

TQ_GENERIC_INSTANCES_OF_PRESET(TQ_GENERIC_INSTANTIATE, Preset::turboquant_4bit_nc)

}  // namespace tqdecode::cuda::generic
