// The tensor-core decode kernel's instance for fp8 keys, 4-bit values (turboquant_k8v4) at D = 128.
#include "../kernel.cuh"

namespace tqdecode::cuda::tensor_core {

TQ_TENSOR_CORE_INSTANTIATE(128, CacheFormat::fp8)

}  // namespace tqdecode::cuda::tensor_core
