#!/usr/bin/env python3
"""Per-CTA phase clocks of the Hopper decode kernel (a tuning tool; docs/PERFORMANCE.md quotes them).

Copies this tree to DEST (without build directories) and patches the copy:
thread 0 of every CTA records clock64 at thirteen points of the kernel
(entry, after the wait for the previous kernel, its partition dealt, the
ring about to be built, first tiles issued, rotation done, its own main
loop done, all warps done, the merge's partials stored, its rows'
statistics done, partition written, arrival known, reduction done), the SM
it ran on, and the globaltimer at entry and exit;
tqdecode_bench then prints, after each automatic record, the spread of each
phase over the CTAs of the last call and each CTA's loop by SM. The library
itself is never built this way.

    python3 scripts/phase_clocks.py /tmp/phase
    cmake -S /tmp/phase -B /tmp/phase/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DTQDECODE_TESTS=OFF -DTQDECODE_BENCH=ON -DTQDECODE_PYTHON=OFF -DCMAKE_CUDA_ARCHITECTURES=90a-real
    cmake --build /tmp/phase/build --target tqdecode_bench
    TQDECODE_PROGRAMMATIC_LAUNCH=0 /tmp/phase/build/tqdecode_bench --automatic-only --shapes b1_l32768_g8_bs16_4bit_nc

With programmatic launch off each phase is the CTA's own (with it, early
CTAs wait for the previous call). The patch anchors on the kernel's source
text and fails loudly when that text has changed.
"""
import shutil
import sys
from pathlib import Path

if len(sys.argv) != 2:
    sys.exit(__doc__)
tree = Path(__file__).resolve().parent.parent
root = sys.argv[1]
shutil.copytree(tree, root, ignore=shutil.ignore_patterns("build*", ".git", ".device", "__pycache__"))
kernel_dir = root + '/src/cuda/tensor_core'
def rep(old, new, count=1):
    global s
    assert s.count(old) == count, (old, s.count(old))
    s = s.replace(old, new)
# The recording helpers, in epilogue.cuh (kernel.cuh includes it before its
# own code); every instance in one file, so the kernels and tq_phase share a module.
p = kernel_dir + '/epilogue.cuh'
s = open(p).read()
helpers = r'''
namespace tqdecode::cuda::tensor_core {
#define TQ_SLOTS 20
__device__ long long tq_phase[4096][TQ_SLOTS];
__device__ __forceinline__ long long tq_globaltimer() { long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ int tq_cta() { return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); }
#define TQ_MARK(i) do { if (threadIdx.x == 0 && tq_cta() < 4096) tq_phase[tq_cta()][i] = clock64(); } while (0)
}
'''
i = s.index('namespace tqdecode')
s = s[:i] + helpers + s[i:]
rep("  if (!is_last) return;\n", "  TQ_MARK(7);\n  if (threadIdx.x == 0 && tq_cta() < 4096) tq_phase[tq_cta()][11] = tq_globaltimer();\n  if (!is_last) return;\n  if (threadIdx.x == 0 && tq_cta() < 4096) tq_phase[tq_cta()][9] = 1;\n")
rep("    for (int j = 0; j < kLaneDims; ++j) store_from_float(r.output, r.output_dtype, output + j, value[j]);\n  }\n}\n",
    "    for (int j = 0; j < kLaneDims; ++j) store_from_float(r.output, r.output_dtype, output + j, value[j]);\n  }\n  TQ_MARK(8);\n  if (threadIdx.x == 0 && tq_cta() < 4096) tq_phase[tq_cta()][11] = tq_globaltimer();\n}\n")
rep("  __syncthreads();  // lookup table and rings are dead; the region becomes the merge buffer\n",
    "  __syncthreads();  // lookup table and rings are dead; the region becomes the merge buffer\n  TQ_MARK(5);\n")
# inside the merge: the partials stored, the rows' statistics done
rep("  __syncthreads();\n  // Each row's maximum, weights and sum, once per row",
    "  __syncthreads();\n  TQ_MARK(12);\n  // Each row's maximum, weights and sum, once per row")
rep("  __syncthreads();\n  // The thread's rows kRowBatch at a time",
    "  __syncthreads();\n  TQ_MARK(13);\n  // The thread's rows kRowBatch at a time")
open(p, 'w').write(s)
for instance in Path(kernel_dir, 'instances').glob('*.cu'):
    instance.write_text('// every instance is in all.cu in this profiling copy\n')
p = kernel_dir + '/instances/all.cu'
s = '#include "../kernel.cuh"\nnamespace tqdecode::cuda::tensor_core {\nTQ_TENSOR_CORE_INSTANCES(TQ_TENSOR_CORE_INSTANTIATE)\n}\n'
open(p, 'w').write(s)
p = kernel_dir + '/kernel.cuh'
s = open(p).read()
rep("  extern __shared__ __align__(128) std::uint8_t shared[];\n",
    "  extern __shared__ __align__(128) std::uint8_t shared[];\n  if (threadIdx.x == 0 && tq_cta() < 4096) { tq_phase[tq_cta()][10] = tq_globaltimer(); tq_phase[tq_cta()][9] = 0; tq_phase[tq_cta()][7] = 0; tq_phase[tq_cta()][8] = 0; unsigned sm; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(sm)); tq_phase[tq_cta()][14] = sm; }\n  TQ_MARK(0);\n")
rep("  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel's CTAs may take SMs as this grid's free up\n#endif\n",
    "  cudaTriggerProgrammaticLaunchCompletion();  // the next kernel's CTAs may take SMs as this grid's free up\n#endif\n  TQ_MARK(1);\n")
rep("  if (assigned.idle()) return;  // past its sequence's kMaxPartitions: writes nothing\n",
    "  if (assigned.idle()) return;  // past its sequence's kMaxPartitions: writes nothing\n  TQ_MARK(15);\n")
rep("    TileRing<Shape, Shared> ring(", "    TQ_MARK(16);\n    TileRing<Shape, Shared> ring(")
# after the loop issuing the ring's first tiles
rep("    ring.issue_first_tiles();\n", "    ring.issue_first_tiles();\n    TQ_MARK(2);\n")
rep("    if constexpr (kBulkCopy) fence_proxy_async_shared();  // the copy engine overwrites the query bits next\n    __syncthreads();\n",
    "    if constexpr (kBulkCopy) fence_proxy_async_shared();  // the copy engine overwrites the query bits next\n    __syncthreads();\n    TQ_MARK(3);\n")
rep("    if constexpr (!kBulkCopy) cp_async_wait<0>();\n", "    if constexpr (!kBulkCopy) cp_async_wait<0>();\n    TQ_MARK(4);\n")
rep("  if (num_partitions == 1) return;  // the merge wrote the output\n",
    "  TQ_MARK(6);\n  if (threadIdx.x == 0 && tq_cta() < 4096) tq_phase[tq_cta()][11] = tq_globaltimer();\n"
    "  if (num_partitions == 1) return;  // the merge wrote the output\n")
open(p, 'w').write(s)
p = kernel_dir + '/instances/all.cu'
s = open(p).read()
s += r'''
#include <algorithm>
#include <cstdio>
#include <vector>
namespace tqdecode::cuda {
void dump_phase_times(int ctas) {
  std::vector<long long> h(4096 * TQ_SLOTS);
  cudaMemcpyFromSymbol(h.data(), tensor_core::tq_phase, h.size() * sizeof(long long));
  ctas = 0;
  while (ctas < 4096 && h[ctas * TQ_SLOTS + 10] != 0) ++ctas;
  if (ctas == 0) { std::printf("  no phase records\n"); return; }
  long long t0 = h[10], t1 = h[11];
  for (int c = 0; c < ctas; ++c) { t0 = std::min(t0, h[c * TQ_SLOTS + 10]); t1 = std::max(t1, h[c * TQ_SLOTS + 11]); }
  std::printf("  phases over %d CTAs: globaltimer span %.2f us (first start to last end)\n", ctas, (t1 - t0) / 1e3);
  const char* names[] = {"entry", "after wait", "first tiles issued", "rotation done (loop start)", "own loop end", "all warps done",
                         "partition written", "arrival known", "reduction done"};
  // Cycles from mark `from` to mark `to` over the CTAs that recorded both (the reduction: the reducing CTAs only).
  const auto spread = [&](const char* name, int from, int to) {
    std::vector<double> d;
    for (int c = 0; c < ctas; ++c) {
      const long long* r = &h[c * TQ_SLOTS];
      if (to == 8 && r[9] != 1) continue;
      if (r[to] != 0 && r[from] != 0) d.push_back(double(r[to] - r[from]));
    }
    if (d.empty()) return;
    std::sort(d.begin(), d.end());
    std::printf("  %-32s cycles: min %7.0f median %7.0f max %7.0f (n %zu)\n", name, d.front(), d[d.size() / 2], d.back(), d.size());
  };
  for (int ph = 1; ph <= 8; ++ph) spread(names[ph], ph - 1, ph);
  spread("  deal (after wait -> dealt)", 1, 15);
  spread("  setup (dealt -> ring built)", 15, 16);
  spread("  issue (ring built -> issued)", 16, 2);
  spread("  merge: partials stored", 5, 12);
  spread("  merge: row statistics", 12, 13);
  spread("  merge: sums, partition written", 13, 6);
  std::vector<double> starts, ends;
  for (int c = 0; c < ctas; ++c) { starts.push_back((h[c * TQ_SLOTS + 10] - t0) / 1e3); ends.push_back((h[c * TQ_SLOTS + 11] - t0) / 1e3); }
  std::sort(starts.begin(), starts.end()); std::sort(ends.begin(), ends.end());
  std::printf("  start (us after first): min %.2f median %.2f max %.2f; end: min %.2f median %.2f max %.2f\n", starts.front(),
              starts[starts.size() / 2], starts.back(), ends.front(), ends[ends.size() / 2], ends.back());
  // Each CTA's own loop (mark 3 to 4) in kilocycles, by the SM it ran on: the
  // same SMs slow in every shape point at the SM's place on the chip, not its work.
  std::vector<std::pair<long long, double>> by_sm;
  for (int c = 0; c < ctas; ++c) by_sm.emplace_back(h[c * TQ_SLOTS + 14], (h[c * TQ_SLOTS + 4] - h[c * TQ_SLOTS + 3]) / 1e3);
  std::sort(by_sm.begin(), by_sm.end());
  std::printf("  own loop by SM (smid:kcycles):");
  for (std::size_t i = 0; i < by_sm.size(); ++i) std::printf("%s%lld:%.0f", i % 16 ? " " : "\n   ", by_sm[i].first, by_sm[i].second);
  std::printf("\n");
  double cyc = 0, ns = 0;
  for (int c = 0; c < ctas; ++c) { const long long* r = &h[c * TQ_SLOTS]; long long last = r[9] == 1 ? r[8] : r[7] != 0 ? r[7] : r[6]; cyc += last - r[0]; ns += r[11] - r[10]; }
  std::printf("  clock: %.3f cycles per ns (CTA clocks over globaltimer)\n", cyc / ns);
  std::fill(h.begin(), h.end(), 0LL);
  cudaMemcpyToSymbol(tensor_core::tq_phase, h.data(), h.size() * sizeof(long long));
}
}  // namespace tqdecode::cuda
'''
open(p, 'w').write(s)
b = root + '/bench/tqdecode_bench.cu'
s = open(b).read()
rep("  record.single = time_single_steps(graphs, flush, stream);\n",
    "  record.single = time_single_steps(graphs, flush, stream);\n  std::printf(\"%s: %.2f us\\n\", record.request.c_str(), record.single.median_us);\n  tqdecode::cuda::dump_phase_times(4096);\n")
i = s.index('namespace tqbench {')
s = s[:i] + 'namespace tqdecode::cuda { void dump_phase_times(int ctas); }\n' + s[i:]
open(b, 'w').write(s)
print(f"patched copy in {root}")
