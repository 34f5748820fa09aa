#!/usr/bin/env python3
"""The one benchmark command: run tqdecode_bench and the bf16 baseline on this
GPU, merge them, evaluate the performance targets, and write DIR/results.json
and DIR/RESULTS.md (plus each program's JSON and log).

    python3 bench/run_bench.py --build build --out DIR [--quick]

On a machine that runs a copy of the working tree whose git metadata may be
stale, pass --commit. A run recorded under the wrong commit is corrected with
--relabel-commit SHA --out DIR: it merges the programs' JSON already in DIR
again under SHA, keeping the run's date, command and driver, and says so.

It builds the tqdecode_bench target in --build first (configuring that
directory if it has no CMakeCache.txt), so the binary measured is the working
tree's. Every number in the outputs comes from the two programs; this script
only combines them.
"""
import argparse
import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# The performance issue's targets, keyed by (B, L) for the headline config.
LARGE = {(16, 32768), (64, 8192), (128, 4096), (32, 131072)}
LATENCY_US = {(1, 4096): 10.0, (1, 32768): 16.0}
HEADLINE = {"preset": "turboquant_4bit_nc", "Hq": 64, "Hk": 8, "D": 128, "block_size": 16}
REFERENCE_BL = (16, 32768)


def run_logged(command, log_path, echo=True):
    """Runs `command`, saving its output to `log_path` (and echoing it); returns the exit code."""
    print("+", shlex.join(str(c) for c in command), f"  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for line in process.stdout:
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()
            log.write(line)
        return process.wait()


def fail_with_log(message, log_path):
    lines = Path(log_path).read_text(errors="replace").splitlines()
    sys.exit("\n".join(lines[-40:]) + f"\nrun_bench: {message} (full log: {log_path})")


def git_commit():
    """HEAD of the working tree ('-dirty' when it has changes), or 'unknown' without git or commits."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        # Read-only (unlike git status, git diff never rewrites the index); exit code 1 means changes.
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True).returncode == 1
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty else "")


def driver_release():
    """The kernel driver's version (e.g. 580.159.04); the CUDA programs report the CUDA version it supports."""
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return query.stdout.strip().splitlines()[0] if query.stdout.strip() else "unknown"


def build(build_dir, out_dir):
    if not (build_dir / "CMakeCache.txt").exists():
        # Tests off: the benchmark machine may lack GTest, and they are not needed here.
        if run_logged(["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                       "-DTQDECODE_TESTS=OFF"], out_dir / "configure.log", echo=False):
            fail_with_log(f"configuring {build_dir} failed", out_dir / "configure.log")
    # Compiler output goes to the log only: the console keeps the measurements.
    if run_logged(["cmake", "--build", build_dir, "--target", "tqdecode_bench"], out_dir / "build.log", echo=False):
        fail_with_log("building tqdecode_bench failed", out_dir / "build.log")


def load_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def config_key(record):
    return tuple(record[k] for k in ("preset", "B", "L", "Hq", "Hk", "D", "block_size", "request"))


def is_headline(record, **overrides):
    want = {**HEADLINE, **overrides}
    return all(record[k] == v for k, v in want.items())


def evaluate(record, by_key):
    """The issue's targets that apply to this record: [(target text, met: bool or None)].
    Ratios print with three decimals, so a miss never shows as its threshold."""
    bl = (record["B"], record["L"])
    automatic = record["request"] == "automatic"
    targets = []
    if record.get("tq_us") is None:
        return targets
    frac = record["tq_tbps"] / record["read_tbps"]
    if automatic and is_headline(record) and bl in LARGE:
        targets.append((f"tq_tbps >= 0.8 x read ({frac:.3f})", frac >= 0.8))
        speedup = record.get("speedup_vs_bf16")
        targets.append((f"speedup >= 3.0 ({speedup:.3f})" if speedup else "speedup >= 3.0 (no bf16 time)",
                        speedup >= 3.0 if speedup else None))
    if automatic and is_headline(record) and bl in LATENCY_US:
        limit = LATENCY_US[bl]
        targets.append((f"tq_us <= {limit:g} ({record['tq_us']:.2f})", record["tq_us"] <= limit))
    if automatic and bl == REFERENCE_BL and record["preset"] == HEADLINE["preset"] and not is_headline(record):
        reference = by_key.get(config_key({**record, **HEADLINE}))
        if reference and reference.get("tq_tbps"):
            ratio = record["tq_tbps"] / reference["tq_tbps"]
            targets.append((f"tq_tbps >= 0.9 x g8/bs16 ({ratio:.3f})", ratio >= 0.9))
        else:
            targets.append(("tq_tbps >= 0.9 x g8/bs16 (no reference)", None))
    generic_headline = record["request"] == "cuda_generic" and is_headline(record)
    other_preset = automatic and record["preset"] != HEADLINE["preset"] and is_headline(record, preset=record["preset"])
    if bl == REFERENCE_BL and (generic_headline or other_preset):
        targets.append((f"tq_tbps >= 0.6 x read ({frac:.3f})", frac >= 0.6))
    return targets


def merge(tq, bf16, commit):
    bf16_by_name = {r["name"]: r for r in (bf16 or {}).get("records", [])}
    records = []
    for r in (tq or {}).get("records", []):
        b = bf16_by_name.get(r["name"], {})
        bf16_us = b.get("best_us")
        merged = {
            "name": r["name"], "preset": r["preset"], "B": r["B"], "L": r["L"], "Hq": r["Hq"], "Hk": r["Hk"],
            "D": r["D"], "block_size": r["block_size"], "request": r["request"], "path": r["path"],
            "kernel": r.get("kernel", ""),
            "instances": r["instances"], "partitions": r["partitions"],
            "tq_us": r["tq_us"], "bf16_us": bf16_us, "bf16_impl": b.get("best_impl"),
            "copy_tbps": r["copy_tbps"], "read_tbps": r["read_tbps"], "tq_tbps": r["tq_tbps"],
            "frac_of_read": r["frac_of_read"], "bf16_tbps": b.get("best_tbps"),
            "speedup_vs_bf16": bf16_us / r["tq_us"] if bf16_us and r["tq_us"] else None,
            "bytes": r["bytes"], "bf16_bytes": b.get("bytes"),
            "nonfinite_outputs": r["nonfinite_outputs"], "max_abs_diff_vs_automatic": r["max_abs_diff_vs_automatic"],
            "commit": commit, "gpu": r["gpu"], "driver": r["driver"], "error": r["error"],
        }
        records.append(merged)
    by_key = {config_key(r): r for r in records}
    for r in records:
        r["targets"] = [{"target": text, "met": met} for text, met in evaluate(r, by_key)]
    return records


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def targets_cell(record):
    parts = []
    for t in record["targets"]:
        word = {True: "met", False: "MISSED", None: "unknown"}[t["met"]]
        parts.append(f"{word}: {t['target']}")
    return "; ".join(parts) if parts else "-"


def write_markdown(path, meta, tq, bf16, records):
    ceilings = (tq or {}).get("ceilings", {})
    lines = [
        "# tqdecode benchmark results",
        "",
        f"- date (UTC): {meta['date']}",
        f"- GPU: {meta['gpu']}",
        f"- driver: {meta['driver_release']} (supports CUDA {meta['driver']}; runtime {meta['runtime']}); "
        f"torch {meta['torch']} (CUDA {meta['torch_cuda']})",
        f"- commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        *([f"- relabelled: {meta['relabelled']}"] if meta.get("relabelled") else []),
        f"- ceilings: device-to-device copy {fmt(ceilings.get('copy_tbps'), '.3f')} TB/s (read+write bytes), "
        f"read-only stream {fmt(ceilings.get('read_tbps'), '.3f')} TB/s (median of {ceilings.get('reps', '-')} reps)",
        "",
        "tq_us: one whole decode step (rotation + partitions + reduce), median of CUDA-graph replays / R "
        "instances rotated over >= 1 GiB; tq TB/s: (cache + query + output bytes) / tq_us; bf16_us: fastest "
        "PyTorch bf16 implementation on the same logical shape (contiguous K/V), timed the same way.",
        "",
        "| shape | request | path | R | N | tq_us | tq TB/s | % read | bf16_us | bf16 impl | speedup | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r["error"]:
            lines.append(f"| {r['name']} | {r['request'] or '-'} | ERROR | | | | | | | | | {r['error']} |")
            continue
        lines.append(
            f"| {r['name']} | {r['request']} | {' '.join(filter(None, (r['path'], r['kernel'])))} | {r['instances']} | {r['partitions']} | "
            f"{fmt(r['tq_us'], '.2f')} | {fmt(r['tq_tbps'], '.3f')} | {fmt(r['frac_of_read'] and 100 * r['frac_of_read'], '.1f')} | "
            f"{fmt(r['bf16_us'], '.2f')} | {r['bf16_impl'] or '-'} | {fmt(r['speedup_vs_bf16'], '.2f')} | "
            f"{targets_cell(r)} |")
    all_targets = [t for r in records for t in r["targets"]]
    met = sum(t["met"] is True for t in all_targets)
    missed = sum(t["met"] is False for t in all_targets)
    unknown = sum(t["met"] is None for t in all_targets)
    lines += ["", f"Targets: {met} met, {missed} missed, {unknown} unknown (of {len(all_targets)}).", ""]
    lines += [
        "Targets (from the performance issue; evaluated on the automatic path unless stated): "
        "(16,32768), (64,8192), (128,4096), (32,131072): tq TB/s >= 0.8 x read ceiling and speedup >= 3.0; "
        "(1,4096): tq_us <= 10; (1,32768): tq_us <= 16; group 4 / 16 and block 32 at (16,32768): tq TB/s >= 0.9 x "
        "the group-8 / block-16 record; other presets (automatic) and the 4bit_nc generic path (request cuda_generic, "
        "its best kernel for the device) at (16,32768): tq TB/s >= 0.6 x read ceiling. cuda_generic_scalar: the "
        "generic path's scalar kernel, for comparison.",
        "",
    ]
    checks = [r for r in records if not r["error"] and (r["nonfinite_outputs"] or r["max_abs_diff_vs_automatic"])]
    if checks:
        lines += ["Output checks (instance 0; the paths differ by bf16 rounding and summation order):", ""]
        for r in checks:
            lines.append(f"- {r['name']} {r['request']}: non-finite outputs {r['nonfinite_outputs']}, max |diff| vs "
                         f"automatic path {fmt(r['max_abs_diff_vs_automatic'], '.3g')}")
        lines.append("")
    if bf16:
        names = list(next(iter(bf16["records"]), {}).get("impls", {}))
        lines += ["## bf16 implementations (us per call; - = refused or failed; * = eager, not graph-captured)", "",
                  "| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for b in bf16["records"]:
            cells = []
            for name in names:
                impl = b["impls"].get(name, {})
                cells.append("-" if impl.get("us") is None else f"{impl['us']:.2f}{'' if impl['graph'] else '*'}")
            lines.append(f"| {b['name']} | " + " | ".join(cells) + " |")
        refused = {(name, impl["error"]) for b in bf16["records"] for name, impl in b["impls"].items() if impl.get("error")}
        if refused:
            lines += ["", "Refusals and failures:", ""] + [f"- {name}: {error}" for name, error in sorted(refused)]
        lines.append("")
    for label, log in meta["failures"]:
        lines.append(f"**{label} failed**: see `{log}`.")
    path.write_text("\n".join(lines) + "\n")


def write_results(out_dir, meta, tq, bf16, records):
    """results.json and RESULTS.md of one run."""
    results = {**{k: v for k, v in meta.items() if k != "failures"}, "failures": meta["failures"],
               "ceilings": (tq or {}).get("ceilings"), "records": records, "bf16": (bf16 or {}).get("records")}
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(out_dir / "RESULTS.md", meta, tq, bf16, records)


def relabel(out_dir, commit):
    """Rewrites results.json and RESULTS.md of the run in `out_dir` under `commit`; every number is the run's."""
    tq, bf16, earlier = (load_json(out_dir / name) for name in ("tqdecode_bench.json", "bf16_baseline.json", "results.json"))
    if not (tq and bf16 and earlier):
        sys.exit(f"run_bench: --relabel-commit needs tqdecode_bench.json, bf16_baseline.json and results.json in {out_dir}")
    records = merge(tq, bf16, commit)
    meta = {key: earlier[key] for key in ("date", "command", "gpu", "driver", "runtime", "driver_release", "torch", "torch_cuda")}
    meta.update(commit=commit, failures=earlier["failures"],
                relabelled=f"recorded as {earlier['commit']}, relabelled by `{shlex.join(['python3', *sys.argv])}`")
    write_results(out_dir, meta, tq, bf16, records)
    print(f"relabelled {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'} as {commit}")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build", help="CMake build directory [build]")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="only the first two shapes (smoke test)")
    parser.add_argument("--shapes", help="comma list of shape names (both programs)")
    parser.add_argument("--commit", help="commit to record [git rev-parse HEAD, else unknown]")
    parser.add_argument("--no-build", action="store_true", help="use the tqdecode_bench binary as it is")
    parser.add_argument("--relabel-commit", metavar="SHA",
                        help="run nothing: merge the JSON of an earlier run in --out again, recorded under SHA")
    args = parser.parse_args()
    if args.relabel_commit:
        return relabel(Path(args.out).resolve(), args.relabel_commit)

    build_dir = Path(args.build).resolve()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = args.commit or git_commit()
    command = shlex.join(["python3", *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")

    if not args.no_build:
        build(build_dir, out_dir)
    # The shape list is passed explicitly: the path baked into the binary is
    # where it was configured, which need not be this copy of the tree.
    selection = ["--shapes-file", BENCH / "shapes.json"]
    selection += (["--quick"] if args.quick else []) + (["--shapes", args.shapes] if args.shapes else [])

    failures = []
    tq_json, bf16_json = out_dir / "tqdecode_bench.json", out_dir / "bf16_baseline.json"
    for path in (tq_json, bf16_json):
        path.unlink(missing_ok=True)  # never merge a previous run's numbers
    if run_logged([build_dir / "tqdecode_bench", "--json", tq_json, "--commit", commit, *selection],
                  out_dir / "tqdecode_bench.log"):
        failures.append(("tqdecode_bench", out_dir / "tqdecode_bench.log"))
    if run_logged([sys.executable, BENCH / "bf16_baseline.py", "--json", bf16_json, *selection],
                  out_dir / "bf16_baseline.log"):
        failures.append(("bf16_baseline", out_dir / "bf16_baseline.log"))

    tq, bf16 = load_json(tq_json), load_json(bf16_json)
    records = merge(tq, bf16, commit)
    meta = {
        "date": date, "command": command, "commit": commit,
        "gpu": (tq or bf16 or {}).get("gpu", "unknown"), "driver": (tq or {}).get("driver", "unknown"),
        "runtime": (tq or {}).get("runtime", "unknown"), "driver_release": driver_release(),
        "torch": (bf16 or {}).get("torch", "unknown"), "torch_cuda": (bf16 or {}).get("cuda", "unknown"),
        "failures": [(label, str(log)) for label, log in failures],
    }
    write_results(out_dir, meta, tq, bf16, records)
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'}")
    if records:
        all_targets = [t for r in records for t in r["targets"]]
        print(f"targets: {sum(t['met'] is True for t in all_targets)} met, "
              f"{sum(t['met'] is False for t in all_targets)} missed, "
              f"{sum(t['met'] is None for t in all_targets)} unknown")
    return 1 if failures or not records else 0


if __name__ == "__main__":
    sys.exit(main())
