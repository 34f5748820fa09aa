// The launcher of a build without CUDA: the CPU reference serves the same API.
#if !defined(TQDECODE_WITH_CUDA)

#include <cstdlib>

#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode {

struct DecodeWorkspace::Impl {
  int max_batch;
};

DecodeWorkspace::DecodeWorkspace(int max_batch) : impl_(std::make_unique<Impl>(Impl{max_batch > 0 ? max_batch : 512})) {}
DecodeWorkspace::~DecodeWorkspace() = default;
int DecodeWorkspace::max_batch() const { return impl_->max_batch; }
DecodeWorkspace::Stats DecodeWorkspace::stats() const { return {}; }

bool cuda_available() { return false; }
bool is_available() { return false; }

LaunchPlan plan_decode(const DecodeArgs& args, PathRequest request) {
  validate_decode_shapes(args, /*output_required=*/false);
  TQ_REQUIRE(request == PathRequest::automatic || request == PathRequest::cpu_reference, "path",
          "this build has no CUDA; accepted: automatic, cpu_reference");
  return {DecodePath::cpu_reference, "this build has no CUDA", 1, 1};
}

PathChoice choose_decode_path(const DecodeArgs& args, PathRequest request) {
  const LaunchPlan plan = plan_decode(args, request);
  return {plan.path, plan.reason};
}

void* decode(const DecodeArgs& args, DecodeWorkspace&, CUstream_st*, PathRequest request) {
  plan_decode(args, request);
  decode_cpu(args);
  return args.output;
}

}  // namespace tqdecode

#endif
