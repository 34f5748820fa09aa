// continuation_route (include/tqdecode/continuation.hpp): one CTA reads the
// rows' lengths once and writes both calls' inputs.
#include <cuda_runtime.h>

#include "cuda_check.hpp"
#include "tqdecode/continuation.hpp"
#include "tqdecode/error.hpp"

namespace tqdecode {
namespace {

constexpr int kRouteThreads = 256;

__global__ void __launch_bounds__(kRouteThreads)
    continuation_route_kernel(const std::int32_t* seq_lens, int rows, std::int64_t capacity, std::int32_t* route) {
  bool rising = true;
  for (int i = threadIdx.x; i + 1 < rows; i += kRouteThreads) {
    rising = rising && static_cast<std::int64_t>(seq_lens[i + 1]) - seq_lens[i] == 1;
  }
  const std::int32_t last = seq_lens[rows - 1];
  const bool chunk = __syncthreads_and(rising) && seq_lens[0] >= 1 && last <= capacity;
  for (int i = threadIdx.x; i < rows; i += kRouteThreads) route[i] = chunk ? 0 : seq_lens[i];
  if (threadIdx.x == 0) {
    route[rows] = 0;
    route[rows + 1] = chunk ? rows : 0;
    route[rows + 2] = chunk ? last : 0;
  }
}

}  // namespace

void continuation_route(const std::int32_t* seq_lens, int rows, std::int64_t capacity, std::int32_t* route,
                        CUstream_st* stream) {
  TQ_REQUIRE(rows >= 1, "rows", std::to_string(rows) + " rows; accepted: at least 1");
  TQ_REQUIRE(seq_lens != nullptr, "seq_lens", "null; accepted: a device pointer to rows int32 lengths");
  TQ_REQUIRE(route != nullptr, "route", "null; accepted: a device pointer to rows + 3 int32");
  continuation_route_kernel<<<1, kRouteThreads, 0, stream>>>(seq_lens, rows, capacity, route);
  TQ_CUDA_CHECK_LAUNCH();
}

}  // namespace tqdecode
