#!/usr/bin/env python3
"""bf16 decode-attention baseline for the shapes of bench/shapes.json,
measured the way tqdecode_bench measures tqdecode.

What an engine without a compressed cache runs: one query token per
sequence against bf16 K/V with grouped-query attention.
- Uniform lengths: q [B, Hq, 1, D] against contiguous k/v [B, Hk, L, D], every
  scaled_dot_product_attention backend that accepts the shape (flash, cuDNN,
  efficient; math with --with-math: it never wins and takes seconds).
- Ragged lengths: dense SDPA needs one length, so FlashAttention's varlen
  kernel (torch.ops.aten._flash_attention_forward with cumulative sequence
  offsets, the kernel behind torch.nn.attention.varlen) on packed k/v
  [tokens, Hk, D]: the bf16 attention in PyTorch that takes ragged lengths
  without padding.
- Several query tokens per sequence (q_len > 1, speculative decoding): the
  same varlen kernel with q_len query rows per sequence and its causal mask,
  which FlashAttention 2 aligns to the end of the keys (token j of q sees the
  first L - q + j + 1 positions), as engines call it for draft verification.
The inputs are N(0, 1); the backends' work does not depend on the scores.
Block-table width (max_model_len) and score distribution have no bf16
counterpart, so shapes that differ only in those share one measurement.

Method (the same as tqdecode_bench's):
- Layers: several instances, each its own q, k, v (and offsets).
- Single step (primary): each layer's call captured as its own CUDA graph;
  before every timed replay the L2 is flushed on the same stream outside the
  timed events (a reduction reading 4x the L2, at least 256 MiB; --l2-flush
  write zeroes it instead); replays cycle through the layers; median of at
  least 30. An op on a one-element tensor timed the same way is the floor.
- Back-to-back (throughput, shapes with "back_to_back", fastest
  implementation only): one graph of R calls over R layers with
  R * bytes >= 1 GiB, no flush, median replay / R.
- Engine-like step (shapes with "engine", fastest implementation): 16 layers
  in one graph, each torch.mm of its own activations [B, 8192] and 128 MiB of
  weights [8192, 8192] (cuBLAS) then its attention; per layer = (step - the
  GEMMs alone) / 16; floor = the same with the one-element op in place of
  the attention; the three graphs' replays interleaved, each after a flush.

Writes JSON with --json after every shape (a crash keeps the shapes before;
"in_progress" names the shape being measured). Exit status 3: the CUDA
context was lost (the shapes after it need a new process).
"""
import argparse
import json
import math
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import shape_plan

MIN_REPLAYS = 30
BACK_TO_BACK_WARMUPS = 2
BACK_TO_BACK_REPLAYS = 30
ENGINE_REPLAYS = 30
MIN_FLUSH_BYTES = 256 << 20
# An implementation whose output strays further from the fp32 reference is not counted: bf16 rounding of
# N(0, 1) inputs stays under 1e-3 at every shape measured, and a wrong mask (a causal one aligned to the
# start instead of the end) moves outputs by a tenth or more.
MAX_ABS_DIFF = 1e-2

SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa_math": SDPBackend.MATH,
}


class ContextLost(RuntimeError):
    pass


# ------------------------------------------------------------- inputs ----

def make_layer(shape, lengths, generator):
    """One layer's tensors: q, k, v, and for ragged lengths the offsets."""
    def randn(*size):
        return torch.randn(*size, generator=generator, device="cuda", dtype=torch.bfloat16)

    batch, num_q_heads, num_kv_heads, head_dim = shape["B"], shape["Hq"], shape["Hk"], shape["D"]
    q_len = shape["q_len"]
    if shape["lengths"] == "uniform" and q_len == 1:
        return {"q": randn(batch, num_q_heads, 1, head_dim), "k": randn(batch, num_kv_heads, shape["L"], head_dim),
                "v": randn(batch, num_kv_heads, shape["L"], head_dim)}
    tokens = sum(lengths)
    offsets = torch.tensor([0] + list(_cumulative(lengths)), dtype=torch.int32, device="cuda")
    return {"q": randn(batch * q_len, num_q_heads, head_dim), "k": randn(tokens, num_kv_heads, head_dim),
            "v": randn(tokens, num_kv_heads, head_dim), "cu_k": offsets,
            "cu_q": torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda"),
            "max_q": q_len, "max_k": max(lengths)}


def _cumulative(values):
    total = 0
    for value in values:
        total += value
        yield total


# ------------------------------------------------------ implementations ----

def sdpa_call(backend):
    def call(layer):
        # The backend is chosen at call time, so the context must also hold during capture.
        with sdpa_kernel(backend):
            q = layer["q"]
            return F.scaled_dot_product_attention(q, layer["k"], layer["v"], enable_gqa=True, scale=1.0 / math.sqrt(q.shape[-1]))
    return call


def flash_varlen(layer):
    """Causal where a sequence has several query rows (one row: the mask would allow every position anyway)."""
    q = layer["q"]
    output = torch.ops.aten._flash_attention_forward(
        q, layer["k"], layer["v"], layer["cu_q"], layer["cu_k"], layer["max_q"], layer["max_k"], 0.0,
        layer["max_q"] > 1, False, scale=1.0 / math.sqrt(q.shape[-1]))
    return output[0]


def reference(layer, shape, lengths):
    """fp32 matmul + softmax, one sequence at a time for packed layers: the output the others are checked against.
    Query row j of a sequence's q rows sees its first n - q + j + 1 positions."""
    group = shape["Hq"] // shape["Hk"]
    scale = 1.0 / math.sqrt(shape["D"])
    q_len = shape["q_len"]

    def attend(q, k, v):  # q [q_len, Hq, D], k/v [Hk, n, D] -> [q_len, Hq, D]
        n = k.shape[1]
        qg = q.float().permute(1, 0, 2).reshape(shape["Hk"], group * q_len, shape["D"])  # rows (head, token)
        scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale
        row_token = torch.arange(group * q_len, device=q.device) % q_len
        seen = torch.arange(n, device=q.device)[None, :] <= (n - q_len + row_token)[:, None]
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out = torch.matmul(probs, v.float()).view(shape["Hq"], q_len, shape["D"])
        return out.permute(1, 0, 2)

    if shape["lengths"] == "uniform" and q_len == 1:
        return torch.stack([attend(layer["q"][b, :, 0][None], layer["k"][b], layer["v"][b])[0]
                            for b in range(shape["B"])])
    rows, start = [], 0
    for b, n in enumerate(lengths):
        k = layer["k"][start:start + n].transpose(0, 1)
        v = layer["v"][start:start + n].transpose(0, 1)
        rows.append(attend(layer["q"][b * q_len:(b + 1) * q_len], k, v))
        start += n
    return torch.cat(rows)


def implementations(shape, with_math):
    if shape["lengths"] == "ragged" or shape["q_len"] > 1:
        return {"flash_varlen": flash_varlen}
    return {name: sdpa_call(backend) for name, backend in SDPA_BACKENDS.items() if with_math or name != "sdpa_math"}


# -------------------------------------------------------------- timing ----

class L2Flush:
    """Evicts the L2: a reduction reading 4x its size (at least 256 MiB), or zeroing the buffer."""

    def __init__(self, kind):
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        self.kind = kind
        self.bytes = max(MIN_FLUSH_BYTES, 4 * l2_bytes)
        self.buffer = torch.zeros(self.bytes // 4, dtype=torch.float32, device="cuda")
        self.sink = torch.zeros((), dtype=torch.float32, device="cuda")

    def __call__(self):
        if self.kind == "write":
            self.buffer.zero_()
        else:
            torch.sum(self.buffer, dim=0, out=self.sink)


def timed(runs, flush, replays, warmups):
    """Event-timed replays: run i is runs[i % len(runs)], each after a flush (if any) outside its events.
    Returns the milliseconds of each run, grouped by runs' index."""
    count = len(runs)
    for i in range(warmups):
        if flush:
            flush()
        runs[i % count]()
    events = []
    for i in range(replays):
        if flush:
            flush()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runs[i % count]()
        stop.record()
        events.append((start, stop))
    torch.cuda.synchronize()
    grouped = [[] for _ in range(count)]
    for i, (start, stop) in enumerate(events):
        grouped[i % count].append(start.elapsed_time(stop))
    return grouped


def spread(milliseconds):
    return {"median_us": statistics.median(milliseconds) * 1e3, "min_us": min(milliseconds) * 1e3,
            "max_us": max(milliseconds) * 1e3, "replays": len(milliseconds)}


def capture(body, pool):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        body()
    return graph


def warm_up_on_side_stream(body):
    """As torch.cuda.graphs recommends before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)


def single_steps(fn, layers, flush, pool):
    """One graph per layer holding one call; replays cycled through them after a flush each."""
    warm_up_on_side_stream(lambda: [fn(layer) for layer in layers])
    graphs = [capture(lambda layer=layer: fn(layer), pool) for layer in layers]
    replays = shape_plan.single_step_replays(len(graphs), MIN_REPLAYS)
    grouped = timed([g.replay for g in graphs], flush, replays, warmups=len(graphs))
    return spread([ms for group in grouped for ms in group])


def back_to_back(fn, layers, pool):
    graph = capture(lambda: [fn(layer) for layer in layers], pool)
    grouped = timed([graph.replay], None, BACK_TO_BACK_REPLAYS, BACK_TO_BACK_WARMUPS)
    return statistics.median(grouped[0]) * 1e3 / len(layers)


def measure_floor(flush, pool):
    tiny = torch.zeros(1, device="cuda")
    graph = capture(tiny.zero_, pool)
    grouped = timed([graph.replay], flush, MIN_REPLAYS, warmups=1)
    return spread(grouped[0])


class WeightGemms:
    """Each engine layer's own bf16 weights [8192, 8192] (128 MiB) and activations [B, 8192]."""

    def __init__(self, layers, generator):
        dim = shape_plan.GEMM_DIM
        self.weights = [torch.randn(dim, dim, generator=generator, device="cuda", dtype=torch.bfloat16) * 0.01
                        for _ in range(layers)]
        self.generator = generator
        self.batch = None

    def set_batch(self, batch):
        if batch != self.batch:
            dim = shape_plan.GEMM_DIM
            self.inputs = [torch.randn(batch, dim, generator=self.generator, device="cuda", dtype=torch.bfloat16)
                           for _ in self.weights]
            self.outputs = [torch.empty(batch, dim, device="cuda", dtype=torch.bfloat16) for _ in self.weights]
            self.batch = batch

    def __call__(self, i):
        torch.mm(self.inputs[i], self.weights[i], out=self.outputs[i])


def engine_step(fn, layers, gemms, flush, pool):
    tiny = torch.zeros(1, device="cuda")
    count = len(layers)

    def gemms_only():
        for i in range(count):
            gemms(i)

    def gemms_empty():
        for i in range(count):
            gemms(i)
            tiny.zero_()

    def step():
        for i, layer in enumerate(layers):
            gemms(i)
            fn(layer)

    warm_up_on_side_stream(step)
    graphs = [capture(body, pool) for body in (gemms_only, gemms_empty, step)]
    grouped = timed([g.replay for g in graphs], flush, 3 * ENGINE_REPLAYS, warmups=3)
    alone, empty, full = (spread(g) for g in grouped)
    return {"layers": count, "status": "ok", "gemms": alone, "gemms_empty": empty, "step": full,
            "per_layer_us": (full["median_us"] - alone["median_us"]) / count,
            "floor_per_layer_us": (empty["median_us"] - alone["median_us"]) / count, "error": None}


# ------------------------------------------------------------ a problem ----

def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def check_context():
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:  # a sticky error (illegal address, ...): nothing after it can run
        raise ContextLost(first_line(error)) from error


def measure_problem(shape, needs_back_to_back, needs_engine, flush, gemms, with_math):
    plan = shape_plan.bf16_plan({**shape, "back_to_back": needs_back_to_back, "engine": needs_engine})
    lengths = shape_plan.sequence_lengths(shape)
    generator = torch.Generator(device="cuda").manual_seed(1)
    layers = [make_layer(shape, lengths, generator) for _ in range(plan["instances"])]
    expected = reference(layers[0], shape, lengths)
    pool = torch.cuda.graph_pool_handle()
    impls, best = {}, None
    for name, fn in implementations(shape, with_math).items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a refusing SDPA backend warns before it raises
                output = fn(layers[0])
                torch.cuda.synchronize()
            diff = (output.float().reshape(expected.shape) - expected).abs().max().item()
            if not diff <= MAX_ABS_DIFF:  # NaN too
                raise RuntimeError(f"output differs from the fp32 reference by {diff:.3g} (more than {MAX_ABS_DIFF})")
            result = {"single": single_steps(fn, layers[:plan["layers"]], flush, pool), "max_abs_diff_vs_reference": diff}
            result["us"] = result["single"]["median_us"]
            print(f"    {name:16s} single step {result['us']:10.2f} us  max|diff| {diff:.3g}", flush=True)
        except RuntimeError as error:  # refused shape or GQA, out of memory, capture failure
            check_context()
            result = {"us": None, "error": first_line(error)}
            print(f"    {name:16s} skipped: {result['error']}", flush=True)
        impls[name] = result
        if result["us"] is not None and (best is None or result["us"] < impls[best]["us"]):
            best = name
        torch.cuda.empty_cache()
    record = {"status": "ok" if best else "error", "impls": impls, "best_impl": best,
              "best_us": impls[best]["us"] if best else None, "back_to_back_us": None, "engine": None,
              "error": None if best else "no implementation ran"}
    if best and plan["back_to_back_instances"]:
        record["back_to_back_us"] = back_to_back(implementations(shape, with_math)[best],
                                                 layers[:plan["back_to_back_instances"]], pool)
        print(f"    {best:16s} back-to-back {record['back_to_back_us']:9.2f} us", flush=True)
    if best and plan["engine_layers"]:
        try:
            gemms.set_batch(shape["B"])
            record["engine"] = engine_step(implementations(shape, with_math)[best], layers[:plan["engine_layers"]],
                                           gemms, flush, pool)
            e = record["engine"]
            print(f"    engine-like, {e['layers']} layers: GEMMs alone {e['gemms']['median_us']:.1f} us, with "
                  f"attention {e['step']['median_us']:.1f} us: {e['per_layer_us']:.2f} us per layer "
                  f"(floor {e['floor_per_layer_us']:.2f})", flush=True)
        except RuntimeError as error:
            check_context()
            record["engine"] = {"status": "error", "error": first_line(error)}
    del layers
    torch.cuda.empty_cache()
    return plan, record


# ---------------------------------------------------------------- main ----

def write_json(path, document):
    if not path:
        return
    partial = Path(str(path) + ".partial")
    partial.write_text(json.dumps(document, indent=1) + "\n")
    os.replace(partial, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes-file", default=str(shape_plan.DEFAULT_SHAPES))
    parser.add_argument("--quick", action="store_true", help="only the shapes marked quick")
    parser.add_argument("--shapes", help="comma list of shape names")
    parser.add_argument("--l2-flush", choices=("read", "write"), default="read")
    parser.add_argument("--with-math", action="store_true", help="also time SDPA's math backend")
    args = parser.parse_args()
    try:
        shapes = shape_plan.select(shape_plan.load_shapes(args.shapes_file), args.quick,
                                   [s for s in (args.shapes or "").split(",") if s])
    except (shape_plan.ShapeError, OSError, ValueError) as error:
        sys.exit(f"bf16_baseline: {error}")
    if not torch.cuda.is_available():
        sys.exit("bf16_baseline: no CUDA device visible to PyTorch")

    print(f"bf16_baseline: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    flush = L2Flush(args.l2_flush)
    pool = torch.cuda.graph_pool_handle()
    floor = measure_floor(flush, pool)
    print(f"  L2 flush before every timed replay: {args.l2_flush} of {flush.bytes >> 20} MiB; floor (an op on a "
          f"one-element tensor per replay): median {floor['median_us']:.2f} us", flush=True)
    # What each logical bf16 problem must measure, over every selected shape that shares it.
    needs = {}
    for shape in shapes:
        key = shape_plan.bf16_key(shape)
        back, engine = needs.get(key, (False, False))
        needs[key] = (back or shape["back_to_back"], engine or shape["engine"])
    engine_layers = shape_plan.ENGINE_LAYERS if any(engine for _, engine in needs.values()) else 0
    gemms = WeightGemms(engine_layers, torch.Generator(device="cuda").manual_seed(2)) if engine_layers else None

    document = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "method": {"l2_flush": {"kind": args.l2_flush, "bytes": flush.bytes}, "min_replays": MIN_REPLAYS,
                           "back_to_back_replays": BACK_TO_BACK_REPLAYS, "engine_replays": ENGINE_REPLAYS},
                "floor": floor, "in_progress": None, "aborted": None, "records": []}
    measured = {}  # bf16 problem -> (first shape's name, plan, record)
    status = 0
    for shape in shapes:
        document["in_progress"] = shape["name"]
        write_json(args.json, document)
        key = shape_plan.bf16_key(shape)
        plan = shape_plan.bf16_plan(shape)
        base = {"name": shape["name"], "B": shape["B"], "L": shape["L"], "Hq": shape["Hq"], "Hk": shape["Hk"],
                "D": shape["D"], "lengths": shape["lengths"], "q_len": shape["q_len"], "tokens": plan["tokens"],
                "max_len": plan["max_len"], "bytes": plan["bytes"]}
        if key in measured:
            first, first_plan, record = measured[key]
            print(f"  {shape['name']}: same bf16 problem as {first}", flush=True)
            document["records"].append({**base, **first_plan, **record, "same_as": first})
        else:
            print(f"  {shape['name']}: B={shape['B']} L={shape['L']} Hq={shape['Hq']} Hk={shape['Hk']} D={shape['D']} "
                  f"{shape['lengths']} ({plan['bytes'] / 1e6:.1f} MB per call)", flush=True)
            try:
                try:
                    problem_plan, record = measure_problem(shape, *needs[key], flush, gemms, args.with_math)
                except ContextLost:
                    raise
                except RuntimeError as error:
                    check_context()
                    problem_plan, record = plan, {"status": "error", "error": first_line(error)}
                    print(f"    ERROR: {record['error']}", flush=True)
            except ContextLost as error:
                document["aborted"] = f"the CUDA context was lost while measuring {shape['name']}: {error}"
                document["records"].append({**base, "status": "error", "error": document["aborted"], "same_as": None})
                write_json(args.json, document)
                print(f"bf16_baseline: {document['aborted']}; stopping", file=sys.stderr, flush=True)
                return 3
            measured[key] = (shape["name"], problem_plan, record)
            document["records"].append({**base, **problem_plan, **record, "same_as": None})
            if record["status"] != "ok":
                status = 1
    document["in_progress"] = None
    write_json(args.json, document)
    if args.json:
        print(f"wrote {args.json}")
    return status


if __name__ == "__main__":
    sys.exit(main())
