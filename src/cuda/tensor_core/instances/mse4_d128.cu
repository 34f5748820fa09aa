// The tensor-core decode kernel's instance for 4-bit MSE keys, 4-bit values (turboquant_4bit_nc) at D = 128.
#include "../kernel.cuh"

namespace tqdecode::cuda::tensor_core {

TQ_TENSOR_CORE_INSTANTIATE(128, CacheFormat::mse4)

}  // namespace tqdecode::cuda::tensor_core
