// The benchmark's shapes (bench/shapes.json) and what one shape allocates
// and moves. bench/shape_plan.py is the same for the Python programs; the
// sequence lengths must match draw for draw (run_bench.py checks the totals).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tqdecode/decode.hpp"
#include "tqdecode/format.hpp"

namespace tqbench {

enum class Lengths { uniform, ragged };
enum class Scores { flat, peaked };

struct Shape {
  std::string name;
  tqdecode::Preset preset = tqdecode::Preset::turboquant_4bit_nc;
  int batch = 0;         // B
  int context = 0;       // L: every sequence's length (uniform) or their mean (ragged)
  int num_q_heads = 0;   // Hq
  int num_kv_heads = 0;  // Hk
  int head_dim = 0;      // D
  int block_size = 0;
  Lengths lengths = Lengths::uniform;
  int max_model_len = 0;  // block-table width in tokens; 0: the longest sequence
  Scores scores = Scores::flat;
  int q_len = 1;  // query tokens per sequence; above 1: the varlen entry, and the same tokens as rows of the one-token entry
  int tp = 0;     // tensor-parallel degree this per-GPU shape is a shard of; 0: not a shard row
  tqdecode::CacheOrder order = tqdecode::CacheOrder::blocks;  // token_slots: vLLM's dense CUDA layout
  bool norm_correction = false;  // token_slots, MSE keys: renormalized at decode
  bool back_to_back = false;
  bool engine = false;
  bool quick = false;
  std::vector<tqdecode::PathRequest> requests{tqdecode::PathRequest::automatic};
};

const char* lengths_name(Lengths lengths);
const char* scores_name(Scores scores);
const char* request_name(tqdecode::PathRequest request);

/// Reads and checks the shape list; throws naming the file, the shape and the field.
std::vector<Shape> load_shapes(const std::string& path);

/// Seed of the ragged lengths (bench/shape_plan.py LENGTHS_SEED).
inline constexpr std::uint64_t kLengthsSeed = 0x6c656e67746873ULL;

/// The shape's sequence lengths: all L (uniform), or L/4 + a draw from
/// [0, 3L/2] per sequence from tqdecode::Rng(kLengthsSeed) (ragged).
std::vector<std::int32_t> sequence_lengths(const Shape& shape);

inline constexpr int kMaxSingleStepLayers = 8;
inline constexpr int kMinSingleStepLayers = 2;
inline constexpr std::int64_t kSingleStepBudgetBytes = std::int64_t{16} << 30;  // device memory for the single-step layers
inline constexpr std::int64_t kBackToBackBytes = std::int64_t{1} << 30;        // working set one back-to-back replay sweeps
inline constexpr int kEngineLayers = 16;

/// Sizes of one instance (a "layer": its own cache region, block table,
/// query, output and constants) of a shape, and how many of each kind run.
struct InstancePlan {
  tqdecode::CacheLayout layout;
  std::vector<std::int32_t> lengths;
  std::int64_t tokens = 0;  // sum of the lengths
  int max_len = 0;
  int table_width = 0;           // max_blocks_per_seq: max_model_len (else max_len) in blocks
  std::int64_t blocks = 0;       // physical blocks one instance uses
  std::int64_t query_elements = 0;  // B * q_len * Hq * D (also the output's)
  std::int64_t cache_bytes = 0;     // cache bytes one decode reads
  std::int64_t bytes = 0;           // cache + query + output: what one decode moves
  std::int64_t constant_elements = 0;  // PiT and centroids of one instance (floats)
  std::int64_t instance_bytes = 0;     // one instance's device memory
  int layers = 0;         // instances the single step cycles through
  int back_to_back = 0;   // R decodes per back-to-back graph; 0 when the shape has none
  int engine_layers = 0;  // N of the engine-like step; 0 when the shape has none
  int instances = 0;      // max of the three
};

InstancePlan plan_instances(const Shape& shape);

/// The shape's cache layout: the blocks order, or the token_slots order with
/// vLLM's dense strides.
tqdecode::CacheLayout shape_layout(const Shape& shape);

/// Block tables of `instances` instances, [instances][B][table_width].
/// Instance r owns physical blocks [r * blocks, (r + 1) * blocks), shuffled
/// (seeded) so consecutive logical blocks are scattered as in an engine's
/// pool; columns past a sequence's last block hold 0, as engines leave them
/// (the decode reads only the columns a length covers).
std::vector<std::int32_t> block_tables(const InstancePlan& plan, int batch, int instances, std::uint64_t seed);

}  // namespace tqbench
