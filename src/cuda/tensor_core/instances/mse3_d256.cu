// The tensor-core decode kernel's instance for 3-bit MSE keys, 4-bit values (turboquant_k3v4_nc) at D = 256.
#include "../kernel.cuh"

namespace tqdecode::cuda::tensor_core {

TQ_TENSOR_CORE_INSTANTIATE(256, CacheFormat::mse3)

}  // namespace tqdecode::cuda::tensor_core
