#!/usr/bin/env python3
"""bf16 decode-attention baseline for the shapes of bench/shapes.json.

What an engine without a compressed cache runs: one query token per sequence,
q [B, Hq, 1, D] against contiguous bf16 k/v [B, Hk, L, D] with grouped-query
attention. Timed for every scaled_dot_product_attention backend that accepts
the shape, and for a plain matmul + softmax written here, with the same
method as tqdecode_bench:

- R copies of the inputs, R * bytes per copy >= 1 GiB (R >= 2), so no copy is
  still in L2 when it is read again;
- one CUDA graph holding R calls, 30 replays each between its own pair of
  events, one call = median replay / R; an implementation that cannot be
  captured is timed eagerly (R calls between events) and marked graph=false.

Shapes that differ only in their cache format (preset, block size) are one
bf16 problem and are measured once. Writes JSON with --json.
"""
import argparse
import json
import math
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GIB = 1 << 30
ROTATION_BYTES = GIB
MIN_COPIES = 2
WARMUPS = 2
REPLAYS = 30
DEFAULT_SHAPES = Path(__file__).resolve().parent / "shapes.json"

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}


def load_shapes(path, quick, only):
    """The shape list with the C++ program's --quick / --shapes semantics."""
    shapes = json.loads(Path(path).read_text())["shapes"]
    if only:
        by_name = {s["name"]: s for s in shapes}
        missing = [name for name in only if name not in by_name]
        if missing:
            sys.exit(f"bf16_baseline: --shapes: no shape named {', '.join(missing)} in {path}")
        shapes = [by_name[name] for name in only]
    return shapes[:2] if quick else shapes


def sdpa_call(backend):
    def call(q, k, v):
        # The backend is chosen at call time, so the context must also hold during capture.
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=1.0 / math.sqrt(q.shape[-1]))
    return call


def matmul_softmax(q, k, v):
    """Own baseline: GQA by reshaping q to [B, Hk, G, D]; query head hq uses kv head hq // G."""
    batch, num_q_heads, _, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (1.0 / math.sqrt(head_dim))  # [B, Hk, G, L]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).view(batch, num_q_heads, 1, head_dim)


IMPLEMENTATIONS = {"matmul_softmax": matmul_softmax, **{name: sdpa_call(b) for name, b in SDPA_BACKENDS.items()}}


def median_ms(run, reps):
    """Median of `reps` event-timed runs on the current stream."""
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        times.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def time_implementation(fn, copies):
    """(microseconds per call, captured in a graph?, note, output of copy 0)."""
    # Eager first: it tells whether the backend accepts the shape at all, and
    # it is the warm-up (kernel selection, workspace allocation) capture needs.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refusing SDPA backend warns before it raises
        outputs = [fn(*c) for c in copies]
        torch.cuda.synchronize()
    reference = outputs[0]
    note = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            for c in copies:
                fn(*c)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = [fn(*c) for c in copies]
        for _ in range(WARMUPS):
            graph.replay()
        ms = median_ms(graph.replay, REPLAYS)
        del graph, captured
        return ms * 1e3 / len(copies), True, note, reference
    except RuntimeError as error:
        note = f"graph capture failed, timed eagerly: {str(error).splitlines()[0]}"
        torch.cuda.synchronize()

    def eager():
        for c in copies:
            fn(*c)

    for _ in range(WARMUPS):
        eager()
    ms = median_ms(eager, REPLAYS)
    return ms * 1e3 / len(copies), False, note, reference


def run_problem(batch, context, num_q_heads, num_kv_heads, head_dim):
    copy_bytes = 2 * batch * num_kv_heads * context * head_dim * 2 + 2 * batch * num_q_heads * head_dim * 2
    num_copies = max(MIN_COPIES, -(-ROTATION_BYTES // copy_bytes))
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    copies = [(randn(batch, num_q_heads, 1, head_dim), randn(batch, num_kv_heads, context, head_dim),
               randn(batch, num_kv_heads, context, head_dim)) for _ in range(num_copies)]
    results = {}
    reference = None
    for name, fn in IMPLEMENTATIONS.items():  # matmul_softmax first: it is the reference output
        try:
            us, graphed, note, output = time_implementation(fn, copies)
        except RuntimeError as error:  # refused shape or GQA, out of memory
            results[name] = {"us": None, "graph": None, "error": str(error).strip().splitlines()[0][:300]}
            print(f"    {name:16s} skipped: {results[name]['error']}", flush=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            continue
        if reference is None:
            reference = output.float()
        diff = (output.float() - reference).abs().max().item()
        results[name] = {"us": us, "graph": graphed, "max_abs_diff_vs_matmul": diff}
        if note:
            results[name]["note"] = note
        print(f"    {name:16s} {us:10.2f} us  {copy_bytes / (us * 1e-6) / 1e12:6.3f} TB/s"
              f"{'' if graphed else '  (eager)'}  max|diff| {diff:.3g}", flush=True)
        del output
        torch.cuda.empty_cache()
    del copies
    torch.cuda.empty_cache()
    return num_copies, copy_bytes, results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes-file", default=str(DEFAULT_SHAPES))
    parser.add_argument("--quick", action="store_true", help="only the first two shapes")
    parser.add_argument("--shapes", help="comma list of shape names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bf16_baseline: no CUDA device visible to PyTorch")

    shapes = load_shapes(args.shapes_file, args.quick, [s for s in (args.shapes or "").split(",") if s])
    print(f"bf16_baseline: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    measured = {}  # logical bf16 problem -> (copies, bytes, results)
    records = []
    for shape in shapes:
        key = (shape["B"], shape["L"], shape["Hq"], shape["Hk"], shape["D"])
        if key not in measured:
            print(f"  {shape['name']}: B={key[0]} L={key[1]} Hq={key[2]} Hk={key[3]} D={key[4]}", flush=True)
            measured[key] = run_problem(*key)
        else:
            print(f"  {shape['name']}: same bf16 problem as an earlier shape", flush=True)
        num_copies, copy_bytes, results = measured[key]
        timed = {name: r["us"] for name, r in results.items() if r["us"] is not None}
        best = min(timed, key=timed.get) if timed else None
        records.append({
            "name": shape["name"], "B": key[0], "L": key[1], "Hq": key[2], "Hk": key[3], "D": key[4],
            "copies": num_copies, "bytes": copy_bytes,
            "best_impl": best, "best_us": timed.get(best),
            "best_tbps": copy_bytes / (timed[best] * 1e-6) / 1e12 if best else None,
            "impls": results,
        })
    document = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "replays": REPLAYS, "records": records,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r["best_us"] is not None for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
