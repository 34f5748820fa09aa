// tqdecode_bench: times the decode step as an engine sees it, for the shapes
// in bench/shapes.json, against the device's own memory ceilings.
// bench/run_bench.py runs it together with the bf16 baseline.
//
// Method, and why:
// - Ceilings: a ~2 GiB device-to-device copy and a ~4 GiB read-only streaming
//   kernel, each the median of 20 event-timed reps. Decode attention only
//   reads the cache, so the read ceiling is what it is compared to.
// - Instances: every shape has several "layers", each with its own cache
//   region, block table, lengths, query, output, PiT and centroids (distinct
//   constants: an engine's layers never share them), filled on the GPU
//   (bench_inputs.hpp says with what; the kernels' speed does not depend on
//   the values except through the softmax's rescales, which "peaked" shapes
//   exercise).
// - Single step (the primary number): each layer's decode is captured as a
//   CUDA graph of its own holding exactly that one decode() call (programmatic
//   dependent launch as the library configures it). Before every timed
//   replay the L2 is flushed on the same stream, outside the timed events,
//   by a kernel that reads a buffer of 4x the L2 (at least 256 MiB): reads,
//   so the L2 holds clean lines as after an engine's weight GEMM, and the
//   decode pays no write-back of a flush's dirty lines (--l2-flush write
//   uses cudaMemsetAsync instead). The replays cycle through the layers;
//   the number is the median of at least 30. An empty kernel timed the
//   same way is the floor any single step pays.
// - Back-to-back (throughput, a secondary column, shapes with
//   "back_to_back"): one graph of R decodes over R layers with R * bytes >=
//   1 GiB, no flush, median replay / R: each decode's prologue overlaps the
//   previous one, as engines never run attention.
// - Engine-like step (shapes with "engine"): 16 layers in one graph, each
//   a bf16 GEMM streaming its own 128 MiB of weights (cuBLAS, [B, 8192] x
//   [8192, 8192]) then that layer's decode; the cost per layer is (step -
//   the same graph with the GEMMs alone) / 16, and the floor the same with
//   an empty kernel in place of the decode. The three graphs' replays are
//   interleaved, each after an L2 flush.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench_cuda.hpp"
#include "bench_gemm.hpp"
#include "bench_instances.hpp"
#include "bench_json.hpp"
#include "bench_self_check.hpp"
#include "bench_shapes.hpp"
#include "tqdecode/decode.hpp"

#ifndef TQDECODE_BENCH_SHAPES_FILE
#error "TQDECODE_BENCH_SHAPES_FILE (the default --shapes-file) is defined by bench/CMakeLists.txt"
#endif

namespace tqbench {
namespace {

using tqdecode::DecodeArgs;
using tqdecode::DecodePath;
using tqdecode::DecodeWorkspace;
using tqdecode::GenericKernel;
using tqdecode::PathRequest;

constexpr std::int64_t kGiB = std::int64_t{1} << 30;
constexpr std::int64_t kCopyBytes = 2 * kGiB;  // copied per rep (read and written once each)
constexpr std::int64_t kReadBytes = 4 * kGiB;  // read per rep by the streaming kernel
constexpr int kCeilingWarmups = 3;
constexpr int kCeilingReps = 20;
constexpr int kReadThreads = 1024;  // measured on H200: 1024 x 2 blocks/SM edges out 256 x 8
constexpr std::int64_t kMinFlushBytes = std::int64_t{256} << 20;
constexpr int kMinReplays = 30;      // single steps (rounded up to whole cycles of the layers) and the floor
constexpr int kBackToBackWarmups = 2;
constexpr int kBackToBackReplays = 30;
constexpr int kEngineReplays = 30;  // per graph of the engine-like step

const char* const kUsage =
    "usage: tqdecode_bench [options]\n"
    "  --json FILE         write the run as JSON (rewritten after every shape, so a crash keeps the shapes before)\n"
    "  --commit STR        commit recorded in the JSON [unknown]\n"
    "  --quick             only the shapes marked \"quick\" (smoke test)\n"
    "  --shapes A,B        only these shape names\n"
    "  --shapes-file FILE  the shape list [" TQDECODE_BENCH_SHAPES_FILE "]\n"
    "  --automatic-only    only the automatic path request of each shape\n"
    "  --l2-flush KIND     read (a kernel reads 4x the L2; default) or write (cudaMemsetAsync of it)\n"
    "  --dry-run           print the plan of the selected shapes as JSON (no GPU needed)\n"
    "  --self-check        check the input generators on the CPU (no GPU needed): lengths, block tables,\n"
    "                      planted scores against the CPU reference's rotation, finite reference output\n"
    "  --help              this text\n"
    "Exit status: 0 all measured, 1 a shape failed, 3 the CUDA context was lost (the JSON names the shape).\n";

double terabytes_per_second(double bytes, double microseconds) { return bytes / (microseconds * 1e-6) / 1e12; }

// ------------------------------------------------------------ ceilings ----

/// Reads `count` 16-byte words, grid-stride, four independent loads in
/// flight per thread (enough bytes in flight to saturate HBM). The words are
/// folded with XOR and each warp's fold is XORed into `sink` once, so the
/// loads cannot be eliminated and the writes are negligible. The launch
/// bounds keep it at full occupancy (2048 threads per SM).
__global__ void __launch_bounds__(kReadThreads, 2048 / kReadThreads)
    read_stream_kernel(const uint4* __restrict__ data, std::int64_t count, unsigned* __restrict__ sink) {
  constexpr int kUnroll = 4;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned fold = 0;
  for (; i + (kUnroll - 1) * stride < count; i += kUnroll * stride) {
    uint4 words[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) words[u] = data[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) fold ^= words[u].x ^ words[u].y ^ words[u].z ^ words[u].w;
  }
  for (; i < count; i += stride) {
    const uint4 word = data[i];
    fold ^= word.x ^ word.y ^ word.z ^ word.w;
  }
  fold = __reduce_xor_sync(0xffffffffu, fold);
  if (threadIdx.x % 32 == 0) atomicXor(sink, fold);
}

/// The floor: a kernel that does nothing.
__global__ void empty_kernel() {}

int read_stream_grid(int sm_count) {
  int blocks_per_sm = 0;
  BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, read_stream_kernel, kReadThreads, 0));
  return sm_count * std::max(1, blocks_per_sm);
}

struct Ceilings {
  double copy_tbps;
  double read_tbps;
};

Ceilings measure_ceilings(cudaStream_t stream, int sm_count) {
  DeviceArray<std::uint8_t> buffer(kReadBytes);
  DeviceArray<unsigned> sink(1);
  // Touch every page first so no rep pays for first-use mapping.
  BENCH_CHECK(cudaMemsetAsync(buffer.get(), 1, kReadBytes, stream));
  const auto nothing = [](int) {};
  // The copy moves the first half of the buffer onto the second.
  const Spread copy = spread_of(time_reps(stream, kCeilingWarmups, kCeilingReps, nothing, [&](int) {
    BENCH_CHECK(cudaMemcpyAsync(buffer.get() + kCopyBytes, buffer.get(), kCopyBytes, cudaMemcpyDeviceToDevice, stream));
  }));
  const int grid = read_stream_grid(sm_count);
  const auto* words = reinterpret_cast<const uint4*>(buffer.get());
  const Spread read = spread_of(time_reps(stream, kCeilingWarmups, kCeilingReps, nothing, [&](int) {
    read_stream_kernel<<<grid, kReadThreads, 0, stream>>>(words, kReadBytes / 16, sink.get());
    BENCH_CHECK_LAUNCH("read_stream_kernel");
  }));
  return {terabytes_per_second(2.0 * kCopyBytes, copy.median_us), terabytes_per_second(double(kReadBytes), read.median_us)};
}

// ------------------------------------------------------------ L2 flush ----

enum class FlushKind { read, write };

/// Evicts whatever the L2 holds: 4x its size (at least 256 MiB) read by
/// read_stream_kernel, or written by cudaMemsetAsync.
class L2Flush {
 public:
  L2Flush(FlushKind kind, int l2_bytes, int sm_count, cudaStream_t stream)
      : kind_(kind), buffer_(std::max<std::int64_t>(kMinFlushBytes, 4 * std::int64_t(l2_bytes))), sink_(1),
        grid_(read_stream_grid(sm_count)) {
    BENCH_CHECK(cudaMemsetAsync(buffer_.get(), 0, buffer_.bytes(), stream));
  }
  void enqueue(cudaStream_t stream) const {
    if (kind_ == FlushKind::write) {
      BENCH_CHECK(cudaMemsetAsync(buffer_.get(), 0, buffer_.bytes(), stream));
    } else {
      read_stream_kernel<<<grid_, kReadThreads, 0, stream>>>(reinterpret_cast<const uint4*>(buffer_.get()), buffer_.bytes() / 16,
                                                             sink_.get());
      BENCH_CHECK_LAUNCH("read_stream_kernel (L2 flush)");
    }
  }
  std::int64_t bytes() const { return buffer_.bytes(); }

 private:
  FlushKind kind_;
  DeviceArray<std::uint8_t> buffer_;
  DeviceArray<unsigned> sink_;
  int grid_;
};

/// Replays graphs[i % G] for i < replays * G after an L2 flush each, every
/// replay between its own events (one untimed warm-up replay per graph
/// first); the timings of each graph, in microseconds.
std::vector<Spread> time_cycled(const std::vector<const CapturedGraph*>& graphs, const L2Flush& flush, cudaStream_t stream,
                                int replays_per_graph) {
  const int count = static_cast<int>(graphs.size());
  const std::vector<float> milliseconds =
      time_reps(stream, count, count * replays_per_graph, [&](int) { flush.enqueue(stream); },
                [&](int i) { graphs[i % count]->launch(stream); });
  std::vector<Spread> spreads;
  for (int g = 0; g < count; ++g) {
    std::vector<float> mine;
    for (int i = g; i < count * replays_per_graph; i += count) mine.push_back(milliseconds[i]);
    spreads.push_back(spread_of(std::move(mine)));
  }
  return spreads;
}

/// The single-step timing of a set of one-call graphs: replays cycled
/// through them, at least kMinReplays in whole cycles, pooled.
Spread time_single_steps(const std::vector<const CapturedGraph*>& graphs, const L2Flush& flush, cudaStream_t stream) {
  const int count = static_cast<int>(graphs.size());
  const int cycles = (kMinReplays + count - 1) / count;
  const std::vector<float> milliseconds =
      time_reps(stream, count, cycles * count, [&](int) { flush.enqueue(stream); }, [&](int i) { graphs[i % count]->launch(stream); });
  return spread_of(milliseconds);
}

Spread measure_floor(const L2Flush& flush, cudaStream_t stream) {
  const CapturedGraph graph(stream, [&] {
    empty_kernel<<<1, 1, 0, stream>>>();
    BENCH_CHECK_LAUNCH("empty_kernel");
  });
  return time_single_steps({&graph}, flush, stream);
}

// ------------------------------------------------------------- records ----

/// One (shape, path request) measurement.
struct Record {
  Shape shape;
  InstancePlan plan;
  std::string status = "error";  // ok or error
  /// automatic, cuda_generic or cuda_generic_scalar; for q_len > 1 the form
  /// (automatic request): varlen (the varlen entry) or rows (each token a row
  /// of the one-token entry)
  std::string request;
  std::string path;              // the path that ran
  std::string kernel;            // the generic path's kernel (tensor_core or scalar); empty on the Hopper path
  std::string reason;            // why the launcher chose it
  int partitions = 0;
  Spread single;                  // one decode per replay, L2 flushed, layers cycled
  double back_to_back_us = NAN;   // median replay / R
  double back_to_back_min_us = NAN;
  std::int64_t nonfinite_outputs = -1;
  double max_abs_diff_vs_automatic = NAN;  // other requests (the rows form): layer 0's output against the automatic path's (varlen's)
  std::string error;
};

/// The engine-like step of one shape (automatic path).
struct EngineRecord {
  Shape shape;
  int layers = 0;
  std::string status = "error";
  Spread gemms;        // the GEMMs alone
  Spread gemms_empty;  // each GEMM followed by an empty kernel
  Spread step;         // each GEMM followed by its layer's decode
  double per_layer_us = NAN;
  double floor_per_layer_us = NAN;
  std::string error;
};

/// Layer 0's output checked: non-finite values, and the largest difference from `reference` (when given).
void check_output(const Instances& instances, cudaStream_t stream, const std::vector<float>* reference, Record& record,
                  std::vector<float>* keep) {
  const std::vector<float> output = instances.output(0, stream);
  record.nonfinite_outputs = std::count_if(output.begin(), output.end(), [](float x) { return !std::isfinite(x); });
  if (reference != nullptr && reference->size() == output.size()) {
    double diff = 0;
    for (std::size_t i = 0; i < output.size(); ++i) diff = std::max(diff, double(std::fabs(output[i] - (*reference)[i])));
    record.max_abs_diff_vs_automatic = diff;
  }
  if (keep != nullptr) *keep = output;
}

void measure_request(const std::vector<DecodeArgs>& args, const InstancePlan& plan, PathRequest request,
                     DecodeWorkspace& workspace, const L2Flush& flush, cudaStream_t stream, Record& record) {
  const auto decode_layer = [&](int layer) { tqdecode::decode(args[layer], workspace, stream, request); };
  // Eager calls first: the first allocates the workspace pool, caches the
  // launch plan and loads the kernels (lazy loading); none of that may
  // happen inside a capture.
  for (int layer = 0; layer < plan.instances; ++layer) decode_layer(layer);
  BENCH_SYNC(stream, "the eager decode() of every layer");

  std::vector<std::unique_ptr<CapturedGraph>> layers;
  std::vector<const CapturedGraph*> graphs;
  for (int layer = 0; layer < plan.layers; ++layer) {
    layers.push_back(std::make_unique<CapturedGraph>(stream, [&] { decode_layer(layer); }));
    graphs.push_back(layers.back().get());
  }
  record.single = time_single_steps(graphs, flush, stream);

  if (plan.back_to_back > 0) {
    const CapturedGraph graph(stream, [&] {
      for (int layer = 0; layer < plan.back_to_back; ++layer) decode_layer(layer);
    });
    const Spread replay = spread_of(time_reps(stream, kBackToBackWarmups, kBackToBackReplays, [](int) {},
                                              [&](int) { graph.launch(stream); }));
    record.back_to_back_us = replay.median_us / plan.back_to_back;
    record.back_to_back_min_us = replay.min_us / plan.back_to_back;
  }
}

void run_requests(const Shape& shape, const InstancePlan& plan, const Instances& instances, DecodeWorkspace& workspace,
                  const L2Flush& flush, cudaStream_t stream, bool automatic_only, std::vector<Record>& records) {
  std::vector<float> automatic_output;
  std::vector<std::pair<DecodePath, GenericKernel>> kernels_run;
  for (const PathRequest request : shape.requests) {
    if (automatic_only && request != PathRequest::automatic) continue;
    Record record;
    record.shape = shape;
    record.plan = plan;
    record.request = request_name(request);
    try {
      const tqdecode::LaunchPlan launch = tqdecode::plan_decode(instances.args().front(), request);
      // A kernel an earlier request already ran measures nothing new.
      const std::pair<DecodePath, GenericKernel> kernel{
          launch.path, launch.path == DecodePath::cuda_generic ? launch.generic_kernel : GenericKernel::scalar};
      if (std::find(kernels_run.begin(), kernels_run.end(), kernel) != kernels_run.end()) continue;
      kernels_run.push_back(kernel);
      record.path = tqdecode::decode_path_name(launch.path);
      if (launch.path == DecodePath::cuda_generic) record.kernel = tqdecode::generic_kernel_name(launch.generic_kernel);
      record.reason = launch.reason;
      record.partitions = launch.num_partitions;
      measure_request(instances.args(), plan, request, workspace, flush, stream, record);
      const bool automatic = request == PathRequest::automatic;
      check_output(instances, stream, automatic ? nullptr : &automatic_output, record, automatic ? &automatic_output : nullptr);
      record.status = "ok";
    } catch (const std::exception& error) {
      record.error = std::string(record.request) + ": " + error.what();
    }
    records.push_back(std::move(record));
  }
}

/// q_len > 1: the varlen entry and the same tokens as rows of the one-token
/// entry, both on the automatic path, and the varlen entry on the Hopper
/// path's other kernel for several query tokens: the warp-specialized one's
/// request where it serves the call and the automatic path keeps the row
/// tiles, the Hopper request (row tiles) where the automatic path takes the
/// warp-specialized kernel; one record each (request "varlen", "rows",
/// "varlen_warp_specialized" or "varlen_row_tiles"; the others' outputs
/// compared with the varlen one's).
void run_forms(const Shape& shape, const InstancePlan& plan, const Instances& instances, DecodeWorkspace& workspace,
               const L2Flush& flush, cudaStream_t stream, std::vector<Record>& records) {
  std::vector<float> varlen_output;
  struct Form {
    const char* name;
    bool varlen;
    PathRequest request;
  };
  const bool automatic_warp_specialized = tqdecode::plan_decode(instances.args().front()).warp_specialized;
  const auto serves = [](const DecodeArgs& args, PathRequest request) {
    try {
      tqdecode::plan_decode(args, request);
      return true;
    } catch (const std::exception&) {
      return false;
    }
  };
  for (const Form form : {Form{"varlen", true, PathRequest::automatic},
                          Form{"varlen_warp_specialized", true, PathRequest::hopper_warp_specialized},
                          Form{"varlen_row_tiles", true, PathRequest::hopper}, Form{"rows", false, PathRequest::automatic}}) {
    const std::vector<DecodeArgs>& args = form.varlen ? instances.args() : instances.rows_args();
    const bool first = form.request == PathRequest::automatic && form.varlen;
    // The other varlen kernel: the one the automatic path did not take, where it serves the call.
    if (form.varlen && !first &&
        ((form.request == PathRequest::hopper_warp_specialized) == automatic_warp_specialized ||
         !serves(args.front(), form.request))) {
      continue;
    }
    Record record;
    record.shape = shape;
    record.plan = plan;
    record.request = form.name;
    try {
      const tqdecode::LaunchPlan launch = tqdecode::plan_decode(args.front(), form.request);
      record.path = tqdecode::decode_path_name(launch.path);
      if (launch.path == DecodePath::cuda_generic) record.kernel = tqdecode::generic_kernel_name(launch.generic_kernel);
      if (launch.warp_specialized) record.kernel = "warp-specialized";
      record.reason = launch.reason;
      record.partitions = launch.num_partitions;
      measure_request(args, plan, form.request, workspace, flush, stream, record);
      check_output(instances, stream, first ? nullptr : &varlen_output, record, first ? &varlen_output : nullptr);
      record.status = "ok";
    } catch (const std::exception& error) {
      record.error = record.request + ": " + error.what();
    }
    records.push_back(std::move(record));
  }
}

EngineRecord run_engine(const Shape& shape, const InstancePlan& plan, const Instances& instances, DecodeWorkspace& workspace,
                        const WeightGemms& gemms, const L2Flush& flush, cudaStream_t stream) {
  EngineRecord record;
  record.shape = shape;
  record.layers = plan.engine_layers;
  try {
    const std::vector<DecodeArgs>& args = instances.args();
    const int layers = plan.engine_layers;
    const auto gemm = [&](int layer) { gemms.enqueue(layer, shape.batch, stream); };
    for (int layer = 0; layer < layers; ++layer) {  // eager: cuBLAS picks and loads its kernel outside the capture
      gemm(layer);
      tqdecode::decode(args[layer], workspace, stream);
    }
    BENCH_SYNC(stream, "the eager GEMMs and decodes of the engine-like step");
    const CapturedGraph gemms_only(stream, [&] {
      for (int layer = 0; layer < layers; ++layer) gemm(layer);
    });
    const CapturedGraph gemms_empty(stream, [&] {
      for (int layer = 0; layer < layers; ++layer) {
        gemm(layer);
        empty_kernel<<<1, 1, 0, stream>>>();
        BENCH_CHECK_LAUNCH("empty_kernel (engine-like floor)");
      }
    });
    const CapturedGraph step(stream, [&] {
      for (int layer = 0; layer < layers; ++layer) {
        gemm(layer);
        tqdecode::decode(args[layer], workspace, stream);
      }
    });
    const std::vector<Spread> spreads = time_cycled({&gemms_only, &gemms_empty, &step}, flush, stream, kEngineReplays);
    record.gemms = spreads[0];
    record.gemms_empty = spreads[1];
    record.step = spreads[2];
    record.per_layer_us = (record.step.median_us - record.gemms.median_us) / layers;
    record.floor_per_layer_us = (record.gemms_empty.median_us - record.gemms.median_us) / layers;
    record.status = "ok";
  } catch (const std::exception& error) {
    record.error = std::string("engine-like step: ") + error.what();
  }
  return record;
}

void print_record(const Record& r, double read_tbps) {
  const std::string& name = r.shape.name;
  if (r.status != "ok") {
    std::printf("%-52s %-23s ERROR: %s\n", name.c_str(), r.request.empty() ? "-" : r.request.c_str(), r.error.c_str());
  } else {
    const double tbps = terabytes_per_second(double(r.plan.bytes), r.single.median_us);
    std::printf("%-52s %-23s %-24s %3d %2d %9.2f %6.1f%% %9.2f %9.2f %6lld\n", name.c_str(), r.request.c_str(),
                (r.kernel.empty() ? r.path : r.path + " " + r.kernel).c_str(), r.partitions, r.plan.layers, r.single.median_us,
                100 * tbps / read_tbps, r.single.min_us, r.back_to_back_us, static_cast<long long>(r.nonfinite_outputs));
    if (r.nonfinite_outputs > 0) {
      std::printf("WARNING: %s %s: %lld non-finite outputs in layer 0\n", name.c_str(), r.request.c_str(),
                  static_cast<long long>(r.nonfinite_outputs));
    }
  }
  std::fflush(stdout);
}

void print_engine(const EngineRecord& e) {
  if (e.status != "ok") {
    std::printf("%-52s engine-like ERROR: %s\n", e.shape.name.c_str(), e.error.c_str());
  } else {
    std::printf("%-52s engine-like, %d layers: GEMMs alone %.1f us, with decodes %.1f us, with empty kernels %.1f us: "
                "%.2f us per layer (floor %.2f)\n",
                e.shape.name.c_str(), e.layers, e.gemms.median_us, e.step.median_us, e.gemms_empty.median_us, e.per_layer_us,
                e.floor_per_layer_us);
  }
  std::fflush(stdout);
}

// ---------------------------------------------------------------- JSON ----

struct RunInfo {
  std::string gpu;
  int driver = 0;
  int runtime = 0;
  int sm_count = 0;
  int l2_bytes = 0;
  std::string commit;
};

std::string version_text(int version) { return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10); }

std::string spread_json(const Spread& s) {
  if (s.count == 0) return "null";
  return "{\"median_us\": " + json_number(s.median_us) + ", \"min_us\": " + json_number(s.min_us) + ", \"max_us\": " +
         json_number(s.max_us) + ", \"replays\": " + std::to_string(s.count) + "}";
}

/// The shape's fields and its plan's sizes, as members of an object (no braces).
std::string shape_json(const Shape& s, const InstancePlan& p) {
  std::string out = "\"name\": " + json_string(s.name);
  out += ", \"preset\": " + json_string(tqdecode::preset_info(s.preset).name);
  out += ", \"B\": " + std::to_string(s.batch) + ", \"L\": " + std::to_string(s.context);
  out += ", \"Hq\": " + std::to_string(s.num_q_heads) + ", \"Hk\": " + std::to_string(s.num_kv_heads);
  out += ", \"D\": " + std::to_string(s.head_dim) + ", \"block_size\": " + std::to_string(s.block_size);
  out += ", \"lengths\": " + json_string(lengths_name(s.lengths));
  out += ", \"max_model_len\": " + (s.max_model_len > 0 ? std::to_string(s.max_model_len) : std::string("null"));
  out += ", \"scores\": " + json_string(scores_name(s.scores)) + ", \"q_len\": " + std::to_string(s.q_len);
  out += ", \"tp\": " + (s.tp > 0 ? std::to_string(s.tp) : std::string("null"));
  out += ", \"order\": " + json_string(tqdecode::cache_order_name(s.order));
  out += ", \"norm_correction\": " + std::string(s.norm_correction ? "true" : "false");
  out += ", \"tokens\": " + std::to_string(p.tokens) + ", \"max_len\": " + std::to_string(p.max_len);
  out += ", \"table_width\": " + std::to_string(p.table_width) + ", \"blocks\": " + std::to_string(p.blocks);
  out += ", \"cache_bytes\": " + std::to_string(p.cache_bytes) + ", \"bytes\": " + std::to_string(p.bytes);
  out += ", \"instance_bytes\": " + std::to_string(p.instance_bytes) + ", \"layers\": " + std::to_string(p.layers);
  out += ", \"back_to_back_instances\": " + std::to_string(p.back_to_back);
  out += ", \"engine_layers\": " + std::to_string(p.engine_layers) + ", \"instances\": " + std::to_string(p.instances);
  return out;
}

struct Run {
  RunInfo info;
  Ceilings ceilings{NAN, NAN};
  FlushKind flush_kind = FlushKind::read;
  std::int64_t flush_bytes = 0;
  Spread floor;
  std::vector<Record> records;
  std::vector<EngineRecord> engine;
  std::string in_progress;  // the shape being measured when the file was written
  std::string aborted;      // why the run stopped early
};

std::string method_json(const Run& run) {
  const char* flush = run.flush_kind == FlushKind::read ? "read" : "write";
  std::string out = "{\"primary\": \"single step\"";
  out += ", \"single_step\": " + json_string(
      "one decode() per CUDA-graph replay, each layer its own graph; before every replay the L2 is flushed on the same "
      "stream outside the timed events; replays cycle through the layers; median of at least " + std::to_string(kMinReplays));
  out += ", \"l2_flush\": {\"kind\": " + json_string(flush) + ", \"bytes\": " + std::to_string(run.flush_bytes) + "}";
  out += ", \"distinct_constants\": true, \"layers\": " +
         json_string("each its own cache region, block table, lengths, query, output, PiT and centroids (fp8 keys have none)");
  out += ", \"floor\": " + json_string("one empty kernel per graph replay, timed as the single step");
  out += ", \"back_to_back\": " + json_string("throughput, secondary: one graph of R decodes over R layers with R * bytes >= 1 GiB, no "
                                              "flush, median replay / R (" + std::to_string(kBackToBackReplays) + " replays)");
  out += ", \"engine\": " + json_string("16 layers in one graph, each a cuBLAS bf16 GEMM [B, 8192] x [8192, 8192] over its own "
                                        "128 MiB of weights then its decode; per layer = (step - GEMMs alone) / 16, floor = "
                                        "(GEMMs with empty kernels - GEMMs alone) / 16; the three graphs interleaved, L2 "
                                        "flushed before each replay, medians of " + std::to_string(kEngineReplays));
  out += ", \"peaked_scores\": " + json_string("8 planted tokens per (sequence, kv head) whose keys match the group's first "
                                               "query head, scores 3, 6, ..., 24 for that head (bench/bench_inputs.hpp)");
  out += ", \"ragged_lengths\": " + json_string("L/4 + a draw from [0, 3L/2] per sequence, SplitMix64 seed " +
                                                std::to_string(kLengthsSeed));
  return out + "}";
}

void write_json(const std::string& path, const Run& run) {
  if (path.empty()) return;
  const RunInfo& info = run.info;
  std::string out = "{\n";
  out += "  \"gpu\": " + json_string(info.gpu) + ",\n";
  out += "  \"driver\": " + json_string(version_text(info.driver)) + ",\n";
  out += "  \"runtime\": " + json_string(version_text(info.runtime)) + ",\n";
  out += "  \"sm_count\": " + std::to_string(info.sm_count) + ",\n";
  out += "  \"l2_bytes\": " + std::to_string(info.l2_bytes) + ",\n";
  out += "  \"commit\": " + json_string(info.commit) + ",\n";
  out += "  \"method\": " + method_json(run) + ",\n";
  out += "  \"ceilings\": {\"copy_tbps\": " + json_number(run.ceilings.copy_tbps) + ", \"read_tbps\": " +
         json_number(run.ceilings.read_tbps) + ", \"copy_bytes\": " + std::to_string(kCopyBytes) +
         ", \"read_bytes\": " + std::to_string(kReadBytes) + ", \"reps\": " + std::to_string(kCeilingReps) + "},\n";
  out += "  \"floor\": " + spread_json(run.floor) + ",\n";
  out += "  \"in_progress\": " + (run.in_progress.empty() ? std::string("null") : json_string(run.in_progress)) + ",\n";
  out += "  \"aborted\": " + (run.aborted.empty() ? std::string("null") : json_string(run.aborted)) + ",\n";
  out += "  \"records\": [";
  for (std::size_t i = 0; i < run.records.size(); ++i) {
    const Record& r = run.records[i];
    out += i ? ",\n    {" : "\n    {";
    out += shape_json(r.shape, r.plan);
    out += ", \"status\": " + json_string(r.status);
    out += ", \"request\": " + json_string(r.request) + ", \"path\": " + json_string(r.path);
    out += ", \"kernel\": " + json_string(r.kernel) + ", \"reason\": " + json_string(r.reason);
    out += ", \"partitions\": " + std::to_string(r.partitions);
    out += ", \"single\": " + spread_json(r.single);
    const double tbps = r.single.count ? terabytes_per_second(double(r.plan.bytes), r.single.median_us) : NAN;
    out += ", \"tq_us\": " + json_number(r.single.count ? r.single.median_us : NAN);
    out += ", \"tq_tbps\": " + json_number(tbps) + ", \"frac_of_read\": " + json_number(tbps / run.ceilings.read_tbps);
    out += ", \"back_to_back_us\": " + json_number(r.back_to_back_us);
    out += ", \"back_to_back_min_us\": " + json_number(r.back_to_back_min_us);
    out += ", \"nonfinite_outputs\": " + (r.nonfinite_outputs < 0 ? std::string("null") : std::to_string(r.nonfinite_outputs));
    out += ", \"max_abs_diff_vs_automatic\": " + json_number(r.max_abs_diff_vs_automatic);
    out += ", \"error\": " + (r.error.empty() ? std::string("null") : json_string(r.error)) + "}";
  }
  out += "\n  ],\n  \"engine\": [";
  for (std::size_t i = 0; i < run.engine.size(); ++i) {
    const EngineRecord& e = run.engine[i];
    out += i ? ",\n    {" : "\n    {";
    out += "\"name\": " + json_string(e.shape.name) + ", \"layers\": " + std::to_string(e.layers);
    out += ", \"status\": " + json_string(e.status);
    out += ", \"gemms\": " + spread_json(e.gemms) + ", \"gemms_empty\": " + spread_json(e.gemms_empty);
    out += ", \"step\": " + spread_json(e.step);
    out += ", \"per_layer_us\": " + json_number(e.per_layer_us) + ", \"floor_per_layer_us\": " + json_number(e.floor_per_layer_us);
    out += ", \"error\": " + (e.error.empty() ? std::string("null") : json_string(e.error)) + "}";
  }
  out += "\n  ]\n}\n";
  // Written beside and renamed, so a crash mid-write never leaves half a file.
  const std::string temporary = path + ".partial";
  {
    std::ofstream file(temporary, std::ios::binary);
    file << out;
    if (!file.flush()) throw std::runtime_error("cannot write " + temporary);
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) throw std::runtime_error("cannot rename " + temporary + " to " + path);
}

// ---------------------------------------------------------------- main ----

struct Options {
  std::string json_path;
  std::string commit = "unknown";
  std::string shapes_file = TQDECODE_BENCH_SHAPES_FILE;
  bool quick = false;
  bool automatic_only = false;
  bool dry_run = false;
  bool self_check = false;
  FlushKind flush = FlushKind::read;
  std::vector<std::string> only;  // --shapes
};

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (flag == "--quick") { options.quick = true; continue; }
    if (flag == "--automatic-only") { options.automatic_only = true; continue; }
    if (flag == "--dry-run") { options.dry_run = true; continue; }
    if (flag == "--self-check") { options.self_check = true; continue; }
    if (i + 1 >= argc) throw std::runtime_error(std::string(flag) + " needs a value\n" + kUsage);
    const std::string value = argv[++i];
    if (flag == "--json") {
      options.json_path = value;
    } else if (flag == "--commit") {
      options.commit = value;
    } else if (flag == "--shapes-file") {
      options.shapes_file = value;
    } else if (flag == "--l2-flush") {
      if (value != "read" && value != "write") throw std::runtime_error("--l2-flush: \"" + value + "\"; accepted: read, write");
      options.flush = value == "read" ? FlushKind::read : FlushKind::write;
    } else if (flag == "--shapes") {
      for (std::size_t begin = 0; begin <= value.size();) {
        const std::size_t end = std::min(value.find(',', begin), value.size());
        if (end > begin) options.only.push_back(value.substr(begin, end - begin));
        begin = end + 1;
      }
    } else {
      throw std::runtime_error("unknown option " + std::string(flag) + "\n" + kUsage);
    }
  }
  return options;
}

std::vector<Shape> select_shapes(std::vector<Shape> shapes, const Options& options) {
  if (!options.only.empty()) {
    std::vector<Shape> chosen;
    for (const std::string& name : options.only) {
      const auto found = std::find_if(shapes.begin(), shapes.end(), [&](const Shape& s) { return s.name == name; });
      if (found == shapes.end()) throw std::runtime_error("--shapes: no shape named " + name + " in " + options.shapes_file);
      chosen.push_back(*found);
    }
    shapes = std::move(chosen);
  }
  if (options.quick) shapes.erase(std::remove_if(shapes.begin(), shapes.end(), [](const Shape& s) { return !s.quick; }), shapes.end());
  if (shapes.empty()) throw std::runtime_error("no shape selected");
  return shapes;
}

int print_plan(const std::vector<Shape>& shapes) {
  std::printf("{\"shapes\": [");
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    std::printf("%s\n  {%s}", i ? "," : "", shape_json(shapes[i], plan_instances(shapes[i])).c_str());
  }
  std::printf("\n]}\n");
  return 0;
}

/// True when the CUDA context is unusable (a sticky error such as an illegal address).
bool context_lost(std::string& why) {
  const cudaError_t status = cudaDeviceSynchronize();
  if (status == cudaSuccess) return false;
  why = std::string(cudaGetErrorName(status)) + " (" + cudaGetErrorString(status) + ")";
  return true;
}

int run(const Options& options) {
  const std::vector<Shape> shapes = select_shapes(load_shapes(options.shapes_file), options);
  if (options.dry_run) return print_plan(shapes);
  if (options.self_check) return run_self_check();

  Run run;
  run.flush_kind = options.flush;
  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties;
  BENCH_CHECK(cudaGetDeviceProperties(&properties, device));
  RunInfo& info = run.info;
  info = {properties.name, 0, 0, properties.multiProcessorCount, properties.l2CacheSize, options.commit};
  BENCH_CHECK(cudaDriverGetVersion(&info.driver));
  BENCH_CHECK(cudaRuntimeGetVersion(&info.runtime));
  std::printf("tqdecode_bench: %s (sm_%d%d, %d SMs, L2 %.0f MB), driver %s, runtime %s, commit %s\n", info.gpu.c_str(),
              properties.major, properties.minor, info.sm_count, info.l2_bytes / 1e6, version_text(info.driver).c_str(),
              version_text(info.runtime).c_str(), info.commit.c_str());

  const Stream stream;
  run.ceilings = measure_ceilings(stream.get(), info.sm_count);
  std::printf("ceilings (median of %d): device-to-device copy %.3f TB/s (read+write), read-only stream %.3f TB/s\n", kCeilingReps,
              run.ceilings.copy_tbps, run.ceilings.read_tbps);
  const L2Flush flush(options.flush, info.l2_bytes, info.sm_count, stream.get());
  run.flush_bytes = flush.bytes();
  run.floor = measure_floor(flush, stream.get());
  std::printf("L2 flush before every timed replay: %s %.0f MiB; floor (one empty kernel per replay, timed the same way): "
              "median %.2f us (min %.2f, max %.2f)\n\n",
              options.flush == FlushKind::read ? "read of" : "write of", flush.bytes() / 1048576.0, run.floor.median_us,
              run.floor.min_us, run.floor.max_us);
  std::printf("%-52s %-23s %-24s %3s %2s %9s %7s %9s %9s %6s\n", "shape", "request", "path", "N", "L", "single_us", "%read",
              "min_us", "b2b_us", "nonfin");
  write_json(options.json_path, run);

  std::unique_ptr<WeightGemms> gemms;  // made for the first engine-like shape, for the largest batch of them
  int gemm_batch = 0;
  for (const Shape& shape : shapes) {
    if (shape.engine) gemm_batch = std::max(gemm_batch, shape.batch);
  }

  for (const Shape& shape : shapes) {
    run.in_progress = shape.name;
    write_json(options.json_path, run);
    std::fprintf(stderr, "%s: starting\n", shape.name.c_str());
    const std::size_t first = run.records.size();
    const std::size_t first_engine = run.engine.size();
    try {
      const InstancePlan plan = plan_instances(shape);
      std::fprintf(stderr, "%s: filling %d instances (%.2f GB; %d single-step layers, back-to-back R %d, engine-like %d)\n",
                   shape.name.c_str(), plan.instances, plan.instance_bytes * double(plan.instances) / 1e9, plan.layers,
                   plan.back_to_back, plan.engine_layers);
      const Instances instances(shape, plan, stream.get(), info.sm_count);
      // Pool sized for this step's query rows (B x q_len: the varlen slots, or the rows form's batch); freed with the shape.
      DecodeWorkspace workspace(shape.batch * shape.q_len);
      if (shape.q_len > 1) {
        run_forms(shape, plan, instances, workspace, flush, stream.get(), run.records);
      } else {
        run_requests(shape, plan, instances, workspace, flush, stream.get(), options.automatic_only, run.records);
      }
      if (shape.engine) {
        if (!gemms) gemms = std::make_unique<WeightGemms>(kEngineLayers, gemm_batch, stream.get(), info.sm_count);
        run.engine.push_back(run_engine(shape, plan, instances, workspace, *gemms, flush, stream.get()));
      }
    } catch (const std::exception& error) {
      Record record;
      record.shape = shape;
      record.error = error.what();
      run.records.push_back(std::move(record));
    }
    for (std::size_t i = first; i < run.records.size(); ++i) print_record(run.records[i], run.ceilings.read_tbps);
    for (std::size_t i = first_engine; i < run.engine.size(); ++i) print_engine(run.engine[i]);
    std::string why;
    if (context_lost(why)) {
      run.aborted = "the CUDA context was lost while measuring " + shape.name + ": " + why;
      write_json(options.json_path, run);
      std::fprintf(stderr, "tqdecode_bench: %s; stopping (the shapes after it need a new process)\n", run.aborted.c_str());
      return 3;
    }
  }
  run.in_progress.clear();
  write_json(options.json_path, run);
  std::printf("\nN: split-KV partitions; L: layers the single steps cycle through; single_us: median of the single-step replays\n"
              "(one decode per replay, L2 flushed before each); %%read: (cache + query + output bytes) / single_us of the\n"
              "read ceiling; b2b_us: back-to-back throughput (median replay of R decodes / R); nonfin: non-finite outputs.\n");
  if (!options.json_path.empty()) std::printf("wrote %s\n", options.json_path.c_str());
  const bool failed = std::any_of(run.records.begin(), run.records.end(), [](const Record& r) { return r.status == "error"; }) ||
                      std::any_of(run.engine.begin(), run.engine.end(), [](const EngineRecord& e) { return e.status != "ok"; });
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace tqbench

int main(int argc, char** argv) {
  // Line-buffered even into a pipe, so the table and the progress lines on stderr stay in order.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    return tqbench::run(tqbench::parse_options(argc, argv));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tqdecode_bench: %s\n", error.what());
    return 1;
  }
}
