#include "policy.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <mutex>

#include "cuda_check.hpp"
#include "kernel_params.hpp"

namespace tqdecode::cuda {

const DeviceInfo& current_device_info() {
  static std::mutex mutex;
  static std::map<int, DeviceInfo> devices;
  int device = 0;
  TQ_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto found = devices.find(device);
  if (found == devices.end()) {
    DeviceInfo info{device, 0, 0, 0, 0, 0, 0.0};
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount, device));
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, device));
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, device));
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&info.shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TQ_CUDA_CHECK(cudaDeviceGetAttribute(&info.shared_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    // Clocks are advisory (a device or driver may not report them): 0 where a query fails, its error cleared.
    const auto reported = [&](cudaDeviceAttr attribute) {
      int value = 0;
      if (cudaDeviceGetAttribute(&value, attribute, device) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
      }
      return value;
    };
    const int memory_khz = reported(cudaDevAttrMemoryClockRate), bus_bits = reported(cudaDevAttrGlobalMemoryBusWidth),
              sm_khz = reported(cudaDevAttrClockRate);
    if (memory_khz > 0 && bus_bits > 0 && sm_khz > 0 && info.sm_count > 0) {
      // Double data rate: two transfers of the bus per memory clock.
      info.memory_bytes_per_sm_cycle =
          2.0 * memory_khz * (bus_bits / 8.0) / (static_cast<double>(sm_khz) * info.sm_count);
    }
    found = devices.emplace(device, info).first;
  }
  return found->second;
}

int choose_num_partitions(int batch, int num_kv_heads, int max_context_tokens, int sm_count, int resident_ctas_per_sm) {
  const long long work = std::max(1LL, static_cast<long long>(batch) * num_kv_heads);
  const long long slots = std::max(1LL, static_cast<long long>(std::clamp(resident_ctas_per_sm, 1, kMaxResidentCtasPerSm)) * sm_count);
  const long long by_length = (static_cast<long long>(max_context_tokens) + kMinPartitionTokens - 1) / kMinPartitionTokens;
  const long long cap = std::max(1LL, std::min(static_cast<long long>(kMaxPartitions), by_length));
  long long best = 1;
  double best_utilization = 0.0;
  for (long long partitions = 1; partitions <= cap; ++partitions) {
    const long long ctas = work * partitions;
    const long long waves = (ctas + slots - 1) / slots;
    const double utilization = static_cast<double>(ctas) / static_cast<double>(slots * waves);
    if (utilization >= kGoodWaveUtilization) return static_cast<int>(partitions);
    if (utilization > best_utilization) {
      best = partitions;
      best_utilization = utilization;
    }
  }
  return static_cast<int>(best);
}

/// Whether `ctas` CTAs of one per SM fill a wave of `sm_count` SMs (kGoodWaveUtilization).
static bool fills_a_wave(long long ctas, int sm_count) { return ctas >= kGoodWaveUtilization * sm_count; }

bool wide_table_kernel(Preset preset, int head_dim) { return preset == Preset::turboquant_4bit_nc && head_dim == 128; }

bool tensor_core_four_head_tiles(DecodePath path, const CacheLayout& layout, int rows_per_head, int batch,
                                 int sm_count) {
  if (path != DecodePath::hopper || !wide_table_kernel(layout.preset, layout.head_dim) || layout.token_slots() ||
      rows_per_head <= 2 * kHeadsPerTile) {
    return false;
  }
  const long long ctas = static_cast<long long>(batch) * layout.num_kv_heads * tensor_core_row_tiles(rows_per_head, 4);
  return fills_a_wave(ctas, sm_count);
}

bool warp_specialized_built() {
#if defined(TQDECODE_SM90A)
  return true;
#else
  return false;
#endif
}

bool warp_specialized_serves(DecodePath path, const CacheLayout& layout, bool varlen, int rows_per_head) {
  return warp_specialized_built() && path == DecodePath::hopper && varlen &&
         wide_table_kernel(layout.preset, layout.head_dim) &&
         (!layout.token_slots() || token_slots_box_copies(layout)) && rows_per_head > 2 * kHeadsPerTile;
}

bool warp_specialized_automatic(DecodePath path, const CacheLayout& layout, bool varlen, int rows_per_head, int batch,
                                int sm_count) {
  if (!warp_specialized_serves(path, layout, varlen, rows_per_head)) return false;
  if (rows_per_head > kWarpSpecializedAutomaticPast) return true;
  return layout.token_slots() && layout.renormalize_keys &&
         fills_a_wave(static_cast<long long>(batch) * layout.num_kv_heads, sm_count);
}

int resident_ctas_per_sm(DecodePath path, Preset preset, int group_size, bool wide_table, int head_dim) {
  if (path != DecodePath::hopper) return 2;
  // The kernel's shape table (tensor_core/shape.cuh, KernelShape): one CTA
  // in the wide-table shape (16 warps, 12 for groups over 8), else the
  // narrow configuration's (at D = 128 two of 8 warps up to group 8, one of
  // 12 beyond; two of 8 at D = 64, one of 8 at D = 256).
  return tensor_core_footprint(preset, group_size, head_dim, wide_table && wide_table_kernel(preset, head_dim), 1)
      .planned_ctas_per_sm;
}

GridChoice choose_grid(DecodePath path, Preset preset, int group_size, int batch, int num_kv_heads,
                       int max_context_tokens, int sm_count, int head_dim, SlotRead slots, bool renormalized_keys,
                       double memory_bytes_per_sm_cycle) {
  const bool token_slots = slots != SlotRead::none;
  // The wide shape streams faster per SM but exposes every wave's
  // prologue (rotation, table) and merge, which the two-CTA shape overlaps
  // with the other CTA's streaming: it pays off for grids of few waves.
  const auto waves_of = [&](long long ctas) { return (ctas + sm_count - 1) / sm_count; };
  // CTAs per SM of the shape with `heads_per_cta` kv heads per CTA (the shape table).
  const auto resident = [&](bool wide, int heads_per_cta, bool runs = false) {
    return tensor_core_footprint(preset, group_size, head_dim, wide, heads_per_cta, token_slots, runs)
        .planned_ctas_per_sm;
  };
  // token_slots: whole token rows (token runs: of every kv head) where that
  // grid fills a wave and each CTA streams at least kRowsMinStreamTokens,
  // else (small batches) the narrow configuration, whose one-kv-head CTAs
  // fill the GPU.
  if (path == DecodePath::hopper && (slots == SlotRead::rows || slots == SlotRead::runs)) {
    const bool runs = slots == SlotRead::runs;
    const int heads_per_cta = runs ? num_kv_heads : token_slots_row_kv_heads(num_kv_heads);
    const int partitions = choose_num_partitions(batch, num_kv_heads / heads_per_cta, max_context_tokens, sm_count,
                                                 resident(false, heads_per_cta, runs));
    const long long ctas = static_cast<long long>(batch) * (num_kv_heads / heads_per_cta) * partitions;
    if (fills_a_wave(ctas, sm_count) && max_context_tokens / partitions >= kRowsMinStreamTokens) {
      return {partitions, false, heads_per_cta, runs};
    }
  }
  // The wide shape where bulk copies read the cache, else the narrow
  // configuration, one kv head per CTA.
  if (path == DecodePath::hopper && slots != SlotRead::none && slots != SlotRead::bulk_copies) {
    return {choose_num_partitions(batch, num_kv_heads, max_context_tokens, sm_count, resident(false, 1)), false};
  }
  if (path == DecodePath::hopper && wide_table_kernel(preset, head_dim)) {
    // Two head tiles: one CTA of 12 warps per SM either way, so the wide
    // table's shorter loop wins on every grid.
    if (group_size > kHeadsPerTile) {
      return {choose_num_partitions(batch, num_kv_heads, max_context_tokens, sm_count, resident(true, 1)), true};
    }
    // One kv head per CTA for grids of at most kWideTableMaxWaves waves;
    // several kv heads per CTA keep several work items per SM streaming, as
    // two 8-warp CTAs do, with the wide table's shorter loop. The fewest
    // waves win (the fewer heads on a tie): the fewer times every SM pays a
    // prologue and a merge at once, and no half-empty last wave
    // (docs/PERFORMANCE.md).
    // The wide shape's partitions and waves with `heads_per_cta` kv heads per CTA.
    const auto wide_partitions = [&](int heads_per_cta) {
      return choose_num_partitions(batch, num_kv_heads / heads_per_cta, max_context_tokens, sm_count,
                                   resident(true, heads_per_cta));
    };
    const auto wide_waves_of = [&](int heads_per_cta, int partitions) {
      return waves_of(static_cast<long long>(batch) * (num_kv_heads / heads_per_cta) * partitions);
    };
    GridChoice best{0, true};
    long long best_waves = 0;
    const int wide = wide_partitions(1);
    const long long wide_waves = wide_waves_of(1, wide);
    if (wide_waves <= kWideTableMaxWaves) {
      best = {wide, true, 1};
      best_waves = wide_waves;
    }
    for (const int heads_per_cta : kWideKvHeadsPerCta) {
      if (num_kv_heads % heads_per_cta != 0) continue;
      const int partitions = wide_partitions(heads_per_cta);
      const long long waves = wide_waves_of(heads_per_cta, partitions);
      if (best.num_partitions == 0 || waves < best_waves) {
        best = {partitions, true, heads_per_cta};
        best_waves = waves;
      }
    }
    if (best.num_partitions > 0) {
      // token_slots: a token's row holds every kv head's slot, and each kv
      // head's box shares 128-byte L2 lines with its neighbours'. CTAs of one
      // kv head that stream long ranges drift apart and fetch the shared
      // lines again, so past kSlotsLongStreamTokens a CTA takes the most kv
      // heads, whose warps read whole rows together, with partitions filling
      // the GPU (their extra prologues and reduction cost more on shorter
      // ranges). Without norm correction the one-kv-head CTAs' shorter loop
      // drifts apart sooner: past kSlotsLongStreamTokensUnnormalized. With norm
      // correction on a device of little bandwidth per SM cycle, eight kv heads
      // in whole rows from kSlotsLongStreamTokensUnnormalized tokens
      // (kSlotsBoxesMinBytesPerSmCycle).
      const int long_stream = renormalized_keys ? kSlotsLongStreamTokens : kSlotsLongStreamTokensUnnormalized;
      const int stream = max_context_tokens / best.num_partitions;
      const bool memory_bound_rows = renormalized_keys && num_kv_heads % 8 == 0 &&
                                     slot_boxes_memory_bound(memory_bytes_per_sm_cycle) &&
                                     stream >= kSlotsLongStreamTokensUnnormalized;
      if (slots == SlotRead::bulk_copies && (stream > long_stream || memory_bound_rows)) {
        for (int i = static_cast<int>(std::size(kWideKvHeadsPerCta)) - 1; i >= 0; --i) {
          const int heads_per_cta = kWideKvHeadsPerCta[i];
          if (num_kv_heads % heads_per_cta != 0) continue;
          best = {wide_partitions(heads_per_cta), true, heads_per_cta};
          break;
        }
        // There, half rows (four kv heads) with fewer partitions where they
        // fill no more waves and stream at most
        // kSlotsLongStreamTokensUnnormalized tokens a CTA: fewer arrivals,
        // reductions and partials (on longer streams the two CTAs of a row
        // drift apart and measured slower).
        if (memory_bound_rows && best.kv_heads_per_cta == 8) {
          const int half_rows = wide_partitions(4);
          if (half_rows < best.num_partitions && max_context_tokens / half_rows <= kSlotsLongStreamTokensUnnormalized &&
              wide_waves_of(4, half_rows) <= wide_waves_of(8, best.num_partitions)) {
            best = {half_rows, true, 4};
          }
        }
      }
      // Eight kv heads: whole rows (one copy per tile for the CTA) but with
      // the norm correction on shorter streams; four where memory bound.
      best.whole_rows = slots == SlotRead::bulk_copies &&
                        (best.kv_heads_per_cta == 8 || (memory_bound_rows && best.kv_heads_per_cta == 4)) &&
                        (!renormalized_keys || memory_bound_rows ||
                         max_context_tokens / best.num_partitions >= kSlotsLongStreamTokens);
      return best;
    }
  }
  // The other presets: two kv heads per 16-warp CTA (one per SM) where that
  // grid takes at most kWideTableMaxWaves waves. Two 8-warp CTAs sharing an
  // SM do not end together: one gets ahead and the other then streams alone,
  // with half the warps.
  if (path == DecodePath::hopper && head_dim == 128 && group_size <= kHeadsPerTile && num_kv_heads % 2 == 0 &&
      !token_slots) {
    const int paired = choose_num_partitions(batch, num_kv_heads / 2, max_context_tokens, sm_count, resident(false, 2));
    if (waves_of(static_cast<long long>(batch) * (num_kv_heads / 2) * paired) <= kWideTableMaxWaves) return {paired, false, 2};
  }
  return {choose_num_partitions(batch, num_kv_heads, max_context_tokens, sm_count,
                                path == DecodePath::hopper ? resident(false, 1)
                                                           : resident_ctas_per_sm(path, preset, group_size, false, head_dim)),
          false};
}

int max_partition_rows(int max_batch, int num_kv_heads, int sm_count) {
  int rows = 0;
  // The context cap can only lower N; every resident count a path uses is covered.
  for (int batch = 1; batch <= max_batch; ++batch) {
    for (int resident = 1; resident <= kMaxResidentCtasPerSm; ++resident) {
      rows = std::max(rows, batch * choose_num_partitions(batch, num_kv_heads, 1 << 30, sm_count, resident));
    }
    for (const int heads_per_cta : kWideKvHeadsPerCta) {  // choose_grid's several kv heads per CTA
      if (num_kv_heads % heads_per_cta != 0) continue;
      rows = std::max(rows, batch * choose_num_partitions(batch, num_kv_heads / heads_per_cta, 1 << 30, sm_count, 1));
    }
  }
  return rows;
}

namespace {

// What the tensor-core kernel needs in every configuration, whatever the device.
std::string tensor_core_layout_unsupported_reason(const DecodeArgs& args, const char* kernel) {
  if (!tensor_core_serves(args.layout.head_dim)) {
    return "head_dim " + std::to_string(args.layout.head_dim) + ": the " + kernel + " serves 64, 128 and 256";
  }
  // token_slots: the copies take each slot's aligned 16-byte windows, none
  // before the cache's start when the pointer is aligned; any even strides.
  if (args.layout.token_slots()) {
    if (reinterpret_cast<std::uintptr_t>(args.cache) % 16 != 0) {
      return std::string("token_slots cache pointer not a multiple of 16 bytes (the ") + kernel +
             " copies aligned 16-byte windows of the slots)";
    }
  } else if (args.layout.block_stride % 16 != 0 || reinterpret_cast<std::uintptr_t>(args.cache) % 16 != 0) {
    return std::string("cache pointer or block_stride not a multiple of 16 bytes (the ") + kernel + " uses 16-byte loads)";
  }
  if (args.layout.block_stride >= (std::int64_t{1} << 31)) {
    return std::string("block_stride of 2 GiB or more (the ") + kernel + " keeps offsets within a block in 32 bits)";
  }
  if (!tensor_core_kernel_runnable()) return std::string("the ") + kernel + " is not compiled for this device in this build";
  return {};
}

}  // namespace

bool token_slots_box_copies(const CacheLayout& layout) {
  return layout.token_slots() && layout.token_stride % 16 == 0 && layout.block_stride % 16 == 0 &&
         (layout.num_kv_heads - 1) * layout.head_stride + layout.slot_bytes() <= layout.token_stride;
}

bool token_slots_bulk_copy(const DecodeArgs& args) {
  const CacheLayout& layout = args.layout;
  return wide_table_kernel(layout.preset, layout.head_dim) && token_slots_box_copies(layout) &&
         reinterpret_cast<std::uintptr_t>(args.cache) % 16 == 0;
}

bool token_slots_read_in_place(const CacheLayout& layout) {
  return layout.token_slots() && layout.head_dim == 128 && layout.block_stride % 16 == 0;
}

bool token_slots_read_rotated(const CacheLayout& layout) {
  return token_slots_read_in_place(layout) && layout.preset == Preset::turboquant_k8v4 && layout.token_stride % 16 == 0;
}

bool token_slots_read_rows(const DecodeArgs& args) {
  const CacheLayout& layout = args.layout;
  const int heads_per_cta = token_slots_row_kv_heads(layout.num_kv_heads);
  return token_slots_read_in_place(layout) && layout.preset != Preset::turboquant_4bit_nc &&
         layout.token_stride % 16 == 0 && layout.head_stride == layout.slot_bytes() &&
         layout.num_kv_heads % heads_per_cta == 0 && heads_per_cta * layout.slot_bytes() % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(args.cache) % 16 == 0 && tensor_core_rows_per_head(args) <= kHeadsPerTile;
}

bool token_slots_read_runs(const DecodeArgs& args) {
  const CacheLayout& layout = args.layout;
  const int kv_heads = layout.num_kv_heads;
  // One kv head: fp8 keys only, whose narrow configuration copies each slot
  // in seven rotated windows per lane; the other presets' narrow loops
  // measured as fast or faster than one-kv-head runs (docs/DESIGN.md).
  const bool one_fp8_head = kv_heads == 1 && layout.preset == Preset::turboquant_k8v4;
  return token_slots_read_in_place(layout) && (kv_heads == 2 || kv_heads == 4 || one_fp8_head) &&
         layout.head_stride == layout.slot_bytes() && layout.token_stride == kv_heads * layout.slot_bytes() &&
         layout.block_size >= kHopperTileTokens && reinterpret_cast<std::uintptr_t>(args.cache) % 16 == 0 &&
         tensor_core_rows_per_head(args) <= kHeadsPerTile;
}

SlotRead token_slots_read(const DecodeArgs& args) {
  if (!args.layout.token_slots()) return SlotRead::none;
  if (token_slots_bulk_copy(args)) return SlotRead::bulk_copies;
  if (token_slots_read_rows(args)) return SlotRead::rows;
  if (token_slots_read_runs(args)) return SlotRead::runs;
  if (token_slots_read_rotated(args.layout)) return SlotRead::rotated;
  return token_slots_read_in_place(args.layout) ? SlotRead::in_place : SlotRead::repacked;
}

std::string hopper_unsupported_reason(const DecodeArgs& args, const DeviceInfo& device) {
  if (device.cc_major != 9 || device.cc_minor != 0) {
    return "device is sm_" + std::to_string(device.cc_major * 10 + device.cc_minor) +
           "; the Hopper kernel needs sm_90";
  }
  return tensor_core_layout_unsupported_reason(args, "Hopper kernel");
}

int narrow_resident_ctas(Preset preset, int group_size, const DeviceInfo& device, int head_dim, bool token_slots) {
  const KernelFootprint footprint = narrow_footprint(preset, group_size, head_dim, token_slots);
  if (footprint.shared_bytes > device.shared_per_block) return 0;
  constexpr int kReservedPerCta = 1024;  // shared memory the system keeps per resident CTA (sm_80 and newer)
  return std::min(footprint.planned_ctas_per_sm, device.shared_per_sm / (footprint.shared_bytes + kReservedPerCta));
}

std::string generic_tensor_core_unsupported_reason(const DecodeArgs& args, const DeviceInfo& device) {
  if (device.cc_major < 8) {
    return "device is sm_" + std::to_string(device.cc_major * 10 + device.cc_minor) + "; the tensor-core kernel needs sm_80 or newer";
  }
  if (std::string layout = tensor_core_layout_unsupported_reason(args, "tensor-core kernel"); !layout.empty()) return layout;
  const bool token_slots = args.layout.token_slots();
  if (narrow_resident_ctas(args.layout.preset, tensor_core_rows_per_head(args), device, args.layout.head_dim,
                           token_slots) == 0) {
    return "the tensor-core kernel's CTA needs " +
           std::to_string(narrow_footprint(args.layout.preset, tensor_core_rows_per_head(args), args.layout.head_dim,
                                           token_slots)
                              .shared_bytes) +
           " bytes of shared memory; the device allows " + std::to_string(device.shared_per_block);
  }
  return {};
}

int generic_query_tokens_per_cta(int group_size, int max_query_len) {
  const int fitting = std::max(1, kGenericMaxRows / std::max(group_size, 1));
  const int tiles = (max_query_len + fitting - 1) / fitting;
  return (max_query_len + tiles - 1) / tiles;
}

}  // namespace tqdecode::cuda
