#!/usr/bin/env python3
"""Host time of one eager call: what an engine that runs attention outside
CUDA graphs (vLLM's piecewise graphs, its continuation chunks, eager mode)
pays on the CPU per layer, beside the GPU's time.

Each entry point is called back to back with a small cache (the GPU's work
per call is shorter than the host's, so the host sets the pace); the time
per call is the host's time to issue a batch of calls, before the
synchronisation that follows it, median over rounds. The floor is an
in-place add on a 4-element CUDA tensor (one torch op, one launch).

Entries (token_slots cache, 4bit_nc with norm correction, Hq 64, Hk 8, D 128,
q rows of one request at 512 positions): ``rows`` the engine-signature
function over q rows of their own table rows; ``chunk`` the same over one
table row expanded (vLLM's continuation chunk, served by the
continuation_decode_out op); ``varlen`` varlen_decode_attention of the q
tokens as one sequence; ``decode op`` / ``varlen op`` the ops alone with
prepared arguments (the binding and the launcher without the Python
wrappers); ``blocks`` turboquant_decode_attention over the blocks order.

Usage: PYTHONPATH=python python3 bench/host_overhead.py [--rows 1 8 32]
[--calls 200] [--rounds 7] [--out host.json]
"""

import argparse
import json
import statistics
import time

import torch

import tqdecode

PRESET, HQ, HK, D, BLOCK, CONTEXT = "turboquant_4bit_nc", 64, 8, 128, 16, 512
ENTRIES = ("floor: torch add_", "rows", "chunk", "decode op", "varlen", "varlen op", "blocks")


def host_us_per_call(call, calls, rounds):
    """Median over rounds of the host's time per call to issue `calls` calls."""
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def entries(q):
    """{name: call} of every entry point for q rows (``chunk`` from CONTINUATION_MIN_ROWS rows)."""
    blocks = (CONTEXT + BLOCK - 1) // BLOCK
    slots = tqdecode.allocate_cache(blocks * q, BLOCK, HK, D, PRESET, device="cuda", cache_order="token_slots")
    soa = tqdecode.allocate_cache(blocks * q, BLOCK, HK, D, PRESET, device="cuda")
    centroids, Pi, PiT = tqdecode.make_model_constants(PRESET, D, device="cuda")
    holder = type("BufHolder", (), {})()
    query = torch.randn(q, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    own_rows = torch.arange(blocks * q, dtype=torch.int32, device="cuda").view(q, blocks)
    one_row = own_rows[:1]
    lengths = torch.arange(CONTEXT - q + 1, CONTEXT + 1, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, q], dtype=torch.int32, device="cuda")
    last = lengths[-1:].clone()
    scale = D ** -0.5
    engine = dict(norm_correction=True, PiT=PiT, output_buf=out, buf_holder=holder)

    def rows():
        tqdecode.token_slots_decode_attention(query, slots, own_rows, lengths, Pi, centroids, scale, 4, 64, 4,
                                              **engine)

    def chunk():
        tqdecode.token_slots_decode_attention(query, slots, one_row.expand(q, -1), lengths, Pi, centroids, scale, 4,
                                              64, 4, **engine)

    def varlen():
        tqdecode.varlen_decode_attention(query, slots, one_row, last, starts, Pi, centroids, scale, 4, 4,
                                         max_query_len=q, PiT=PiT, output_buf=out, buf_holder=holder,
                                         cache_order="token_slots", norm_correction=True)

    def blocks_order():
        tqdecode.turboquant_decode_attention(query, soa, own_rows, lengths, Pi, centroids, scale, 4, 64, 4, 64,
                                             PiT=PiT, output_buf=out, buf_holder=holder)

    constants = (centroids.contiguous(), PiT.contiguous(), scale, 4, 4, False, None, True, "token_slots", True)
    decode_args = (query, slots, own_rows, lengths, *constants)
    varlen_args = (query, slots, one_row, last, starts, q, *constants)
    small = torch.zeros(4, device="cuda")
    calls = {"floor: torch add_": lambda: small.add_(1), "rows": rows, "chunk": chunk,
             "decode op": lambda: tqdecode.ops.decode_out(*decode_args, out=out), "varlen": varlen,
             "varlen op": lambda: tqdecode.ops.varlen_decode_out(*varlen_args, out=out), "blocks": blocks_order}
    if q < tqdecode.CONTINUATION_MIN_ROWS:
        del calls["chunk"]
    return calls


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("host_overhead: no CUDA device, nothing measured")
        return
    print(f"# {torch.cuda.get_device_name()}, tqdecode {tqdecode.__version__}, torch {torch.__version__}: host us per "
          f"eager call, median of {args.rounds} rounds of {args.calls} calls")
    print("| q rows | " + " | ".join(ENTRIES) + " |")
    print("|---" * (len(ENTRIES) + 1) + "|")
    results = []
    for q in args.rows:
        measured = {name: host_us_per_call(call, args.calls, args.rounds) for name, call in entries(q).items()}
        results.append({"rows": q, "host_us": measured})
        print(f"| {q} | " + " | ".join(f"{measured[name]:.1f}" if name in measured else "-" for name in ENTRIES) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls,
                       "rounds": args.rounds, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
