#!/usr/bin/env python3
"""The one benchmark command: run tqdecode_bench and the bf16 baseline on this
GPU, merge them, evaluate the performance targets, and write DIR/results.json
and DIR/RESULTS.md (plus each program's JSON and log).

    python3 bench/run_bench.py --build build --out DIR [--quick] [--shapes A,B]
    python3 bench/run_bench.py --dry-run [--quick] [--shapes A,B]   (no GPU)

The primary numbers are single steps: one decode per CUDA-graph replay, the
L2 flushed before each, every layer with its own cache and constants,
against an empty-op floor timed the same way; back-to-back throughput is a
secondary column, and the engine-like step (16 layers, a 128 MiB weight GEMM
before each attention) gives the cost per layer. tqdecode_bench.cu and
bf16_baseline.py describe the method; results.json records it.

It builds the tqdecode_bench target in --build first (configuring that
directory if it has no CMakeCache.txt), so the binary measured is the working
tree's. A program that dies mid-run is started again for the shapes after the
one it died on (at most --restarts times); the one it died on is recorded as
an error naming the log. Every number in the outputs comes from the two
programs; this script only combines them.

--dry-run prints the plan (shapes, instances, bytes, an estimate of the GPU
time), checks that every target and README row names a shape, and, where
--build holds a tqdecode_bench binary, that its plan agrees with this one
(the same lengths, bytes and instance counts) and its --self-check passes.

On a machine that runs a copy of the working tree whose git metadata may be
stale, pass --commit. A run recorded under the wrong commit is corrected with
--relabel-commit SHA --out DIR: it merges the programs' JSON already in DIR
again under SHA, keeping the run's date, command and driver, and says so.
"""
import argparse
import datetime
import json
import shlex
import subprocess
import sys
from pathlib import Path

import shape_plan

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

HEADLINE = "b16_l32768_g8_bs16_4bit_nc"

# The performance targets, evaluated on the single-step numbers of the
# automatic path (the engine-like ones on the cost per layer).
# (shape, metric, comparison, threshold, source)
TARGETS = [
    *[(name, metric, ">=", value, "issue 29")
      for name in (HEADLINE, "b64_l8192_g8_bs16_4bit_nc", "b128_l4096_g8_bs16_4bit_nc", "b32_l131072_g8_bs16_4bit_nc")
      for metric, value in (("frac_of_read", 0.88), ("speedup_vs_bf16", 3.4))],
    *[(name, metric, ">=", value, "issue 29")
      for name in ("b16_l32768_hq16_hk2_d128_bs16_4bit_nc", "b16_l32768_hq8_hk1_d128_bs16_4bit_nc",
                   "b64_l8192_hq16_hk2_d128_bs16_4bit_nc", "b64_l8192_hq8_hk1_d128_bs16_4bit_nc")
      for metric, value in (("frac_of_read", 0.80), ("speedup_vs_bf16", 3.0))],
    ("b1_l4096_g8_bs16_4bit_nc", "engine_us_per_layer", "<=", 9.0, "issue 29"),
    ("b1_l32768_g8_bs16_4bit_nc", "engine_us_per_layer", "<=", 13.0, "issue 29"),
    ("b16_l4096_g8_bs16_4bit_nc", "engine_us_per_layer", "<=", 19.0, "issue 29"),
    ("b16_l32768_g8_bs16_k3v4_nc", "frac_of_read", ">=", 0.75, "issue 29"),
    ("b16_l32768_g8_bs16_3bit_nc", "frac_of_read", ">=", 0.75, "issue 29"),
    ("b16_l32768_g8_bs16_k8v4", "frac_of_read", ">=", 0.85, "issue 29"),
    *[(name, metric, ">=", value, "issue 28")
      for name in ("b16_l32768_hq12_hk2_d256_bs16_4bit_nc", "b16_l16384_hq32_hk4_d256_bs16_4bit_nc",
                   "b16_l32768_hq32_hk8_d64_bs16_4bit_nc")
      for metric, value in (("frac_of_read", 0.75), ("speedup_vs_bf16", 2.8))],
    ("b16_l8192_hq9_hk3_d64_bs16_4bit_nc", "speedup_vs_bf16", ">=", 1.8, "issue 28"),
    *[(name, metric, ">=", value, "issue 33")
      for name in ("b16_l32768_g8_bs16_4bit_nc_slots_nc", "b64_l8192_g8_bs16_4bit_nc_slots_nc",
                   "b32_l131072_g8_bs16_4bit_nc_slots_nc")
      for metric, value in (("frac_of_read", 0.80), ("speedup_vs_bf16", 3.2))],
    ("b16_l32768_g8_bs16_k8v4_slots", "frac_of_read", ">=", 0.80, "issue 33"),
    ("b16_l32768_g8_bs16_k3v4_nc_slots_nc", "frac_of_read", ">=", 0.70, "issue 33"),
    ("b16_l32768_g8_bs16_3bit_nc_slots_nc", "frac_of_read", ">=", 0.70, "issue 33"),
    *[(f"b16_l32768_hq12_hk2_d256_bs16_{preset}", "frac_of_read", ">=", 0.65, "issue 28")
      for preset in ("k3v4_nc", "3bit_nc", "k8v4")],
    (HEADLINE, "us_vs_reference", "<=", 1.02, "issue 28"),
]
METRIC_TEXT = {
    "frac_of_read": "single step, fraction of the read ceiling",
    "speedup_vs_bf16": "single step, bf16 / tqdecode",
    "engine_us_per_layer": "engine-like cost per layer (us)",
    "us_vs_reference": "single step / the --reference-results run's (D 128 not slower)",
}

# The README's table: (shape, request, label), single-step numbers.
README_ROWS = [
    (HEADLINE, "automatic", "(16, 32768)"),
    ("b32_l131072_g8_bs16_4bit_nc", "automatic", "(32, 131072)"),
    ("b64_l8192_g8_bs16_4bit_nc", "automatic", "(64, 8192)"),
    ("b128_l4096_g8_bs16_4bit_nc", "automatic", "(128, 4096)"),
    ("b16_l4096_g8_bs16_4bit_nc", "automatic", "(16, 4096)"),
    ("b4_l8192_g8_bs16_4bit_nc", "automatic", "(4, 8192)"),
    ("b1_l4096_g8_bs16_4bit_nc", "automatic", "(1, 4096)"),
    ("b1_l32768_g8_bs16_4bit_nc", "automatic", "(1, 32768)"),
    ("b16_l32768_g8_bs16_4bit_nc_ragged_mml131072_peaked", "automatic",
     "(16, 32768) ragged lengths, 131072-token tables, peaked scores"),
    ("b16_l32768_g16_bs16_4bit_nc", "automatic", "(16, 32768) group 16 (Hq 128)"),
    ("b16_l32768_g8_bs16_k3v4_nc", "automatic", "(16, 32768) turboquant_k3v4_nc"),
    ("b16_l32768_g8_bs16_3bit_nc", "automatic", "(16, 32768) turboquant_3bit_nc"),
    ("b16_l32768_g8_bs16_k8v4", "automatic", "(16, 32768) turboquant_k8v4"),
    ("b16_l32768_hq12_hk2_d256_bs16_4bit_nc", "automatic", "(16, 32768) Hq 12, Hk 2, D 256"),
    ("b16_l32768_hq32_hk8_d64_bs16_4bit_nc", "automatic", "(16, 32768) Hq 32, Hk 8, D 64"),
    (HEADLINE, "cuda_generic", "(16, 32768), generic path (tensor-core kernel)"),
    (HEADLINE, "cuda_generic_scalar", "(16, 32768), generic path (scalar kernel)"),
]

PROGRAM_STARTUP_S = {"tqdecode_bench": 3.0, "bf16_baseline": 15.0}  # context, ceilings / torch import, cuDNN load


# ------------------------------------------------------------ processes ----

def run_logged(command, log_path, echo=True, mode="w"):
    """Runs `command`, saving its output to `log_path` (and echoing it); returns the exit code."""
    print("+", shlex.join(str(c) for c in command), f"  (log: {log_path})", flush=True)
    with open(log_path, mode) as log:
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


def machine_facts(build_dir):
    """What else sets the numbers: the GPU's identity, clocks and power limit, and the build's configuration."""
    facts = []
    try:
        query = subprocess.run(["nvidia-smi", "--query-gpu=uuid,clocks.max.sm,clocks.max.mem,power.limit,"
                                "ecc.mode.current,temperature.gpu", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True)
        facts.append("GPU uuid, max SM / memory clocks, power limit, ECC, temperature: "
                     + query.stdout.strip().splitlines()[0])
    except (OSError, subprocess.CalledProcessError, IndexError):
        pass
    cache = build_dir / "CMakeCache.txt"
    if cache.exists():
        wanted = ("CMAKE_BUILD_TYPE", "CMAKE_CUDA_ARCHITECTURES", "TQDECODE_SANITIZE")
        values = [line.split("=", 1) for line in cache.read_text().splitlines() if line.split(":", 1)[0] in wanted]
        facts.append("build: " + ", ".join(f"{name.split(':')[0]}={value}" for name, value in values))
    return "; ".join(facts)


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
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def run_program(label, command, names, out_dir, restarts):
    """Runs `command --json PART --shapes ...` until every shape in `names` ran, starting it again after a crash
    for the shapes after the one it died on. Returns (parts, failures, crashed): the JSON documents, the
    (label, log) of failed runs, and {shape: error} for shapes a process died on without recording them."""
    log = out_dir / f"{label}.log"
    log.unlink(missing_ok=True)
    parts, failures, crashed = [], [], {}
    remaining = list(names)
    for attempt in range(restarts + 1):
        part = out_dir / (f"{label}.json" if attempt == 0 else f"{label}.part{attempt}.json")
        part.unlink(missing_ok=True)  # never merge a previous run's numbers
        code = run_logged([*command, "--json", part, "--shapes", ",".join(remaining)], log, mode="a")
        document = load_json(part)
        if document:
            parts.append(document)
        if code != 0:
            failures.append((f"{label} (exit status {code}, attempt {attempt + 1})", str(log)))
        if code in (0, 1) or not document:
            break  # finished (1: some shapes failed, each recorded), or died before it wrote anything
        done = {r["name"] for r in document.get("records", [])}
        stopped_at = document.get("in_progress")
        if stopped_at and stopped_at not in done:
            crashed[stopped_at] = f"{label} died (exit status {code}) while measuring this shape; see {log}"
        remaining = [n for n in remaining if n not in done and n != stopped_at]
        if not remaining:
            break
        print(f"run_bench: {label} stopped at {stopped_at} (exit status {code}); starting it again for the "
              f"{len(remaining)} shapes after it", flush=True)
    return parts, failures, crashed


# ---------------------------------------------------------------- merge ----

def first_of(parts, key):
    return next((p[key] for p in parts if p.get(key) is not None), None)


def single_us(record):
    return (record.get("single") or {}).get("median_us")


def read_ceiling(tq_parts, bf16_parts):
    """The run's read ceiling: the read kernel's rate (the best of the
    programs' parts, each of which measures it), or the fastest rate a timed
    step of the run read its bytes at where that is higher, since every
    measured rate is a lower bound on the ceiling; so no step reads at over
    100 %. Returns (read_tbps, the read kernel's rate, what set the ceiling)."""
    kernel = max((p["ceilings"]["read_tbps"] for p in tq_parts if (p.get("ceilings") or {}).get("read_tbps")),
                 default=None)
    best, source = kernel, "the read kernel"
    steps = [(r["bytes"] / single_us(r) * 1e-6, f"tqdecode {r['name']} ({r.get('request', '')})")
             for p in tq_parts for r in p.get("records", [])
             if r.get("status") == "ok" and r.get("bytes") and single_us(r)]
    steps += [(r["bytes"] / r["best_us"] * 1e-6, f"bf16 {r['name']} ({r.get('best_impl')})")
              for p in bf16_parts for r in p.get("records", [])
              if r.get("status") == "ok" and r.get("bytes") and r.get("best_us")]
    for rate, name in steps:
        if best is None or rate > best:
            best, source = rate, name
    return best, kernel, source


def merge(tq_parts, bf16_parts, shapes, crashed, commit):
    """One record per (shape, request) with the bf16 numbers beside, and one engine row per engine-like shape."""
    read = read_ceiling(tq_parts, bf16_parts)[0]
    bf16_by_name = {r["name"]: r for p in bf16_parts for r in p.get("records", [])}
    by_name = {s["name"]: s for s in shapes}
    tq_records = [r for p in tq_parts for r in p.get("records", [])]
    for name, error in crashed.get("tqdecode_bench", {}).items():
        tq_records.append({"name": name, "status": "error", "request": "", "error": error})
    records = []
    for r in tq_records:
        shape = by_name.get(r["name"], {})
        plan = shape_plan.tq_plan(shape) if shape else {}
        b = bf16_by_name.get(r["name"], {})
        if r["name"] in crashed.get("bf16_baseline", {}):
            b = {"status": "error", "error": crashed["bf16_baseline"][r["name"]]}
        tq_us = single_us(r) if r.get("status") == "ok" else None
        bf16_us = b.get("best_us") if b.get("status") == "ok" else None
        error = r.get("error")
        if bf16_us is not None and r.get("tokens") is not None and b.get("tokens") != r.get("tokens"):
            error = (error + "; " if error else "") + (f"the programs' lengths differ ({r['tokens']} tokens against "
                                                       f"{b.get('tokens')}): no bf16 comparison")
            bf16_us = None
        bf16_b2b = b.get("back_to_back_us") if bf16_us is not None else None
        records.append({
            **{k: shape.get(k) for k in ("preset", "B", "L", "Hq", "Hk", "D", "block_size", "lengths", "max_model_len",
                                         "scores", "q_len", "tp", "order", "norm_correction")},
            "name": r["name"], "status": r.get("status"), "request": r.get("request", ""), "path": r.get("path", ""),
            "kernel": r.get("kernel", ""), "reason": r.get("reason", ""), "partitions": r.get("partitions"),
            "tokens": r.get("tokens", plan.get("tokens")), "bytes": r.get("bytes", plan.get("bytes")),
            "layers": r.get("layers"), "back_to_back_instances": r.get("back_to_back_instances"),
            "tq_us": tq_us, "tq_us_min": (r.get("single") or {}).get("min_us"), "tq_us_max": (r.get("single") or {}).get("max_us"),
            "tq_tbps": r.get("tq_tbps"), "read_tbps": read,
            "frac_of_read": r["bytes"] / tq_us * 1e-6 / read if tq_us and r.get("bytes") and read else None,
            "back_to_back_us": r.get("back_to_back_us"),
            "bf16_us": bf16_us, "bf16_impl": b.get("best_impl") if bf16_us is not None else None,
            "bf16_bytes": b.get("bytes"),
            "bf16_frac_of_read": b["bytes"] / (bf16_us * 1e-6) / 1e12 / read if bf16_us and read else None,
            "bf16_back_to_back_us": bf16_b2b,
            "speedup_vs_bf16": bf16_us / tq_us if bf16_us and tq_us else None,
            "back_to_back_speedup": bf16_b2b / r["back_to_back_us"] if bf16_b2b and r.get("back_to_back_us") else None,
            "nonfinite_outputs": r.get("nonfinite_outputs"), "max_abs_diff_vs_automatic": r.get("max_abs_diff_vs_automatic"),
            "bf16_error": b.get("error") if b.get("status") != "ok" else None,
            "commit": commit, "error": error,
        })
    engine = []
    for e in (e for p in tq_parts for e in p.get("engine", [])):
        shape = by_name.get(e["name"], {})
        be = (bf16_by_name.get(e["name"]) or {}).get("engine") or {}
        tq_layer = e.get("per_layer_us") if e.get("status") == "ok" else None
        bf16_layer = be.get("per_layer_us") if be.get("status") == "ok" else None
        engine.append({
            "name": e["name"], "B": shape.get("B"), "L": shape.get("L"), "layers": e.get("layers"),
            "tq_per_layer_us": tq_layer, "tq_floor_per_layer_us": e.get("floor_per_layer_us"),
            "tq_gemms_us": (e.get("gemms") or {}).get("median_us"), "tq_step_us": (e.get("step") or {}).get("median_us"),
            "bf16_per_layer_us": bf16_layer, "bf16_floor_per_layer_us": be.get("floor_per_layer_us"),
            "bf16_gemms_us": (be.get("gemms") or {}).get("median_us"), "bf16_step_us": (be.get("step") or {}).get("median_us"),
            "bf16_impl": (bf16_by_name.get(e["name"]) or {}).get("best_impl"),
            "speedup_vs_bf16": bf16_layer / tq_layer if bf16_layer and tq_layer else None,
            "error": "; ".join(filter(None, (e.get("error"), be.get("error") if be.get("status") == "error" else None))) or None,
        })
    return records, engine


def automatic(records, name):
    return next((r for r in records if r["name"] == name and r["request"] == "automatic" and r["status"] == "ok"), None)


def evaluate(records, engine, selected, reference):
    """One row per target whose shape ran: measured value and met (True / False / None: unknown)."""
    rows = []
    for name, metric, comparison, threshold, source in TARGETS:
        if name not in selected:
            continue
        record, note = automatic(records, name), None
        measured = None
        if metric == "engine_us_per_layer":
            row = next((e for e in engine if e["name"] == name), None)
            measured = row and row["tq_per_layer_us"]
        elif metric == "us_vs_reference":
            earlier = automatic(reference["records"], name) if reference else None
            if earlier and record and earlier.get("tq_us") and record.get("tq_us"):
                # H200s differ by a few % in bandwidth: each time is scaled by its own run's read ceiling.
                measured = record["tq_us"] / earlier["tq_us"]
                if record.get("read_tbps") and earlier.get("read_tbps"):
                    measured *= record["read_tbps"] / earlier["read_tbps"]
                note = (f"reference {earlier['tq_us']:.2f} us at {reference.get('commit', '?')}, times scaled by "
                        f"each run's read ceiling ({fmt(record.get('read_tbps'), '.3f')} against "
                        f"{fmt(earlier.get('read_tbps'), '.3f')} TB/s)")
            else:
                note = "needs --reference-results (a single-step results.json of the earlier commit)"
        elif record:
            measured = record.get(metric)
        met = None if measured is None else (measured >= threshold if comparison == ">=" else measured <= threshold)
        rows.append({"shape": name, "metric": metric, "comparison": comparison, "threshold": threshold,
                     "measured": measured, "met": met, "source": source, "note": note})
    return rows


def load_reference(path):
    if not path:
        return None
    document = load_json(path)
    if not document or (document.get("method") or {}).get("primary") != "single step":
        sys.exit(f"run_bench: --reference-results {path} is not a single-step results.json of this benchmark")
    return document


# ------------------------------------------------------------- markdown ----

def fmt(value, spec, suffix=""):
    return "-" if value is None else format(value, spec) + suffix


def percent(value):
    return fmt(None if value is None else 100 * value, ".1f", " %")


# metric: (scale, unit, threshold format, measured format)
METRIC_FORMAT = {"frac_of_read": (100, " %", ".0f", ".2f"), "speedup_vs_bf16": (1, "x", ".1f", ".3f"),
                 "engine_us_per_layer": (1, " us", "g", ".2f"), "us_vs_reference": (1, "", "g", ".3f")}


def metric_text(metric, value, which):
    """A threshold (which=2) or a measured value (which=3) of `metric`, with its unit."""
    if value is None:
        return "-"
    scale, unit = METRIC_FORMAT[metric][:2]
    return format(scale * value, METRIC_FORMAT[metric][which]) + unit


def method_lines(meta):
    tq_method, bf16_method = meta.get("tq_method") or {}, meta.get("bf16_method") or {}
    flush = tq_method.get("l2_flush") or {}
    tq_floor, bf16_floor = meta.get("tq_floor") or {}, meta.get("bf16_floor") or {}
    return [
        "Method. **Single step** (the primary numbers): every shape has several layers, each with its own cache "
        "region, block table, query, output, PiT and centroids (distinct constants; fp8 keys have none); each "
        "layer's decode is its own CUDA graph holding one decode call (programmatic dependent launch as the "
        f"library configures it); before every timed replay the L2 is flushed on the same stream ({flush.get('kind', '?')} "
        f"of {fmt((flush.get('bytes') or 0) / 2**20 or None, '.0f')} MiB, outside the timed events); replays cycle "
        "through the layers; median of at least 30. **Floor**: one empty op per replay timed the same way: "
        f"{fmt(tq_floor.get('median_us'), '.2f')} us (tqdecode_bench, an empty kernel), "
        f"{fmt(bf16_floor.get('median_us'), '.2f')} us (bf16_baseline, an op on a one-element tensor). "
        "**bf16**: the fastest PyTorch implementation on the same logical K/V (contiguous; SDPA backends for uniform "
        "lengths, FlashAttention varlen for ragged ones), measured the same way. **Back-to-back (throughput)**, "
        "secondary: R decodes in one graph over >= 1 GiB of layers, median replay / R, no flush. **Engine-like**: "
        "16 layers in one graph, each a cuBLAS bf16 GEMM [B, 8192] x [8192, 8192] over its own 128 MiB of weights "
        "then its attention; cost per layer = (step - GEMMs alone) / 16; floor = (GEMMs with an empty op - GEMMs "
        "alone) / 16. % read: (cache + query + output bytes) / time, of the measured read ceiling. Ragged lengths: "
        "L/4 + a seeded draw from [0, 3L/2]; peaked scores: 8 planted keys per (sequence, kv head) scoring 3, 6, "
        "..., 24 for the group's first query head (bench/bench_inputs.hpp).",
        "",
    ]


def query_tokens_lines(records):
    """Shapes of several query tokens per sequence: the varlen entry beside the same tokens sent as rows of the
    one-token entry, and against the one-token step of the same problem (q_len 1: automatic, and the scalar kernel
    the varlen entry runs on), where those ran."""
    ok = [r for r in records if r["status"] == "ok"]
    varlen = [r for r in ok if r["request"] == "varlen"]
    if not varlen:
        return []
    same = ("preset", "B", "L", "Hq", "Hk", "D", "block_size", "lengths", "max_model_len", "scores", "order",
            "norm_correction")
    lines = ["## Several query tokens per sequence (single step)", "",
             "Each sequence has q_len new tokens. varlen: one call of the varlen entry; rows: the same tokens as rows "
             "of the one-token entry (a row per token over its own prefix), as engines send them without it; q_len 1: "
             "the one-token step of the same problem (automatic path, and the scalar kernel). bf16: FlashAttention's "
             "varlen kernel on the same logical bf16 K/V with q_len query rows per sequence and its causal mask aligned "
             "to the end (bf16_baseline.py), measured the same way; bf16 bytes at the read ceiling: the time the same "
             "work's bf16 K/V, query and output bytes take at the measured read ceiling (a lower bound for any bf16 "
             "kernel; the comparison where the bf16 kernel did not run). TFLOP/s: the QK^T and PV products of the call "
             "(4 Hq D per query token and position it sees) per second. other kernel: the varlen entry on the Hopper path's "
             "kernel for several query tokens that the automatic path did not take, where it serves the call: the "
             "warp-specialized kernel (PathRequest::hopper_warp_specialized) where the automatic path keeps the row "
             "tiles (32 query rows per kv head and below), the row tiles (PathRequest::hopper) where it takes the "
             "warp-specialized kernel.", "",
             "| shape | q_len | varlen | path | % read | rows | rows / varlen | q_len 1 step | varlen / q_len 1 | "
             "q_len 1, scalar kernel | varlen / scalar q_len 1 | bf16 | bf16 / varlen | bf16 bytes at the read "
             "ceiling | that / varlen | TFLOP/s | other kernel | its time | that / q_len 1 | its TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(a, b):
        return fmt(a / b if a and b else None, ".2f", "x")

    def bf16_floor_us(r):
        q_tokens = r["B"] * r["q_len"]
        nbytes = r["tokens"] * r["Hk"] * 4 * r["D"] + 4 * q_tokens * r["Hq"] * r["D"]
        return nbytes / (r["read_tbps"] * 1e6) if r.get("read_tbps") else None

    def tflops(r):
        if not r or not r["tq_us"]:
            return None
        # Token j of q new tokens of a sequence of length L sees L - q + j + 1 positions.
        q = r["q_len"]
        positions = q * r["tokens"] - r["B"] * q * q + r["B"] * q * (q + 1) // 2
        return 4 * r["Hq"] * r["D"] * positions / (r["tq_us"] * 1e6)

    for r in varlen:
        rows = next((o for o in ok if o["name"] == r["name"] and o["request"] == "rows"), None)
        other = next((o for o in ok if o["name"] == r["name"]
                      and o["request"] in ("varlen_warp_specialized", "varlen_row_tiles")), None)
        other_us = other and other["tq_us"]
        other_kernel = other and ("warp-specialized" if other["request"] == "varlen_warp_specialized" else "row tiles")
        one_token = [o for o in ok if o["q_len"] == 1 and all(o[k] == r[k] for k in same)]
        single = next((o for o in one_token if o["request"] == "automatic"), None)
        scalar = next((o for o in one_token if o["request"] == "cuda_generic_scalar"), None)
        rows_us, single_us, scalar_us = rows and rows["tq_us"], single and single["tq_us"], scalar and scalar["tq_us"]
        lines.append(f"| {r['name']} | {r['q_len']} | {fmt(r['tq_us'], '.1f', ' us')} | "
                     f"{' '.join(filter(None, (r['path'], r['kernel'])))} | {percent(r['frac_of_read'])} | "
                     f"{fmt(rows_us, '.1f', ' us')} | {ratio(rows_us, r['tq_us'])} | {fmt(single_us, '.1f', ' us')} | "
                     f"{ratio(r['tq_us'], single_us)} | {fmt(scalar_us, '.1f', ' us')} | {ratio(r['tq_us'], scalar_us)} | "
                     f"{fmt(r['bf16_us'], '.1f', ' us')} | {ratio(r['bf16_us'], r['tq_us'])} | "
                     f"{fmt(bf16_floor_us(r), '.1f', ' us')} | {ratio(bf16_floor_us(r), r['tq_us'])} | "
                     f"{fmt(tflops(r), '.1f')} | {other_kernel or '-'} | {fmt(other_us, '.1f', ' us')} | "
                     f"{ratio(other_us, single_us)} | {fmt(tflops(other), '.1f')} |")
    return lines + [""]


def token_slots_lines(records):
    """The token_slots rows (vLLM's CUDA cache) beside the same shape in the blocks order."""
    slots = [r for r in records if r.get("order") == "token_slots" and r["status"] == "ok" and r["q_len"] == 1]
    if not slots:
        return []
    def key(r):  # the same shape, lengths and scores: a ragged row beside the ragged blocks-order row
        return tuple(r.get(k) for k in ("preset", "B", "L", "Hq", "Hk", "D", "block_size", "lengths", "scores",
                                        "max_model_len", "request"))

    blocks = {key(r): r for r in records if r.get("order") == "blocks" and r["status"] == "ok" and r["q_len"] == 1}
    lines = ["## token_slots order (the layout vLLM writes on CUDA GPUs; single step)", "",
             "| shape | request | norm correction | path | time | % of read ceiling | bf16 | speedup | "
             "blocks order, same shape |", "|---|---|---|---|---|---|---|---|---|"]
    for r in slots:
        same = blocks.get(key(r))
        lines.append(f"| {r['name']} | {r['request']} | {'yes' if r['norm_correction'] else 'no'} | "
                     f"{' '.join(filter(None, (r['path'], r['kernel'])))} | {fmt(r['tq_us'], '.1f', ' us')} | "
                     f"{percent(r['frac_of_read'])} | {fmt(r['bf16_us'], '.1f', ' us')} | "
                     f"{fmt(r['speedup_vs_bf16'], '.2f', 'x')} | "
                     f"{fmt(same and same['tq_us'], '.1f', ' us')} {percent(same and same['frac_of_read'])} |")
    return lines + [""]


def write_markdown(path, meta, records, engine, targets, bf16_parts):
    ceilings = meta.get("ceilings") or {}
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
        f"- ceilings: device-to-device copy {fmt(ceilings.get('copy_tbps'), '.3f')} TB/s (read+write bytes); "
        f"read ceiling {fmt(ceilings.get('read_tbps'), '.3f')} TB/s, set by "
        f"{ceilings.get('read_source', 'the read kernel')} (the read kernel: "
        f"{fmt(ceilings.get('read_kernel_tbps', ceilings.get('read_tbps')), '.3f')} TB/s, median of "
        f"{ceilings.get('reps', '-')} reps; every % of read is of the read ceiling)",
        *([f"- machine: {meta['machine']}"] if meta.get("machine") else []),
        "",
        *method_lines(meta),
    ]
    met = sum(t["met"] is True for t in targets)
    missed = sum(t["met"] is False for t in targets)
    unknown = sum(t["met"] is None for t in targets)
    lines += [f"## Targets: {met} met, {missed} MISSED, {unknown} unknown (of {len(targets)})", "",
              "| shape | metric | threshold | measured | result | source |", "|---|---|---|---|---|---|"]
    for t in targets:
        word = {True: "met", False: "MISSED", None: "unknown"}[t["met"]]
        lines.append(f"| {t['shape']} | {METRIC_TEXT[t['metric']]} | {t['comparison']} {metric_text(t['metric'], t['threshold'], 2)} | "
                     f"{metric_text(t['metric'], t['measured'], 3)} | "
                     f"{word}{' (' + t['note'] + ')' if t['note'] else ''} | {t['source']} |")
    lines.append("")

    by_key = {(r["name"], r["request"]): r for r in records}
    readme = [(label, by_key.get((name, request))) for name, request, label in README_ROWS]
    readme = [(label, r) for label, r in readme if r and r["status"] == "ok"]
    if readme:
        lines += ["## README table (single step)", "",
                  "| (B, context) | tqdecode | bf16 | speedup | % of read bandwidth | back-to-back (throughput) |",
                  "|---|---|---|---|---|---|"]
        for label, r in readme:
            lines.append(f"| {label} | {fmt(r['tq_us'], '.1f', ' us')} | {fmt(r['bf16_us'], '.1f', ' us')} | "
                         f"{fmt(r['speedup_vs_bf16'], '.2f', 'x')} | {percent(r['frac_of_read'])} | "
                         f"{fmt(r['back_to_back_us'], '.1f', ' us')} |")
        lines.append("")

    if engine:
        lines += ["## Engine-like step (16 layers, a 128 MiB weight GEMM before each attention)", "",
                  "| (B, L) | GEMMs alone | tqdecode per layer | bf16 per layer | speedup | empty op per layer "
                  "(tqdecode_bench / bf16_baseline) | bf16 impl |", "|---|---|---|---|---|---|---|"]
        for e in engine:
            lines.append(f"| ({e['B']}, {e['L']}) | {fmt(e['tq_gemms_us'], '.1f', ' us')} | "
                         f"{fmt(e['tq_per_layer_us'], '.2f', ' us')} | {fmt(e['bf16_per_layer_us'], '.2f', ' us')} | "
                         f"{fmt(e['speedup_vs_bf16'], '.2f', 'x')} | {fmt(e['tq_floor_per_layer_us'], '.2f', ' us')} / "
                         f"{fmt(e['bf16_floor_per_layer_us'], '.2f', ' us')} | {e['bf16_impl'] or '-'} |"
                         + (f" {e['error']}" if e["error"] else ""))
        lines.append("")

    lines += query_tokens_lines(records)
    lines += token_slots_lines(records)

    shards = sorted((r for r in records if r["tp"] and r["request"] == "automatic"),
                    key=lambda r: (r["tp"], -r["B"] * r["L"], r["B"]))
    if shards:
        lines += ["## Tensor-parallel shards of the 64/8-head model (per GPU)", "",
                  "| per GPU (B, L, Hq, Hk) | TP | single step | % of read ceiling | bf16 | speedup |",
                  "|---|---|---|---|---|---|"]
        for r in shards:
            lines.append(f"| {r['B']}, {r['L']}, {r['Hq']}, {r['Hk']} | {r['tp']} | {fmt(r['tq_us'], '.1f', ' us')} | "
                         f"{percent(r['frac_of_read'])} | {fmt(r['bf16_us'], '.1f', ' us')} | "
                         f"{fmt(r['speedup_vs_bf16'], '.2f', 'x')} |")
        lines.append("")

    lines += ["## Every shape (single step; back-to-back as the secondary column)", "",
              "| shape | request | path | N | layers | tq us (min-max) | % read | bf16 us | bf16 impl | speedup | "
              "back-to-back (throughput) tq us | back-to-back bf16 us |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['request'] or '-'} | ERROR | | | | | | | | | {r['error']} |")
            continue
        lines.append(
            f"| {r['name']} | {r['request']} | {' '.join(filter(None, (r['path'], r['kernel'])))} | {r['partitions']} | "
            f"{r['layers']} | {fmt(r['tq_us'], '.2f')} ({fmt(r['tq_us_min'], '.1f')}-{fmt(r['tq_us_max'], '.1f')}) | "
            f"{percent(r['frac_of_read'])} | {fmt(r['bf16_us'], '.2f')} | {r['bf16_impl'] or '-'} | "
            f"{fmt(r['speedup_vs_bf16'], '.2f', 'x')} | {fmt(r['back_to_back_us'], '.2f')} | "
            f"{fmt(r['bf16_back_to_back_us'], '.2f')} |")
    lines.append("")

    checks = [r for r in records if r["status"] == "ok" and (r["nonfinite_outputs"] or r["max_abs_diff_vs_automatic"])]
    if checks:
        lines += ["Output checks (layer 0; the paths differ by bf16 rounding and summation order):", ""]
        for r in checks:
            lines.append(f"- {r['name']} {r['request']}: non-finite outputs {r['nonfinite_outputs']}, max |diff| vs "
                         f"automatic path {fmt(r['max_abs_diff_vs_automatic'], '.3g')}")
        lines.append("")

    bf16_records = [b for p in bf16_parts for b in p.get("records", []) if b.get("impls") and not b.get("same_as")]
    if bf16_records:
        names = sorted({name for b in bf16_records for name in b["impls"]})
        lines += ["## bf16 implementations (single step, us; - = refused or failed)", "",
                  "| shape | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for b in bf16_records:
            cells = [fmt((b["impls"].get(name) or {}).get("us"), ".2f") for name in names]
            lines.append(f"| {b['name']} | " + " | ".join(cells) + " |")
        refused = sorted({(name, impl["error"]) for b in bf16_records for name, impl in b["impls"].items()
                          if impl.get("error")})
        if refused:
            lines += ["", "Refusals and failures:", ""] + [f"- {name}: {error}" for name, error in refused]
        lines.append("")
    for label, log in meta["failures"]:
        lines.append(f"**{label} failed**: see `{log}`.")
    path.write_text("\n".join(lines) + "\n")


def write_results(out_dir, meta, tq_parts, bf16_parts, records, engine, targets):
    """results.json and RESULTS.md of one run."""
    results = {**meta, "method": {"primary": "single step", "tqdecode_bench": meta.get("tq_method"),
                                  "bf16_baseline": meta.get("bf16_method"),
                                  "floor_us": {"tqdecode_bench": meta.get("tq_floor"), "bf16_baseline": meta.get("bf16_floor")}},
               "targets": targets, "records": records, "engine": engine,
               "bf16": [b for p in bf16_parts for b in p.get("records", [])]}
    for key in ("tq_method", "bf16_method", "tq_floor", "bf16_floor"):
        results.pop(key, None)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(out_dir / "RESULTS.md", meta, records, engine, targets, bf16_parts)


def parts_in(out_dir, label):
    files = [out_dir / f"{label}.json"] + sorted(out_dir.glob(f"{label}.part*.json"))
    return [d for d in (load_json(f) for f in files if f.exists()) if d]


def combine(out_dir, meta, tq_parts, bf16_parts, shapes, crashed, reference):
    records, engine = merge(tq_parts, bf16_parts, shapes, crashed, meta["commit"])
    targets = evaluate(records, engine, {s["name"] for s in shapes}, reference)
    read, kernel, source = read_ceiling(tq_parts, bf16_parts)
    meta.update(ceilings={**(first_of(tq_parts, "ceilings") or {}), "read_tbps": read, "read_kernel_tbps": kernel,
                          "read_source": source}, tq_method=first_of(tq_parts, "method"),
                bf16_method=first_of(bf16_parts, "method"), tq_floor=first_of(tq_parts, "floor"),
                bf16_floor=first_of(bf16_parts, "floor"), crashed=crashed)
    write_results(out_dir, meta, tq_parts, bf16_parts, records, engine, targets)
    return records, targets


def relabel(out_dir, commit, reference):
    """Rewrites results.json and RESULTS.md of the run in `out_dir` under `commit`; every number is the run's."""
    earlier = load_json(out_dir / "results.json")
    tq_parts, bf16_parts = parts_in(out_dir, "tqdecode_bench"), parts_in(out_dir, "bf16_baseline")
    if not (tq_parts and bf16_parts and earlier):
        sys.exit(f"run_bench: --relabel-commit needs tqdecode_bench.json, bf16_baseline.json and results.json in {out_dir}")
    meta = {key: earlier.get(key, "unknown") for key in ("date", "command", "gpu", "driver", "runtime", "driver_release",
                                                         "torch", "torch_cuda")}
    meta["machine"] = earlier.get("machine")
    meta["shapes"] = earlier.get("shapes") or list(dict.fromkeys(r["name"] for p in tq_parts for r in p.get("records", [])))
    meta.update(commit=commit, failures=earlier.get("failures", []),
                relabelled=f"recorded as {earlier['commit']}, relabelled by `{shlex.join(['python3', *sys.argv])}`")
    all_shapes = {s["name"]: s for s in shape_plan.load_shapes(BENCH / "shapes.json")}
    shapes = [all_shapes[n] for n in meta["shapes"] if n in all_shapes]
    combine(out_dir, meta, tq_parts, bf16_parts, shapes, earlier.get("crashed") or {}, reference)
    print(f"relabelled {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'} as {commit}")
    return 0


# -------------------------------------------------------------- dry run ----

READ_TBPS = 4.5  # the H200's measured read ceiling, for the estimate only


def estimate_seconds(shape, tq, bf16, flush_bytes=256 << 20):
    """Rough device seconds of one shape in each program (the bf16 one 0 when an earlier shape shares its problem)."""
    flush_us = flush_bytes / (READ_TBPS * 1e6)

    def call_us(nbytes, efficiency):
        return nbytes / (efficiency * READ_TBPS * 1e6) + 10

    efficiency = {"automatic": 0.8 if shape["D"] == 128 else 0.1, "hopper": 0.8, "hopper_warp_specialized": 0.8,
                  "cuda_generic": 0.7, "cuda_generic_scalar": 0.12}
    gemm_us = shape_plan.gemm_weight_bytes() / (0.85 * READ_TBPS * 1e6)
    tq_s = 0.3 + tq["instance_bytes"] * tq["instances"] / 2e11  # allocation, fills, tables, constants, plans
    # q_len > 1: the varlen form (the tensor-core kernel, a row tile per two tokens of a group of 8) and the rows
    # form (q_len reads).
    forms = ({"varlen": efficiency["automatic"] / max(1, shape["q_len"] / 2), "rows": efficiency["automatic"] / shape["q_len"],
              "varlen_warp_specialized": efficiency["automatic"] / 2}
             if shape["q_len"] > 1 else {request: efficiency[request] for request in shape["requests"]})
    for form_efficiency in forms.values():
        t = call_us(tq["bytes"], form_efficiency)
        us = tq["instances"] * (t + 20) + tq["layers"] * 2000
        us += shape_plan.single_step_replays(tq["layers"]) * (flush_us + t + 10)
        if tq["back_to_back_instances"]:
            us += tq["back_to_back_instances"] * 80 + 32 * tq["back_to_back_instances"] * t
        tq_s += us * 1e-6
    if tq["engine_layers"]:
        step = tq["engine_layers"] * (gemm_us + call_us(tq["bytes"], efficiency["automatic"]) + 5)
        tq_s += 0.2 + 93 * (flush_us + step) * 1e-6
    bf16_s = 0.0
    if bf16 is not None:
        impls = 1 if shape["lengths"] == "ragged" or shape["q_len"] > 1 else 3
        t = call_us(bf16["bytes"], 0.9)
        # Each capture synchronises and collects garbage (torch.cuda.graph): ~30 ms.
        bf16_s = 0.5 + bf16["instance_bytes"] * bf16["instances"] / 2e11 + impls * (
            0.3 + 0.03 * bf16["layers"] + shape_plan.single_step_replays(bf16["layers"]) * (flush_us + t + 10) * 1e-6)
        if bf16["back_to_back_instances"]:
            bf16_s += 0.2 + 32 * bf16["back_to_back_instances"] * t * 1e-6
        if bf16["engine_layers"]:
            bf16_s += 0.5 + 93 * (flush_us + bf16["engine_layers"] * (gemm_us + t + 5)) * 1e-6
    return tq_s, bf16_s


def compare_with_binary(binary, shapes, plans):
    """Differences between tqdecode_bench's own plan and shape_plan's, as text lines (empty: they agree)."""
    command = [binary, "--dry-run", "--shapes-file", BENCH / "shapes.json", "--shapes", ",".join(s["name"] for s in shapes)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        return [f"{binary} --dry-run failed: {result.stderr.strip() or result.stdout.strip()}"]
    theirs = {s["name"]: s for s in json.loads(result.stdout)["shapes"]}
    problems = []
    for shape, plan in zip(shapes, plans):
        other = theirs.get(shape["name"])
        if other is None:
            problems.append(f"{shape['name']}: missing from the binary's plan")
            continue
        for key, value in plan.items():
            if other.get(key) != value:
                problems.append(f"{shape['name']}: {key} is {other.get(key)} in tqdecode_bench, {value} here")
    return problems


def dry_run(args, shapes):
    problems = []
    names = {s["name"] for s in shape_plan.load_shapes(BENCH / "shapes.json")}
    for name, _, _, _, _ in TARGETS:
        if name not in names:
            problems.append(f"a target names {name}, which is not in shapes.json")
    for name, _, _ in README_ROWS:
        if name not in names:
            problems.append(f"a README row names {name}, which is not in shapes.json")
    print(f"{'shape':52s} {'tokens':>8s} {'width':>6s} {'MB/call':>9s} {'L':>2s} {'R':>4s} {'N':>3s} "
          f"{'tq GB':>6s} {'bf16 MB':>9s} {'bL':>3s} {'bR':>4s} {'bf16 GB':>7s} {'tq s':>5s} {'bf16 s':>6s}  options")
    plans, seen, totals = [], set(), [PROGRAM_STARTUP_S["tqdecode_bench"], PROGRAM_STARTUP_S["bf16_baseline"]]
    for shape in shapes:
        tq = shape_plan.tq_plan(shape)
        plans.append(tq)
        key = shape_plan.bf16_key(shape)
        bf16 = None if key in seen else shape_plan.bf16_plan(
            {**shape, "back_to_back": any(s["back_to_back"] for s in shapes if shape_plan.bf16_key(s) == key),
             "engine": any(s["engine"] for s in shapes if shape_plan.bf16_key(s) == key)})
        seen.add(key)
        tq_s, bf16_s = estimate_seconds(shape, tq, bf16)
        totals[0] += tq_s
        totals[1] += bf16_s
        options = [shape["preset"].replace("turboquant_", ""), f"Hq {shape['Hq']} Hk {shape['Hk']} D {shape['D']} "
                   f"bs {shape['block_size']}", shape["lengths"], shape["scores"]]
        options += [f"max_model_len {shape['max_model_len']}"] if shape["max_model_len"] else []
        options += [f"q_len {shape['q_len']}: varlen and rows"] if shape["q_len"] > 1 else []
        options += [f"tp {shape['tp']}"] if shape["tp"] else []
        options += ["requests " + "/".join(shape["requests"])] if len(shape["requests"]) > 1 else []
        bf16_text = (f"{bf16['bytes'] / 1e6:9.1f} {bf16['layers']:3d} {bf16['back_to_back_instances']:4d} "
                     f"{bf16['instance_bytes'] * bf16['instances'] / 1e9:7.2f}") if bf16 else \
            f"{'(shared)':>9s} {'':3s} {'':4s} {'':7s}"
        print(f"{shape['name']:52s} {tq['tokens']:8d} {tq['table_width']:6d} {tq['bytes'] / 1e6:9.1f} {tq['layers']:2d} "
              f"{tq['back_to_back_instances']:4d} {tq['engine_layers']:3d} {tq['instance_bytes'] * tq['instances'] / 1e9:6.2f} "
              f"{bf16_text} {tq_s:5.1f} {bf16_s:6.1f}  {', '.join(options)}")
    print(f"\n{len(shapes)} shapes; L: single-step layers, R: back-to-back instances, N: engine-like layers (bL, bR: "
          f"the bf16 program's). Estimated device time: tqdecode_bench {totals[0]:.0f} s, bf16_baseline "
          f"{totals[1]:.0f} s, together {(totals[0] + totals[1]) / 60:.1f} min (a rough model: H200 read ceiling "
          f"{READ_TBPS} TB/s, startup {PROGRAM_STARTUP_S}, fills at 0.2 TB/s with allocation; building "
          "tqdecode_bench not included).")
    binary = Path(args.build).resolve() / "tqdecode_bench"
    if binary.exists():
        mismatches = compare_with_binary(binary, shapes, plans)
        problems += mismatches
        print(f"{binary} --dry-run: " + ("the same plan (lengths, bytes, instance counts) as shape_plan.py"
                                          if not mismatches else f"{len(mismatches)} differences"))
        check = subprocess.run([binary, "--self-check"], capture_output=True, text=True, cwd=ROOT)
        print(check.stdout.rstrip())
        if check.returncode != 0:
            problems.append(f"{binary} --self-check failed: {check.stderr.strip()}")
    else:
        print(f"(no {binary}: the C++ plan and --self-check were not checked)")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


# ----------------------------------------------------------------- main ----

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default="build", help="CMake build directory [build]")
    parser.add_argument("--out", help="output directory (required unless --dry-run)")
    parser.add_argument("--quick", action="store_true", help="only the shapes marked quick (smoke test)")
    parser.add_argument("--shapes", help="comma list of shape names (both programs)")
    parser.add_argument("--commit", help="commit to record [git rev-parse HEAD, else unknown]")
    parser.add_argument("--no-build", action="store_true", help="use the tqdecode_bench binary as it is")
    parser.add_argument("--l2-flush", choices=("read", "write"), default="read",
                        help="how the L2 is flushed before each single step [read]")
    parser.add_argument("--reference-results", metavar="FILE",
                        help="an earlier run's results.json, for the target that D 128 does not get slower")
    parser.add_argument("--restarts", type=int, default=3, help="times a program that died is started again [3]")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and check it; run nothing on a GPU")
    parser.add_argument("--relabel-commit", metavar="SHA",
                        help="run nothing: merge the JSON of an earlier run in --out again, recorded under SHA")
    args = parser.parse_args()
    try:
        shapes = shape_plan.select(shape_plan.load_shapes(BENCH / "shapes.json"), args.quick,
                                   [s for s in (args.shapes or "").split(",") if s])
    except (shape_plan.ShapeError, OSError, ValueError) as error:
        sys.exit(f"run_bench: {error}")
    if args.dry_run:
        return dry_run(args, shapes)
    if not args.out:
        sys.exit("run_bench: --out DIR is required (unless --dry-run)")
    reference = load_reference(args.reference_results)
    if args.relabel_commit:
        return relabel(Path(args.out).resolve(), args.relabel_commit, reference)

    build_dir = Path(args.build).resolve()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = args.commit or git_commit()
    command = shlex.join(["python3", *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    if not args.no_build:
        build(build_dir, out_dir)
    for stale in [*out_dir.glob("tqdecode_bench*.json"), *out_dir.glob("bf16_baseline*.json")]:
        stale.unlink()  # never merge a previous run's numbers
    # The shape list is passed explicitly: the path baked into the binary is
    # where it was configured, which need not be this copy of the tree.
    common = ["--shapes-file", BENCH / "shapes.json", "--l2-flush", args.l2_flush]
    names = [s["name"] for s in shapes]
    tq_parts, tq_failures, tq_crashed = run_program(
        "tqdecode_bench", [build_dir / "tqdecode_bench", "--commit", commit, *common], names, out_dir, args.restarts)
    bf16_parts, bf16_failures, bf16_crashed = run_program(
        "bf16_baseline", [sys.executable, BENCH / "bf16_baseline.py", *common], names, out_dir, args.restarts)

    meta = {
        "date": date, "command": command, "commit": commit, "shapes": names,
        "gpu": first_of(tq_parts, "gpu") or first_of(bf16_parts, "gpu") or "unknown",
        "driver": first_of(tq_parts, "driver") or "unknown", "runtime": first_of(tq_parts, "runtime") or "unknown",
        "driver_release": driver_release(), "machine": machine_facts(build_dir),
        "torch": first_of(bf16_parts, "torch") or "unknown",
        "torch_cuda": first_of(bf16_parts, "cuda") or "unknown",
        "failures": [[label, log] for label, log in tq_failures + bf16_failures],
    }
    crashed = {"tqdecode_bench": tq_crashed, "bf16_baseline": bf16_crashed}
    records, targets = combine(out_dir, meta, tq_parts, bf16_parts, shapes, crashed, reference)
    print(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'RESULTS.md'}")
    print(f"targets: {sum(t['met'] is True for t in targets)} met, {sum(t['met'] is False for t in targets)} missed, "
          f"{sum(t['met'] is None for t in targets)} unknown")
    return 1 if meta["failures"] or not records else 0


if __name__ == "__main__":
    sys.exit(main())
