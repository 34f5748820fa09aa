#!/usr/bin/env bash
# Reliability checks of the CPU code (docs/RELIABILITY.md): builds tqdecode
# with clang, ASan and UBSan in ./build-sanitize (CUDA off, fuzz targets on),
# runs the CPU test suite under the sanitizers, then fuzzes store and decode
# for FUZZ_SECONDS (default 60) from the committed seed corpus. Fails on any
# test failure, sanitizer report, crash, leak or fuzzer finding (the input is
# kept in build-sanitize/fuzz-artifacts/). Installs clang, its libFuzzer
# runtime and the other build tools (Debian packages) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh

FUZZ_SECONDS="${FUZZ_SECONDS:-60}"
start=$SECONDS

ensure_packages cmake:cmake ninja:ninja-build clang++:clang /usr/include/gtest/gtest.h:libgtest-dev
clang_major="$(clang++ -dumpversion | cut -d. -f1)"
ensure_packages "$(clang++ -print-resource-dir)/lib/linux/libclang_rt.fuzzer-x86_64.a:libclang-rt-${clang_major}-dev"

echo "== reliability: configure and build (clang ${clang_major}, ASan + UBSan, libFuzzer) in build-sanitize/"
cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=clang++ \
  -DTQDECODE_CUDA=OFF -DTQDECODE_FUZZ=ON -DTQDECODE_SANITIZE=ON -DTQDECODE_BENCH=OFF >/dev/null
cmake --build build-sanitize --parallel "$(nproc)"

# Any sanitizer report fails the run (UBSan is built with -fno-sanitize-recover).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

echo "== reliability: CPU tests under ASan + UBSan ($((SECONDS - start)) s so far)"
ctest --test-dir build-sanitize --output-on-failure -j2

echo "== reliability: fuzzing store and decode for ${FUZZ_SECONDS} s ($((SECONDS - start)) s so far)"
work=build-sanitize/fuzz-corpus       # the committed seeds plus what this run finds
artifacts=build-sanitize/fuzz-artifacts/
log=build-sanitize/fuzz.log
mkdir -p "$work" "$artifacts"
status=0
TQDECODE_FUZZ_STATS=1 build-sanitize/tests/fuzz/fuzz_decode_store -max_total_time="$FUZZ_SECONDS" -timeout=10 \
  -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$artifacts" "$work" tests/fuzz/corpus \
  >"$log" 2>&1 || status=$?
if [ "$status" -ne 0 ] || grep -qE "ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|runtime error:" "$log"; then
  tail -n 60 "$log"
  echo "reliability: FAILED: the fuzzer reported a finding (exit $status); input in $artifacts, log in $log"
  exit 1
fi
grep -E "^(#[0-9]+[[:space:]]+DONE|stat::number_of_executed_units|stat::peak_rss_mb|fuzz_decode_store stats)" "$log" || true
echo "reliability: passed in $((SECONDS - start)) s (fuzzing log: $log)"
