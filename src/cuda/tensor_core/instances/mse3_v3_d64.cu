// The tensor-core decode kernel's instance for 3-bit MSE keys and values (turboquant_3bit_nc) at D = 64.
#include "../kernel.cuh"

namespace tqdecode::cuda::tensor_core {

TQ_TENSOR_CORE_INSTANTIATE(64, CacheFormat::mse3_v3)

}  // namespace tqdecode::cuda::tensor_core
