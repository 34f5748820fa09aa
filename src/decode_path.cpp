#include "tqdecode/decode.hpp"

namespace tqdecode {

const char* decode_path_name(DecodePath path) {
  switch (path) {
    case DecodePath::hopper: return "hopper";
    case DecodePath::cuda_generic: return "cuda_generic";
    default: return "cpu_reference";
  }
}

const char* generic_kernel_name(GenericKernel kernel) {
  return kernel == GenericKernel::tensor_core ? "tensor_core" : "scalar";
}

}  // namespace tqdecode
