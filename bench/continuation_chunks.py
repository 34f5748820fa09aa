#!/usr/bin/env python3
"""Continuation chunks as vLLM's TurboQuant backend sends them on CUDA: one
request's q new tokens as q rows of ``token_slots_decode_attention`` with
``seq_lens`` rising by one and the request's block-table row expanded
(stride 0), in an eager engine-like step (every layer a bf16 GEMM
[q, 8192] x [8192, 8192] over its own weights, then its attention).

Three ways to run the rows, per (context, q): ``rows`` (each row reads the
cache), ``chunk`` (the engine function's route from ``CONTINUATION_MIN_ROWS``
rows: the device decides that the rows are one chunk, the rows' call runs
with lengths 0 and one varlen call serves them), ``varlen`` (the varlen call
alone: what a caller that knows it sends a chunk gets). The cost per layer is
(step - the GEMMs alone) / layers, median over the steps, from CUDA events
around each step, so any GPU idle time between the calls counts.

Usage: python3 bench/continuation_chunks.py [--contexts 4096 32768]
[--rows 2 4 8 16 32] [--layers 8] [--steps 20] [--out results.json]
(needs the binding: PYTHONPATH=python, built with -DTQDECODE_PYTHON=ON).
"""

import argparse
import json
import statistics

import torch

import tqdecode

PRESET, HQ, HK, D, BLOCK = "turboquant_4bit_nc", 64, 8, 128, 16
HIDDEN = 8192


class Layer:
    """A cache of `context` tokens in the token_slots order, stored with the
    engine's semantics from random keys and values, its block-table row in
    random block order, its constants and its GEMM weights."""

    def __init__(self, context, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        blocks = (context + BLOCK - 1) // BLOCK
        self.cache = tqdecode.allocate_cache(blocks, BLOCK, HK, D, PRESET, device="cuda", cache_order="token_slots")
        self.centroids, self.Pi, self.PiT = tqdecode.make_model_constants(PRESET, D, seed=seed, device="cuda")
        self.table = torch.randperm(blocks, generator=g, device="cuda").to(torch.int32).unsqueeze(0)
        positions = torch.arange(context, device="cuda")
        slots = self.table[0].long()[positions // BLOCK] * BLOCK + positions % BLOCK
        for first in range(0, context, 8192):
            n = min(8192, context - first)
            key = torch.randn(n, HK, D, generator=g, device="cuda")
            value = torch.randn(n, HK, D, generator=g, device="cuda")
            tqdecode.store(key, value, self.cache, slots[first:first + n], self.Pi, self.centroids, PRESET,
                           cache_order="token_slots")
        self.weight = torch.randn(HIDDEN, HIDDEN, generator=g, device="cuda", dtype=torch.bfloat16) * 0.01
        self.context = context


def run_step(layers, hidden, queries, outputs, mode):
    for layer, query, out in zip(layers, queries, outputs):
        torch.matmul(hidden, layer.weight, out=hidden)
        if mode == "gemm":
            continue
        q = query.shape[0]
        seq_lens = torch.arange(layer.context - q + 1, layer.context + 1, dtype=torch.int32, device="cuda")
        if mode == "varlen":
            starts = torch.arange(0, 2 * q, q, dtype=torch.int32, device="cuda")
            tqdecode.varlen_decode_attention(query, layer.cache, layer.table, seq_lens[-1:], starts, layer.Pi,
                                             layer.centroids, D ** -0.5, 4, 4, max_query_len=q, PiT=layer.PiT,
                                             output_buf=out, cache_order="token_slots", norm_correction=True)
        else:
            tqdecode.token_slots_decode_attention(query, layer.cache, layer.table.expand(q, -1), seq_lens, layer.Pi,
                                                  layer.centroids, D ** -0.5, 4, 64, 4, norm_correction=True,
                                                  PiT=layer.PiT, output_buf=out)


def time_steps(layers, q, mode, steps, graph=False):
    hidden = torch.randn(q, HIDDEN, device="cuda", dtype=torch.bfloat16)
    queries = [torch.randn(q, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in layers]
    outputs = [torch.empty(q, HQ, D, device="cuda", dtype=torch.bfloat16) for _ in layers]
    saved = tqdecode.CONTINUATION_MIN_ROWS
    tqdecode.CONTINUATION_MIN_ROWS = 2 if mode == "chunk" else 1 << 30
    try:
        step_graph = None
        if graph:  # the step captured once (after an eager warm-up for the buffer pool), then replayed
            run_step(layers, hidden, queries, outputs, mode)
            torch.cuda.synchronize()
            step_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step_graph):
                run_step(layers, hidden, queries, outputs, mode)
        times = []
        for step in range(steps + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            if step_graph is not None:
                step_graph.replay()
            else:
                run_step(layers, hidden, queries, outputs, mode)
            end.record()
            end.synchronize()
            if step >= 3:
                times.append(start.elapsed_time(end) * 1000.0)
        return statistics.median(times)
    finally:
        tqdecode.CONTINUATION_MIN_ROWS = saved


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 32, 128])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--graphs", action="store_true",
                        help="also each step captured in one CUDA graph: the GPU's time without the host's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("continuation_chunks: no CUDA device, nothing measured")
        return
    print(f"# {torch.cuda.get_device_name()}, {PRESET} token_slots with norm correction, Hq {HQ}, Hk {HK}, D {D}, "
          f"block size {BLOCK}, {args.layers} layers, median of {args.steps} eager steps")
    modes = ("rows", "chunk", "varlen")
    header = "| context | q | GEMMs alone (us a step) | rows (us a layer) | chunk (route) | varlen alone |"
    if args.graphs:
        header += " in a graph: GEMMs alone | rows | chunk (route) | varlen alone |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    results = []
    for context in args.contexts:
        layers = [Layer(context, seed) for seed in range(args.layers)]
        for q in args.rows:
            gemm = time_steps(layers, q, "gemm", args.steps)
            cost = {mode: (time_steps(layers, q, mode, args.steps) - gemm) / args.layers for mode in modes}
            result = {"context": context, "q": q, "gemm_step_us": gemm, **{f"{m}_us": v for m, v in cost.items()}}
            line = f"| {context} | {q} | {gemm:.1f} | " + " | ".join(f"{cost[m]:.1f}" for m in modes) + " |"
            if args.graphs:
                graph_gemm = time_steps(layers, q, "gemm", args.steps, graph=True)
                graph_cost = {m: (time_steps(layers, q, m, args.steps, graph=True) - graph_gemm) / args.layers
                              for m in modes}
                result.update({"graph_gemm_step_us": graph_gemm, **{f"graph_{m}_us": v for m, v in graph_cost.items()}})
                line += f" {graph_gemm:.1f} | " + " | ".join(f"{graph_cost[m]:.1f}" for m in modes) + " |"
            results.append(result)
            print(line, flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "layers": args.layers, "steps": args.steps,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
