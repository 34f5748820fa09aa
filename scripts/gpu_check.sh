#!/usr/bin/env bash
# Builds everything (C++ tests, CLI, benchmarks, PyTorch binding when torch is
# importable) on a GPU machine and runs every GPU check, writing one log per
# step into LOG_DIR (default ./gpu-logs):
#   gpu_tests.log   all GoogleTest suites (GPU tests run for real; the GPU
#                   suite in GPU_TEST_SHARDS processes at once, default 8 on
#                   machines of 16 cores or more, else 4)
#   sanitizer.log   compute-sanitizer memcheck + racecheck on every CTA shape
#                   (split grids), beside the GPU suite's shards
#   pytest.log      the PyTorch binding tests
#   install.log     examples/find_package built against a fresh install and run (its GPU branch)
#   demo.txt        tqdecode demo
# Set GTEST_SOURCE to a GoogleTest source tree on machines without libgtest-dev,
# CUDA_ARCHITECTURES to build for fewer architectures (e.g. 90a-real: a
# shorter build on an H100/H200), SANITIZERS=0 to leave out the
# compute-sanitizer step (the longest) and PYTEST_ARGS to narrow the binding's
# tests (e.g. "-k cuda").
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${LOG_DIR:-gpu-logs}
mkdir -p "$LOG_DIR"
command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"

python_flag=-DTQDECODE_PYTHON=OFF
python3 -c "import torch" 2>/dev/null && python_flag=-DTQDECODE_PYTHON=ON
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTQDECODE_TESTS=ON -DTQDECODE_BENCH=ON $python_flag \
  ${GTEST_SOURCE:+-DTQDECODE_GTEST_SOURCE_DIR=$GTEST_SOURCE} \
  ${CUDA_ARCHITECTURES:+-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES} >"$LOG_DIR/build.log" 2>&1 &&
  cmake --build build --parallel "$(nproc)" >>"$LOG_DIR/build.log" 2>&1 || { tail -40 "$LOG_DIR/build.log"; exit 1; }

status=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; ./build/tqdecode demo; } >"$LOG_DIR/demo.txt" 2>&1 || status=1
./build/tests/tqdecode_cpu_tests --gtest_brief=1 >"$LOG_DIR/gpu_tests.log" 2>&1 || status=1
# Every CTA shape on a split grid (CtaShapes), lengths past the block table,
# graph replay, the stores; query rows in row tiles (group 16 at D = 256);
# several query tokens per sequence: inconsistent offsets, 32 rows (two row
# tiles of the tensor-core kernel, one query tile of the scalar kernel),
# 8-warp CTAs (D = 256, 32 rows), replay (four head tiles on the Hopper
# path); memcheck also four head tiles at group 1.
# Racecheck leaves out the cases whose scalar-kernel merge (16 and 32 rows)
# draws its false report (docs/RELIABILITY.md, resolved findings).
small='DecodeGpuQuery.*:Split/CtaShapes.*:DecodeGpuArguments.LengthsPast*:Grid/DecodeGpu.*/q4_d64:DecodeGpuGraph.*:StoreGpu*'
small+=':Grid/DecodeGpu.*/q4_d256_g16_row_tiles:Grid/VarlenGpu.*/q4_d128_g8_spec4:VarlenGpuGraph.*'
memcheck_only=':VarlenGpuArguments.*:DecodeGpuArguments.PlansKey*:DecodeGpuPool.AGrowth*:Grid/VarlenGpu.*/k3v4_nc_d256_g16:Grid/VarlenGpu.*/q4_d128_g1_hk8_four_head_tiles'
# The sanitizers run beside the GPU suite's shards: most of their time is
# the tools' host work, and the GPU has room for both.
rm -f "$LOG_DIR/sanitizer.log"
sanitizer_pid=
if [ "${SANITIZERS:-1}" != 0 ]; then
  {
    compute-sanitizer --tool memcheck --error-exitcode 9 ./build/tests/tqdecode_gpu_tests \
      --gtest_filter="$small$memcheck_only" >>"$LOG_DIR/sanitizer.log" 2>&1 &&
      compute-sanitizer --tool racecheck --error-exitcode 9 ./build/tests/tqdecode_gpu_tests --gtest_filter="$small" \
        >>"$LOG_DIR/sanitizer.log" 2>&1
  } &
  sanitizer_pid=$!
fi
# The GPU suite in GPU_TEST_SHARDS shards side by side: most of its time is
# host work (the caches' encoding, the CPU reference), so the shards use the
# machine's cores.
shards=${GPU_TEST_SHARDS:-$(($(nproc) >= 16 ? 8 : 4))}
pids=()
for ((shard = 0; shard < shards; ++shard)); do
  GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard ./build/tests/tqdecode_gpu_tests \
    >"$LOG_DIR/gpu_tests_shard$shard.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat "$LOG_DIR"/gpu_tests_shard*.log >>"$LOG_DIR/gpu_tests.log" && rm -f "$LOG_DIR"/gpu_tests_shard*.log
if [ -n "$sanitizer_pid" ]; then wait "$sanitizer_pid" || status=1; fi
ctest --test-dir build -R install.find_package --output-on-failure -V >"$LOG_DIR/install.log" 2>&1 || status=1
if [ "$python_flag" = -DTQDECODE_PYTHON=ON ]; then
  if python3 -c "import pytest" 2>/dev/null; then
    # shellcheck disable=SC2086 # PYTEST_ARGS is split into arguments on purpose
    PYTHONPATH="$PWD/python" python3 -m pytest -p no:cacheprovider -q -rs ${PYTEST_ARGS:-} python/tests \
      >"$LOG_DIR/pytest.log" 2>&1 || status=1
  else
    PYTHONPATH="$PWD/python" python3 -m unittest discover -s python/tests >"$LOG_DIR/pytest.log" 2>&1 || status=1
  fi
fi
grep -hE "^\[  (PASSED|FAILED|SKIPPED) |tests? (passed|failed)|ERROR SUMMARY|passed|failed" "$LOG_DIR"/*.log | sort | uniq -c | head -40
exit $status
