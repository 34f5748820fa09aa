"""Tensor-parallel decode attention with tqdecode under torch.distributed.

    PYTHONPATH=python torchrun --nproc-per-node N python/examples/tp_decode.py [--device cpu|cuda] [options]

One attention layer of a model with 64 query heads and 8 kv heads (head size
128) is sharded by kv heads across N ranks, as engines do under tensor
parallelism: rank r holds kv heads [r*8/N, (r+1)*8/N) of the cache and the
matching query heads. Every rank builds the same full K/V, queries and sinks
from --seed, stores its shard with tqdecode.store into its own cache and
decodes it with tqdecode.turboquant_decode_attention: on CUDA inside a CUDA
graph (captured once, replayed), on the CPU with eager calls of the C++
reference. The outputs are all-gathered (NCCL on GPUs, gloo on the CPU) and
rank 0 checks

  (a) each rank's output bitwise against the same shard stored and decoded
      alone (a fresh cache and an eager call on rank 0's device);
  (b) the gathered output against one decode of all 64 heads (the same
      function, within the tolerance below) and against exact fp32 attention
      on the unquantized K/V (docs/FORMAT.md section 6: the quantization error,
      measured and bounded).

It prints each rank's decode time (median over --iters CUDA-graph replays
timed with CUDA events, or eager calls on the CPU) and exits non-zero when a
check fails.
"""

import argparse
import datetime
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tqdecode

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 8, 128

# (b), all heads in one process: the same function, but on the GPU the
# split-KV partition count follows B * Hk, which differs between a shard and
# the whole model, so the fp32 summation order and the tensor-core operand
# rounding relative to each partition's running max differ. This is the
# bound docs/DESIGN.md and the binding's tests use for two computations of
# the same function: cosine, relative L2, max abs error / peak |expected|.
SAME_FUNCTION_TOLERANCE = (0.9999, 1e-2, 2e-2)

# (b), exact attention: the quantization error of each preset, from the
# bounds of tests/cpu/test_reference.cpp for softmax that is not sharply
# peaked (cosine above, relative L2 below).
QUANTIZATION_BOUNDS = {
    "turboquant_4bit_nc": (0.985, 0.17),
    "turboquant_k3v4_nc": (0.97, 0.24),
    "turboquant_3bit_nc": (0.95, 0.33),
    "turboquant_k8v4": (0.985, 0.17),
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda when a CUDA device is available")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                        help="collective backend (default: nccl for cuda, gloo for cpu; gloo on cuda gathers through "
                             "host memory and lets ranks share a GPU)")
    parser.add_argument("--preset", default="turboquant_4bit_nc", choices=sorted(QUANTIZATION_BOUNDS),
                        help="default: turboquant_4bit_nc")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default: 16 on cuda, 3 on cpu)")
    parser.add_argument("--context", type=int, default=None,
                        help="longest sequence in tokens; the others are random shorter lengths "
                             "(default: 4096 on cuda, 333 on cpu)")
    parser.add_argument("--block-size", type=int, default=16, help="default: 16")
    parser.add_argument("--seed", type=int, default=0, help="of the K/V, queries, sinks and model constants (default: 0)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed decodes per rank (default: 200 graph replays on cuda, 3 eager calls on cpu)")
    parser.add_argument("--no-sinks", action="store_true", help="decode without attention sinks")
    parser.add_argument("--corrupt-rank", type=int, default=None,
                        help="add one ulp to one output element of this rank before the gather, to see check (a) "
                             "fail (the tests use it)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    args.backend = args.backend or ("nccl" if cuda else "gloo")
    args.batch = args.batch if args.batch is not None else (16 if cuda else 3)
    args.context = args.context if args.context is not None else (4096 if cuda else 333)
    args.iters = args.iters if args.iters is not None else (200 if cuda else 3)
    if args.batch < 1 or args.context < 1 or args.iters < 1:
        parser.error("--batch, --context and --iters must be at least 1")
    return args


class Model:
    """The full layer on the host, the same on every rank (built from the seed):
    bf16 K/V [tokens, Hk, D] in shuffled cache blocks, queries [B, Hq, D] and sinks."""

    def __init__(self, args):
        generator = torch.Generator().manual_seed(args.seed)
        self.preset, self.block_size, self.scale = args.preset, args.block_size, 1 / math.sqrt(HEAD_DIM)
        lengths = torch.randint(1, args.context + 1, (args.batch,), generator=generator)
        lengths[0] = args.context  # the longest sequence sets the block table's width
        self.seq_lens = lengths.to(torch.int32)
        blocks_per_seq = [math.ceil(length / args.block_size) for length in lengths.tolist()]
        self.num_blocks = sum(blocks_per_seq) + 2  # two blocks no sequence uses
        order = torch.randperm(self.num_blocks, generator=generator)
        self.block_table = torch.full((args.batch, max(blocks_per_seq)), -1, dtype=torch.int32)
        slots, start = [], 0
        for i, (length, count) in enumerate(zip(lengths.tolist(), blocks_per_seq)):
            self.block_table[i, :count] = order[start:start + count]
            start += count
            t = torch.arange(length)
            slots.append(self.block_table[i, t // args.block_size].long() * args.block_size + t % args.block_size)
        self.slot_mapping = torch.cat(slots)
        tokens = self.slot_mapping.numel()
        # Keys with non-zero channel means and a few outlier channels; values with a non-zero mean.
        channel_mean = torch.randn(HEAD_DIM, generator=generator) * 0.5
        channel_scale = torch.ones(HEAD_DIM)
        channel_scale[torch.randperm(HEAD_DIM, generator=generator)[:4]] = 8.0
        self.key = (torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) * channel_scale
                    + channel_mean).to(torch.bfloat16)
        self.value = (torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, generator=generator) + 0.3).to(torch.bfloat16)
        self.query = torch.randn(args.batch, NUM_Q_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
        self.sinks = None if args.no_sinks else torch.randn(NUM_Q_HEADS, generator=generator) * 2
        self.centroids, self.Pi, _ = tqdecode.make_model_constants(args.preset, HEAD_DIM, seed=args.seed)
        self.decode_kwargs = tqdecode.cache_layout(args.preset, HEAD_DIM, args.block_size, NUM_KV_HEADS).decode_kwargs()


class Shard:
    """kv heads [kv_begin, kv_end) of the model on `device`: a cache of its own
    holding them, and the decode arguments of the matching query heads."""

    def __init__(self, model, kv_begin, kv_end, device):
        group = NUM_Q_HEADS // NUM_KV_HEADS
        self.kv_heads, self.q_heads = (kv_begin, kv_end), (kv_begin * group, kv_end * group)
        self.model, self.device = model, device
        self.Pi = None if model.Pi is None else model.Pi.to(device)
        self.centroids = None if model.centroids is None else model.centroids.to(device)
        self.kv_cache = tqdecode.allocate_cache(model.num_blocks, model.block_size, kv_end - kv_begin, HEAD_DIM,
                                                model.preset, device=device)
        tqdecode.store(model.key[:, kv_begin:kv_end].to(device), model.value[:, kv_begin:kv_end].to(device),
                       self.kv_cache, model.slot_mapping.to(device), self.Pi, self.centroids, model.preset,
                       check=True)  # on CUDA: raise, not only count, when a token fails the store's checks
        # A strided view of the full query, as engines slice their qkv tensor.
        self.query = model.query.to(device)[:, self.q_heads[0]:self.q_heads[1]]
        self.block_table, self.seq_lens = model.block_table.to(device), model.seq_lens.to(device)
        self.sinks = None if model.sinks is None else model.sinks[self.q_heads[0]:self.q_heads[1]].to(device)
        self.output = torch.empty(self.query.shape, dtype=self.query.dtype, device=device)
        self.buf_holder = type("BufHolder", (), {})()  # stands in for the engine's attention layer

    def decode_args(self):
        args = (self.query, self.kv_cache, self.block_table, self.seq_lens, self.Pi, self.centroids, self.model.scale)
        return args, {**self.model.decode_kwargs, "sinks": self.sinks, "buf_holder": self.buf_holder}

    def decode(self):
        """Writes self.output (the engine passes output_buf)."""
        args, kwargs = self.decode_args()
        return tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=self.output)

    def path(self):
        args, kwargs = self.decode_args()
        return tqdecode.decode_path(*args, **kwargs)


def decoded_alone(model, kv_begin, kv_end, device):
    """The shard stored into a fresh cache and decoded by one eager call."""
    shard = Shard(model, kv_begin, kv_end, device)
    shard.output.fill_(float("nan"))
    return shard.decode().clone()


def median_decode_seconds_cuda(shard, iters):
    """Captures the decode into a CUDA graph and times `iters` replays with events."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: plan, buffer pool, fp32 constants on buf_holder
        shard.decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shard.decode()
    shard.output.fill_(float("nan"))  # the checked output is what the replays write
    for _ in range(min(iters, 20)):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def median_decode_seconds_cpu(shard, iters):
    shard.output.fill_(float("nan"))
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        shard.decode()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def exact_attention(model, device):
    """fp32 [B, Hq, D]: softmax attention on the unquantized K/V, sinks in the denominator."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    key, value = model.key.to(device).float(), model.value.to(device).float()
    sinks = None if model.sinks is None else model.sinks.to(device)
    out = torch.zeros(model.query.shape, dtype=torch.float32, device=device)
    start = 0  # the tokens are the sequences' tokens in order
    for i, length in enumerate(model.seq_lens.tolist()):
        k = key[start:start + length].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        v = value[start:start + length].repeat_interleave(group, dim=1).transpose(0, 1)
        start += length
        scores = model.scale * torch.einsum("hd,hld->hl", model.query[i].to(device).float(), k)
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None]], dim=1)
        weights = torch.softmax(scores, dim=1)[:, :length]
        out[i] = torch.einsum("hl,hld->hd", weights, v)
    return out


def errors(got, expected):
    """(cosine similarity, relative L2 error, max abs error / peak |expected|), in double."""
    got, expected = got.double().flatten(), expected.double().flatten()
    cosine = F.cosine_similarity(got, expected, dim=0).item()
    relative = ((got - expected).norm() / expected.norm()).item()
    peak = ((got - expected).abs().max() / expected.abs().max()).item()
    return cosine, relative, peak


def run_checks(model, gathered, world_size, device):
    """Rank 0's checks; prints one line per check and returns whether all passed."""
    results = []

    def report(passed, text):
        results.append(passed)
        print(f"{'PASS' if passed else 'FAIL'}  {text}")

    per_rank = NUM_KV_HEADS // world_size
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for rank in range(world_size):
        kv_begin, kv_end = rank * per_rank, (rank + 1) * per_rank
        alone = decoded_alone(model, kv_begin, kv_end, device).cpu()
        got = gathered[:, kv_begin * group:kv_end * group]
        differing = int((got.view(torch.int16) != alone.view(torch.int16)).sum())
        report(differing == 0, f"(a) rank {rank} (kv heads [{kv_begin}, {kv_end})) == the shard decoded alone: "
                               f"{differing} of {got.numel()} elements differ in their bits")

    whole = decoded_alone(model, 0, NUM_KV_HEADS, device).cpu()
    measured = errors(gathered, whole)
    differing = int((gathered.view(torch.int16) != whole.view(torch.int16)).sum())
    cosine, relative, peak = SAME_FUNCTION_TOLERANCE
    report(measured[0] > cosine and measured[1] < relative and measured[2] < peak,
           f"(b) gathered vs one process decoding all {NUM_Q_HEADS} heads: cosine {measured[0]:.7f}, "
           f"relative L2 {measured[1]:.2e}, max abs / peak {measured[2]:.2e} ({differing} of {whole.numel()} "
           f"elements differ); tolerance: cosine > {cosine}, relative L2 < {relative:g}, max abs / peak < {peak:g}")

    measured = errors(gathered, exact_attention(model, device).cpu())
    cosine, relative = QUANTIZATION_BOUNDS[model.preset]
    report(measured[0] > cosine and measured[1] < relative,
           f"(b) gathered vs exact fp32 attention on the unquantized K/V: cosine {measured[0]:.5f}, relative L2 "
           f"{measured[1]:.4f}; bound for {model.preset}: cosine > {cosine}, relative L2 < {relative}")
    return all(results)


def main():
    args = parse_args()
    if not dist.is_available():
        sys.exit("tp_decode.py: this torch has no torch.distributed")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if NUM_KV_HEADS % world_size != 0:
        sys.exit(f"tp_decode.py: {world_size} ranks do not divide the {NUM_KV_HEADS} kv heads; accepted: 1, 2, 4, 8")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("tp_decode.py: --device cuda, but no CUDA device is available")
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if args.backend == "nccl" and local_world_size > torch.cuda.device_count():
            sys.exit(f"tp_decode.py: {local_world_size} ranks per node but {torch.cuda.device_count()} GPUs; NCCL "
                     f"needs one GPU per rank (--backend gloo lets ranks share a GPU)")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        tqdecode.set_max_batch(args.batch)  # before any capture: the pool's rows
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=5),
                            device_id=device if args.backend == "nccl" else None)

    model = Model(args)
    per_rank = NUM_KV_HEADS // world_size
    shard = Shard(model, rank * per_rank, (rank + 1) * per_rank, device)
    if device.type == "cuda":
        seconds = median_decode_seconds_cuda(shard, args.iters)
        how = f"{args.iters} CUDA-graph replays"
    else:
        seconds = median_decode_seconds_cpu(shard, args.iters)
        how = f"{args.iters} eager calls"
    # Asked after the decodes: asked first, it would derive and cache the fp32
    # constants on buf_holder, and the first decode would take them as written
    # long before it (constants_stable) though their copy kernel just ran.
    path = shard.path()
    if args.corrupt_rank == rank:
        shard.output.view(torch.int16)[0, 0, 0] += 1  # one ulp in the last bit of the mantissa

    # Gather [world_size * B, Hq / N, D] (gloo gathers host tensors), then
    # put the ranks' query heads side by side: [B, Hq, D].
    local = shard.output if args.backend == "nccl" else shard.output.cpu()
    gathered = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(gathered, local)
    gathered = gathered.view(world_size, *local.shape).transpose(0, 1).reshape(model.query.shape).cpu()
    timings = [None] * world_size
    dist.all_gather_object(timings, (str(device), shard.kv_heads, shard.q_heads, path.path, seconds))

    passed = [True]
    if rank == 0:
        print(f"tqdecode tensor-parallel decode: {world_size} rank{'s' if world_size > 1 else ''} ({args.backend}), {args.preset}, "
              f"Hq {NUM_Q_HEADS}, Hk {NUM_KV_HEADS}, D {HEAD_DIM}, block size {args.block_size}, batch {args.batch}, "
              f"seq_lens {model.seq_lens.tolist()}, sinks {'off' if args.no_sinks else 'on'}")
        for r, (where, kv_heads, q_heads, path_name, rank_seconds) in enumerate(timings):
            print(f"rank {r}: {where}, kv heads [{kv_heads[0]}, {kv_heads[1]}), q heads [{q_heads[0]}, {q_heads[1]}), "
                  f"{path_name}: decode {rank_seconds * 1e6:.1f} us (median of {how})")
        passed = [run_checks(model, gathered, world_size, device)]
        print("all checks passed" if passed[0] else "a check failed")
    dist.broadcast_object_list(passed, src=0)
    dist.destroy_process_group()
    return 0 if passed[0] else 1


if __name__ == "__main__":
    sys.exit(main())
