#include "bench_instances.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "bench_inputs.hpp"
#include "tqdecode/constants.hpp"

namespace tqbench {

namespace {

constexpr int kFillThreads = 256;
constexpr std::uint64_t kCodesSeed = 0x7d3c0de5eedULL;
constexpr std::uint64_t kMetadataSeed = kCodesSeed + 1;
constexpr std::uint64_t kQuerySeed = kCodesSeed + 2;
constexpr std::uint64_t kTableSeed = kCodesSeed + 3;
constexpr std::uint64_t kPeakSeed = kCodesSeed + 4;
constexpr std::uint64_t kConstantsSeed = kCodesSeed + 5;  // instance r's rotation: seed + r

__global__ void fill_cache_codes_kernel(uint4* cache, std::int64_t words, tqdecode::CacheLayout layout, std::uint64_t seed) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t word = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; word < words; word += stride) {
    uint4 out;
    cache_code_word(word, layout, seed, reinterpret_cast<std::uint8_t*>(&out));
    cache[word] = out;
  }
}

__global__ void fill_cache_metadata_kernel(std::uint8_t* cache, std::int64_t num_blocks, tqdecode::CacheLayout layout,
                                           std::uint64_t seed) {
  const std::int64_t total = num_blocks * metadata_fields_per_block(layout);
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const HalfAt field = metadata_field(i, layout, seed);
    *reinterpret_cast<std::uint16_t*>(cache + field.offset) = field.bits;
  }
}

__global__ void fill_bf16_kernel(std::uint16_t* data, std::int64_t count, std::uint64_t seed) {
  const std::int64_t stride = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    data[i] = query_element(seed, i);
  }
}

/// One thread per (sequence, kv head, planted token).
__global__ void plant_peaks_kernel(PeakInputs inputs, int batch) {
  const int per_sequence = inputs.layout.num_kv_heads * kPeaksPerSequence;
  const std::int64_t index = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= std::int64_t(batch) * per_sequence) return;
  const int sequence = static_cast<int>(index / per_sequence);
  const int within = static_cast<int>(index % per_sequence);
  plant_peak(inputs, sequence, within / kPeaksPerSequence, within % kPeaksPerSequence);
}

}  // namespace

void fill_random_bf16(std::uint16_t* data, std::int64_t count, std::uint64_t seed, cudaStream_t stream, int sm_count) {
  fill_bf16_kernel<<<sm_count * 8, kFillThreads, 0, stream>>>(data, count, seed);
  BENCH_CHECK_LAUNCH("fill_bf16_kernel");
}

Instances::Instances(const Shape& shape, const InstancePlan& plan, cudaStream_t stream, int sm_count)
    : plan_(plan),
      cache_(plan.blocks * plan.instances * plan.layout.block_stride),
      block_tables_(std::int64_t(shape.batch) * plan.table_width * plan.instances),
      seq_lens_(std::int64_t(shape.batch) * plan.instances),
      queries_(plan.query_elements * plan.instances),
      outputs_(plan.query_elements * plan.instances) {
  const int instances = plan.instances;
  const std::int64_t total_blocks = plan.blocks * instances;
  const int fill_grid = sm_count * 8;
  fill_cache_codes_kernel<<<fill_grid, kFillThreads, 0, stream>>>(reinterpret_cast<uint4*>(cache_.get()), cache_.bytes() / 16,
                                                                  plan.layout, kCodesSeed);
  BENCH_CHECK_LAUNCH("fill_cache_codes_kernel");
  BENCH_SYNC(stream, "fill_cache_codes_kernel");
  fill_cache_metadata_kernel<<<fill_grid, kFillThreads, 0, stream>>>(cache_.get(), total_blocks, plan.layout, kMetadataSeed);
  BENCH_CHECK_LAUNCH("fill_cache_metadata_kernel");
  BENCH_SYNC(stream, "fill_cache_metadata_kernel");
  fill_random_bf16(queries_.get(), queries_.count(), kQuerySeed, stream, sm_count);

  const std::vector<std::int32_t> tables = block_tables(plan, shape.batch, instances, kTableSeed);
  std::vector<std::int32_t> lengths;
  for (int r = 0; r < instances; ++r) lengths.insert(lengths.end(), plan.lengths.begin(), plan.lengths.end());
  upload(block_tables_, tables, stream);
  upload(seq_lens_, lengths, stream);

  // Each instance's own rotation (seeded by its index) and its own copy of
  // the codebook: what a model's layers hold, at addresses of their own.
  const tqdecode::PresetInfo info = tqdecode::preset_info(shape.preset);
  const int num_centroids = info.key_fp8 ? 0 : 1 << info.key_bits;
  const std::int64_t matrix = std::int64_t(shape.head_dim) * shape.head_dim;
  std::vector<float> centroids, PiT;
  if (!info.key_fp8) {
    centroids.reserve(std::size_t(num_centroids) * instances);
    PiT.reserve(std::size_t(matrix) * instances);
    for (int r = 0; r < instances; ++r) {
      const tqdecode::ModelConstants constants = tqdecode::make_model_constants(shape.preset, shape.head_dim, kConstantsSeed + r);
      centroids.insert(centroids.end(), constants.centroids.begin(), constants.centroids.end());
      PiT.insert(PiT.end(), constants.PiT.begin(), constants.PiT.end());
    }
    centroids_ = DeviceArray<float>(static_cast<std::int64_t>(centroids.size()));
    PiT_ = DeviceArray<float>(static_cast<std::int64_t>(PiT.size()));
    upload(centroids_, centroids, stream);
    upload(PiT_, PiT, stream);
  }

  const float scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  for (int r = 0; r < instances; ++r) {
    tqdecode::DecodeArgs args;
    args.query = queries_.get() + r * plan.query_elements;
    args.query_dtype = tqdecode::DType::bf16;
    args.batch = shape.batch;
    args.num_q_heads = shape.num_q_heads;
    args.layout = plan.layout;
    args.num_blocks = total_blocks;
    args.cache = cache_.get();
    args.block_table = block_tables_.get() + std::int64_t(r) * shape.batch * plan.table_width;
    args.max_blocks_per_seq = plan.table_width;
    args.seq_lens = seq_lens_.get() + std::int64_t(r) * shape.batch;
    args.centroids = info.key_fp8 ? nullptr : centroids_.get() + std::int64_t(r) * num_centroids;
    args.num_centroids = num_centroids;
    args.PiT = info.key_fp8 ? nullptr : PiT_.get() + r * matrix;
    args.scale = scale;
    args.output = outputs_.get() + r * plan.query_elements;
    args_.push_back(args);
  }

  if (shape.q_len > 1) add_query_tokens(shape, tables, stream);

  if (shape.scores == Scores::peaked) {
    const int threads = shape.batch * shape.num_kv_heads * kPeaksPerSequence;
    for (int r = 0; r < instances; ++r) {
      const tqdecode::DecodeArgs& a = args_[r];
      const PeakInputs inputs{plan.layout,   cache_.get(), a.block_table, plan.table_width, a.seq_lens,
                              static_cast<const std::uint16_t*>(a.query), shape.num_q_heads, a.PiT, a.centroids,
                              num_centroids, scale,        kPeakSeed};
      plant_peaks_kernel<<<(threads + 127) / 128, 128, 0, stream>>>(inputs, shape.batch);
      BENCH_CHECK_LAUNCH("plant_peaks_kernel");
    }
  }
  BENCH_SYNC(stream, "plant_peaks_kernel, the queries' fill and the uploads");  // the host vectors above die here
}

void Instances::add_query_tokens(const Shape& shape, const std::vector<std::int32_t>& tables, cudaStream_t stream) {
  const int q_len = shape.q_len;
  const std::int64_t rows = std::int64_t(shape.batch) * q_len;
  const std::int64_t width = plan_.table_width;
  std::vector<std::int32_t> starts(shape.batch + 1);
  for (int b = 0; b <= shape.batch; ++b) starts[b] = b * q_len;
  std::vector<std::int32_t> row_tables(rows * width * plan_.instances), row_lengths(rows * plan_.instances);
  for (int r = 0; r < plan_.instances; ++r) {
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int64_t b = row / q_len;
      const std::int64_t at = r * rows + row;
      row_lengths[at] = plan_.lengths[b] - q_len + static_cast<std::int32_t>(row % q_len) + 1;
      std::copy_n(tables.begin() + (std::int64_t(r) * shape.batch + b) * width, width, row_tables.begin() + at * width);
    }
  }
  query_start_loc_ = DeviceArray<std::int32_t>(shape.batch + 1);
  row_tables_ = DeviceArray<std::int32_t>(static_cast<std::int64_t>(row_tables.size()));
  row_lengths_ = DeviceArray<std::int32_t>(static_cast<std::int64_t>(row_lengths.size()));
  upload(query_start_loc_, starts, stream);
  upload(row_tables_, row_tables, stream);
  upload(row_lengths_, row_lengths, stream);
  BENCH_SYNC(stream, "the uploads of the varlen offsets and the rows form");  // the host vectors die here
  for (int r = 0; r < plan_.instances; ++r) {
    tqdecode::DecodeArgs rows_form = args_[r];
    rows_form.batch = static_cast<int>(rows);
    rows_form.block_table = row_tables_.get() + r * rows * width;
    rows_form.seq_lens = row_lengths_.get() + r * rows;
    rows_args_.push_back(rows_form);
    args_[r].query_start_loc = query_start_loc_.get();
    args_[r].num_tokens = static_cast<int>(rows);
    args_[r].max_query_len = q_len;
  }
}

std::vector<float> Instances::output(int instance, cudaStream_t stream) const {
  std::vector<std::uint16_t> bits(static_cast<std::size_t>(plan_.query_elements));
  BENCH_CHECK(cudaMemcpyAsync(bits.data(), outputs_.get() + instance * plan_.query_elements, bits.size() * 2,
                              cudaMemcpyDeviceToHost, stream));
  BENCH_SYNC(stream, "the copy of an output to the host");
  std::vector<float> values(bits.size());
  std::transform(bits.begin(), bits.end(), values.begin(), tqdecode::bf16_bits_to_float);
  return values;
}

}  // namespace tqbench
