// tqdecode_bench: times the whole decode step (query rotation, split-KV
// partitions, reduce) against the device's own memory ceilings, for the
// shapes in bench/shapes.json. bench/run_bench.py runs it together with the
// bf16 baseline; bench/NOTES.md has the roofline predictions.
//
// Method, and why:
// - Ceilings: a ~2 GiB device-to-device copy and a ~4 GiB read-only streaming
//   kernel, each the median of 20 event-timed reps. Decode attention only
//   reads the cache, so the read ceiling is what it is compared to.
// - Inputs: each shape's cache is filled on the GPU (random code bytes, sane
//   finite fp16 metadata at the byte offsets of CacheLayout): the CPU store
//   path would take minutes for a 4M-token cache, and the kernels' speed
//   does not depend on the values.
// - Cold caches: R instances (own block tables over disjoint physical-block
//   regions of one cache, own query, seq_lens and output) with R * bytes per
//   instance >= 1 GiB, so no instance is still in the 60 MB L2 when it is
//   read again: every call pays for HBM, as in an engine where the other
//   layers' caches pass through L2 between two calls of a layer.
// - Timing: one CUDA graph holds R decode() calls; each of 30 replays sits
//   between its own pair of events on the launch stream, and one call costs
//   the median replay / R. Graphs are how engines run decode, and they take
//   host launch overhead out of the measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "random.hpp"
#include "tqdecode/constants.hpp"
#include "tqdecode/decode.hpp"
#include "tqdecode/format.hpp"
#include "tqdecode/numeric.hpp"

#ifndef TQDECODE_BENCH_SHAPES_FILE
#error "TQDECODE_BENCH_SHAPES_FILE (the default --shapes-file) is defined by bench/CMakeLists.txt"
#endif

namespace {

using namespace tqdecode;

constexpr std::int64_t kGiB = std::int64_t{1} << 30;
constexpr std::int64_t kCopyBytes = 2 * kGiB;  // copied per rep (read and written once each)
constexpr std::int64_t kReadBytes = 4 * kGiB;  // read per rep by the streaming kernel
constexpr int kCeilingWarmups = 3;
constexpr int kCeilingReps = 20;
constexpr int kReadThreads = 1024;  // measured on H200: 1024 x 2 blocks/SM edges out 256 x 8
constexpr int kFillThreads = 256;
constexpr std::int64_t kRotationBytes = kGiB;  // working set one graph replay sweeps (>> 60 MB L2)
constexpr int kMinInstances = 2;
constexpr int kGraphWarmups = 2;
constexpr int kGraphReplays = 30;
constexpr std::uint64_t kSeed = 0x7d3c0de5eedULL;

const char* const kUsage =
    "usage: tqdecode_bench [options]\n"
    "  --json FILE         write the ceilings and one record per (shape, path) as JSON\n"
    "  --commit STR        commit recorded in the JSON [unknown]\n"
    "  --quick             only the first two shapes of the shape list (smoke test)\n"
    "  --automatic-only    only the automatic path (A/B runs of the fast path)\n"
    "  --shapes A,B        only these shape names\n"
    "  --shapes-file FILE  the shape list [" TQDECODE_BENCH_SHAPES_FILE "]\n"
    "  --help              this text\n";

void check_cuda(cudaError_t status, const char* what, int line) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("CUDA error in ") + what + " (tqdecode_bench.cu:" + std::to_string(line) +
                             "): " + cudaGetErrorString(status));
  }
}
#define BENCH_CHECK(call) check_cuda((call), #call, __LINE__)
#define BENCH_CHECK_LAUNCH() check_cuda(cudaGetLastError(), "kernel launch", __LINE__)

// ---------------------------------------------------------------- RAII ----

/// Device memory for `count` elements; count 0 holds nothing (null).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(std::int64_t count) : count_(count) {
    if (count_ > 0) BENCH_CHECK(cudaMalloc(&data_, bytes()));
  }
  // Unchecked: this may run while unwinding from a CUDA error.
  ~DeviceArray() { cudaFree(data_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return data_; }
  std::int64_t bytes() const { return count_ * static_cast<std::int64_t>(sizeof(T)); }

 private:
  T* data_ = nullptr;
  std::int64_t count_;
};

class Stream {
 public:
  // Non-blocking: no implicit ordering with the legacy default stream, which
  // a capture would otherwise reject.
  Stream() { BENCH_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class Event {
 public:
  Event() { BENCH_CHECK(cudaEventCreate(&event_)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

/// A graph captured from everything `body` enqueues on `stream`, instantiated.
class CapturedGraph {
 public:
  template <class Body>
  CapturedGraph(cudaStream_t stream, const Body& body) {
    // ThreadLocal: only this thread's CUDA calls are checked against the capture.
    BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaGraph_t partial = nullptr;
      cudaStreamEndCapture(stream, &partial);  // leave the stream usable; the first error is the one reported
      if (partial != nullptr) cudaGraphDestroy(partial);
      throw;
    }
    BENCH_CHECK(cudaStreamEndCapture(stream, &graph_));
    const cudaError_t status = cudaGraphInstantiate(&exec_, graph_, 0);
    if (status != cudaSuccess) {
      cudaGraphDestroy(graph_);
      check_cuda(status, "cudaGraphInstantiate", __LINE__);
    }
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream) const { BENCH_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// -------------------------------------------------------------- timing ----

/// Milliseconds of each of `reps` runs of `work` (after `warmups` untimed
/// ones). Every rep has its own pair of events recorded on `stream` around
/// the work it enqueues, so a slow rep (clock ramp, preemption) is one
/// outlier the median ignores rather than part of an average.
template <class Work>
std::vector<float> time_reps(cudaStream_t stream, int warmups, int reps, const Work& work) {
  for (int i = 0; i < warmups; ++i) work();
  std::vector<Event> start(reps);
  std::vector<Event> stop(reps);
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(start[i].get(), stream));
    work();
    BENCH_CHECK(cudaEventRecord(stop[i].get(), stream));
  }
  BENCH_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> milliseconds(reps);
  for (int i = 0; i < reps; ++i) BENCH_CHECK(cudaEventElapsedTime(&milliseconds[i], start[i].get(), stop[i].get()));
  return milliseconds;
}

double median(std::vector<float> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 ? values[mid] : 0.5 * (double(values[mid - 1]) + values[mid]);
}

double terabytes_per_second(double bytes, double milliseconds) { return bytes / (milliseconds * 1e-3) / 1e12; }

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

struct Ceilings {
  double copy_tbps;
  double read_tbps;
};

Ceilings measure_ceilings(cudaStream_t stream, int sm_count) {
  DeviceArray<std::uint8_t> buffer(kReadBytes);
  DeviceArray<unsigned> sink(1);
  // Touch every page first so no rep pays for first-use mapping.
  BENCH_CHECK(cudaMemsetAsync(buffer.get(), 1, kReadBytes, stream));

  // The copy moves the first half of the buffer onto the second.
  const std::vector<float> copy_ms = time_reps(stream, kCeilingWarmups, kCeilingReps, [&] {
    BENCH_CHECK(cudaMemcpyAsync(buffer.get() + kCopyBytes, buffer.get(), kCopyBytes, cudaMemcpyDeviceToDevice, stream));
  });

  int blocks_per_sm = 0;
  BENCH_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, read_stream_kernel, kReadThreads, 0));
  const int grid = sm_count * std::max(1, blocks_per_sm);
  const auto* words = reinterpret_cast<const uint4*>(buffer.get());
  const std::vector<float> read_ms = time_reps(stream, kCeilingWarmups, kCeilingReps, [&] {
    read_stream_kernel<<<grid, kReadThreads, 0, stream>>>(words, kReadBytes / 16, sink.get());
    BENCH_CHECK_LAUNCH();
  });
  return {terabytes_per_second(2.0 * kCopyBytes, median(copy_ms)),
          terabytes_per_second(double(kReadBytes), median(read_ms))};
}

// ---------------------------------------------------------- shape list ----

/// A minimal JSON reader, enough for bench/shapes.json: objects, arrays,
/// strings (no \u escapes), numbers, true, false, null.
struct Json {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Json> items;                            // array elements
  std::vector<std::pair<std::string, Json>> members;  // object members, in file order

  const Json* member(std::string_view key) const {
    for (const auto& [name, value] : members) {
      if (name == key) return &value;
    }
    return nullptr;
  }
};

class JsonReader {
 public:
  JsonReader(std::string text, std::string source) : text_(std::move(text)), source_(std::move(source)) {}

  Json document() {
    Json root = value();
    skip_space();
    if (pos_ != text_.size()) error("unexpected text after the document");
    return root;
  }

 private:
  [[noreturn]] void error(const std::string& what) const {
    throw std::runtime_error(source_ + ": byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  char peek() {
    skip_space();
    if (pos_ == text_.size()) error("unexpected end of the document");
    return text_[pos_];
  }
  bool consume(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  void expect(char c) {
    if (!consume(c)) error(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (text_.compare(pos_, word.size(), word) != 0) return false;
    pos_ += word.size();
    return true;
  }

  std::string string_literal() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ == text_.size()) error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) error("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ == text_.size()) error("unterminated string");
      const char escaped = text_[pos_++];
      const std::string_view from = "\"\\/bfnrt";
      const std::string_view to = "\"\\/\b\f\n\r\t";
      const std::size_t which = from.find(escaped);
      if (which == std::string_view::npos) error(std::string("unsupported escape \\") + escaped);
      out += to[which];
    }
  }

  Json value() {
    Json v;
    const char c = peek();
    if (c == '{') {
      ++pos_;
      v.kind = Json::Kind::object;
      if (consume('}')) return v;
      do {
        std::string key = string_literal();
        expect(':');
        v.members.emplace_back(std::move(key), value());
      } while (consume(','));
      expect('}');
    } else if (c == '[') {
      ++pos_;
      v.kind = Json::Kind::array;
      if (consume(']')) return v;
      do v.items.push_back(value());
      while (consume(','));
      expect(']');
    } else if (c == '"') {
      v.kind = Json::Kind::string;
      v.string = string_literal();
    } else if (literal("true") || literal("false")) {
      v.kind = Json::Kind::boolean;
      v.boolean = c == 't';
    } else if (literal("null")) {
      v.kind = Json::Kind::null;
    } else {
      const char* begin = text_.c_str() + pos_;
      char* end = nullptr;
      v.number = std::strtod(begin, &end);
      if (end == begin) error("expected a JSON value");
      v.kind = Json::Kind::number;
      pos_ += static_cast<std::size_t>(end - begin);
    }
    return v;
  }

  std::string text_;
  std::string source_;
  std::size_t pos_ = 0;
};

struct Shape {
  std::string name;
  Preset preset;
  int batch;         // B
  int context;       // L: every sequence of the batch has this length
  int num_q_heads;   // Hq
  int num_kv_heads;  // Hk
  int head_dim;      // D
  int block_size;
};

int positive_int(const Json& object, std::string_view key, const std::string& where) {
  const Json* value = object.member(key);
  if (value == nullptr || value->kind != Json::Kind::number || value->number != std::floor(value->number) ||
      value->number < 1 || value->number > (1 << 30)) {
    throw std::runtime_error(where + ": \"" + std::string(key) + "\" must be a positive integer");
  }
  return static_cast<int>(value->number);
}

std::string string_member(const Json& object, std::string_view key, const std::string& where) {
  const Json* value = object.member(key);
  if (value == nullptr || value->kind != Json::Kind::string) {
    throw std::runtime_error(where + ": \"" + std::string(key) + "\" must be a string");
  }
  return value->string;
}

std::vector<Shape> load_shapes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) throw std::runtime_error("cannot read the shape list " + path + " (see --shapes-file)");
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const Json root = JsonReader(std::move(text), path).document();
  const Json* list = root.member("shapes");
  if (list == nullptr || list->kind != Json::Kind::array || list->items.empty()) {
    throw std::runtime_error(path + ": expected {\"shapes\": [ ... ]} with at least one shape");
  }
  std::vector<Shape> shapes;
  for (std::size_t i = 0; i < list->items.size(); ++i) {
    const Json& item = list->items[i];
    const std::string where = path + ": shapes[" + std::to_string(i) + "]";
    Shape shape{string_member(item, "name", where),
                parse_preset(string_member(item, "preset", where), where + ".preset"),
                positive_int(item, "B", where),
                positive_int(item, "L", where),
                positive_int(item, "Hq", where),
                positive_int(item, "Hk", where),
                positive_int(item, "D", where),
                positive_int(item, "block_size", where)};
    // The library's own checks: supported head dim, block size, group size.
    make_layout(shape.preset, shape.head_dim, shape.block_size, shape.num_kv_heads);
    validate_group_size(shape.num_q_heads, shape.num_kv_heads);
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

// -------------------------------------------------------------- inputs ----

__device__ __forceinline__ std::uint64_t mix64(std::uint64_t x) {  // SplitMix64 finalizer
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Uniform in [0, 1), a pure function of (seed, index).
__device__ __forceinline__ float uniform01(std::uint64_t seed, std::uint64_t index) {
  return static_cast<float>(mix64(seed ^ mix64(index + 0x9e3779b97f4a7c15ULL)) >> 40) * 0x1.0p-24f;
}

/// Random bytes over the whole cache, 16 at a time (block_stride is a
/// multiple of 16). fp8 e4m3 key bytes get bit 6 cleared: |value| < 2 and
/// never the NaN pattern S.1111.111.
__global__ void fill_cache_codes_kernel(uint4* cache, std::int64_t words, CacheLayout layout, std::uint64_t seed) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t word = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; word < words; word += stride) {
    const std::uint64_t halves[2] = {mix64(seed + 2 * word), mix64(seed + 2 * word + 1)};
    std::uint8_t bytes[16];
    std::memcpy(bytes, halves, sizeof bytes);
    if (layout.key_fp8()) {
      const std::int64_t in_block = (word * 16) % layout.block_stride;
      for (int j = 0; j < 16; ++j) {
        const std::int64_t offset = in_block + j;
        if (offset < layout.metadata_region_offset() && offset % layout.record_bytes() < layout.key_bytes()) {
          bytes[j] &= 0xbf;
        }
      }
    }
    uint4 out;
    std::memcpy(&out, bytes, sizeof out);
    cache[word] = out;
  }
}

/// Every fp16 metadata field of every (block, slot, head), at
/// CacheLayout::field_offset: key norm ~U(5, 15), value scale ~U(0.05, 0.2),
/// value zero ~U(-1.5, -0.5). Index order follows the metadata region, so
/// consecutive threads write consecutive halves.
__global__ void fill_cache_metadata_kernel(std::uint8_t* cache, std::int64_t num_blocks, CacheLayout layout,
                                           std::uint64_t seed) {
  const int per_block = layout.num_kv_heads * layout.fields() * layout.block_size;
  const std::int64_t total = num_blocks * per_block;
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const std::int64_t block = i / per_block;
    const int within = static_cast<int>(i % per_block);  // (head * F + field) * block_size + slot
    const int slot = within % layout.block_size;
    const int field = (within / layout.block_size) % layout.fields();
    const int head = within / (layout.block_size * layout.fields());
    const float u = uniform01(seed, static_cast<std::uint64_t>(i));
    float value = -1.5f + u;  // value zero
    if (!layout.key_fp8() && field == layout.key_norm_field()) {
      value = 5.0f + 10.0f * u;
    } else if (field == layout.value_scale_field()) {
      value = 0.05f + 0.15f * u;
    }
    auto* half = reinterpret_cast<std::uint16_t*>(cache + layout.block_offset(block) + layout.field_offset(slot, head, field));
    *half = float_to_half_bits(value);
  }
}

/// bf16 values ~U(-1, 1).
__global__ void fill_bf16_kernel(std::uint16_t* data, std::int64_t count, std::uint64_t seed) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = float_to_bf16_bits(2.0f * uniform01(seed, static_cast<std::uint64_t>(i)) - 1.0f);
  }
}

/// Copies `host` into `device` (same element count); nothing for an empty array.
template <class T>
void upload(const DeviceArray<T>& device, const std::vector<T>& host, cudaStream_t stream) {
  if (host.empty()) return;
  BENCH_CHECK(cudaMemcpyAsync(device.get(), host.data(), device.bytes(), cudaMemcpyHostToDevice, stream));
}

/// Sizes of one instance of a shape, and how many instances rotate.
struct InstancePlan {
  CacheLayout layout;
  int blocks_per_seq;
  std::int64_t blocks;          // physical blocks of one instance
  std::int64_t query_elements;  // B * Hq * D (also the output's)
  std::int64_t bytes;           // one instance's memory: cache region, query, output, block table, seq_lens
  int instances;                // R
};

InstancePlan plan_instances(const Shape& shape) {
  InstancePlan plan;
  plan.layout = make_layout(shape.preset, shape.head_dim, shape.block_size, shape.num_kv_heads);
  plan.blocks_per_seq = (shape.context + shape.block_size - 1) / shape.block_size;
  plan.blocks = std::int64_t(shape.batch) * plan.blocks_per_seq;
  plan.query_elements = std::int64_t(shape.batch) * shape.num_q_heads * shape.head_dim;
  plan.bytes = plan.blocks * plan.layout.block_stride + 2 * plan.query_elements * 2 + plan.blocks * 4 + shape.batch * 4;
  plan.instances = static_cast<int>(std::max<std::int64_t>(kMinInstances, (kRotationBytes + plan.bytes - 1) / plan.bytes));
  if (plan.layout.block_stride % 16 != 0) throw std::runtime_error(shape.name + ": block stride is not a multiple of 16 bytes");
  if (plan.blocks * plan.instances > std::numeric_limits<std::int32_t>::max()) {
    throw std::runtime_error(shape.name + ": more physical blocks than an int32 block table can address");
  }
  return plan;
}

/// R instances of one shape in device memory, and their decode arguments.
class Problem {
 public:
  Problem(const Shape& shape, const InstancePlan& plan, cudaStream_t stream, int sm_count)
      : plan_(plan),
        cache_(plan.blocks * plan.instances * plan.layout.block_stride),
        block_tables_(plan.blocks * plan.instances),
        seq_lens_(std::int64_t(shape.batch) * plan.instances),
        queries_(plan.query_elements * plan.instances),
        outputs_(plan.query_elements * plan.instances),
        constants_(make_model_constants(shape.preset, shape.head_dim, kSeed)),
        centroids_(static_cast<std::int64_t>(constants_.centroids.size())),
        PiT_(static_cast<std::int64_t>(constants_.PiT.size())) {
    const int instances = plan.instances;
    const std::int64_t total_blocks = plan.blocks * instances;
    const int fill_grid = sm_count * 8;
    fill_cache_codes_kernel<<<fill_grid, kFillThreads, 0, stream>>>(reinterpret_cast<uint4*>(cache_.get()),
                                                                   cache_.bytes() / 16, plan.layout, kSeed);
    BENCH_CHECK_LAUNCH();
    fill_cache_metadata_kernel<<<fill_grid, kFillThreads, 0, stream>>>(cache_.get(), total_blocks, plan.layout, kSeed + 1);
    BENCH_CHECK_LAUNCH();
    fill_bf16_kernel<<<fill_grid, kFillThreads, 0, stream>>>(queries_.get(), plan.query_elements * instances, kSeed + 2);
    BENCH_CHECK_LAUNCH();

    // Block tables: instance r owns physical blocks [r * blocks, (r + 1) * blocks),
    // shuffled so consecutive logical blocks are scattered, as in a real pool.
    Rng rng(kSeed + 3);
    std::vector<std::int32_t> tables(static_cast<std::size_t>(total_blocks));
    for (int r = 0; r < instances; ++r) {
      std::int32_t* region = tables.data() + r * plan.blocks;
      std::iota(region, region + plan.blocks, static_cast<std::int32_t>(r * plan.blocks));
      for (std::int64_t i = plan.blocks - 1; i > 0; --i) {
        std::swap(region[i], region[rng.below(static_cast<std::uint64_t>(i) + 1)]);
      }
    }
    const std::vector<std::int32_t> lengths(static_cast<std::size_t>(shape.batch) * instances, shape.context);
    upload(block_tables_, tables, stream);
    upload(seq_lens_, lengths, stream);
    upload(centroids_, constants_.centroids, stream);
    upload(PiT_, constants_.PiT, stream);
    BENCH_CHECK(cudaStreamSynchronize(stream));  // the host vectors above die at the end of this scope

    for (int r = 0; r < instances; ++r) {
      DecodeArgs args;
      args.query = queries_.get() + r * plan.query_elements;
      args.query_dtype = DType::bf16;
      args.batch = shape.batch;
      args.num_q_heads = shape.num_q_heads;
      args.layout = plan.layout;
      args.num_blocks = total_blocks;
      args.cache = cache_.get();
      args.block_table = block_tables_.get() + r * plan.blocks;
      args.max_blocks_per_seq = plan.blocks_per_seq;
      args.seq_lens = seq_lens_.get() + std::int64_t(r) * shape.batch;
      args.centroids = centroids_.get();
      args.num_centroids = static_cast<int>(constants_.centroids.size());
      args.PiT = PiT_.get();
      args.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
      args.output = outputs_.get() + r * plan.query_elements;
      args_.push_back(args);
    }
  }

  const std::vector<DecodeArgs>& args() const { return args_; }

  /// Instance 0's output as fp32 (synchronises).
  std::vector<float> first_output(cudaStream_t stream) const {
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(plan_.query_elements));
    BENCH_CHECK(cudaMemcpyAsync(bits.data(), outputs_.get(), bits.size() * 2, cudaMemcpyDeviceToHost, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> values(bits.size());
    std::transform(bits.begin(), bits.end(), values.begin(), bf16_bits_to_float);
    return values;
  }

 private:
  InstancePlan plan_;
  DeviceArray<std::uint8_t> cache_;
  DeviceArray<std::int32_t> block_tables_;
  DeviceArray<std::int32_t> seq_lens_;
  DeviceArray<std::uint16_t> queries_;
  DeviceArray<std::uint16_t> outputs_;
  ModelConstants constants_;
  DeviceArray<float> centroids_;  // empty (null) for fp8 keys
  DeviceArray<float> PiT_;        // empty (null) for fp8 keys
  std::vector<DecodeArgs> args_;
};

// ------------------------------------------------------------- records ----

struct Record {
  Shape shape;
  std::string request;  // automatic, cuda_generic or cuda_generic_scalar
  std::string path;     // the path that ran
  std::string kernel;   // the generic path's kernel (tensor_core or scalar); empty on the Hopper path
  std::string reason;   // why the launcher chose it
  int instances = 0;
  int partitions = 0;
  double tq_us = NAN;      // median replay / R
  double tq_us_min = NAN;  // fastest replay / R
  std::int64_t cache_bytes = 0;
  std::int64_t bytes = 0;  // cache + query + output
  double flops = 0;
  double tq_tbps = NAN;
  double frac_of_read = NAN;
  std::int64_t nonfinite_outputs = -1;
  double max_abs_diff_vs_automatic = NAN;  // generic-path records: instance 0's output against the automatic path's
  std::string error;
};

/// Times decode() over every instance as graph replays (see the header).
std::vector<float> time_decode(const std::vector<DecodeArgs>& args, PathRequest request, DecodeWorkspace& workspace,
                               cudaStream_t stream) {
  // Eager calls first: the first one allocates the workspace pool, caches the
  // launch plan and loads the kernels (lazy loading); none of that may happen
  // inside a capture.
  for (const DecodeArgs& call : args) decode(call, workspace, stream, request);
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const CapturedGraph graph(stream, [&] {
    for (const DecodeArgs& call : args) decode(call, workspace, stream, request);
  });
  return time_reps(stream, kGraphWarmups, kGraphReplays, [&] { graph.launch(stream); });
}

void run_shape(const Shape& shape, const Ceilings& ceilings, cudaStream_t stream, int sm_count, bool automatic_only,
               std::vector<Record>& records) {
  Record base;
  base.shape = shape;
  try {
    const InstancePlan plan = plan_instances(shape);
    base.instances = plan.instances;
    base.cache_bytes = std::int64_t(shape.batch) * shape.context * shape.num_kv_heads * plan.layout.bytes_per_token_head();
    base.bytes = base.cache_bytes + 2 * plan.query_elements * 2;
    base.flops = 4.0 * shape.batch * shape.context * shape.num_q_heads * shape.head_dim;
    std::fprintf(stderr, "%s: filling %d instances (%.2f GB)...\n", shape.name.c_str(), plan.instances,
                 plan.bytes * double(plan.instances) / 1e9);
    const Problem problem(shape, plan, stream, sm_count);
    DecodeWorkspace workspace(shape.batch);  // pool sized for this batch; freed with the shape

    std::vector<float> automatic_output;
    std::vector<std::pair<DecodePath, GenericKernel>> kernels_run;
    const std::pair<PathRequest, const char*> requests[] = {{PathRequest::automatic, "automatic"},
                                                            {PathRequest::cuda_generic, "cuda_generic"},
                                                            {PathRequest::cuda_generic_scalar, "cuda_generic_scalar"}};
    for (const auto& [request, request_name] : requests) {
      if (automatic_only && request != PathRequest::automatic) break;
      Record record = base;
      record.request = request_name;
      try {
        const LaunchPlan launch = plan_decode(problem.args().front(), request);
        // A kernel an earlier request already ran measures nothing new.
        const std::pair<DecodePath, GenericKernel> kernel{launch.path, launch.path == DecodePath::cuda_generic
                                                                           ? launch.generic_kernel
                                                                           : GenericKernel::scalar};
        if (std::find(kernels_run.begin(), kernels_run.end(), kernel) != kernels_run.end()) continue;
        kernels_run.push_back(kernel);
        record.path = decode_path_name(launch.path);
        if (launch.path == DecodePath::cuda_generic) record.kernel = generic_kernel_name(launch.generic_kernel);
        record.reason = launch.reason;
        record.partitions = launch.num_partitions;
        const std::vector<float> replay_ms = time_decode(problem.args(), request, workspace, stream);
        record.tq_us = median(replay_ms) * 1e3 / plan.instances;
        record.tq_us_min = *std::min_element(replay_ms.begin(), replay_ms.end()) * 1e3 / plan.instances;
        record.tq_tbps = terabytes_per_second(double(record.bytes), record.tq_us * 1e-3);
        record.frac_of_read = record.tq_tbps / ceilings.read_tbps;

        // Sanity checks on instance 0, so a broken kernel cannot pass as a fast one.
        const std::vector<float> output = problem.first_output(stream);
        record.nonfinite_outputs = std::count_if(output.begin(), output.end(), [](float x) { return !std::isfinite(x); });
        if (request == PathRequest::automatic) {
          automatic_output = output;
        } else if (!automatic_output.empty()) {
          double diff = 0;
          for (std::size_t i = 0; i < output.size(); ++i) diff = std::max(diff, double(std::fabs(output[i] - automatic_output[i])));
          record.max_abs_diff_vs_automatic = diff;
        }
      } catch (const std::exception& error) {
        record.error = error.what();
      }
      records.push_back(std::move(record));
    }
  } catch (const std::exception& error) {
    base.error = error.what();
    records.push_back(std::move(base));
  }
}

void print_record(const Record& r) {
  if (!r.error.empty()) {
    std::printf("%-30s %-19s ERROR: %s\n", r.shape.name.c_str(), r.request.empty() ? "-" : r.request.c_str(), r.error.c_str());
  } else {
    std::printf("%-30s %-19s %-24s %4d %3d %10.2f %10.2f %7.3f %6.1f%% %8lld\n", r.shape.name.c_str(), r.request.c_str(),
                (r.kernel.empty() ? r.path : r.path + " " + r.kernel).c_str(), r.instances, r.partitions, r.tq_us, r.bytes / 1e6, r.tq_tbps, 100 * r.frac_of_read,
                static_cast<long long>(r.nonfinite_outputs));
  }
  std::fflush(stdout);
}

// ---------------------------------------------------------------- JSON ----

std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

/// A number, or null where there is none (NaN: not measured).
std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", value);
  return text;
}

struct RunInfo {
  std::string gpu;
  int driver;
  int runtime;
  int sm_count;
  int l2_bytes;
  std::string commit;
};

std::string version_text(int version) { return std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10); }

void write_json(const std::string& path, const RunInfo& info, const Ceilings& ceilings, const std::vector<Record>& records) {
  std::string out = "{\n";
  out += "  \"gpu\": " + json_string(info.gpu) + ",\n";
  out += "  \"driver\": " + json_string(version_text(info.driver)) + ",\n";
  out += "  \"runtime\": " + json_string(version_text(info.runtime)) + ",\n";
  out += "  \"sm_count\": " + std::to_string(info.sm_count) + ",\n";
  out += "  \"l2_bytes\": " + std::to_string(info.l2_bytes) + ",\n";
  out += "  \"commit\": " + json_string(info.commit) + ",\n";
  out += "  \"ceilings\": {\"copy_tbps\": " + json_number(ceilings.copy_tbps) + ", \"read_tbps\": " +
         json_number(ceilings.read_tbps) + ", \"copy_bytes\": " + std::to_string(kCopyBytes) +
         ", \"read_bytes\": " + std::to_string(kReadBytes) + ", \"reps\": " + std::to_string(kCeilingReps) + "},\n";
  out += "  \"graph_replays\": " + std::to_string(kGraphReplays) + ",\n";
  out += "  \"records\": [";
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    out += i ? ",\n    {" : "\n    {";
    out += "\"name\": " + json_string(r.shape.name);
    out += ", \"preset\": " + json_string(preset_info(r.shape.preset).name);
    out += ", \"B\": " + std::to_string(r.shape.batch) + ", \"L\": " + std::to_string(r.shape.context);
    out += ", \"Hq\": " + std::to_string(r.shape.num_q_heads) + ", \"Hk\": " + std::to_string(r.shape.num_kv_heads);
    out += ", \"D\": " + std::to_string(r.shape.head_dim) + ", \"block_size\": " + std::to_string(r.shape.block_size);
    out += ", \"request\": " + json_string(r.request) + ", \"path\": " + json_string(r.path);
    out += ", \"kernel\": " + json_string(r.kernel);
    out += ", \"reason\": " + json_string(r.reason);
    out += ", \"instances\": " + std::to_string(r.instances) + ", \"partitions\": " + std::to_string(r.partitions);
    out += ", \"tq_us\": " + json_number(r.tq_us) + ", \"tq_us_min\": " + json_number(r.tq_us_min);
    out += ", \"cache_bytes\": " + std::to_string(r.cache_bytes) + ", \"bytes\": " + std::to_string(r.bytes);
    out += ", \"flops\": " + json_number(r.flops);
    out += ", \"tq_tbps\": " + json_number(r.tq_tbps) + ", \"read_tbps\": " + json_number(ceilings.read_tbps);
    out += ", \"copy_tbps\": " + json_number(ceilings.copy_tbps) + ", \"frac_of_read\": " + json_number(r.frac_of_read);
    out += ", \"nonfinite_outputs\": " + (r.nonfinite_outputs < 0 ? std::string("null") : std::to_string(r.nonfinite_outputs));
    out += ", \"max_abs_diff_vs_automatic\": " + json_number(r.max_abs_diff_vs_automatic);
    out += ", \"gpu\": " + json_string(info.gpu) + ", \"driver\": " + json_string(version_text(info.driver));
    out += ", \"commit\": " + json_string(info.commit);
    out += ", \"error\": " + (r.error.empty() ? std::string("null") : json_string(r.error)) + "}";
  }
  out += "\n  ]\n}\n";
  std::ofstream file(path, std::ios::binary);
  file << out;
  if (!file.flush()) throw std::runtime_error("cannot write " + path);
}

// ---------------------------------------------------------------- main ----

struct Options {
  std::string json_path;
  std::string commit = "unknown";
  std::string shapes_file = TQDECODE_BENCH_SHAPES_FILE;
  bool quick = false;
  bool automatic_only = false;
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
    if (flag == "--quick" || flag == "--automatic-only") {
      (flag == "--quick" ? options.quick : options.automatic_only) = true;
      continue;
    }
    if (i + 1 >= argc) throw std::runtime_error(std::string(flag) + " needs a value\n" + kUsage);
    const std::string value = argv[++i];
    if (flag == "--json") {
      options.json_path = value;
    } else if (flag == "--commit") {
      options.commit = value;
    } else if (flag == "--shapes-file") {
      options.shapes_file = value;
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
  if (options.quick && shapes.size() > 2) shapes.resize(2);
  return shapes;
}

int run(const Options& options) {
  const std::vector<Shape> shapes = select_shapes(load_shapes(options.shapes_file), options);

  int device = 0;
  BENCH_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties;
  BENCH_CHECK(cudaGetDeviceProperties(&properties, device));
  RunInfo info{properties.name, 0, 0, properties.multiProcessorCount, properties.l2CacheSize, options.commit};
  BENCH_CHECK(cudaDriverGetVersion(&info.driver));
  BENCH_CHECK(cudaRuntimeGetVersion(&info.runtime));
  std::printf("tqdecode_bench: %s (sm_%d%d, %d SMs, L2 %.0f MB), driver %s, runtime %s, commit %s\n", info.gpu.c_str(),
              properties.major, properties.minor, info.sm_count, info.l2_bytes / 1e6, version_text(info.driver).c_str(),
              version_text(info.runtime).c_str(), info.commit.c_str());

  const Stream stream;
  const Ceilings ceilings = measure_ceilings(stream.get(), info.sm_count);
  std::printf("ceilings (median of %d): device-to-device copy %.3f TB/s (read+write), read-only stream %.3f TB/s\n\n",
              kCeilingReps, ceilings.copy_tbps, ceilings.read_tbps);
  std::printf("%-30s %-19s %-24s %4s %3s %10s %10s %7s %7s %8s\n", "shape", "request", "path", "R", "N", "tq_us",
              "MB/call", "TB/s", "%read", "nonfin");

  std::vector<Record> records;
  for (const Shape& shape : shapes) {
    const std::size_t first = records.size();
    run_shape(shape, ceilings, stream.get(), info.sm_count, options.automatic_only, records);
    for (std::size_t i = first; i < records.size(); ++i) print_record(records[i]);
  }
  std::printf("\nR: instances rotated per graph replay; N: split-KV partitions; tq_us: median of %d graph replays / R;\n"
              "MB/call: cache + query + output bytes; %%read: of the read-only ceiling; nonfin: non-finite outputs.\n",
              kGraphReplays);

  if (!options.json_path.empty()) {
    write_json(options.json_path, info, ceilings, records);
    std::printf("wrote %s\n", options.json_path.c_str());
  }
  const bool failed = std::any_of(records.begin(), records.end(), [](const Record& r) { return !r.error.empty(); });
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Line-buffered even into a pipe, so the table and the progress lines on stderr stay in order.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    return run(parse_options(argc, argv));
  } catch (const std::exception& error) {
    std::fprintf(stderr, "tqdecode_bench: %s\n", error.what());
    return 1;
  }
}
