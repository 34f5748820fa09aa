"""Tests of the PyTorch binding (python/tqdecode, python/csrc/ops.cpp).

Written with unittest so that pytest and `python3 -m unittest` both run them.
The whole module is skipped when torch is missing; tests that need a GPU
skip, each with a message, when CUDA is unavailable (the CPU ops still run:
they are the C++ reference path). Needs the binding built
(-DTQDECODE_PYTHON=ON) and `python` on PYTHONPATH; see python/run_tests.sh.

Oracles: the CPU op (the C++ reference decode) and, independently, torch SDPA
in fp32 over the cache as dequantized by the small Python reader of
docs/FORMAT.md below.
"""

import math
import unittest
from dataclasses import dataclass
from typing import Optional

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    raise unittest.SkipTest("torch is not installed: the PyTorch binding tests need it")

import tqdecode  # an ImportError here means the binding is not built: a failure, not a skip

HAS_CUDA = torch.cuda.is_available()
requires_cuda = unittest.skipUnless(HAS_CUDA, "no CUDA device: GPU test of the PyTorch binding skipped")

# docs/FORMAT.md section 1: key bits, value bits, fp8 keys, norm correction.
SPEC_PRESETS = {
    "turboquant_4bit_nc": (4, 4, False, True),
    "turboquant_k3v4_nc": (3, 4, False, True),
    "turboquant_3bit_nc": (3, 3, False, True),
    "turboquant_k8v4": (8, 4, True, False),
}


# ---- a reader of the cache format, written from docs/FORMAT.md alone -------------

def spec_sizes(preset, head_dim):
    """(KD, VD, F) of docs/FORMAT.md section 4."""
    key_bits, value_bits, key_fp8, _ = SPEC_PRESETS[preset]
    key_bytes = head_dim if key_fp8 else math.ceil(head_dim * key_bits / 8)
    return key_bytes, math.ceil(head_dim * value_bits / 8), 2 if key_fp8 else 3


def unpack_codes(packed, bits, count):
    """Codes of `bits` bits, LSB first within little-endian bytes: [..., bytes] -> [..., count]."""
    stream = ((packed.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)
    stream = stream[..., : count * bits].unflatten(-1, (count, bits))
    return (stream << torch.arange(bits)).sum(-1)


def dequantize(cache, preset, head_dim, centroids):
    """(khat, vhat) fp32 [num_blocks, block_size, Hk, D]: keys in the rotated
    space for MSE presets (docs/FORMAT.md section 5 steps 2 and 4)."""
    key_bits, value_bits, key_fp8, _ = SPEC_PRESETS[preset]
    key_bytes, value_bytes, fields = spec_sizes(preset, head_dim)
    num_blocks, block_size, num_kv_heads, _ = cache.shape
    blocks = cache.cpu().reshape(num_blocks, -1)  # one row per block; padding past the natural size unused
    data_end = block_size * num_kv_heads * (key_bytes + value_bytes)
    records = blocks[:, :data_end].reshape(num_blocks, block_size, num_kv_heads, key_bytes + value_bytes)
    meta = blocks[:, data_end : data_end + 2 * fields * num_kv_heads * block_size]
    meta = meta.reshape(num_blocks, num_kv_heads, fields, block_size, 2).contiguous().view(torch.float16)
    meta = meta.squeeze(-1).float().permute(0, 3, 1, 2)  # [num_blocks, block_size, Hk, F]
    if key_fp8:
        khat = records[..., :key_bytes].contiguous().view(torch.float8_e4m3fn).float()
    else:
        codes = unpack_codes(records[..., :key_bytes], key_bits, head_dim)
        khat = meta[..., 0:1] * centroids.cpu().float()[codes]
    value_codes = unpack_codes(records[..., key_bytes:], value_bits, head_dim).float()
    vhat = value_codes * meta[..., fields - 2 : fields - 1] + meta[..., fields - 1 : fields]
    return khat, vhat


# ---- test cases ----------------------------------------------------------------

@dataclass
class Config:
    preset: str
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    sinks: bool = True
    slot_padding: int = 0  # extra bytes per (token, head): block stride above the natural size
    num_q_heads: int = 8
    num_kv_heads: int = 2
    seq_lens: tuple = (37, 0, 1, 160, 95)

    @property
    def name(self):
        return (f"{self.preset}_d{self.head_dim}_bs{self.block_size}_{str(self.dtype)[6:]}"
                f"{'_sinks' if self.sinks else ''}{'_padded' if self.slot_padding else ''}")


CONFIGS = [Config(preset) for preset in SPEC_PRESETS] + [
    Config("turboquant_4bit_nc", head_dim=64, block_size=32, dtype=torch.float16, sinks=False, slot_padding=2,
           num_q_heads=12, num_kv_heads=2),
    Config("turboquant_k3v4_nc", head_dim=256, block_size=32, dtype=torch.float16, slot_padding=6),
    Config("turboquant_3bit_nc", head_dim=64, block_size=64, sinks=False, num_q_heads=4, num_kv_heads=4),
    Config("turboquant_k8v4", head_dim=64, block_size=16, dtype=torch.float16, sinks=False, slot_padding=4,
           num_q_heads=16, num_kv_heads=1),
]


@dataclass
class Case:
    config: Config
    layout: tqdecode.CacheLayout
    centroids: Optional[torch.Tensor]
    Pi: Optional[torch.Tensor]
    PiT: Optional[torch.Tensor]
    key: torch.Tensor  # [tokens, Hk, D] fp32, the unquantized keys
    value: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [tokens]
    kv_cache: torch.Tensor
    query: torch.Tensor  # [B, Hq, D], a strided view (engines pass slices of a qkv tensor)
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    sinks: Optional[torch.Tensor]
    scale: float

    def decode_args(self):
        """The positional arguments of turboquant_decode_attention, and its keywords."""
        args = (self.query, self.kv_cache, self.block_table, self.seq_lens, self.Pi, self.centroids, self.scale)
        return args, {**self.layout.decode_kwargs(), "sinks": self.sinks}

    def to(self, device):
        moved = {name: value.to(device) if isinstance(value, torch.Tensor) else value
                 for name, value in self.__dict__.items()}
        moved["query"] = strided_copy(self.query.to(device))
        return Case(**moved)


def strided_copy(query):
    """query as a [B, Hq, D] view with a batch stride larger than Hq * D."""
    batch, heads, head_dim = query.shape
    wide = torch.zeros(batch, heads + 3, head_dim, dtype=query.dtype, device=query.device)
    wide[:, 1 : heads + 1] = query
    return wide[:, 1 : heads + 1]


def make_case(config: Config, seed: int = 0) -> Case:
    """Random K/V (non-zero means, outlier channels) stored by the CPU op into
    blocks in shuffled order; block-table entries past a sequence are -1."""
    generator = torch.Generator().manual_seed(seed)
    c = config
    layout = tqdecode.cache_layout(c.preset, c.head_dim, c.block_size, c.num_kv_heads)
    centroids, Pi, PiT = tqdecode.make_model_constants(c.preset, c.head_dim, seed=seed + 1)
    blocks_per_seq = [math.ceil(length / c.block_size) for length in c.seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_table = torch.full((len(c.seq_lens), max_blocks), -1, dtype=torch.int32)
    slots = []
    for i, length in enumerate(c.seq_lens):
        for j in range(blocks_per_seq[i]):
            block_table[i, j] = order.pop()
        slots += [int(block_table[i, t // c.block_size]) * c.block_size + t % c.block_size for t in range(length)]
    tokens = len(slots)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    channel_mean = randn(c.head_dim) * 0.5
    channel_scale = torch.ones(c.head_dim)
    channel_scale[torch.randperm(c.head_dim, generator=generator)[:4]] = 8.0  # outlier channels
    key = randn(tokens, c.num_kv_heads, c.head_dim) * channel_scale + channel_mean
    value = randn(tokens, c.num_kv_heads, c.head_dim) + 0.3
    kv_cache = torch.zeros(num_blocks, c.block_size, c.num_kv_heads, layout.slot_bytes + c.slot_padding,
                           dtype=torch.uint8)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    tqdecode.store(key, value, kv_cache, slot_mapping, Pi, centroids, c.preset)
    query = strided_copy(randn(len(c.seq_lens), c.num_q_heads, c.head_dim).to(c.dtype))
    sinks = randn(c.num_q_heads) * 2 if c.sinks else None
    return Case(c, layout, centroids, Pi, PiT, key, value, slot_mapping, kv_cache, query, block_table,
                torch.tensor(c.seq_lens, dtype=torch.int32), sinks, 1 / math.sqrt(c.head_dim))


def sdpa_reference(case: Case) -> torch.Tensor:
    """fp32 [B, Hq, D]: torch SDPA over the dequantized cache, sinks applied
    as out * sigmoid(logsumexp(scores) - sink) (docs/FORMAT.md section 5 step 5)."""
    c = case.config
    khat, vhat = dequantize(case.kv_cache, c.preset, c.head_dim, case.centroids)
    query = case.query.cpu().float()
    if not SPEC_PRESETS[c.preset][2]:
        query = (query @ case.PiT.cpu()).to(torch.bfloat16).float()  # q_rot = bf16(fp32(q) @ PiT)
    group = c.num_q_heads // c.num_kv_heads
    out = torch.zeros(query.shape)
    for i, length in enumerate(case.seq_lens.tolist()):
        if length == 0:
            continue  # no tokens: an all-zero row
        t = torch.arange(length)
        blocks = case.block_table.cpu()[i, t // c.block_size].long()
        keys = khat[blocks, t % c.block_size].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        values = vhat[blocks, t % c.block_size].repeat_interleave(group, dim=1).transpose(0, 1)
        q = query[i].unsqueeze(1)  # [Hq, 1, D]
        row = F.scaled_dot_product_attention(q, keys, values, scale=case.scale).squeeze(1)
        if case.sinks is not None:
            lse = torch.logsumexp(case.scale * (q @ keys.transpose(1, 2)).squeeze(1), dim=-1)
            row = row * torch.sigmoid(lse - case.sinks.cpu())[:, None]
        out[i] = row
    return out


def errors(got, expected):
    """(cosine similarity, relative L2 error, max abs error / peak |expected|)."""
    got, expected = got.detach().cpu().double().flatten(), expected.detach().cpu().double().flatten()
    cosine = F.cosine_similarity(got, expected, dim=0).item()
    relative = ((got - expected).norm() / expected.norm()).item()
    peak = ((got - expected).abs().max() / expected.abs().max()).item()
    return cosine, relative, peak


class Holder:
    """Stands in for the engine object passed as buf_holder."""


class AccuracyTest(unittest.TestCase):
    def assert_close(self, got, expected, cosine, relative, peak, what):
        measured = errors(got, expected)
        print(f"{what}: cosine {measured[0]:.7f}, relative L2 {measured[1]:.2e}, max abs / peak {measured[2]:.2e}")
        self.assertGreater(measured[0], cosine, what)
        self.assertLess(measured[1], relative, what)
        self.assertLess(measured[2], peak, what)

    def check_cpu(self, config):
        case = make_case(config)
        args, kwargs = case.decode_args()
        out = tqdecode.turboquant_decode_attention(*args, **kwargs)
        self.assertEqual((out.shape, out.dtype, out.device.type), (case.query.shape, config.dtype, "cpu"))
        self.assertTrue(bool(torch.all(out[1] == 0)), "seq_len 0 gives an all-zero row")
        flat = torch.empty(out.shape[0], out.shape[1] * out.shape[2], dtype=config.dtype)  # engines' [B, Hq * D]
        returned = tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=flat)
        self.assertEqual((returned.data_ptr(), returned.shape), (flat.data_ptr(), flat.shape))
        self.assertTrue(torch.equal(flat.view(out.shape), out))
        # Same function, fp32 vs double accumulation; the output is rounded to the query dtype.
        self.assert_close(out, sdpa_reference(case), 0.99999, 5e-3, 1e-2, f"CPU op vs SDPA, {config.name}")

    def check_cuda(self, config):
        case = make_case(config)
        expected = tqdecode.turboquant_decode_attention(*case.decode_args()[0], **case.decode_args()[1])
        gpu = case.to("cuda")
        args, kwargs = gpu.decode_args()
        pooled = tqdecode.turboquant_decode_attention(*args, **kwargs)
        output_buf = torch.full_like(pooled, float("nan"))
        returned = tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=output_buf)
        self.assertEqual(returned.data_ptr(), output_buf.data_ptr())
        self.assertTrue(torch.equal(pooled, output_buf), "returned output and output_buf agree")
        self.assertTrue(bool(torch.all(pooled[1] == 0)), "seq_len 0 gives an all-zero row")
        path = tqdecode.decode_path(*args, **kwargs)
        # DESIGN.md: bf16 tensor-core operands and fp32 accumulation against the reference.
        tolerance = (0.9999, 1e-2, 2e-2)
        self.assert_close(pooled, expected, *tolerance, f"CUDA op ({path.path}) vs CPU op, {config.name}")
        self.assert_close(pooled, sdpa_reference(case), *tolerance, f"CUDA op ({path.path}) vs SDPA, {config.name}")


for _config in CONFIGS:
    setattr(AccuracyTest, f"test_cpu_op_vs_sdpa_{_config.name}", lambda self, c=_config: self.check_cpu(c))
    setattr(AccuracyTest, f"test_cuda_op_vs_cpu_op_and_sdpa_{_config.name}",
            requires_cuda(lambda self, c=_config: self.check_cuda(c)))


class FormatTest(unittest.TestCase):
    def test_layout_matches_spec(self):
        for preset in SPEC_PRESETS:
            for head_dim in (64, 128, 256):
                layout = tqdecode.cache_layout(preset, head_dim, 32, 4)
                key_bytes, value_bytes, fields = spec_sizes(preset, head_dim)
                self.assertEqual((layout.key_packed_size, layout.value_packed_size, layout.fields),
                                 (key_bytes, value_bytes, fields), preset)
                self.assertEqual(layout.slot_bytes, key_bytes + value_bytes + 2 * fields)
                self.assertEqual(layout.block_bytes, 32 * 4 * layout.slot_bytes)
        self.assertEqual(tqdecode.cache_layout("turboquant_4bit_nc", 128, 16, 8).slot_bytes, 134)
        cache = tqdecode.allocate_cache(3, 16, 8, 128, "turboquant_4bit_nc")
        self.assertEqual((cache.shape, cache.dtype), (torch.Size([3, 16, 8, 134]), torch.uint8))

    def test_store_matches_spec_encoding(self):
        """The Python reader recovers what the CPU store encoded (docs/FORMAT.md section 3)."""
        for config in CONFIGS[:4]:
            case = make_case(config)
            khat, vhat = dequantize(case.kv_cache, config.preset, config.head_dim, case.centroids)
            bs = config.block_size
            blocks, slots = case.slot_mapping // bs, case.slot_mapping % bs
            values = vhat[blocks, slots]
            span = case.value.amax(-1, keepdim=True) - case.value.amin(-1, keepdim=True)
            step = span / (2 ** SPEC_PRESETS[config.preset][1] - 1)
            self.assertTrue(bool(torch.all((values - case.value).abs() <= step * 0.5 + 1e-2 * span)), config.name)
            keys = khat[blocks, slots]
            if case.Pi is not None:
                keys = keys @ case.Pi  # back from the rotated space: k = Pi^T r
            cosine = F.cosine_similarity(keys, case.key, dim=-1).min().item()
            self.assertGreater(cosine, {4: 0.98, 3: 0.95, 8: 0.999}[SPEC_PRESETS[config.preset][0]], config.name)

    def test_model_constants(self):
        centroids, Pi, PiT = tqdecode.make_model_constants("turboquant_3bit_nc", 64, seed=3, rotation="dense")
        self.assertEqual((centroids.shape, Pi.shape, Pi.dtype), (torch.Size([8]), torch.Size([64, 64]), torch.float32))
        self.assertTrue(torch.equal(PiT, Pi.t()))
        self.assertTrue(torch.allclose(Pi @ PiT, torch.eye(64), atol=1e-5))
        self.assertTrue(bool(torch.all(centroids[1:] > centroids[:-1])))
        self.assertEqual(tqdecode.make_model_constants("turboquant_k8v4", 128), (None, None, None))


class ConstantsCacheTest(unittest.TestCase):
    def test_constants_cached_on_buf_holder(self):
        case = make_case(CONFIGS[0])
        args, kwargs = case.decode_args()
        holder = Holder()
        first = tqdecode.turboquant_decode_attention(*args, **kwargs, buf_holder=holder).clone()
        cached_PiT = holder._tqdecode_consts[case.query.device][3]
        self.assertTrue(torch.equal(cached_PiT, case.Pi.t()))
        tqdecode.turboquant_decode_attention(*args, **kwargs, buf_holder=holder)
        self.assertIs(holder._tqdecode_consts[case.query.device][3], cached_PiT, "reused while Pi is unchanged")
        with_PiT = tqdecode.turboquant_decode_attention(*args, **kwargs, PiT=case.PiT)
        self.assertTrue(torch.equal(first, with_PiT))
        case.Pi.mul_(1.0)  # an in-place write bumps the version: derived constants are rebuilt
        tqdecode.turboquant_decode_attention(*args, **kwargs, buf_holder=holder)
        self.assertIsNot(holder._tqdecode_consts[case.query.device][3], cached_PiT)

    def test_constants_derived_in_the_call_are_not_stable(self):
        # constants_stable=False (no early reads by a programmatic launch)
        # whenever the call itself wrote the fp32 constants.
        case = make_case(CONFIGS[0])
        query, Pi, centroids = case.query, case.Pi, case.centroids
        from tqdecode import _model_constants
        holder = Holder()
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, holder)[2], "first call derives")
        # The deriving call may have failed before its decode: the first call after it still waits.
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, holder)[2], "first use of the cache")
        self.assertTrue(_model_constants(query, Pi, centroids, None, False, holder)[2], "cached")
        Pi.mul_(1.0)
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, holder)[2], "Pi written: derived again")
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, None)[2], "no buf_holder")
        self.assertTrue(_model_constants(query, None, None, None, True, None)[2], "fp8 keys: no constants")
        fresh = Holder()  # decode_path derives without caching: the next decode still waits for them
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, fresh, keep=False)[2])
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, fresh)[2], "not cached by decode_path")
        failing = Holder()  # a call that derives them and then fails: the next call does not read them early
        with self.assertRaisesRegex(ValueError, "output_buf"):
            tqdecode.turboquant_decode_attention(*case.decode_args()[0], **case.decode_args()[1], buf_holder=failing,
                                                 output_buf=torch.empty(1, dtype=query.dtype))
        self.assertFalse(_model_constants(query, Pi, centroids, None, False, failing)[2], "after a failed call")


@requires_cuda
class CudaTest(unittest.TestCase):
    def test_cuda_store_writes_the_cpu_bytes(self):
        for config in CONFIGS[:4]:
            case = make_case(config)
            for dtype in (torch.float32, torch.bfloat16):
                expected = torch.zeros_like(case.kv_cache)
                key, value = case.key.to(dtype), case.value.to(dtype)
                tqdecode.store(key, value, expected, case.slot_mapping, case.Pi, case.centroids, config.preset)
                gpu = case.to("cuda")
                cache = torch.zeros_like(gpu.kv_cache)
                tqdecode.store(key.cuda(), value.cuda(), cache, gpu.slot_mapping, gpu.Pi, gpu.centroids, config.preset)
                self.assertTrue(torch.equal(cache.cpu(), expected), f"{config.name} {dtype}")

    def test_cuda_store_rejects_non_finite_input(self):
        case = make_case(CONFIGS[0]).to("cuda")
        key = case.key.clone()
        key[3, 1, 7] = float("nan")
        before = case.kv_cache.clone()
        store_args = (key, case.value, case.kv_cache, case.slot_mapping, case.Pi, case.centroids, CONFIGS[0].preset)
        with self.assertRaisesRegex(ValueError, "tqdecode: key"):
            tqdecode.store(*store_args, check=True)
        self.assertTrue(torch.equal(case.kv_cache, before), "nothing written")
        tqdecode.store_check_report()
        tqdecode.store(*store_args)  # the default: recorded on the device, not raised
        report = tqdecode.store_check_report()
        self.assertTrue(torch.equal(case.kv_cache, before), "nothing written")
        self.assertEqual((report["checked_calls"], report["failed_calls"], report["first_failure"]),
                         (1, 1, "non_finite_key"))
        self.assertEqual(report["failures"]["non_finite_key"], 1)

    def test_cuda_store_refuses_bad_constants_like_the_cpu(self):
        case = make_case(CONFIGS[0])
        centroids, Pi = case.centroids.clone(), case.Pi.clone()
        centroids[[2, 3]] = centroids[[3, 2]]
        Pi[5, 9] = float("inf")
        for name, bad in (("centroids", (case.Pi, centroids)), ("Pi", (Pi, case.centroids))):
            with self.subTest(argument=name):
                args = lambda c, constants: (c.key, c.value, c.kv_cache, c.slot_mapping, *constants, CONFIGS[0].preset)
                with self.assertRaisesRegex(ValueError, f"tqdecode: {name}"):
                    tqdecode.store(*args(case, bad))
                gpu = case.to("cuda")
                before = gpu.kv_cache.clone()
                gpu_constants = tuple(t.cuda() for t in bad)
                with self.assertRaisesRegex(ValueError, f"tqdecode: {name}: "):
                    tqdecode.store(*args(gpu, gpu_constants), check=True)
                tqdecode.store_check_report()
                tqdecode.store(*args(gpu, gpu_constants))  # recorded on the device
                report = tqdecode.store_check_report()
                self.assertTrue(torch.equal(gpu.kv_cache, before), "nothing written")
                expected = "invalid_centroids" if name == "centroids" else "non_finite_rotation"
                self.assertEqual((report["failed_calls"], report["first_failure"]), (1, expected))
                self.assertEqual(report["failures"][expected], 1)

    def test_cuda_store_refuses_duplicate_slots_like_the_cpu(self):
        case = make_case(CONFIGS[1])
        slots = case.slot_mapping.clone()
        slots[40] = slots[3]
        args = lambda c, s: (c.key, c.value, c.kv_cache.clone(), s, c.Pi, c.centroids, CONFIGS[1].preset)
        with self.assertRaisesRegex(ValueError, r"tqdecode: slot_mapping\[40\]"):
            tqdecode.store(*args(case, slots))
        gpu = case.to("cuda")
        with self.assertRaisesRegex(ValueError, "tqdecode: slot_mapping: two tokens map to the same slot"):
            tqdecode.store(*args(gpu, slots.cuda()), check=True)

    def test_cuda_store_default_is_graph_safe(self):
        """The default store synchronises nothing: it captures in a CUDA graph
        and replays with new K/V; check=True is refused during capture."""
        case = make_case(CONFIGS[0])
        expected = torch.zeros_like(case.kv_cache)
        tqdecode.store(case.key, case.value, expected, case.slot_mapping, case.Pi, case.centroids, CONFIGS[0].preset)
        gpu = case.to("cuda")
        key, value = torch.zeros_like(gpu.key), torch.zeros_like(gpu.value)
        cache = torch.zeros_like(gpu.kv_cache)
        store = lambda **kw: tqdecode.store(key, value, cache, gpu.slot_mapping, gpu.Pi, gpu.centroids,
                                            CONFIGS[0].preset, **kw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            store()  # warm-up: the device's store report exists before capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            store()
            with self.assertRaisesRegex(ValueError, "tqdecode: check"):
                store(check=True)
        key.copy_(gpu.key)
        value.copy_(gpu.value)
        cache.zero_()
        tqdecode.store_check_report()
        graph.replay()
        self.assertTrue(torch.equal(cache.cpu(), expected), "the replay wrote the CPU bytes")
        self.assertEqual(tqdecode.store_check_report()["checked_calls"], 1)

    def test_decode_path(self):
        case = make_case(CONFIGS[0]).to("cuda")  # turboquant_4bit_nc, D = 128
        args, kwargs = case.decode_args()
        path = tqdecode.decode_path(*args, **kwargs)
        print(f"decode_path: {path}")
        self.assertEqual(path.path, "hopper" if tqdecode.is_available() else "cuda_generic")
        three_bit = make_case(CONFIGS[2]).to("cuda")  # turboquant_3bit_nc, D = 128: the Hopper kernel too
        path = tqdecode.decode_path(*three_bit.decode_args()[0], **three_bit.decode_args()[1])
        self.assertEqual(path.path, "hopper" if tqdecode.is_available() else "cuda_generic")
        small_heads = make_case(CONFIGS[4]).to("cuda")  # turboquant_4bit_nc, D = 64: the tensor-core kernel too
        path = tqdecode.decode_path(*small_heads.decode_args()[0], **small_heads.decode_args()[1])
        self.assertEqual(path.path, "hopper" if tqdecode.is_available() else "cuda_generic")
        three_bit_d256 = make_case(CONFIGS[5]).to("cuda")  # turboquant_k3v4_nc, D = 256: the tensor-core kernel too
        path = tqdecode.decode_path(*three_bit_d256.decode_args()[0], **three_bit_d256.decode_args()[1])
        self.assertEqual(path.path, "hopper" if tqdecode.is_available() else "cuda_generic")
        # turboquant_4bit_nc, D = 256, group 16: the tensor-core kernel in two row tiles of one head tile
        large_group = make_case(Config("turboquant_4bit_nc", head_dim=256, num_q_heads=32, num_kv_heads=2)).to("cuda")
        path = tqdecode.decode_path(*large_group.decode_args()[0], **large_group.decode_args()[1])
        self.assertEqual(path.path, "hopper" if tqdecode.is_available() else "cuda_generic")
        if tqdecode.is_available():  # elsewhere the reason may be the device's
            self.assertIn("2 row tiles", path.reason)

    def test_device_checks_zero_bad_sequences_and_report_them(self):
        case = make_case(CONFIGS[0])  # seq_lens (37, 0, 1, 160, 95), block size 16
        args, kwargs = case.to("cuda").decode_args()
        query, cache, block_table, seq_lens, Pi, centroids, scale = args
        num_blocks, coverage = cache.shape[0], block_table.shape[1] * case.config.block_size
        table, lens = block_table.clone(), seq_lens.clone()
        table[0, 1] = num_blocks  # inside the 3 blocks of sequence 0's 37 tokens
        lens[3] = coverage + 1
        passed = lens.clone()  # what the checks let through: the failing sequences as empty ones
        passed[[0, 3]] = 0
        cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        expected = tqdecode.turboquant_decode_attention(query.cpu(), cache.cpu(), table.cpu(), passed.cpu(), Pi.cpu(),
                                                        centroids.cpu(), scale, **cpu_kwargs)
        tqdecode.device_check_report()  # start from an empty report
        tqdecode.set_device_checks(True)
        try:
            out = tqdecode.turboquant_decode_attention(query, cache, table, lens, Pi, centroids, scale, **kwargs).clone()
            report = tqdecode.device_check_report()
        finally:
            tqdecode.set_device_checks(False)
        self.assertTrue(bool(torch.all(out[[0, 3]] == 0)), "failing sequences give all-zero rows")
        cosine, relative, peak = errors(out, expected)
        print(f"checked decode vs CPU op: cosine {cosine:.7f}, relative L2 {relative:.2e}, max abs / peak {peak:.2e}")
        self.assertGreater(cosine, 0.9999)
        self.assertLess(relative, 1e-2)
        self.assertLess(peak, 2e-2)
        self.assertEqual(report, {
            "checked_calls": 1, "failed_sequences": 2, "bad_seq_lens": 1, "bad_block_entries": 1,
            "first_bad_seq_len": {"sequence": 3, "value": coverage + 1},
            "first_bad_block_entry": {"sequence": 0, "column": 1, "value": num_blocks},
        })
        self.assertEqual(tqdecode.device_check_report()["checked_calls"], 0, "reading cleared the report")

    def test_cuda_graphs_share_one_pool_across_batch_sizes(self):
        config = Config("turboquant_4bit_nc", seq_lens=tuple(range(3, 3 + 41 * 24, 41)))
        case = make_case(config).to("cuda")
        args, kwargs = case.decode_args()
        _, cache, _, _, Pi, centroids, scale = args
        holder = Holder()
        tqdecode.set_max_batch(24)
        try:
            def decode(q, table, lens):
                return tqdecode.turboquant_decode_attention(q, cache, table, lens, Pi, centroids, scale, **kwargs,
                                                            buf_holder=holder)

            pool = torch.cuda.graph_pool_handle()
            graphs = {}
            for batch in (1, 7, 24):
                inputs = (case.query[:batch].clone(), case.block_table[:batch].clone(), case.seq_lens[:batch].clone())
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: plans, pools and constants exist before capture
                    decode(*inputs)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = decode(*inputs)
                graphs[batch] = (graph, inputs, out)
            pointers = {out.data_ptr() for _, _, out in graphs.values()}
            self.assertEqual(len(pointers), 3, "each captured call owns its output")
            stats = tqdecode.pool_stats()
            self.assertEqual(stats["max_batch"], 24)
            self.assertEqual([pool["bucket_batch"] for pool in stats["pools"]], [24])

            generator = torch.Generator().manual_seed(11)
            num_blocks, max_blocks = cache.shape[0], case.block_table.shape[1]
            for batch, (graph, (q, table, lens), out) in graphs.items():
                for _ in range(2):  # new inputs: values, lengths and block tables all change
                    q.copy_(torch.randn(q.shape, generator=generator).to(q.dtype))
                    table.copy_(torch.randint(0, num_blocks, table.shape, generator=generator, dtype=torch.int32))
                    lens.copy_(torch.randint(0, max_blocks * config.block_size + 1, lens.shape, generator=generator,
                                             dtype=torch.int32))
                    graph.replay()
                    replayed = out.clone()
                    eager = decode(q, table, lens).clone()
                    self.assertTrue(torch.equal(replayed, eager), f"replay == eager at batch {batch}")
                    cpu_kwargs = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                    cpu = tqdecode.turboquant_decode_attention(
                        q.cpu(), cache.cpu(), table.cpu(), lens.cpu(), Pi.cpu(), centroids.cpu(), scale, **cpu_kwargs)
                    self.assertGreater(errors(replayed, cpu)[0], 0.9999, f"replay vs CPU op at batch {batch}")
        finally:
            tqdecode.set_max_batch(0)


class StoreThenDecode(torch.nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.preset, self.scale = case.config.preset, case.scale
        self.decode_kwargs = case.layout.decode_kwargs()
        self.Pi, self.centroids = case.Pi, case.centroids

    def forward(self, key, value, kv_cache, slot_mapping, query, block_table, seq_lens, sinks):
        tqdecode.store(key, value, kv_cache, slot_mapping, self.Pi, self.centroids, self.preset)
        return tqdecode.turboquant_decode_attention(query, kv_cache, block_table, seq_lens, self.Pi, self.centroids,
                                                    self.scale, **self.decode_kwargs, sinks=sinks)


class CompileTest(unittest.TestCase):
    def check_compiled(self, device):
        torch._dynamo.reset()
        case = make_case(CONFIGS[0]).to(device)
        module = StoreThenDecode(case)
        compiled = torch.compile(module, fullgraph=True)
        inputs = lambda cache: (case.key, case.value, cache, case.slot_mapping, case.query, case.block_table,
                                case.seq_lens, case.sinks)
        eager_cache, compiled_cache = torch.zeros_like(case.kv_cache), torch.zeros_like(case.kv_cache)
        expected = module(*inputs(eager_cache)).clone()
        got = compiled(*inputs(compiled_cache))
        self.assertTrue(torch.equal(compiled_cache, eager_cache), "the compiled store wrote the eager bytes")
        self.assertTrue(torch.equal(got, expected), "compiled decode == eager decode")

    def test_compile_fullgraph_cpu(self):
        self.check_compiled("cpu")

    @requires_cuda
    def test_compile_fullgraph_cuda(self):
        self.check_compiled("cuda")

    def test_fakes_match_eager_and_check_arguments(self):
        from torch._subclasses.fake_tensor import FakeTensorMode

        c = make_case(CONFIGS[0])
        decode_args = (c.kv_cache, c.block_table, c.seq_lens, c.centroids, c.PiT, c.scale, 4, 4, False)
        eager = torch.ops.tqdecode.decode(c.query, *decode_args, c.sinks)
        real_constants = torch.ops.tqdecode.make_model_constants("turboquant_3bit_nc", 64)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = torch.ops.tqdecode.decode(c.query, *decode_args, c.sinks)
            constants = torch.ops.tqdecode.make_model_constants("turboquant_3bit_nc", 64)
            with self.assertRaisesRegex(ValueError, "tqdecode: query"):
                torch.ops.tqdecode.decode(c.query.float(), *decode_args, c.sinks)
            with self.assertRaisesRegex(ValueError, "tqdecode: out"):
                torch.ops.tqdecode.decode_out(c.query, *decode_args, c.sinks, out=c.query[:2])
        self.assertEqual((fake.shape, fake.dtype), (eager.shape, eager.dtype))
        self.assertEqual([t.shape for t in constants], [t.shape for t in real_constants])


class BadArgumentsTest(unittest.TestCase):
    """Each bad call raises ValueError naming the argument, before anything is written."""

    def setUp(self):
        self.case = make_case(CONFIGS[0])

    def call(self, **changes):
        args, kwargs = self.case.decode_args()
        names = ("query", "kv_cache", "block_table", "seq_lens", "Pi", "centroids", "scale")
        kwargs.update(zip(names, args))
        kwargs.update(changes)
        return tqdecode.turboquant_decode_attention(**kwargs)

    def assert_names(self, argument, **changes):
        with self.assertRaisesRegex(ValueError, f"tqdecode: {argument}"):
            self.call(**changes)

    def test_wrong_dtypes(self):
        c = self.case
        self.assert_names("query", query=c.query.float())
        self.assert_names("block_table", block_table=c.block_table.long())
        self.assert_names("seq_lens", seq_lens=c.seq_lens.long())
        self.assert_names("kv_cache", kv_cache=c.kv_cache.view(torch.int8))
        self.assert_names("output_buf", output_buf=torch.empty(c.query.shape, dtype=torch.float16))

    def test_wrong_shapes(self):
        c = self.case
        self.assert_names("seq_lens", seq_lens=c.seq_lens[:-1])
        self.assert_names("block_table", block_table=c.block_table[:-1])
        self.assert_names("query", query=c.query[0])
        self.assert_names("sinks", sinks=torch.zeros(3))
        self.assert_names("Pi", Pi=c.Pi[:64])
        self.assert_names("centroids", centroids=c.centroids[:8])
        self.assert_names("centroids", centroids=None)
        self.assert_names("output_buf", output_buf=torch.empty(2, *c.query.shape[1:], dtype=c.query.dtype))
        self.assert_names("output_buf", output_buf=torch.empty(c.query.numel() + 1, dtype=c.query.dtype))
        strided_dims = torch.empty(*c.query.shape[:2], 2 * c.query.shape[2], dtype=c.query.dtype)[..., ::2]
        self.assert_names("output_buf: the head_dim dimension must have stride 1", output_buf=strided_dims)
        with self.assertRaisesRegex(ValueError, "tqdecode: num_blocks: 0 is out of range"):
            tqdecode.allocate_cache(0, 16, 2, 128, "turboquant_4bit_nc")

    def test_unsupported_preset_and_geometry(self):
        c = self.case
        self.assert_names("mse_bits", mse_bits=2)
        self.assert_names("block_size", kv_cache=torch.zeros(4, 8, 2, 134, dtype=torch.uint8))
        self.assert_names("query: num_q_heads", query=torch.zeros(5, 7, 128, dtype=torch.bfloat16), sinks=None)
        self.assert_names("block_table: has no columns", block_table=c.block_table[:, :0])
        self.assert_names("head_dim", query=torch.zeros(5, 8, 96, dtype=torch.bfloat16), Pi=torch.eye(96))
        self.assert_names("kv_cache", kv_cache=c.kv_cache[..., :100])  # a block is not one byte range
        self.assert_names("kv_cache", kv_cache=torch.zeros(4, 16, 2, 100, dtype=torch.uint8))  # slots too small
        with self.assertRaisesRegex(ValueError, "tqdecode: preset"):
            tqdecode.cache_layout("turboquant_2bit", 128, 16, 2)
        with self.assertRaisesRegex(ValueError, "tqdecode: rotation"):
            tqdecode.make_model_constants("turboquant_4bit_nc", 128, rotation="givens")
        with self.assertRaisesRegex(ValueError, "tqdecode: max_batch"):
            tqdecode.set_max_batch(-1)

    def test_ints_past_32_bits_and_non_tensors(self):
        """Refused naming the argument, not truncated or failing inside torch."""
        c = self.case
        self.assert_names("mse_bits", mse_bits=2**32 + 4)
        self.assert_names("value_quant_bits", value_quant_bits=2**32 + 4)
        self.assert_names("scale", scale=None)
        self.assert_names("Pi", Pi=c.Pi.tolist())
        self.assert_names("centroids", centroids=c.centroids.tolist())
        with self.assertRaisesRegex(ValueError, "tqdecode: head_dim: 4294967424 is outside"):
            tqdecode.cache_layout("turboquant_4bit_nc", 2**32 + 128, 16, 2)
        with self.assertRaisesRegex(ValueError, "tqdecode: head_dim"):
            tqdecode.make_model_constants("turboquant_4bit_nc", 2**32 + 64)

    def test_values_checked_by_the_cpu_path(self):
        c = self.case
        too_long = c.seq_lens.clone()
        too_long[3] = 10**6
        self.assert_names(r"seq_lens\[3\]", seq_lens=too_long)
        with self.assertRaisesRegex(ValueError, "tqdecode: key"):
            key = c.key.clone()
            key[0, 0, 0] = float("inf")
            tqdecode.store(key, c.value, c.kv_cache.clone(), c.slot_mapping, c.Pi, c.centroids, c.config.preset)
        with self.assertRaisesRegex(ValueError, "tqdecode: preset"):
            tqdecode.store(c.key, c.value, c.kv_cache.clone(), c.slot_mapping, c.Pi, c.centroids, "int4")

    def test_device_checks_leave_the_cpu_op_validating(self):
        """Device-side checks are a GPU feature: the CPU op still raises, and nothing is reported."""
        tqdecode.set_device_checks(True)
        try:
            too_long = self.case.seq_lens.clone()
            too_long[3] = 10**6
            self.assert_names(r"seq_lens\[3\]", seq_lens=too_long)
            report = tqdecode.device_check_report()
        finally:
            tqdecode.set_device_checks(False)
        self.assertEqual((report["failed_sequences"], report["first_bad_seq_len"]), (0, None))

    def test_ops_called_directly_check_in_cpp(self):
        """torch.ops.tqdecode.* skip the Python checks; the C++ ones raise the same ValueError."""
        c = self.case
        with self.assertRaisesRegex(ValueError, "tqdecode: query: dtype torch.float32"):
            torch.ops.tqdecode.decode(c.query.float(), c.kv_cache, c.block_table, c.seq_lens, c.centroids, c.PiT,
                                      c.scale, 4, 4, False)
        with self.assertRaisesRegex(ValueError, "tqdecode: PiT"):
            torch.ops.tqdecode.decode(c.query, c.kv_cache, c.block_table, c.seq_lens, c.centroids, None,
                                      c.scale, 4, 4, False)
        batch, heads, head_dim = c.query.shape
        overlapping_heads = torch.empty(c.query.numel(), dtype=c.query.dtype).as_strided(
            c.query.shape, (heads * head_dim, head_dim // 2, 1))
        with self.assertRaisesRegex(ValueError, r"tqdecode: out: elements overlap \(strides \[1024, 64, 1\]\)"):
            torch.ops.tqdecode.decode_out(c.query, c.kv_cache, c.block_table, c.seq_lens, c.centroids, c.PiT,
                                          c.scale, 4, 4, False, out=overlapping_heads)
        with self.assertRaisesRegex(ValueError, "tqdecode: slot_mapping"):
            torch.ops.tqdecode.store(c.key, c.value, c.kv_cache, c.slot_mapping.int(), c.Pi, c.centroids,
                                     c.config.preset)

    @requires_cuda
    def test_wrong_device(self):
        gpu = self.case.to("cuda")
        args, kwargs = gpu.decode_args()
        self.assert_names("block_table", query=gpu.query, kv_cache=gpu.kv_cache, seq_lens=gpu.seq_lens,
                          Pi=gpu.Pi, centroids=gpu.centroids, sinks=gpu.sinks)
        self.assert_names("kv_cache", query=gpu.query, block_table=gpu.block_table, seq_lens=gpu.seq_lens,
                          Pi=gpu.Pi, centroids=gpu.centroids, sinks=gpu.sinks)
        with self.assertRaisesRegex(ValueError, "tqdecode: kv_cache"):
            torch.ops.tqdecode.decode_out(gpu.query, self.case.kv_cache, gpu.block_table, gpu.seq_lens,
                                          gpu.centroids, gpu.PiT, gpu.scale, 4, 4, False,
                                          out=torch.empty_like(gpu.query))
        # A host query beside CUDA tensors: the CUDA op runs and names the query; the output stays as it was.
        # (Given an output_buf, the Python function names that first: it checks the buffer against the query.)
        poisoned = torch.full_like(gpu.query, float("nan"))
        self.assert_names("query: is on cpu", query=self.case.query, kv_cache=gpu.kv_cache,
                          block_table=gpu.block_table, seq_lens=gpu.seq_lens, Pi=gpu.Pi, centroids=gpu.centroids,
                          sinks=gpu.sinks)
        with self.assertRaisesRegex(ValueError, "tqdecode: query: is on cpu"):
            torch.ops.tqdecode.decode_out(self.case.query, gpu.kv_cache, gpu.block_table, gpu.seq_lens,
                                          gpu.centroids, gpu.PiT, gpu.scale, 4, 4, False, out=poisoned)
        self.assertTrue(torch.isnan(poisoned).all())


class SeedCallsTest(unittest.TestCase):
    """Calls the entry point exactly as the engine-side launcher's callers do
    (docs/LAUNCHER.md: arguments it does not need are accepted and ignored): each
    variant gives the canonical call's result, on the CPU and on CUDA."""

    def check(self, device):
        case = make_case(CONFIGS[0]).to(device) if device != "cpu" else make_case(CONFIGS[0])
        args, kwargs = case.decode_args()
        expected = tqdecode.turboquant_decode_attention(*args, **kwargs)
        batch, heads, head_dim = case.query.shape
        layout = case.layout

        # Sizes an engine computes its own way (one config gives ceil(D * bits / 8) + 4), and
        # norm_correction=False for 4-bit MSE keys: the decode is the same function.
        for changes in ({"key_packed_size": math.ceil(head_dim * 4 / 8) + 4, "value_packed_size": 0},
                        {"norm_correction": False}, {"norm_correction": True, "max_seq_len": 4096,
                                                     "max_num_kv_splits": 8, "mid_o_buf": torch.empty(1),
                                                     "lse_buf": torch.empty(1), "buf_holder": Holder()}):
            got = tqdecode.turboquant_decode_attention(*args, **{**kwargs, **changes})
            self.assertTrue(torch.equal(got, expected), f"{device}: {sorted(changes)}")

        # output_buf with more rows than the batch: the first B rows are written and returned.
        for shape in ((batch + 3, heads, head_dim), (batch + 3, heads * head_dim)):
            output_buf = torch.full(shape, float("nan"), dtype=case.query.dtype, device=device)
            returned = tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=output_buf)
            self.assertEqual((returned.shape[0], returned.data_ptr()), (batch, output_buf.data_ptr()))
            self.assertTrue(torch.equal(returned.reshape(expected.shape), expected), f"{device}: {shape}")
            self.assertTrue(bool(torch.isnan(output_buf[batch:]).all()), "rows past B are not written")
        # A 2-D view of a contiguous [N, Hq * D] buffer taken from a larger one (engines slice theirs).
        whole = torch.full((batch + 8, heads * head_dim + 16), float("nan"), dtype=case.query.dtype, device=device)
        view = whole[2:, : heads * head_dim]
        tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=view)
        self.assertTrue(torch.equal(view[:batch].reshape(expected.shape), expected))
        self.assertTrue(bool(torch.isnan(whole[:2]).all()) and bool(torch.isnan(whole[:, heads * head_dim:]).all()))
        # Expanded views (vLLM's continuation rows share one block-table row): repeated rows read as the rows
        # they repeat; an output whose rows overlap is refused.
        first = lambda t: t[:1].repeat(batch, *([1] * (t.dim() - 1)))  # noqa: E731
        repeated = tqdecode.turboquant_decode_attention(first(args[0]), args[1], first(args[2]), first(args[3]),
                                                        *args[4:], **kwargs)
        expanded = tqdecode.turboquant_decode_attention(args[0][:1].expand(batch, -1, -1), args[1],
                                                        args[2][:1].expand(batch, -1), first(args[3]), *args[4:],
                                                        **kwargs)
        self.assertTrue(torch.equal(expanded, repeated), device)
        with self.assertRaisesRegex(ValueError, "tqdecode: output_buf: elements overlap"):
            tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=torch.empty(
                1, heads, head_dim, dtype=case.query.dtype, device=device).expand(batch, -1, -1))
        with self.assertRaisesRegex(ValueError, "tqdecode: output_buf: elements overlap"):  # heads half a head apart
            tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=torch.empty(
                batch * heads * head_dim, dtype=case.query.dtype, device=device).as_strided(
                    (batch, heads, head_dim), (heads * head_dim, head_dim // 2, 1)))
        with self.assertRaisesRegex(ValueError, r"tqdecode: output_buf: .*accepted: \[N, 8, 128\] or \[N, 1024\]"):
            tqdecode.turboquant_decode_attention(*args, **kwargs, output_buf=torch.empty(
                batch - 1, heads, head_dim, dtype=case.query.dtype, device=device))

    def test_seed_calls_cpu(self):
        self.check("cpu")

    @requires_cuda
    def test_seed_calls_cuda(self):
        self.check("cuda")


class OpCheckTest(unittest.TestCase):
    """torch.library.opcheck on every op: schema (mutations and aliasing as
    declared), fake implementations, autograd registration, AOT dispatch."""

    def check_ops(self, device):
        case = make_case(CONFIGS[0])
        if device != "cpu":
            case = case.to(device)
        c = case
        decode_args = (c.query, c.kv_cache, c.block_table, c.seq_lens, c.centroids, c.PiT, c.scale, 4, 4, False, c.sinks)
        # Several query tokens per sequence: 5, 0, 1, 128 and 17 of the lengths 37, 0, 1, 160 and 95.
        starts = torch.tensor([0, 5, 5, 6, 134, 151], dtype=torch.int32, device=c.query.device)
        tokens = torch.randn(151, *c.query.shape[1:], generator=torch.Generator().manual_seed(1)).to(c.query)
        varlen_args = (tokens, c.kv_cache, c.block_table, c.seq_lens, starts, 128, c.centroids, c.PiT, c.scale, 4, 4,
                       False, c.sinks)
        ops = torch.ops.tqdecode
        slot_mapping = c.slot_mapping
        samples = [
            (ops.decode.default, decode_args, {}),
            (ops.decode_out.default, decode_args, {"out": torch.empty_like(c.query)}),
            (ops.decode_path.default, decode_args, {}),
            (ops.varlen_decode.default, varlen_args, {}),
            (ops.varlen_decode_out.default, varlen_args, {"out": torch.empty_like(tokens)}),
            (ops.store.default, (c.key, c.value, torch.zeros_like(c.kv_cache), slot_mapping, c.Pi, c.centroids,
                                 c.config.preset), {}),
            (ops.make_model_constants.default, ("turboquant_3bit_nc", 64, 3, "dense"), {}),
            (ops.cache_layout.default, ("turboquant_k8v4", 128, 16, 2), {}),
            (ops.continuation_route.default, (torch.arange(3, 9, dtype=torch.int32, device=c.query.device), 16), {}),
            # One row (opcheck clones its inputs, so an expanded table would reach the op as distinct rows).
            (ops.continuation_decode_out.default, (c.query[:1], c.kv_cache, c.block_table[:1], c.seq_lens[:1],
                                                   *decode_args[4:]), {"out": torch.empty_like(c.query[:1])}),
            (ops.is_available.default, (), {}),
            (ops.runs_on_device.default, (0,), {}),
            (ops.version.default, (), {}),
            (ops.pool_stats.default, (), {}),
            (ops.set_device_checks.default, (False,), {}),
            (ops.set_max_batch.default, (0,), {}),
            (ops.device_check_report.default, (0,), {}),
            (ops.store_check_report.default, (0,), {}),
        ]
        for op, args, kwargs in samples:
            with self.subTest(op=str(op), device=device):
                # No AOT check where a compiled graph cannot equal eager calls: decode_path's fake cannot know
                # the path (it depends on the device and the cache's alignment) and answers "unknown"; the
                # pool stats and reports describe the process's state (and each read clears a report); the AOT
                # check cannot compare version's bare string.
                no_aot = (ops.decode_path.default, ops.pool_stats.default, ops.device_check_report.default,
                          ops.store_check_report.default, ops.version.default)
                utils = [u for u in torch.library._OPCHECK_DEFAULT_UTILS
                         if not (op in no_aot and u == "test_aot_dispatch_dynamic")]
                torch.library.opcheck(op, args, kwargs, test_utils=utils)

    def test_opcheck_cpu(self):
        self.check_ops("cpu")

    @requires_cuda
    def test_opcheck_cuda(self):
        self.check_ops("cuda")


@requires_cuda
class PoolTest(unittest.TestCase):
    """docs/LAUNCHER.md's buffer pool as the binding uses it."""

    def setUp(self):
        self.case = make_case(Config("turboquant_4bit_nc", seq_lens=tuple(range(5, 5 + 37 * 20, 37)))).to("cuda")

    def tearDown(self):
        tqdecode.set_max_batch(0)

    def decode(self, batch, **extra):
        c = self.case
        args, kwargs = c.decode_args()
        return tqdecode.turboquant_decode_attention(c.query[:batch], c.kv_cache, c.block_table[:batch],
                                                    c.seq_lens[:batch], *args[4:], **{**kwargs, **extra})

    def buckets(self):
        return [pool["bucket_batch"] for pool in tqdecode.pool_stats()["pools"]]

    def test_growth_is_geometric_and_results_own_their_memory(self):
        tqdecode.set_max_batch(4)
        first = self.decode(3)
        kept = first.clone()
        self.assertEqual(self.buckets(), [4])
        for batch, bucket in ((5, 8), (7, 8), (9, 16), (16, 16), (20, 32)):
            out = self.decode(batch)
            self.assertEqual(self.buckets(), [bucket], f"batch {batch}")
            cosine, relative, _ = errors(out[:3], kept)  # N depends on the batch: summation order may differ
            self.assertGreater(cosine, 0.99999, f"batch {batch}")
            self.assertLess(relative, 2e-3, f"batch {batch}")
        tqdecode.set_max_batch(2)  # releases the pools
        self.decode(2)
        self.assertTrue(torch.equal(first, kept), "a result stays valid after the pools are released")

    def test_growth_during_capture_names_set_max_batch(self):
        tqdecode.set_max_batch(4)
        self.decode(4)  # warm-up: the pool exists with 4 rows
        graph = torch.cuda.CUDAGraph()
        with self.assertRaisesRegex(ValueError, "tqdecode: max_batch: .*set_max_batch"):
            with torch.cuda.graph(graph):
                self.decode(6)


class OneEntryDimensionsTest(unittest.TestCase):
    """torch gives a dimension of one entry any stride (a permuted view has
    them): a cache of one block, or of one kv head, stores and decodes in
    both orders as its contiguous self does."""

    def test_any_stride_on_a_dimension_of_one_entry(self):
        preset, head_dim, block_size = "turboquant_4bit_nc", 128, 16
        centroids, Pi, _ = tqdecode.make_model_constants(preset, head_dim, seed=3)
        g = torch.Generator().manual_seed(3)
        for order in ("blocks", "token_slots"):
            for num_blocks, num_kv_heads in ((1, 2), (3, 1)):
                layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, order)
                tokens = num_blocks * block_size - 3
                key, value = torch.randn(2, tokens, num_kv_heads, head_dim, generator=g)
                query = torch.randn(1, 4 * num_kv_heads, head_dim, generator=g).to(torch.bfloat16)
                block_table = torch.arange(num_blocks, dtype=torch.int32)[None]
                seq_lens = torch.tensor([tokens], dtype=torch.int32)

                def cache_and_output(odd_strides):
                    cache = tqdecode.allocate_cache(num_blocks, block_size, num_kv_heads, head_dim, preset,
                                                    cache_order=order)
                    if odd_strides:
                        cache = cache.as_strided(cache.shape, [1 if n == 1 else s
                                                               for n, s in zip(cache.shape, cache.stride())])
                    tqdecode.store(key, value, cache, torch.arange(tokens), Pi, centroids, preset,
                                   cache_order=order)
                    call = (query, cache, block_table, seq_lens, Pi, centroids, head_dim ** -0.5)
                    if order == "blocks":
                        return cache, tqdecode.turboquant_decode_attention(*call, **layout.decode_kwargs())
                    return cache, tqdecode.token_slots_decode_attention(
                        *call, 4, layout.key_packed_size, 4, norm_correction=True)

                name = f"{order}, {num_blocks} blocks, {num_kv_heads} kv heads"
                dense_cache, expected = cache_and_output(False)
                odd_cache, got = cache_and_output(True)
                self.assertNotEqual(odd_cache.stride(), dense_cache.stride(), name)
                self.assertTrue(torch.equal(odd_cache.contiguous(), dense_cache), name)
                self.assertTrue(torch.equal(got, expected), name)


class MaxBatchTest(unittest.TestCase):
    def test_environment_overrides_the_callers_value(self):
        import os
        import subprocess
        import sys
        code = "import tqdecode; tqdecode.set_max_batch(24); print(tqdecode.pool_stats()['max_batch'])"
        env = {**os.environ, "TQDECODE_MAX_BATCH": "40", "PYTHONPATH": os.pathsep.join(sys.path)}
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        self.assertEqual(result.stdout.strip(), "40")


if __name__ == "__main__":
    unittest.main(verbosity=2)
