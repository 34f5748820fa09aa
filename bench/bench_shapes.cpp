#include "bench_shapes.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string_view>

#include "bench_json.hpp"
#include "random.hpp"

namespace tqbench {

using tqdecode::PathRequest;

const char* lengths_name(Lengths lengths) { return lengths == Lengths::ragged ? "ragged" : "uniform"; }
const char* scores_name(Scores scores) { return scores == Scores::peaked ? "peaked" : "flat"; }

const char* request_name(PathRequest request) {
  switch (request) {
    case PathRequest::automatic: return "automatic";
    case PathRequest::hopper: return "hopper";
    case PathRequest::cuda_generic: return "cuda_generic";
    case PathRequest::cuda_generic_scalar: return "cuda_generic_scalar";
    case PathRequest::hopper_warp_specialized: return "hopper_warp_specialized";
    default: return "cpu_reference";
  }
}

namespace {

constexpr std::string_view kKnownFields[] = {"name",          "preset", "B",    "L",  "Hq",           "Hk",
                                             "D",             "block_size", "lengths", "max_model_len", "scores",
                                             "q_len",         "tp",     "back_to_back", "engine", "requests", "quick",
                                             "order",         "norm_correction"};

[[noreturn]] void bad_field(const std::string& where, std::string_view key, const std::string& what) {
  throw std::runtime_error(where + ": \"" + std::string(key) + "\" " + what);
}

int positive_int(const Json& object, std::string_view key, const std::string& where, int fallback = 0) {
  const Json* value = object.member(key);
  if (value == nullptr) {
    if (fallback > 0) return fallback;
    bad_field(where, key, "is required (a positive integer)");
  }
  if (value->kind != Json::Kind::number || value->number != std::floor(value->number) || value->number < 1 ||
      value->number > (1 << 30)) {
    bad_field(where, key, "must be a positive integer");
  }
  return static_cast<int>(value->number);
}

std::string string_member(const Json& object, std::string_view key, const std::string& where, const char* fallback = nullptr) {
  const Json* value = object.member(key);
  if (value == nullptr && fallback != nullptr) return fallback;
  if (value == nullptr || value->kind != Json::Kind::string) bad_field(where, key, "must be a string");
  return value->string;
}

bool bool_member(const Json& object, std::string_view key, const std::string& where) {
  const Json* value = object.member(key);
  if (value == nullptr) return false;
  if (value->kind != Json::Kind::boolean) bad_field(where, key, "must be true or false");
  return value->boolean;
}

PathRequest parse_request(const std::string& text, const std::string& where) {
  for (const PathRequest request : {PathRequest::automatic, PathRequest::hopper, PathRequest::cuda_generic,
                                    PathRequest::cuda_generic_scalar, PathRequest::hopper_warp_specialized}) {
    if (text == request_name(request)) return request;
  }
  bad_field(where, "requests",
            "has \"" + text +
                "\"; accepted: automatic, hopper, cuda_generic, cuda_generic_scalar, hopper_warp_specialized");
}

Shape parse_shape(const Json& item, const std::string& where) {
  if (item.kind != Json::Kind::object) throw std::runtime_error(where + ": expected an object");
  for (const auto& [key, value] : item.members) {
    if (std::find(std::begin(kKnownFields), std::end(kKnownFields), key) == std::end(kKnownFields)) {
      bad_field(where, key, "is not a shape field (see the comment at the top of the shape list)");
    }
  }
  Shape shape;
  shape.name = string_member(item, "name", where);
  const std::string named = where + " (" + shape.name + ")";
  shape.preset = tqdecode::parse_preset(string_member(item, "preset", named), named + ".preset");
  shape.batch = positive_int(item, "B", named);
  shape.context = positive_int(item, "L", named);
  shape.num_q_heads = positive_int(item, "Hq", named);
  shape.num_kv_heads = positive_int(item, "Hk", named);
  shape.head_dim = positive_int(item, "D", named);
  shape.block_size = positive_int(item, "block_size", named);

  const std::string lengths = string_member(item, "lengths", named, "uniform");
  if (lengths != "uniform" && lengths != "ragged") bad_field(named, "lengths", "must be \"uniform\" or \"ragged\"");
  shape.lengths = lengths == "ragged" ? Lengths::ragged : Lengths::uniform;
  const std::string scores = string_member(item, "scores", named, "flat");
  if (scores != "flat" && scores != "peaked") bad_field(named, "scores", "must be \"flat\" or \"peaked\"");
  shape.scores = scores == "peaked" ? Scores::peaked : Scores::flat;
  if (item.member("max_model_len") != nullptr) shape.max_model_len = positive_int(item, "max_model_len", named);
  shape.q_len = positive_int(item, "q_len", named, 1);
  if (item.member("tp") != nullptr) shape.tp = positive_int(item, "tp", named);
  shape.back_to_back = bool_member(item, "back_to_back", named);
  shape.engine = bool_member(item, "engine", named);
  shape.quick = bool_member(item, "quick", named);
  shape.order = tqdecode::parse_cache_order(string_member(item, "order", named, "blocks"), named + ".order");
  shape.norm_correction = bool_member(item, "norm_correction", named);
  if (shape.norm_correction && shape.order != tqdecode::CacheOrder::token_slots) {
    bad_field(named, "norm_correction", "needs order \"token_slots\"");
  }
  if (const Json* requests = item.member("requests")) {
    if (requests->kind != Json::Kind::array || requests->items.empty()) {
      bad_field(named, "requests", "must be a non-empty array of path requests");
    }
    shape.requests.clear();
    for (const Json& request : requests->items) {
      if (request.kind != Json::Kind::string) bad_field(named, "requests", "must hold strings");
      shape.requests.push_back(parse_request(request.string, named));
    }
    if (shape.requests.front() != PathRequest::automatic) {
      bad_field(named, "requests", "must start with \"automatic\" (the other paths are compared with it)");
    }
  }
  // The library's own checks: supported head dim, block size, group size, norm correction.
  shape_layout(shape);
  tqdecode::validate_group_size(shape.num_q_heads, shape.num_kv_heads);
  const std::int64_t longest = shape.lengths == Lengths::ragged ? shape.context / 4 + 3 * std::int64_t(shape.context) / 2
                                                                 : shape.context;
  if (shape.max_model_len > 0 && shape.max_model_len < longest) {
    bad_field(named, "max_model_len", "is " + std::to_string(shape.max_model_len) + ", below the longest sequence the lengths allow (" +
                                          std::to_string(longest) + ")");
  }
  if (shape.engine && shape.q_len > 1) bad_field(named, "engine", "needs q_len 1");
  return shape;
}

}  // namespace

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
    Shape shape = parse_shape(list->items[i], path + ": shapes[" + std::to_string(i) + "]");
    for (const Shape& earlier : shapes) {
      if (earlier.name == shape.name) throw std::runtime_error(path + ": two shapes are named " + shape.name);
    }
    shapes.push_back(std::move(shape));
  }
  return shapes;
}

std::vector<std::int32_t> sequence_lengths(const Shape& shape) {
  std::vector<std::int32_t> lengths(static_cast<std::size_t>(shape.batch), shape.context);
  if (shape.lengths == Lengths::ragged) {
    tqdecode::Rng rng(kLengthsSeed);
    const std::uint64_t span = 3 * static_cast<std::uint64_t>(shape.context) / 2 + 1;
    for (std::int32_t& length : lengths) {
      length = std::max<std::int32_t>(1, shape.context / 4 + static_cast<std::int32_t>(rng.below(span)));
    }
  }
  return lengths;
}

tqdecode::CacheLayout shape_layout(const Shape& shape) {
  if (shape.order == tqdecode::CacheOrder::token_slots) {
    return tqdecode::make_token_slots_layout(shape.preset, shape.head_dim, shape.block_size, shape.num_kv_heads,
                                             shape.norm_correction);
  }
  return tqdecode::make_layout(shape.preset, shape.head_dim, shape.block_size, shape.num_kv_heads);
}

InstancePlan plan_instances(const Shape& shape) {
  InstancePlan plan;
  plan.layout = shape_layout(shape);
  if (plan.layout.block_stride % 16 != 0) throw std::runtime_error(shape.name + ": block stride is not a multiple of 16 bytes");
  plan.lengths = sequence_lengths(shape);
  for (const std::int32_t length : plan.lengths) {
    if (length < shape.q_len) throw std::runtime_error(shape.name + ": a sequence is shorter than q_len");
    plan.tokens += length;
    plan.max_len = std::max(plan.max_len, static_cast<int>(length));
    plan.blocks += (length + shape.block_size - 1) / shape.block_size;
  }
  const int table_tokens = shape.max_model_len > 0 ? shape.max_model_len : plan.max_len;
  plan.table_width = (table_tokens + shape.block_size - 1) / shape.block_size;
  const std::int64_t query_rows = std::int64_t(shape.batch) * shape.q_len;
  plan.query_elements = query_rows * shape.num_q_heads * shape.head_dim;
  plan.cache_bytes = plan.tokens * shape.num_kv_heads * plan.layout.bytes_per_token_head();
  plan.bytes = plan.cache_bytes + 2 * plan.query_elements * 2;
  const tqdecode::PresetInfo info = tqdecode::preset_info(shape.preset);
  plan.constant_elements = info.key_fp8 ? 0 : std::int64_t(shape.head_dim) * shape.head_dim + (std::int64_t{1} << info.key_bits);
  plan.instance_bytes = plan.blocks * plan.layout.block_stride + 2 * plan.query_elements * 2 +
                        std::int64_t(shape.batch) * plan.table_width * 4 + shape.batch * 4 + plan.constant_elements * 4;
  // q_len > 1: the rows form's block table and lengths (a row per token).
  if (shape.q_len > 1) plan.instance_bytes += query_rows * plan.table_width * 4 + query_rows * 4;
  plan.layers = static_cast<int>(std::clamp<std::int64_t>(kSingleStepBudgetBytes / plan.instance_bytes, kMinSingleStepLayers,
                                                          kMaxSingleStepLayers));
  plan.back_to_back = shape.back_to_back
                          ? static_cast<int>(std::max<std::int64_t>(2, (kBackToBackBytes + plan.instance_bytes - 1) / plan.instance_bytes))
                          : 0;
  plan.engine_layers = shape.engine ? kEngineLayers : 0;
  plan.instances = std::max({plan.layers, plan.back_to_back, plan.engine_layers});
  if (plan.blocks * plan.instances > std::numeric_limits<std::int32_t>::max()) {
    throw std::runtime_error(shape.name + ": more physical blocks than an int32 block table can address");
  }
  return plan;
}

std::vector<std::int32_t> block_tables(const InstancePlan& plan, int batch, int instances, std::uint64_t seed) {
  const std::int64_t row_entries = std::int64_t(batch) * plan.table_width;
  std::vector<std::int32_t> tables(static_cast<std::size_t>(row_entries * instances), 0);
  std::vector<std::int32_t> region(static_cast<std::size_t>(plan.blocks));
  tqdecode::Rng rng(seed);
  for (int r = 0; r < instances; ++r) {
    std::iota(region.begin(), region.end(), static_cast<std::int32_t>(r * plan.blocks));
    for (std::int64_t i = plan.blocks - 1; i > 0; --i) std::swap(region[i], region[rng.below(static_cast<std::uint64_t>(i) + 1)]);
    std::int64_t next = 0;
    for (int b = 0; b < batch; ++b) {
      const int used = (plan.lengths[b] + plan.layout.block_size - 1) / plan.layout.block_size;
      std::copy_n(region.begin() + next, used, tables.begin() + r * row_entries + std::int64_t(b) * plan.table_width);
      next += used;
    }
  }
  return tables;
}

}  // namespace tqbench
