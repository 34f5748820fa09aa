#!/usr/bin/env python3
"""A/B of one source file's variants in one GPU session (a tuning tool).

Builds tqdecode_bench once per variant of SOURCE in an existing build
directory (each variant copied over SOURCE, then an incremental build: one
object and the link, not a tree per variant), restores SOURCE, then runs the
variants' benchmarks interleaved for --rounds rounds on the same GPU and
prints each (shape, request)'s median single-step time per variant and its
ratio to the first variant. The tree's own SOURCE is the variant "tree";
other variants are files named on the command line (label: the file's stem).

    python3 scripts/ab_bench.py --build build --shapes b16_l32768_g8_bs16_4bit_nc_qlen8 \\
      --source src/cuda/tensor_core/warp_specialized.cuh /tmp/slots4.cuh /tmp/refill.cuh

The numbers are tqdecode_bench's single steps (one decode per CUDA-graph
replay, L2 flushed before each); the record stays `bench/run_bench.py`'s.
--dry-run builds the variants and runs tqdecode_bench --dry-run (no GPU).
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_variants(build: Path, source: Path, variants: dict, out: Path) -> dict:
    """label -> the tqdecode_bench binary built with that variant of `source`."""
    original = source.read_bytes()
    binaries = {}
    try:
        for label, text in variants.items():
            source.write_bytes(text)
            subprocess.run(["cmake", "--build", str(build), "--target", "tqdecode_bench"], check=True,
                           stdout=subprocess.DEVNULL)
            binaries[label] = out / f"tqdecode_bench_{label}"
            shutil.copy2(build / "tqdecode_bench", binaries[label])
    finally:
        source.write_bytes(original)  # a newer time than the last build's: the next build is the tree's again
    return binaries


def run_rounds(binaries: dict, shapes: str, rounds: int, out: Path, dry_run: bool) -> dict:
    """(shape, request) -> label -> single-step times (us), one per round."""
    times = {}
    for round_index in range(rounds):
        for label, binary in binaries.items():
            json_path = out / f"{label}_{round_index}.json"
            command = [str(binary), "--shapes", shapes]
            command += ["--dry-run"] if dry_run else ["--json", str(json_path)]
            log = out / f"{label}_{round_index}.log"
            with log.open("w") as stream:
                result = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT)
            if result.returncode != 0:
                sys.exit(f"ab_bench.py: {label} round {round_index} exited {result.returncode} (log {log})")
            if dry_run:
                continue
            for record in json.loads(json_path.read_text())["records"]:
                if record.get("status") == "ok":
                    key = (record["name"], record["request"])
                    times.setdefault(key, {}).setdefault(label, []).append(record["tq_us"])
    return times


def print_table(times: dict, labels: list, rounds: int, out: Path):
    """One row per (shape, request): each variant's median and its ratio to the first variant's."""
    print(f"{'shape':52} {'request':24} " + " ".join(f"{label:>16}" for label in labels))
    for (name, request), by_label in sorted(times.items()):
        first = statistics.median(by_label[labels[0]]) if labels[0] in by_label else None
        cells = []
        for label in labels:
            if label not in by_label:
                cells.append(f"{'-':>16}")
                continue
            median = statistics.median(by_label[label])
            ratio = f" {median / first:.3f}" if first else ""
            cells.append(f"{median:>10.2f}{ratio:>6}")
        print(f"{name:52} {request:24} " + " ".join(cells))
    print(f"medians of {rounds} rounds (us; ratio to {labels[0]}); JSON and logs in {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", type=Path, default=ROOT / "build", help="a configured build directory")
    parser.add_argument("--source", type=Path, required=True, help="the file the variants replace")
    parser.add_argument("--shapes", required=True, help="tqdecode_bench --shapes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, help="keep the binaries, JSON and logs here [a temporary directory]")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("variants", nargs="+", type=Path, help="files whose text replaces SOURCE")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds: at least 1")
    source = args.source if args.source.is_absolute() else ROOT / args.source
    if not source.is_file():
        parser.error(f"--source: no file {source}")
    if not (args.build / "CMakeCache.txt").is_file():
        parser.error(f"--build: {args.build} is not a configured build directory (run scripts/build.sh or cmake)")
    variants = {"tree": source.read_bytes()}
    for path in args.variants:
        if path.stem in variants:
            parser.error(f"variant {path}: the label {path.stem} is taken (labels are the files' stems)")
        variants[path.stem] = path.read_bytes()
    out = args.out or Path(tempfile.mkdtemp(prefix="ab_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    binaries = build_variants(args.build, source, variants, out)
    times = run_rounds(binaries, args.shapes, args.rounds, out, args.dry_run)
    if args.dry_run:
        print(f"built and planned {', '.join(binaries)}; logs in {out}")
        return
    print_table(times, list(binaries), args.rounds, out)


if __name__ == "__main__":
    main()
