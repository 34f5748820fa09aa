#!/usr/bin/env python3
"""Runs vLLM's own TurboQuant store and decode kernels beside tqdecode's, on
the CPU, on the same data (docs/VLLM.md, "Checked against vLLM").

vLLM's CUDA TurboQuant backend stores with `triton_turboquant_store` and
decodes with `triton_turboquant_decode_attention` (Triton kernels,
vllm/v1/attention/ops/). This tool loads those two modules from a vLLM
wheel or installed tree, without the rest of vLLM (stand-ins for
`vllm.triton_utils` and `vllm.platforms`: Triton itself, a platform that is
not CUDA, so fp8 keys are e4m3fn as on Hopper), and runs their kernels in
Triton's interpreter (TRITON_INTERPRET=1, on the CPU). Then, for every
preset at head sizes 64, 128 and 256:

- store: vLLM's store and tqdecode.store (cache_order="token_slots") write
  the same K/V into two caches; every byte must be equal, except fp8 key
  bytes, which the interpreter converts with its own emulation: there
  tqdecode's bytes must equal the hardware conversion (round to nearest
  even, saturating at 448; torch's e4m3fn cast of the clamped value), and
  the bytes where the interpreter differs are counted;
- decode: vLLM's decode and tqdecode.token_slots_decode_attention (the CPU
  reference) read the same cache (written by tqdecode.store), both norm
  correction modes; rows with tokens must agree to a relative L2 error of
  1e-2 (bf16 outputs; vLLM keeps the rotated query in fp32), rows of
  sequences with no tokens are zeros in tqdecode (vLLM leaves them unset);
- continuation chunk (D = 128, norm correction as the presets set it): 40
  rows of one request as vLLM sends them (its block-table row expanded,
  seq_lens rising by one), which tqdecode runs as one varlen call, against
  vLLM's kernel on the same rows, within the same 1e-2.

    python3 scripts/check_against_vllm.py --vllm vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl

It needs the PyTorch binding (PYTHONPATH=python after the build, or the
installed package), Triton, and numpy older than 2.4 (Triton 3.6's
interpreter turns loaded scalars into one-element arrays, which numpy 2.4
no longer converts to an index). Exit status 0 when every check passes.

With --device cuda the same checks run with both libraries on the GPU
(vLLM's kernels compiled by Triton; tqdecode's CUDA store and decode), and
then each preset's decode step at (16, 8192), Hq 32, Hk 8, D 128 is timed
for both, eager and back to back. For a GPU machine without internet, take
the three modules out of the wheel beforehand and pass their root:

    unzip WHEEL 'vllm/v1/attention/ops/triton_turboquant_*.py' \
      vllm/v1/attention/ops/triton_decode_attention.py -d DIR
    python3 scripts/check_against_vllm.py --vllm DIR --device cuda
"""
import argparse
import importlib.util
import math
import os
import sys
import tempfile
import types
import zipfile
from pathlib import Path

# On the CPU vLLM's kernels run in Triton's interpreter, which must be chosen before Triton is imported
# (and must be off on the GPU, whatever the shell exports).
ON_GPU = "--device=cuda" in sys.argv or (
    "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cuda"])
if ON_GPU:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = None  # set in main()

import numpy  # noqa: E402
import torch  # noqa: E402

import tqdecode  # noqa: E402

PRESETS = ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "turboquant_k8v4")
MODULES = ("triton_decode_attention", "triton_turboquant_decode", "triton_turboquant_store")


def load_vllm_ops(source: Path):
    """vLLM's decode and store modules from a wheel or a directory holding `vllm/`."""
    import triton
    import triton.language

    if source.is_file():
        unpacked = Path(tempfile.mkdtemp(prefix="vllm-ops-"))
        with zipfile.ZipFile(source) as wheel:
            for name in MODULES:
                wheel.extract(f"vllm/v1/attention/ops/{name}.py", unpacked)
        source = unpacked
    ops_dir = source / "vllm/v1/attention/ops"
    for name in MODULES:
        if not (ops_dir / f"{name}.py").is_file():
            sys.exit(f"check_against_vllm.py: {ops_dir / name}.py not found; --vllm takes a vLLM wheel or a "
                     "directory holding vllm/")

    class Platform:  # CUDA on the GPU (vLLM then picks the fp8 format by capability), else e4m3fn as on Hopper
        @staticmethod
        def is_rocm():
            return False

        @staticmethod
        def is_cuda_alike():
            return ON_GPU

    stand_ins = {
        "vllm": types.ModuleType("vllm"),
        "vllm.platforms": types.ModuleType("vllm.platforms"),
        "vllm.triton_utils": types.ModuleType("vllm.triton_utils"),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.attention": types.ModuleType("vllm.v1.attention"),
        "vllm.v1.attention.ops": types.ModuleType("vllm.v1.attention.ops"),
    }
    stand_ins["vllm.platforms"].current_platform = Platform()
    stand_ins["vllm.triton_utils"].triton = triton
    stand_ins["vllm.triton_utils"].tl = triton.language
    stand_ins["vllm.triton_utils"].HAS_TRITON = True
    for name, module in stand_ins.items():
        module.__path__ = []
        sys.modules[name] = module
    loaded = {}
    for name in MODULES:
        qualified = f"vllm.v1.attention.ops.{name}"
        spec = importlib.util.spec_from_file_location(qualified, ops_dir / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
        loaded[name] = module
    return (loaded["triton_turboquant_store"].triton_turboquant_store,
            loaded["triton_turboquant_decode"].triton_turboquant_decode_attention)


def on_device(*values):
    """The tensors among `values` on DEVICE (a tensor already there is itself, so an expanded view stays one)."""
    return tuple(v.to(DEVICE) if isinstance(v, torch.Tensor) else v for v in values)


def engine_key_packed_size(layout):
    """vLLM's key_packed_size: the key data and, for codebook keys, the 2-byte norm."""
    return layout.key_packed_size + (0 if layout.key_fp8 else 2)


def fp8_hardware_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn as the GPU converts (cvt.rn.satfinite): nearest even, saturating at 448."""
    return values.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def value_codes(cache: torch.Tensor, offset: int, bits: int, count: int) -> torch.Tensor:
    """The `count` value codes of every slot: an LSB-first bitstream of `bits`-bit codes from byte `offset`."""
    region = cache[..., offset:offset + (count * bits + 7) // 8].long()
    stream = ((region[..., :, None] >> torch.arange(8)) & 1).flatten(-2)[..., :count * bits]
    return (stream.unflatten(-1, (count, bits)) << torch.arange(bits)).sum(-1)


def split_value_codes(ours, theirs, layout, head_dim):
    """(bytes differing outside the value codes, value codes one level apart, value codes further apart)."""
    offset = layout.key_packed_size + (0 if layout.key_fp8 else 2)  # fp8 keys have no norm field
    size = (head_dim * layout.value_bits + 7) // 8
    outside = ours != theirs
    outside[..., offset:offset + size] = False
    apart = (value_codes(ours, offset, layout.value_bits, head_dim)
             - value_codes(theirs, offset, layout.value_bits, head_dim)).abs()
    return int(outside.sum()), int((apart == 1).sum()), int((apart > 1).sum())


def check_store(vllm_store, preset, head_dim, generator):
    num_kv_heads, block_size, num_blocks, tokens = 2, 16, 6, 70
    layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, cache_order="token_slots")
    centroids, Pi, PiT = tqdecode.make_model_constants(preset, head_dim, seed=1)
    key = (torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * 2 + 0.3).to(torch.bfloat16)
    value = (torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * 1.5 - 0.2).to(torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    slots[5] = -1  # skipped by both
    junk = tqdecode.allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, preset, cache_order="token_slots")
    junk.random_(0, 256, generator=generator)  # both stores must leave it where they do not write
    ours, theirs = junk.to(DEVICE).clone(), junk.to(DEVICE).clone()
    if layout.key_fp8:
        rotation, midpoints = torch.eye(head_dim), torch.zeros(1)
    else:
        rotation, midpoints = PiT.float().contiguous(), ((centroids[1:] + centroids[:-1]) / 2).float().contiguous()
    key_d, value_d, Pi_d, centroids_d, rotation, midpoints = on_device(key, value, Pi, centroids, rotation, midpoints)
    tqdecode.store(key_d, value_d, ours, slots.to(DEVICE), Pi_d, centroids_d, preset, cache_order="token_slots")
    vllm_store(key_d, value_d, theirs, slots.to(torch.int32).to(DEVICE), rotation, midpoints,
               0 if layout.key_fp8 else layout.key_bits, engine_key_packed_size(layout), layout.value_bits,
               key_fp8=layout.key_fp8)
    ours, theirs = ours.cpu(), theirs.cpu()
    differ = ours != theirs
    if ON_GPU and int(differ.sum()):
        # Triton compiles the fp32 division of vLLM's value quantisation to the approximate div.full.f32 on
        # the GPU (its CPU run, IEEE division, gives tqdecode's codes exactly): a code next to a rounding
        # boundary can land one level off. Every other byte must agree.
        outside, one_level, further = split_value_codes(ours, theirs, layout, head_dim)
        note = (f"{outside} bytes differ outside the value codes; value codes one level apart (vLLM's approximate "
                f"division): {one_level} of {int(stored_slots(slots)) * num_kv_heads * head_dim}; further: "
                f"{further}")
        if not layout.key_fp8:
            return outside == 0 and further == 0, note
    if not layout.key_fp8:
        # Where they differ (block, row, head, byte of the slot): key codes, norm, value codes or fields.
        where = differ.nonzero()[:4].tolist()
        return int(differ.sum()) == 0, f"{int(differ.sum())} of {ours.numel()} bytes differ" + (
            f", first at (block, row, head, byte) {where}" if where else "")
    # fp8 keys: tqdecode's key bytes against the hardware conversion; the rest byte for byte.
    key_bytes = torch.zeros_like(differ)
    key_bytes[..., :head_dim] = True
    stored = slots >= 0
    block, row = slots[stored] // block_size, slots[stored] % block_size
    hardware = fp8_hardware_bytes(key.float()[stored])
    keys_match = torch.equal(ours[block, row, :, :head_dim], hardware)
    other = int((differ & ~key_bytes).sum())
    key_differ = int((differ & key_bytes).sum())
    if ON_GPU:  # vLLM's conversion is the hardware's there too: every key byte must agree
        outside, one_level, further = split_value_codes(ours, theirs, layout, head_dim)
        return keys_match and key_differ == 0 and outside - key_differ == 0 and further == 0, (
            f"key bytes equal the hardware conversion: {keys_match}; vLLM's key bytes differ on {key_differ}; "
            f"{outside - key_differ} other bytes outside the value codes; value codes one level apart (vLLM's "
            f"approximate division): {one_level}; further: {further}")
    return keys_match and other == 0, (f"{other} non-key bytes differ; key bytes equal the hardware conversion: "
                                       f"{keys_match}; the interpreter's fp8 emulation differs on {key_differ}")


def stored_slots(slots):
    return (slots >= 0).sum()


def check_decode(vllm_decode, preset, head_dim, norm_correction, generator):
    num_kv_heads, num_q_heads, block_size = 2, 8, 16
    seq_lens = torch.tensor([37, 1, 160, 0, 95], dtype=torch.int32)
    max_blocks = 12
    layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, cache_order="token_slots")
    num_blocks = len(seq_lens) * max_blocks
    centroids, Pi, PiT = tqdecode.make_model_constants(preset, head_dim, seed=2)
    cache = tqdecode.allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, preset, cache_order="token_slots")
    tokens = num_blocks * block_size
    key = (torch.randn(tokens, num_kv_heads, head_dim, generator=generator) * 1.7).to(torch.bfloat16)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    tqdecode.store(key, value, cache, torch.arange(tokens), Pi, centroids, preset, cache_order="token_slots")
    block_table = torch.randperm(num_blocks, generator=generator).to(torch.int32).reshape(len(seq_lens), max_blocks)
    query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=generator).to(torch.bfloat16)
    scale = 1 / math.sqrt(head_dim)
    args = (query, cache, block_table, seq_lens, Pi, centroids, scale, 0 if layout.key_fp8 else layout.key_bits,
            engine_key_packed_size(layout), layout.value_bits)
    kwargs = {"key_fp8": layout.key_fp8, "norm_correction": norm_correction}
    args = on_device(*args)
    ours = tqdecode.token_slots_decode_attention(*args, **kwargs).float().cpu()
    theirs = vllm_decode(*args, **kwargs, PiT=on_device(None if PiT is None else PiT.float().contiguous())[0],
                         max_num_kv_splits=4).float().cpu()
    live = seq_lens > 0
    error = ((ours[live] - theirs[live]).norm() / theirs[live].norm()).item()
    empty_zero = bool((ours[~live] == 0).all())
    return error < 1e-2 and empty_zero, f"relative L2 {error:.2e} on rows with tokens; empty rows zero: {empty_zero}"


def check_continuation(vllm_decode, preset, generator, rows=40):
    """A request's continuation chunk as vLLM 0.33.0 sends it: `rows` query rows over the request's block-table
    row expanded with stride 0, seq_lens rising by one to its length (tqdecode reads it as one varlen call)."""
    head_dim, num_kv_heads, num_q_heads, block_size, length = 128, 2, 8, 16, 200
    layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, cache_order="token_slots")
    blocks = (length + block_size - 1) // block_size
    centroids, Pi, PiT = tqdecode.make_model_constants(preset, head_dim, seed=3)
    cache = tqdecode.allocate_cache(blocks + 3, block_size, num_kv_heads, head_dim, preset, cache_order="token_slots")
    tokens = (blocks + 3) * block_size
    key = torch.randn(tokens, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    value = torch.randn(tokens, num_kv_heads, head_dim, generator=generator).to(torch.bfloat16)
    tqdecode.store(key, value, cache, torch.arange(tokens), Pi, centroids, preset, cache_order="token_slots")
    table = torch.randperm(blocks + 3, generator=generator)[:blocks].to(torch.int32)[None].to(DEVICE)  # then expanded
    query = torch.randn(rows, num_q_heads, head_dim, generator=generator).to(torch.bfloat16)
    seq_lens = torch.arange(length - rows + 1, length + 1, dtype=torch.int32)
    args = (query, cache, table.expand(rows, -1), seq_lens, Pi, centroids, 1 / math.sqrt(head_dim),
            0 if layout.key_fp8 else layout.key_bits, engine_key_packed_size(layout), layout.value_bits)
    kwargs = {"key_fp8": layout.key_fp8, "norm_correction": not layout.key_fp8}
    args = on_device(*args)
    one_call = tqdecode._continuation_chunk(args[0], args[2], args[3], args[1].shape[1])
    ours = tqdecode.token_slots_decode_attention(*args, **kwargs).float().cpu()
    theirs = vllm_decode(*args, **kwargs, PiT=on_device(None if PiT is None else PiT.float().contiguous())[0],
                         max_num_kv_splits=4).float().cpu()
    error = ((ours - theirs).norm() / theirs.norm()).item()
    return error < 1e-2 and one_call, f"{rows} rows, one varlen call: {one_call}; relative L2 {error:.2e}"


def time_decodes(vllm_decode, preset, batch=16, context=8192, num_q_heads=32, num_kv_heads=8, head_dim=128,
                 calls=20, rounds=11):
    """Both decodes of one step on the GPU, eager and back to back (CUDA events around `calls` calls, median of
    `rounds`; not the benchmark's single-step method): vLLM's with the buffers its backend passes, tqdecode's with
    a buf_holder. Microseconds per call, (vLLM, tqdecode)."""
    block_size = 16
    layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, cache_order="token_slots")
    blocks_per_seq = context // block_size
    centroids, Pi, PiT = on_device(*tqdecode.make_model_constants(preset, head_dim, seed=4))
    cache = torch.randint(0, 256, (batch * blocks_per_seq, block_size, num_kv_heads, layout.slot_bytes),
                          dtype=torch.uint8, device=DEVICE)
    # Finite fp16 fields (norm, scale, zero) so that no score or value is NaN.
    field_offsets = [layout.key_packed_size + (0 if layout.key_fp8 else 2) + layout.value_packed_size + k
                     for k in (0, 2)] + ([] if layout.key_fp8 else [layout.key_packed_size])
    for offset in field_offsets:
        cache[..., offset:offset + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).to(DEVICE)
    if layout.key_fp8:
        cache[..., :head_dim] &= 0x77  # finite e4m3 values
    block_table = torch.randperm(batch * blocks_per_seq, device=DEVICE).to(torch.int32).reshape(batch, -1)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, num_q_heads, head_dim, device=DEVICE).to(torch.bfloat16)
    args = (query, cache, block_table, seq_lens, Pi, centroids, 1 / math.sqrt(head_dim),
            0 if layout.key_fp8 else layout.key_bits, engine_key_packed_size(layout), layout.value_bits)
    kwargs = {"key_fp8": layout.key_fp8, "norm_correction": layout.norm_correction,
              "PiT": None if PiT is None else PiT.float().contiguous()}
    splits = 32
    buffers = {"mid_o_buf": torch.empty(batch, num_q_heads, splits, head_dim + 1, device=DEVICE),
               "output_buf": torch.empty(batch, num_q_heads, head_dim, dtype=query.dtype, device=DEVICE),
               "lse_buf": torch.empty(batch, num_q_heads, device=DEVICE), "max_num_kv_splits": splits}

    class Holder:
        pass

    holder = Holder()
    runs = {"vllm": lambda: vllm_decode(*args, **kwargs, **buffers, buf_holder=holder),
            # The same buffers, as the plugin route hands them over (tqdecode writes output_buf, ignores the rest).
            "tqdecode": lambda: tqdecode.token_slots_decode_attention(*args, **kwargs, **buffers, buf_holder=holder)}
    times = {}
    for name, run in runs.items():
        for _ in range(3):
            run()
        samples = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        times[name] = sorted(samples)[rounds // 2]
    return times["vllm"], times["tqdecode"]


def main():
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", type=Path, required=True, help="a vLLM wheel, or a directory holding vllm/")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: vLLM's kernels in Triton's interpreter beside tqdecode's CPU ops; cuda: both on "
                             "the GPU, and each preset's step timed")
    parser.add_argument("--presets", default=",".join(PRESETS), help="comma-separated presets [all four]")
    options = parser.parse_args()
    DEVICE = torch.device(options.device)
    presets = options.presets.split(",")
    for preset in presets:
        if preset not in PRESETS:
            parser.error(f"--presets: {preset!r} is not accepted; accepted: {', '.join(PRESETS)}")
    if not ON_GPU and tuple(int(part) for part in numpy.__version__.split(".")[:2]) >= (2, 4):
        sys.exit(f"check_against_vllm.py: numpy {numpy.__version__}: Triton's interpreter needs numpy older than "
                 "2.4 (e.g. pip install --target DIR 'numpy<2.4' and put DIR first on PYTHONPATH)")
    vllm_store, vllm_decode = load_vllm_ops(options.vllm)
    generator = torch.Generator().manual_seed(0)
    failures = 0
    for preset in presets:
        for head_dim in (64, 128, 256):
            checks = [("store", check_store(vllm_store, preset, head_dim, generator))]
            for norm_correction in ((False,) if preset == "turboquant_k8v4" else (False, True)):
                name = "decode, norm correction" if norm_correction else "decode"
                checks.append((name, check_decode(vllm_decode, preset, head_dim, norm_correction, generator)))
            if head_dim == 128:
                checks.append(("continuation chunk", check_continuation(vllm_decode, preset, generator)))
            for name, (ok, detail) in checks:
                failures += not ok
                print(f"{'ok  ' if ok else 'FAIL'} {preset:20s} D {head_dim:3d} {name:24s} {detail}")
    print(f"check_against_vllm.py: {failures} failed on {options.device}")
    if ON_GPU:
        print(f"{torch.cuda.get_device_name()}: (16, 8192), Hq 32, Hk 8, D 128, eager back-to-back calls (CUDA "
              "events, median of 11 rounds of 20; not the benchmark's single-step method):")
        for preset in presets:
            theirs, ours = time_decodes(vllm_decode, preset)
            print(f"  {preset:20s} vLLM {theirs:8.1f} us  tqdecode {ours:8.1f} us  ({theirs / ours:.2f}x)")
    return 1 if failures else 0

if __name__ == "__main__":
    sys.exit(main())
