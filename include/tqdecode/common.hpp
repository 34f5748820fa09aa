// Shared macros and small types used by both host and device code.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define TQ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TQ_HOST_DEVICE inline
#endif

namespace tqdecode {

/// Element type of a query, key/value input or output tensor.
enum class DType : std::uint8_t { f32, f16, bf16 };

/// Name of a dtype as users write it ("float32", "float16", "bfloat16").
const char* dtype_name(DType dtype);

/// Size in bytes of one element.
constexpr int dtype_size(DType dtype) { return dtype == DType::f32 ? 4 : 2; }

}  // namespace tqdecode
