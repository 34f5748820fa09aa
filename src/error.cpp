#include "tqdecode/error.hpp"

#include "tqdecode/common.hpp"

namespace tqdecode {

void fail(std::string_view argument, const std::string& message) {
  throw Error(std::string(argument), message);
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
  }
  return "an unknown dtype";  // a value cast from outside the enum
}

}  // namespace tqdecode
