#!/usr/bin/env python3
"""Per-role clocks of the warp-specialized kernel (a tuning tool; docs/PERFORMANCE.md, issue 30's row).

Copies this tree to DEST (without build directories) and patches the copy:
lane 0 of the first warp of each role (the two producer warpgroups, the two
consumer warpgroups) adds up clock intervals of its tile loop:
  producer: the wait for the tile's input stage, the wait for its ring
            slot's release, the dequantization (to its full-barrier
            arrival), the refill (the wait for the stage's reads and the
            next copies' issue, on the warp's turns: every fourth
            tile of its group);
  consumer: the wait for the slot's full barrier, S = Q K^T (fence to
            wait), the softmax, O = P V' (fence to wait);
and the whole loop and its tile count. tqdecode_bench then prints, after
each single-step record that ran the kernel, the median over the CTAs of
each interval in cycles per tile of that role, so the role that sets the
tile period and what it waits on can be read off. The library itself is
never built this way; clock reads between the waits perturb the timing a
little.

    python3 scripts/role_clocks.py /tmp/roles
    cmake -S /tmp/roles -B /tmp/roles/build -G Ninja -DCMAKE_BUILD_TYPE=Release \\
      -DTQDECODE_TESTS=OFF -DTQDECODE_BENCH=ON -DTQDECODE_PYTHON=OFF -DCMAKE_CUDA_ARCHITECTURES=90a-real
    cmake --build /tmp/roles/build --target tqdecode_bench
    /tmp/roles/build/tqdecode_bench --automatic-only --shapes b16_l32768_g8_bs16_4bit_nc_qlen8

The patch anchors on the kernel's source text and fails loudly when that
text has changed.
"""
import shutil
import sys
from pathlib import Path

if len(sys.argv) != 2:
    sys.exit(__doc__)
tree = Path(__file__).resolve().parent.parent
root = Path(sys.argv[1])
shutil.rmtree(root, ignore_errors=True)  # a rerun on the same machine starts from the tree again
shutil.copytree(tree, root, ignore=shutil.ignore_patterns("build", "build-*", ".git", ".device", ".venv", "__pycache__"))
kernel = root / "src/cuda/tensor_core/warp_specialized.cuh"
launcher = root / "src/cuda/tensor_core/warp_specialized.cu"
bench = root / "bench/tqdecode_bench.cu"


def patch(path, pairs):
    text = path.read_text()
    for old, new in pairs:
        if text.count(old) != 1:
            sys.exit(f"role_clocks.py: {path.name}: expected one occurrence of:\n{old}\nfound {text.count(old)}")
        text = text.replace(old, new)
    path.write_text(text)


# Slots per CTA: 8 per role (producer groups 0 and 1, then consumers 0 and 1).
helpers = r'''
namespace tqdecode::cuda::tensor_core::specialized {
inline constexpr int kRoleSlots = 8, kRoleCtas = 4096;
__device__ long long role_clocks[kRoleCtas][4 * kRoleSlots + 1];
__device__ __forceinline__ int role_cta() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
// The 32-bit SM clock: intervals and their sums over a CTA's loop fit, and take half the registers of clock64.
__device__ __forceinline__ unsigned role_clock() {
  unsigned t;
  asm volatile("mov.u32 %0, %%clock;" : "=r"(t));
  return t;
}
// Lane 0 of the role's first warp writes its sums: slot k of role `role`.
__device__ __forceinline__ void role_record(int role, const unsigned (&sums)[kRoleSlots]) {
  const int cta = role_cta();
  if (cta >= kRoleCtas) return;
  for (int k = 0; k < kRoleSlots; ++k) role_clocks[cta][kRoleSlots * role + k] = sums[k];
  if (role == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    role_clocks[cta][4 * kRoleSlots] = sm + 1;  // 0: the CTA did not run the loop
  }
}
}  // namespace tqdecode::cuda::tensor_core::specialized
'''

patch(kernel, [
    ('namespace tqdecode::cuda::tensor_core::specialized {\n\ninline constexpr int kHeadDim = 128;',
     helpers + '\nnamespace tqdecode::cuda::tensor_core::specialized {\n\ninline constexpr int kHeadDim = 128;'),
    # producer: input wait, empty wait, dequantization, refill; the loop and its tiles
    ('''  for (int tile = group; tile < tiles; tile += kProducerGroups) {
    const int first = work.range.begin + tile * kTileTokens + kBoxTokens * warp;''',
     '''  unsigned role_sums[kRoleSlots] = {};
  const unsigned loop_start = role_clock();
  for (int tile = group; tile < tiles; tile += kProducerGroups) {
    const int first = work.range.begin + tile * kTileTokens + kBoxTokens * warp;
    const unsigned t0 = role_clock();'''),
    ('''    mbarrier_wait_parity(barriers.input(stage), stage_parity);
    if (tile >= L::kSlots) {''',
     '''    mbarrier_wait_parity(barriers.input(stage), stage_parity);
    const unsigned t1 = role_clock();
    if (tile >= L::kSlots) {'''),
    ('''    const std::uint8_t* input = shared + L::kInput + stage * L::kStageBytes;''',
     '''    const unsigned t2 = role_clock();
    const std::uint8_t* input = shared + L::kInput + stage * L::kStageBytes;'''),
    ('''    mbarrier_arrive(barriers.full(tile % L::kRingBarriers));''',
     '''    mbarrier_arrive(barriers.full(tile % L::kRingBarriers));
    const unsigned t3 = role_clock();'''),
    ('''      issue(tile + L::kStages, stage, blocks);
    }
  }
}''',
     '''      issue(tile + L::kStages, stage, blocks);
    }
    const unsigned t4 = role_clock();
    role_sums[0] += t1 - t0, role_sums[1] += t2 - t1, role_sums[2] += t3 - t2, role_sums[3] += t4 - t3;
    ++role_sums[5];
  }
  role_sums[4] = role_clock() - loop_start;
  if (warp == 0 && lane == 0) role_record(group, role_sums);
}'''),
    # consumer: full wait, S, softmax, O; the loop and its tiles
    ('''  const std::uint32_t ring_low = descriptor_low(barriers.slot_address(0));
  for (int tile = SharedTiles ? 0 : consumer; tile < tiles; tile += kStep) {''',
     '''  const std::uint32_t ring_low = descriptor_low(barriers.slot_address(0));
  unsigned role_sums[kRoleSlots] = {};
  const unsigned loop_start = role_clock();
  for (int tile = SharedTiles ? 0 : consumer; tile < tiles; tile += kStep) {
    const unsigned t0 = role_clock();'''),
    ('''    mbarrier_wait_parity(barriers.full(ring_barrier), (tile / L::kRingBarriers) & 1u);''',
     '''    mbarrier_wait_parity(barriers.full(ring_barrier), (tile / L::kRingBarriers) & 1u);
    const unsigned t1 = role_clock();'''),
    ('''    keep(score);
    std::uint32_t probability[4][4];''',
     '''    keep(score);
    const unsigned t2 = role_clock();
    std::uint32_t probability[4][4];'''),
    ('''    // O = P V': k-step kt takes tokens 16 kt ..
    wgmma_fence();''',
     '''    const unsigned t3 = role_clock();
    // O = P V': k-step kt takes tokens 16 kt ..
    wgmma_fence();'''),
    ('''    keep_words(probability);
    mbarrier_arrive(barriers.empty(ring_barrier));
  }
}''',
     '''    keep_words(probability);
    const unsigned t4 = role_clock();
    mbarrier_arrive(barriers.empty(ring_barrier));
    role_sums[0] += t1 - t0, role_sums[1] += t2 - t1, role_sums[2] += t3 - t2, role_sums[3] += t4 - t3;
    ++role_sums[5];
  }
  role_sums[4] = role_clock() - loop_start;
  if (wg_warp == 0 && lane == 0) role_record(kProducerGroups + consumer, role_sums);
}'''),
])

dump = r'''
#include <algorithm>
#include <cstdio>
#include <vector>
namespace tqdecode::cuda {
// Medians over the CTAs that ran the loop, in cycles per tile of each role; then cleared.
void dump_role_clocks() {
  namespace ws = tensor_core::specialized;
  constexpr int kRow = 4 * ws::kRoleSlots + 1;
  std::vector<long long> h(ws::kRoleCtas * kRow);
  if (cudaMemcpyFromSymbol(h.data(), ws::role_clocks, h.size() * sizeof(long long)) != cudaSuccess) {
    std::printf("  role clocks: reading the record failed\n");
    return;
  }
  std::vector<int> ctas;
  for (int c = 0; c < ws::kRoleCtas; ++c)
    if (h[c * kRow + 4 * ws::kRoleSlots] != 0) ctas.push_back(c);
  if (ctas.empty()) return;
  const char* names[2][4] = {{"input wait", "slot wait", "dequantize", "refill"},
                             {"full wait", "S = Q K^T", "softmax", "O = P V'"}};
  std::printf("  role clocks over %zu CTAs (median cycles per tile of the role; loop = the whole loop / tiles):\n",
              ctas.size());
  for (int role = 0; role < 4; ++role) {
    const int base = ws::kRoleSlots * role;
    std::vector<double> per_tile[5], tiles;
    for (int c : ctas) {
      const long long* r = &h[c * kRow + base];
      if (r[5] == 0) continue;
      for (int k = 0; k < 5; ++k) per_tile[k].push_back(double(r[k]) / double(r[5]));
      tiles.push_back(double(r[5]));
    }
    if (tiles.empty()) continue;
    const auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    std::printf("    %s %d (%.0f tiles):", role < 2 ? "producer" : "consumer", role % 2, median(tiles));
    for (int k = 0; k < 4; ++k) std::printf(" %s %.0f,", names[role / 2][k], median(per_tile[k]));
    std::printf(" loop %.0f\n", median(per_tile[4]));
  }
  std::fill(h.begin(), h.end(), 0LL);
  // The copy runs on the legacy stream, which the bench's stream does not wait for: done before the next run.
  if (cudaMemcpyToSymbol(ws::role_clocks, h.data(), h.size() * sizeof(long long)) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    std::printf("  role clocks: clearing the record failed\n");
  }
}
}  // namespace tqdecode::cuda
'''
launcher.write_text(launcher.read_text() + dump)

patch(bench, [
    ("  record.single = time_single_steps(graphs, flush, stream);\n",
     "  record.single = time_single_steps(graphs, flush, stream);\n"
     "  std::printf(\"%s: %.2f us\\n\", record.request.c_str(), record.single.median_us);\n"
     "  tqdecode::cuda::dump_role_clocks();\n"),
    ("namespace tqbench {", "namespace tqdecode::cuda { void dump_role_clocks(); }\nnamespace tqbench {"),
])
print(f"patched copy in {root}")
