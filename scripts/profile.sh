#!/usr/bin/env bash
# Profiles one launch of the Hopper decode kernel with Nsight Compute on a GPU
# machine, for one benchmark shape (bench/shapes.json), and writes to LOG_DIR
# (default ./gpu-logs):
#   ncu_<shape>.ncu-rep   the full report (ncu --import to browse it)
#   ncu_<shape>.txt       speed of light, occupancy, scheduler and warp-state
#                         statistics, with the stall reasons per issued instruction
#   ncu_<shape>_sass.csv  per-SASS-instruction stall samples (source page)
# Usage: scripts/profile.sh [shape]   (default b16_l32768_g8_bs16_4bit_nc)
# KERNEL: a regex of the kernel's name (default decode_kernel, the tensor-core
# kernel; warp_specialized_partitions for the several-query-token kernel).
# Needs build/tqdecode_bench (python3 bench/run_bench.py --build build builds it).
set -euo pipefail
cd "$(dirname "$0")/.."
shape=${1:-b16_l32768_g8_bs16_4bit_nc}
LOG_DIR=${LOG_DIR:-gpu-logs}
mkdir -p "$LOG_DIR"
report="$LOG_DIR/ncu_$shape"
# --clock-control none: the boost clock the benchmark runs at, not ncu's base clock.
# --cache-control none: L2 keeps what the benchmark's replays leave there (the
# rotation matrix, queries, block tables), as in the timed runs; the cache
# itself is rotated over more than L2 either way.
ncu --clock-control none --cache-control none --set full --import-source yes \
  --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active \
  -k "regex:${KERNEL:-decode_kernel}" -c 1 -f -o "$report" ./build/tqdecode_bench --shapes "$shape" >"$report.log" 2>&1
ncu --import "$report.ncu-rep" --page details >"$report.txt"
ncu --import "$report.ncu-rep" --page source --print-source sass --csv >"${report}_sass.csv" ||
  echo "no per-SASS export from this ncu version; open $report.ncu-rep instead" >&2
grep -E "Duration|DRAM Throughput|Issued Warp|Eligible Warps|Active Warps Per|stalled_.*ratio" "$report.txt" || true
