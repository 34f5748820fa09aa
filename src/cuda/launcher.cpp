// The decode entry point of CUDA builds (docs/LAUNCHER.md).
#include <cuda_runtime.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "cuda_check.hpp"
#include "kernel_params.hpp"
#include "policy.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/error.hpp"
#include "tqdecode/reference.hpp"
#include "workspace.hpp"

namespace tqdecode {

namespace {

bool device_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

// Everything a plan depends on: shapes and strides fixed at capture, never
// tensor values. The cache pointer's and the block stride's 16-byte
// alignment and a block stride past 31 bits each gate kernels on their own;
// token_slots: the token and head strides and the norm correction choose
// how the slots are read and the grid.
using PlanKey = std::tuple<int, int, int, int, int, int, int, int, int, int, bool, bool, bool, int, int, std::int64_t,
                           std::int64_t, bool>;

PlanKey plan_key(const DecodeArgs& args, int device, PathRequest request) {
  const bool slots = args.layout.token_slots();
  return {device,
          args.batch,
          args.num_q_heads,
          args.layout.num_kv_heads,
          args.layout.head_dim,
          args.layout.block_size,
          args.max_blocks_per_seq,
          static_cast<int>(args.layout.preset),
          static_cast<int>(args.query_dtype),
          static_cast<int>(request),
          reinterpret_cast<std::uintptr_t>(args.cache) % 16 == 0,
          args.layout.block_stride % 16 == 0,
          args.layout.block_stride >= (std::int64_t{1} << 31),
          static_cast<int>(args.layout.order),
          args.varlen() ? args.max_query_len : 0,
          slots ? args.layout.token_stride : 0,
          slots ? args.layout.head_stride : 0,
          slots && args.layout.renormalize_keys};
}

// Several query tokens per sequence on the scalar kernel, whose CTAs serve
// up to kGenericMaxRows query rows of a kv head from each key and value they
// load. The partition count fills the GPU with the grid's query tiles.
void plan_scalar_query_tiles(const DecodeArgs& args, const cuda::DeviceInfo& device, LaunchPlan& plan) {
  const int tokens_per_cta = cuda::generic_query_tokens_per_cta(args.group_size(), args.max_query_len);
  const int query_tiles = (args.max_query_len + tokens_per_cta - 1) / tokens_per_cta;
  plan.num_partitions = cuda::choose_num_partitions(
      args.batch * query_tiles, args.layout.num_kv_heads, args.max_blocks_per_seq * args.layout.block_size,
      device.sm_count, cuda::resident_ctas_per_sm(DecodePath::cuda_generic, args.layout.preset, args.group_size(), false));
  plan.query_tokens_per_cta = tokens_per_cta;
  plan.reason += "; " + std::to_string(tokens_per_cta) + " query token(s) of a sequence per CTA";
}

// Why the automatic path took the Hopper path: the preset and head size it serves on sm_90.
std::string hopper_automatic_text(const DecodeArgs& args) {
  return std::string(preset_info(args.layout.preset).name) + ", D=" + std::to_string(args.layout.head_dim) +
         " on sm_90";
}

// The tensor-core kernel's row tiles, where there are several or the call
// has several query tokens per sequence.
std::string row_tiles_text(const DecodeArgs& args, int head_tiles) {
  const int rows = cuda::tensor_core_rows_per_head(args);
  const int tiles = cuda::tensor_core_row_tiles(rows, head_tiles);
  if (!args.varlen() && tiles == 1) return {};
  return "; " + std::to_string(rows) + " query rows per kv head" +
         (args.varlen() ? " (max_query_len " + std::to_string(args.max_query_len) + ")" : std::string()) + " in " +
         std::to_string(tiles) + (tiles == 1 ? " row tile" : " row tiles");
}

void log_fallback_once(const std::string& reason) {
  static std::mutex mutex;
  static std::set<std::string> logged;
  std::lock_guard<std::mutex> lock(mutex);
  if (logged.insert(reason).second) std::fprintf(stderr, "tqdecode: using the generic CUDA path: %s\n", reason.c_str());
}

// How the tensor-core kernels read a token_slots cache (tensor_core/slot_tile.cuh):
// the wide shape's 4-bit keys by bulk copies per kv head or in whole rows,
// the other presets' CTAs of several kv heads in whole rows or token runs.
std::string token_slots_text(const DecodeArgs& args, const cuda::GridChoice& grid) {
  if (!args.layout.token_slots()) return {};
  if (grid.wide_table && !grid.whole_rows) return ", token_slots order (bulk copies, read in place)";
  if (grid.token_runs) return ", token_slots order (token runs of every kv head by bulk copies, read in place)";
  if (grid.kv_heads_per_cta > 1) {
    return std::string(", token_slots order (whole token rows by bulk copies, read in place") +
           (args.layout.preset == Preset::turboquant_k8v4 || grid.wide_table ? ", rotated)" : ")");
  }
  if (cuda::token_slots_read_rotated(args.layout)) return ", token_slots order (read in place, rotated)";
  return cuda::token_slots_read_in_place(args.layout) ? ", token_slots order (read in place)"
                                                       : ", token_slots order (repacked)";
}

LaunchPlan make_plan(const DecodeArgs& args, PathRequest request, const cuda::DeviceInfo& device) {
  TQ_REQUIRE(cuda::tensor_core_kernel_runnable(), "device",
             "sm_" + std::to_string(device.cc_major) + std::to_string(device.cc_minor) +
                 " has no kernels in this build; accepted: a device of the architectures it was built for "
                 "(CMAKE_CUDA_ARCHITECTURES), or a newer one where it holds PTX");
  const std::string not_hopper = cuda::hopper_unsupported_reason(args, device);
  const int max_context = args.max_blocks_per_seq * args.layout.block_size;
  // The tensor-core kernel's grid: row tiles of each (sequence, kv head)'s
  // query rows (tensor_core/cta_rows.cuh) take the place of sequences.
  const int rows_per_head = cuda::tensor_core_rows_per_head(args);
  const int head_dim = args.layout.head_dim;
  if (request == PathRequest::hopper) {
    TQ_REQUIRE(not_hopper.empty(), "path", "the Hopper kernel cannot serve this call: " + not_hopper);
  }
  const bool warp_specialized_by_default =
      request == PathRequest::automatic && not_hopper.empty() &&
      cuda::warp_specialized_automatic(DecodePath::hopper, args.layout, args.varlen(), rows_per_head, args.batch,
                                       device.sm_count);
  if (request == PathRequest::hopper_warp_specialized || warp_specialized_by_default) {
    TQ_REQUIRE(not_hopper.empty(), "path",
               "the warp-specialized kernel runs on the Hopper path, which cannot serve this call: " + not_hopper);
    TQ_REQUIRE(cuda::warp_specialized_serves(DecodePath::hopper, args.layout, args.varlen(), rows_per_head), "path",
               std::string("the warp-specialized kernel cannot serve this call (") +
                   (cuda::warp_specialized_built() ? "" : "this build has no sm_90a code; ") +
                   preset_info(args.layout.preset).name + ", D=" + std::to_string(head_dim) + ", " +
                   std::to_string(rows_per_head) +
                   " query rows per kv head); accepted: several query tokens per sequence (query_start_loc) of "
                   "turboquant_4bit_nc at D = 128, in the blocks order or in the token_slots order with token rows "
                   "and blocks of 16-byte multiples, with more than 16 query rows per kv head (group x "
                   "max_query_len), in a build with sm_90a code");
    const int tokens_per_cta = cuda::warp_specialized_tokens_per_cta(args.group_size(), args.max_query_len);
    const int query_tiles = (args.max_query_len + tokens_per_cta - 1) / tokens_per_cta;
    LaunchPlan plan{DecodePath::hopper,
                    (warp_specialized_by_default ? hopper_automatic_text(args) : std::string("requested")) +
                        "; the warp-specialized kernel: " + std::to_string(rows_per_head) +
                        " query rows per kv head (max_query_len " + std::to_string(args.max_query_len) + ") in " +
                        std::to_string(query_tiles) + (query_tiles == 1 ? " query tile" : " query tiles") + " of " +
                        std::to_string(tokens_per_cta) + " token(s)",
                    cuda::choose_num_partitions(args.batch * query_tiles, args.layout.num_kv_heads, max_context,
                                                device.sm_count, 1),
                    cuda::kWarpSpecializedAlign};
    plan.warp_specialized = true;
    plan.query_tokens_per_cta = tokens_per_cta;
    return plan;
  }
  if (request == PathRequest::hopper || (request == PathRequest::automatic && not_hopper.empty())) {
    const int head_tiles = cuda::tensor_core_head_tiles(
        rows_per_head, head_dim,
        cuda::tensor_core_four_head_tiles(DecodePath::hopper, args.layout, rows_per_head, args.batch, device.sm_count));
    const cuda::GridChoice grid =
        cuda::choose_grid(DecodePath::hopper, args.layout.preset, rows_per_head,
                          args.batch * cuda::tensor_core_row_tiles(rows_per_head, head_tiles), args.layout.num_kv_heads,
                          max_context, device.sm_count, args.layout.head_dim, cuda::token_slots_read(args),
                          args.layout.renormalize_keys, device.memory_bytes_per_sm_cycle);
    const std::string reason =
        (request == PathRequest::hopper ? std::string("requested")
                                        : hopper_automatic_text(args) + token_slots_text(args, grid)) +
        row_tiles_text(args, head_tiles);
    LaunchPlan plan{DecodePath::hopper, reason, grid.num_partitions, cuda::kPartitionAlign, grid.wide_table,
                    grid.kv_heads_per_cta};
    plan.head_tiles = head_tiles;
    plan.token_runs = grid.token_runs;
    plan.whole_rows = grid.whole_rows;
    return plan;
  }
  // The generic path: the tensor-core kernel's narrow configuration where it
  // runs, else the scalar kernel.
  const std::string reason = request == PathRequest::automatic ? not_hopper : "requested";
  const std::string not_tensor_core = request == PathRequest::cuda_generic_scalar
                                          ? "the scalar kernel was requested"
                                          : cuda::generic_tensor_core_unsupported_reason(args, device);
  LaunchPlan plan{DecodePath::cuda_generic, {}, 0, cuda::kPartitionAlign};
  if (not_tensor_core.empty()) {
    plan.generic_kernel = GenericKernel::tensor_core;
    plan.head_tiles = cuda::tensor_core_head_tiles(rows_per_head, head_dim, false);
    plan.num_partitions = cuda::choose_num_partitions(
        args.batch * cuda::tensor_core_row_tiles(rows_per_head, plan.head_tiles), args.layout.num_kv_heads, max_context,
        device.sm_count,
        cuda::narrow_resident_ctas(args.layout.preset, rows_per_head, device, args.layout.head_dim,
                                   args.layout.token_slots()));
    plan.reason = reason + "; the tensor-core kernel (narrow configuration" +
                  token_slots_text(args, cuda::GridChoice{}) + ")" +
                  row_tiles_text(args, plan.head_tiles);
  } else if (args.varlen()) {
    plan.reason = reason + "; the scalar kernel: " + not_tensor_core;
    plan_scalar_query_tiles(args, device, plan);
  } else {
    const cuda::GridChoice grid = cuda::choose_grid(DecodePath::cuda_generic, args.layout.preset, args.group_size(),
                                                    args.batch, args.layout.num_kv_heads, max_context, device.sm_count,
                                                    args.layout.head_dim);
    plan.num_partitions = grid.num_partitions;
    plan.reason = reason + "; the scalar kernel: " + not_tensor_core;
  }
  if (request == PathRequest::automatic) log_fallback_once(plan.reason);
  return plan;
}

}  // namespace

// The probe kernel is built for the same architectures as every kernel.
bool cuda_available() { return device_present() && cuda::tensor_core_kernel_runnable(); }

bool is_available() {
  if (!device_present()) return false;
  const cuda::DeviceInfo& device = cuda::current_device_info();
  return device.cc_major == 9 && device.cc_minor == 0 && cuda::tensor_core_kernel_runnable();
}

LaunchPlan plan_decode(const DecodeArgs& args, PathRequest request) {
  validate_decode_shapes(args, /*output_required=*/false);
  if (request == PathRequest::cpu_reference) return {DecodePath::cpu_reference, "requested", 1, 1};
  if (!device_present()) {
    TQ_REQUIRE(request == PathRequest::automatic, "path", "no CUDA device is present; accepted: automatic, cpu_reference");
    return {DecodePath::cpu_reference, "no CUDA device is present", 1, 1};
  }
  // Before any pool is acquired or grown, and for every kernel alike.
  TQ_REQUIRE(args.batch <= cuda::kMaxGridSequences, "batch",
             std::to_string(args.batch) + " sequences do not fit one GPU call; accepted: 0 to " +
                 std::to_string(cuda::kMaxGridSequences) + " (the grid's z dimension), or the cpu_reference path");
  const cuda::DeviceInfo& device = cuda::current_device_info();
  static std::mutex mutex;
  static std::map<PlanKey, LaunchPlan> plans;
  const PlanKey key = plan_key(args, device.device, request);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto found = plans.find(key); found != plans.end()) return found->second;
  }
  LaunchPlan plan = make_plan(args, request, device);
  std::lock_guard<std::mutex> lock(mutex);
  return plans.emplace(key, std::move(plan)).first->second;
}

PathChoice choose_decode_path(const DecodeArgs& args, PathRequest request) {
  LaunchPlan plan = plan_decode(args, request);
  return {plan.path, std::move(plan.reason)};
}

void* decode(const DecodeArgs& args, DecodeWorkspace& workspace, CUstream_st* stream, PathRequest request) {
  if (args.batch == 0 || args.query_rows() == 0) {  // no rows to write (a varlen call may have no tokens)
    validate_decode_shapes(args, /*output_required=*/false);
    return args.output;
  }
  DecodeArgs call = args;
  const bool pooled_output = call.output == nullptr;
  const LaunchPlan plan = plan_decode(call, request);
  if (plan.path == DecodePath::cpu_reference) {
    TQ_REQUIRE(!pooled_output, "output", "the CPU path needs a caller-provided output");
    decode_cpu(call);
    return call.output;
  }
  // The generic rotation stages PiT with 16-byte copies (the Hopper kernel
  // reads 8-byte pairs); one rule for both paths.
  TQ_REQUIRE(call.layout.key_fp8() || reinterpret_cast<std::uintptr_t>(call.PiT) % 16 == 0, "PiT",
             "device pointer is not 16-byte aligned; accepted: a 16-byte aligned [D, D] fp32 matrix");
  // The scalar kernel reads a token_slots cache in 2-byte pieces and fp16
  // fields (validate_layout makes every stride even).
  TQ_REQUIRE(!call.layout.token_slots() || reinterpret_cast<std::uintptr_t>(call.cache) % 2 == 0, "cache",
             "device pointer of a token_slots cache is odd; accepted: a 2-byte aligned pointer (every fp16 field "
             "of a slot 2-byte aligned)");
  const cuda::DeviceInfo& device = cuda::current_device_info();
  // Query slots: one per sequence, or max_query_len per sequence (varlen).
  const int query_slots = call.batch * call.query_tokens_bound();
  const PooledBuffers buffers = workspace.impl().acquire(
      {device.device, call.layout.num_kv_heads, call.num_q_heads, call.layout.head_dim, static_cast<int>(call.query_dtype)},
      {query_slots, std::int64_t(query_slots) * plan.num_partitions}, device.sm_count, stream);
  if (pooled_output) {
    call.output = buffers.output;
    call.output_stride_batch = 0;
    call.output_stride_head = 0;
  }

  // Device-side checks: the decode kernels read the checked copy of the
  // lengths, in which a sequence with a bad length or block-table entry is 0.
  const std::int32_t* seq_lens = call.seq_lens;
  if (workspace.device_checks()) {
    cuda::launch_check_decode_inputs({call.seq_lens, call.block_table, call.table_stride(), call.max_blocks_per_seq,
                                      call.layout.block_size, call.num_blocks, call.batch, buffers.checked_seq_lens,
                                      buffers.check_state},
                                     stream);
    seq_lens = buffers.checked_seq_lens;
  }

  const bool mse_keys = !call.layout.key_fp8();
  const cuda::RotateParams rotate{call.query, call.query_dtype, call.q_stride_b(), call.q_stride_h(),
                                  mse_keys ? call.PiT : nullptr, buffers.q_rot, call.query_rows(), call.num_q_heads,
                                  call.layout.head_dim};
  const cuda::PartitionParams partitions{buffers.q_rot, call.cache, call.layout, call.num_blocks,
                                         call.block_table, call.table_stride(), call.max_blocks_per_seq,
                                         seq_lens, mse_keys ? call.centroids : nullptr, call.scale,
                                         call.batch, call.num_q_heads, plan.num_partitions,
                                         plan.partition_align, buffers.part_max, buffers.part_sum,
                                         buffers.part_out};
  const cuda::ReduceParams reduce{buffers.part_max, buffers.part_sum, buffers.part_out, call.sinks, call.output,
                                  call.query_dtype, call.out_stride_b(), call.out_stride_h(), call.batch,
                                  call.num_q_heads, call.layout.head_dim, plan.num_partitions};
  if (plan.warp_specialized) {
    const cuda::QueryRows rows{call.query_start_loc, call.query_rows(), call.query_tokens_bound(),
                               plan.query_tokens_per_cta};
    cuda::launch_rotate_queries(rotate, stream);
    cuda::launch_partitions_warp_specialized(partitions, rows, stream);
    cuda::launch_reduce_partitions(reduce, rows, stream);
  } else if (plan.path == DecodePath::hopper || plan.generic_kernel == GenericKernel::tensor_core) {
    // One launch: rotation, partitions and reduction fused. The generic
    // path's plan has the narrow configuration, launched plainly (programmatic
    // dependent launch is an sm_90 feature).
    const bool programmatic = plan.path == DecodePath::hopper && workspace.programmatic_launch() && call.constants_stable;
    const cuda::QueryRows rows{call.query_start_loc, call.query_rows(), call.query_tokens_bound(), 1};
    cuda::launch_decode_tensor_core({partitions, rotate, reduce, buffers.arrivals, plan.wide_table, plan.kv_heads_per_cta,
                                     programmatic, call.scale * cuda::kLog2e, rows,
                                     cuda::tensor_core_row_tiles(cuda::tensor_core_rows_per_head(call), plan.head_tiles),
                                     plan.token_runs, plan.whole_rows, plan.head_tiles},
                                    stream);
  } else {
    const cuda::QueryRows rows{call.query_start_loc, call.query_rows(), call.query_tokens_bound(),
                               plan.query_tokens_per_cta};
    cuda::launch_rotate_queries(rotate, stream);
    cuda::launch_partitions_generic(partitions, rows, stream);
    cuda::launch_reduce_partitions(reduce, rows, stream);
  }
  return call.output;
}

}  // namespace tqdecode
