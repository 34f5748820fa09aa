// The launcher of a build without CUDA: the CPU reference serves the same API.
#if !defined(TQDECODE_WITH_CUDA)

#include <atomic>

#include "../workspace_defaults.hpp"
#include "tqdecode/continuation.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/reference.hpp"

namespace tqdecode {

// No pools: the CPU path allocates per call. The settings are kept so code
// written for the CUDA build runs unchanged.
struct DecodeWorkspace::Impl {
  int max_batch = 0;
  std::atomic<bool> device_checks{false};
  std::atomic<bool> programmatic_launch{true};
};

DecodeWorkspace::DecodeWorkspace(int max_batch) : impl_(std::make_unique<Impl>()) {
  impl_->max_batch = resolve_max_batch(max_batch);
  impl_->device_checks = switch_from_environment("TQDECODE_DEVICE_CHECKS", false);
  impl_->programmatic_launch = switch_from_environment("TQDECODE_PROGRAMMATIC_LAUNCH", true);
}
DecodeWorkspace::~DecodeWorkspace() = default;
int DecodeWorkspace::max_batch() const { return impl_->max_batch; }
DecodeWorkspace::Stats DecodeWorkspace::stats() const { return {}; }
void DecodeWorkspace::set_device_checks(bool enabled) { impl_->device_checks = enabled; }
bool DecodeWorkspace::device_checks() const { return impl_->device_checks; }
void DecodeWorkspace::set_programmatic_launch(bool enabled) { impl_->programmatic_launch = enabled; }
bool DecodeWorkspace::programmatic_launch() const { return impl_->programmatic_launch; }
// Nothing runs on a device here: decode_cpu validates seq_lens and the block
// table on the host and throws Error instead.
DeviceCheckReport DecodeWorkspace::device_check_report(CUstream_st*) { return {}; }

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

void continuation_route(const std::int32_t*, int, std::int64_t, std::int32_t*, CUstream_st*) {
  fail("continuation_route", "this build has no CUDA; accepted: a build with CUDA");
}

}  // namespace tqdecode

#endif
