"""The token-interleaved cache vLLM writes on CUDA GPUs (docs/FORMAT.md section
4b) through the binding: the engine-signature entry point
``tqdecode.token_slots_decode_attention``, the engine-semantics store
(``cache_order="token_slots"``) and the vLLM plugin hook.

Oracle: a reader of section 4b written here from the document alone, and
torch SDPA in fp32 over what it reads. GPU tests skip with a message without
CUDA.
"""

import importlib
import inspect
import math
import os
import sys
import tempfile
import unittest
import unittest.mock

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    raise unittest.SkipTest("torch is not installed: the PyTorch binding tests need it")

import tqdecode

HAS_CUDA = torch.cuda.is_available()
requires_cuda = unittest.skipUnless(HAS_CUDA, "no CUDA device: GPU test of the token_slots order skipped")

PRESETS = {  # key bits, value bits, fp8 keys
    "turboquant_4bit_nc": (4, 4, False),
    "turboquant_k3v4_nc": (3, 4, False),
    "turboquant_3bit_nc": (3, 3, False),
    "turboquant_k8v4": (8, 4, True),
}


def unpack(packed, bits, count):
    """LSB-first codes: [..., bytes] uint8 -> [..., count] int64."""
    stream = ((packed.long().unsqueeze(-1) >> torch.arange(8)) & 1).flatten(-2)
    return (stream[..., : count * bits].unflatten(-1, (count, bits)) << torch.arange(bits)).sum(-1)


def read_slots(cache, preset, head_dim, centroids, norm_correction):
    """(khat, vhat) fp32 [num_blocks, block_size, Hk, D] of section 4b: keys in
    the rotated space (MSE) or as fp8 values."""
    key_bits, value_bits, fp8 = PRESETS[preset]
    kd = head_dim if fp8 else math.ceil(head_dim * key_bits / 8)
    vd = math.ceil(head_dim * value_bits / 8)
    raw = cache.cpu()
    half = lambda at: raw[..., at : at + 2].contiguous().view(torch.float16).float()  # noqa: E731
    value_at = kd if fp8 else kd + 2
    if fp8:
        khat = raw[..., :kd].contiguous().view(torch.float8_e4m3fn).float()
    else:
        c = centroids.cpu().float()[unpack(raw[..., :kd], key_bits, head_dim)]
        norm = half(kd)
        if norm_correction:
            c_norm = c.norm(dim=-1, keepdim=True)
            c = torch.where(c_norm > 0, c / c_norm, torch.zeros_like(c))
        khat = norm * c
    codes = unpack(raw[..., value_at : value_at + vd], value_bits, head_dim).float()
    vhat = codes * half(value_at + vd) + half(value_at + vd + 2)
    return khat, vhat


class Case:
    def __init__(self, preset, head_dim=128, block_size=16, num_kv_heads=2, num_q_heads=8, seq_lens=(37, 1, 160, 0, 95),
                 heads_major=False, page_padding=0, seed=0, dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        self.preset, self.head_dim, self.block_size = preset, head_dim, block_size
        self.num_kv_heads, self.num_q_heads, self.dtype = num_kv_heads, num_q_heads, dtype
        layout = tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads, "token_slots")
        self.layout = layout
        self.centroids, self.Pi, self.PiT = tqdecode.make_model_constants(preset, head_dim, seed=seed + 1)
        blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
        num_blocks = sum(blocks_per_seq) + 2
        order = torch.randperm(num_blocks, generator=g).tolist()
        self.block_table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
        slots = []
        for i, n in enumerate(seq_lens):
            for j in range(blocks_per_seq[i]):
                self.block_table[i, j] = order.pop()
            slots += [int(self.block_table[i, t // block_size]) * block_size + t % block_size for t in range(n)]
        # The cache as a strided view: tokens-major (vLLM's order) or heads-major, pages padded.
        slot = layout.slot_bytes + 2
        page = block_size * num_kv_heads * slot + page_padding
        self.storage = torch.randint(0, 256, (num_blocks * page,), dtype=torch.uint8, generator=g)
        strides = (page, slot, block_size * slot) if heads_major else (page, num_kv_heads * slot, slot)
        self.kv_cache = self.storage.as_strided((num_blocks, block_size, num_kv_heads, slot), strides + (1,))
        tokens = len(slots)
        channel = torch.ones(head_dim)
        channel[torch.randperm(head_dim, generator=g)[:4]] = 6.0
        self.key = torch.randn(tokens, num_kv_heads, head_dim, generator=g) * channel + 0.3
        self.value = torch.randn(tokens, num_kv_heads, head_dim, generator=g) + 0.2
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        tqdecode.store(self.key, self.value, self.kv_cache, self.slot_mapping, self.Pi, self.centroids, preset,
                       cache_order="token_slots")
        self.query = torch.randn(len(seq_lens), num_q_heads, head_dim, generator=g).to(dtype)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.scale = 1 / math.sqrt(head_dim)

    def args(self, device="cpu"):
        on = lambda t: None if t is None else t.to(device)  # noqa: E731
        cache = self.storage.to(device).as_strided(self.kv_cache.shape, self.kv_cache.stride())  # the same strides
        key_bits, value_bits, fp8 = PRESETS[self.preset]
        return ((on(self.query), cache, on(self.block_table), on(self.seq_lens), on(self.Pi), on(self.centroids),
                 self.scale, key_bits, self.layout.key_packed_size, value_bits), {"key_fp8": fp8})

    def sdpa(self, norm_correction):
        khat, vhat = read_slots(self.kv_cache, self.preset, self.head_dim, self.centroids, norm_correction)
        query = self.query.float()
        if not PRESETS[self.preset][2]:
            query = (query @ self.PiT).to(torch.bfloat16).float()
        group = self.num_q_heads // self.num_kv_heads
        out = torch.zeros(query.shape)
        for i, n in enumerate(self.seq_lens.tolist()):
            if n == 0:
                continue
            t = torch.arange(n)
            blocks = self.block_table[i, t // self.block_size].long()
            k = khat[blocks, t % self.block_size].repeat_interleave(group, dim=1).transpose(0, 1)
            v = vhat[blocks, t % self.block_size].repeat_interleave(group, dim=1).transpose(0, 1)
            out[i] = F.scaled_dot_product_attention(query[i].unsqueeze(1), k, v, scale=self.scale).squeeze(1)
        return out


def errors(got, expected):
    got, expected = got.detach().cpu().double().flatten(), expected.detach().cpu().double().flatten()
    return (F.cosine_similarity(got, expected, dim=0).item(), ((got - expected).norm() / expected.norm()).item())


class RecordedOps:
    """The ops tqdecode calls, each call recorded as (name, arguments) in `calls` before it runs."""

    ROUTED = ("decode", "decode_out", "varlen_decode_out", "continuation_route", "continuation_decode_out")

    def __init__(self, ops):
        self._ops = ops
        self.calls = []

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def call(*args, **kwargs):
            self.calls.append((name, args))
            return op(*args, **kwargs)
        return call

    def routed(self):
        """The calls of the ops a row set is routed through, in order."""
        return [(name, args) for name, args in self.calls if name in self.ROUTED]


def recording_ops():
    """A context in which tqdecode's ops are a RecordedOps (the context's value)."""
    return unittest.mock.patch.object(tqdecode, "ops", RecordedOps(tqdecode.ops))


class TokenSlotsTest(unittest.TestCase):
    def test_signature_is_the_engines(self):
        expected = ["query", "kv_cache", "block_table", "seq_lens", "Pi", "centroids", "scale", "mse_bits",
                    "key_packed_size", "value_quant_bits", "key_fp8", "norm_correction", "PiT", "mid_o_buf",
                    "output_buf", "lse_buf", "buf_holder", "max_num_kv_splits"]
        parameters = inspect.signature(tqdecode.token_slots_decode_attention).parameters
        self.assertEqual(list(parameters), expected)
        defaults = {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}
        self.assertEqual(defaults, {"key_fp8": False, "norm_correction": False, "PiT": None, "mid_o_buf": None,
                                    "output_buf": None, "lse_buf": None, "buf_holder": None, "max_num_kv_splits": 32})

    def test_slot_sizes_at_head_dim_128(self):
        sizes = {p: tqdecode.cache_layout(p, 128, 16, 8, "token_slots").slot_bytes for p in PRESETS}
        self.assertEqual(sizes, {"turboquant_k8v4": 196, "turboquant_4bit_nc": 134, "turboquant_k3v4_nc": 118,
                                 "turboquant_3bit_nc": 102})

    def check(self, case, device):
        for norm_correction in (True, False):
            args, kwargs = case.args(device)
            out = tqdecode.token_slots_decode_attention(*args, **kwargs, norm_correction=norm_correction)
            self.assertEqual((out.shape, out.dtype), (case.query.shape, case.dtype))
            self.assertTrue(bool(torch.all(out[3] == 0)), "seq_len 0 gives an all-zero row")
            cosine, relative = errors(out, case.sdpa(norm_correction))
            what = f"{case.preset} {device} norm_correction={norm_correction}"
            print(f"{what}: cosine {cosine:.7f}, relative L2 {relative:.2e}")
            self.assertGreater(cosine, 0.9999, what)
            self.assertLess(relative, 1e-2, what)

    def test_every_preset_cpu(self):
        for preset in PRESETS:
            self.check(Case(preset), "cpu")

    def test_heads_major_padded_pages_and_other_head_sizes_cpu(self):
        self.check(Case("turboquant_4bit_nc", heads_major=True, page_padding=6), "cpu")
        self.check(Case("turboquant_3bit_nc", head_dim=64, block_size=32, num_kv_heads=1, num_q_heads=4), "cpu")
        self.check(Case("turboquant_k8v4", head_dim=256, num_q_heads=4, dtype=torch.float16), "cpu")

    @requires_cuda
    def test_every_preset_cuda_matches_the_cpu(self):
        for preset in PRESETS:
            for case in (Case(preset), Case(preset, heads_major=True, page_padding=6, seed=3)):
                self.check(case, "cuda")
                cpu_args, kwargs = case.args("cpu")
                gpu_args, _ = case.args("cuda")
                expected = tqdecode.token_slots_decode_attention(*cpu_args, **kwargs, norm_correction=True)
                got = tqdecode.token_slots_decode_attention(*gpu_args, **kwargs, norm_correction=True)
                cosine, relative = errors(got, expected)
                self.assertGreater(cosine, 0.9999, preset)
                self.assertLess(relative, 1e-2, preset)

    @requires_cuda
    def test_cuda_store_writes_the_cpu_bytes(self):
        for preset in PRESETS:
            case = Case(preset)
            on_gpu = lambda t: None if t is None else t.cuda()  # noqa: E731
            expected = torch.zeros(case.kv_cache.shape[0], case.block_size, case.num_kv_heads, case.layout.slot_bytes,
                                   dtype=torch.uint8)
            gpu = expected.cuda()
            tqdecode.store(case.key, case.value, expected, case.slot_mapping, case.Pi, case.centroids, preset,
                           cache_order="token_slots")
            tqdecode.store(case.key.cuda(), case.value.cuda(), gpu, case.slot_mapping.cuda(), on_gpu(case.Pi),
                           on_gpu(case.centroids), preset, check=True, cache_order="token_slots")
            self.assertTrue(torch.equal(gpu.cpu(), expected), preset)

    def test_output_buf_as_the_engine_passes_it(self):
        case = Case("turboquant_4bit_nc")
        args, kwargs = case.args()
        expected = tqdecode.token_slots_decode_attention(*args, **kwargs)
        batch, heads, dim = case.query.shape
        output_buf = torch.full((batch + 2, heads, dim), float("nan"), dtype=case.dtype)
        returned = tqdecode.token_slots_decode_attention(*args, **kwargs, output_buf=output_buf)
        self.assertEqual(returned.data_ptr(), output_buf.data_ptr())
        self.assertTrue(torch.equal(returned, expected))
        self.assertTrue(bool(torch.isnan(output_buf[batch:]).all()))
        other_dtype = torch.empty((batch, heads, dim), dtype=torch.float32)  # not usable: a new tensor, as vLLM does
        self.assertTrue(torch.equal(tqdecode.token_slots_decode_attention(*args, **kwargs, output_buf=other_dtype),
                                    expected))

    @staticmethod
    def continuation(device, rows=40, lengths=None):
        """A request's chunk as vLLM sends it: `rows` rows with seq_lens rising by one to the request's 200 tokens,
        over its block-table row expanded with stride 0."""
        case = Case("turboquant_4bit_nc", seq_lens=(200,), seed=5)
        args, kwargs = case.args(device)
        g = torch.Generator().manual_seed(7)
        query = torch.randn(rows, case.num_q_heads, case.head_dim, generator=g).to(case.dtype).to(device)
        if lengths is None:
            lengths = torch.arange(201 - rows, 201, dtype=torch.int32)
        call = (query, args[1], args[2][:1].expand(rows, -1), lengths.to(device), *args[4:])
        return call, {**kwargs, "norm_correction": True}

    def route(self, call):
        """The continuation_route op's answer for a call: whether its rows are one chunk."""
        query, kv_cache, block_table, lengths = call[:4]
        rows = query.shape[0]
        route = tqdecode.ops.continuation_route(lengths, block_table.shape[1] * kv_cache.shape[1]).cpu()
        self.assertEqual(route.shape[0], rows + 3)
        return int(route[rows + 1]) == rows

    def check_routed(self, recorded, call, kwargs, got, chunk):
        """Rows over one expanded table row take one op, continuation_decode_out, whose result is, bitwise, the
        varlen call's of the rows as the request's last tokens where they are one chunk, else the rows' own call's
        (on CUDA both calls run, the rows' with every length 0 for a chunk, the varlen one with no token
        otherwise; on the CPU only the one that writes the rows)."""
        self.assertEqual([name for name, _ in recorded.routed()], ["continuation_decode_out"])
        query, kv_cache, block_table, lengths = call[:4]
        if chunk:
            rows = query.shape[0]
            Pi, centroids, scale, key_bits, _, value_bits = call[4:10]
            starts = torch.tensor([0, rows], dtype=torch.int32, device=query.device)
            expected = tqdecode.varlen_decode_attention(query, kv_cache, block_table[:1], lengths[-1:], starts, Pi,
                                                        centroids, scale, key_bits, value_bits, max_query_len=rows,
                                                        cache_order="token_slots", **kwargs)
        else:
            expected = tqdecode.token_slots_decode_attention(*call[:2], block_table.contiguous(), *call[3:], **kwargs)
        self.assertTrue(torch.equal(got, expected))

    def check_continuation(self, device):
        call, kwargs = self.continuation(device)
        self.assertTrue(tqdecode._continuation_candidate(call[0], call[2]))
        self.assertTrue(self.route(call))
        as_rows = tqdecode.token_slots_decode_attention(*call[:2], call[2].contiguous(), *call[3:], **kwargs)
        with recording_ops() as recorded:
            got = tqdecode.token_slots_decode_attention(*call, **kwargs)
        self.check_routed(recorded, call, kwargs, got, chunk=True)
        cosine, relative = errors(got, as_rows)
        print(f"continuation chunk {device}: one varlen call against rows: cosine {cosine:.8f}, relative L2 {relative:.2e}")
        self.assertGreater(cosine, 0.99999)
        self.assertLess(relative, 2e-3)
        rows, heads, dim = call[0].shape
        output_buf = torch.full((rows + 2, heads, dim), float("nan"), dtype=call[0].dtype, device=device)
        returned = tqdecode.token_slots_decode_attention(*call, **kwargs, output_buf=output_buf)
        self.assertEqual(returned.data_ptr(), output_buf.data_ptr())
        self.assertTrue(torch.equal(returned, got))
        self.assertTrue(bool(torch.isnan(output_buf[rows:]).all()))
        return got

    @staticmethod
    def not_continuations():
        """Rows over one expanded table row that are not one chunk, as (rows, lengths): rising lengths with two
        swapped, lengths from 0 (a row of no position), equal lengths. (Lengths past the table's positions:
        test_bad_input_names_the_argument.)"""
        gap = torch.arange(161, 201, dtype=torch.int32)
        gap[10], gap[11] = gap[11].item(), gap[10].item()
        return ((40, gap), (40, torch.arange(0, 40, dtype=torch.int32)), (10, torch.full((10,), 150, dtype=torch.int32)))

    def test_continuation_chunk_runs_as_one_varlen_call_cpu(self):
        self.check_continuation("cpu")

    def test_rows_that_are_not_a_continuation_stay_rows_cpu(self):
        for rows, lengths in (*self.not_continuations(), (tqdecode.CONTINUATION_MIN_ROWS - 1, None)):
            call, kwargs = self.continuation("cpu", rows, lengths)
            if rows >= tqdecode.CONTINUATION_MIN_ROWS:
                self.assertFalse(self.route(call))
            else:
                self.assertFalse(tqdecode._continuation_candidate(call[0], call[2]))
            expected = tqdecode.token_slots_decode_attention(*call[:2], call[2].contiguous(), *call[3:], **kwargs)
            with recording_ops() as recorded:
                got = tqdecode.token_slots_decode_attention(*call, **kwargs)
            self.assertTrue(torch.equal(got, expected))
            if rows >= tqdecode.CONTINUATION_MIN_ROWS:
                self.check_routed(recorded, call, kwargs, got, chunk=False)
            else:
                self.assertEqual([name for name, _ in recorded.routed()], ["decode"])

    def test_continuation_route_op(self):
        cases = (([5], 16), ([1, 2, 3], 3), ([1, 2, 3], 2), ([0, 1, 2], 16), ([4, 5, 7], 16), ([9, 9], 16),
                 (list(range(100, 700)), 700), (list(range(100, 700)), 699))
        for lengths, capacity in cases:
            seq_lens = torch.tensor(lengths, dtype=torch.int32)
            chunk = lengths[0] >= 1 and lengths[-1] <= capacity and all(b - a == 1 for a, b in zip(lengths, lengths[1:]))
            rows = len(lengths)
            expected = [0] * rows + [0, rows, lengths[-1]] if chunk else lengths + [0, 0, 0]
            devices = ("cpu", "cuda") if HAS_CUDA else ("cpu",)
            for device in devices:
                route = tqdecode.ops.continuation_route(seq_lens.to(device), capacity)
                self.assertEqual(route.cpu().tolist(), expected, f"{lengths[:4]}... capacity {capacity} on {device}")
        with self.assertRaisesRegex(ValueError, "tqdecode: seq_lens: torch.int64"):
            tqdecode.ops.continuation_route(torch.ones(3, dtype=torch.int64), 16)
        with self.assertRaisesRegex(ValueError, r"tqdecode: seq_lens: torch.int32 \[0\]"):
            tqdecode.ops.continuation_route(torch.ones(0, dtype=torch.int32), 16)

    def test_more_rows_than_one_varlen_sequence_holds_are_no_candidate(self):
        """The route's varlen call gives the rows one sequence, so they are a candidate only up to the varlen entry's
        max_query_len (tqdecode::kMaxQueryLen); past it they stay rows."""
        most = tqdecode._MAX_QUERY_LEN
        query = torch.empty(most + 1, 1, 1)
        table = torch.zeros(1, 4, dtype=torch.int32).expand(most + 1, -1)
        self.assertFalse(tqdecode._continuation_candidate(query, table))
        self.assertTrue(tqdecode._continuation_candidate(query[:most], table[:most]))
        self.assertFalse(tqdecode._continuation_candidate(query[:most], table[:most].contiguous()))

    @requires_cuda
    def test_continuation_chunk_runs_as_one_varlen_call_cuda(self):
        got = self.check_continuation("cuda")
        call, kwargs = self.continuation("cpu")
        cosine, relative = errors(got, tqdecode.token_slots_decode_attention(*call, **kwargs))
        self.assertGreater(cosine, 0.9999)
        self.assertLess(relative, 1e-2)

    @requires_cuda
    def test_rows_that_are_not_a_continuation_stay_rows_cuda(self):
        for rows, lengths in self.not_continuations():
            call, kwargs = self.continuation("cuda", rows, lengths)
            self.assertFalse(self.route(call))
            expected = tqdecode.token_slots_decode_attention(*call[:2], call[2].contiguous(), *call[3:], **kwargs)
            with recording_ops() as recorded:
                got = tqdecode.token_slots_decode_attention(*call, **kwargs)
            self.assertTrue(torch.equal(got, expected), f"{rows} rows, lengths {lengths[:4].tolist()}...")
            self.check_routed(recorded, call, kwargs, got, chunk=False)

    @requires_cuda
    def test_continuation_route_in_a_cuda_graph(self):
        """One captured call replayed with a chunk at another position, then with rows that are not one: each
        replay matches the rows' own results, with no synchronisation inside the capture."""
        call, kwargs = self.continuation("cuda", 40)
        lengths = call[3]
        output_buf = torch.full(call[0].shape, float("nan"), dtype=call[0].dtype, device="cuda")
        tqdecode.token_slots_decode_attention(*call, **kwargs, output_buf=output_buf)  # warm-up: the buffer pool
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tqdecode.token_slots_decode_attention(*call, **kwargs, output_buf=output_buf)
        gap = self.not_continuations()[0][1]
        for new_lengths in (torch.arange(121, 161, dtype=torch.int32), gap, torch.arange(161, 201, dtype=torch.int32)):
            lengths.copy_(new_lengths.to("cuda"))
            output_buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            as_rows = tqdecode.token_slots_decode_attention(*call[:2], call[2].contiguous(), *call[3:], **kwargs)
            cosine, relative = errors(output_buf, as_rows)
            self.assertFalse(bool(torch.isnan(output_buf).any()))
            self.assertGreater(cosine, 0.99999, f"lengths {new_lengths[:4].tolist()}...")
            self.assertLess(relative, 2e-3)

    def check_continuation_compiled(self, device):
        """The engine function over a chunk's rows under torch.compile(fullgraph=True) gives the eager result (the
        continuation_decode_out op in the graph; on the CPU it reads its route on the host when it runs)."""
        torch._dynamo.reset()
        call, kwargs = self.continuation(device, 12)
        decode = lambda *args: tqdecode.token_slots_decode_attention(*args, **kwargs)  # noqa: E731
        expected = decode(*call)
        got = torch.compile(decode, fullgraph=True)(*call)
        cosine, relative = errors(got, expected)
        self.assertGreater(cosine, 0.99999)
        self.assertLess(relative, 2e-3)

    def test_continuation_compiled_cpu(self):
        self.check_continuation_compiled("cpu")

    @requires_cuda
    def test_continuation_compiled_cuda(self):
        self.check_continuation_compiled("cuda")

    def test_bad_input_names_the_argument(self):
        case = Case("turboquant_4bit_nc")
        args, kwargs = case.args()
        with self.assertRaisesRegex(ValueError, "tqdecode: kv_cache"):
            tqdecode.token_slots_decode_attention(args[0], case.kv_cache[..., :100], *args[2:], **kwargs)
        with self.assertRaisesRegex(ValueError, r"tqdecode: kv_cache: strides \[0, .* block_stride: 0 bytes"):
            tqdecode.token_slots_decode_attention(args[0], args[1][:1].expand(args[1].shape[0], -1, -1, -1),
                                                  *args[2:], **kwargs)
        # A continuation chunk past its table's 13 blocks (a 14th column of -1): the rows' own first bad
        # element is named, row 18's position 208 in block 13.
        call, kwargs = self.continuation("cpu", lengths=torch.arange(191, 231, dtype=torch.int32))
        with self.assertRaisesRegex(ValueError, r"tqdecode: block_table\[18\]\[13\]: -1 is out of range"):
            tqdecode.token_slots_decode_attention(*call, **kwargs)
        # The continuation op serves rows over one table row only: distinct rows are refused, nothing written.
        query, kv_cache, table, lengths = call[:4]
        distinct_rows = table.contiguous()
        distinct_rows[1:, 0] = 3
        out = torch.full(query.shape, float("nan"), dtype=query.dtype)
        args = tqdecode._op_args(query, kv_cache, distinct_rows, lengths, call[4], call[5], call[6], call[7], call[9],
                                 False, None, None, None, cache_order="token_slots", norm_correction=True)
        with self.assertRaisesRegex(ValueError, r"tqdecode: block_table: rows are not one row \(stride\(0\) = 14\)"):
            tqdecode.ops.continuation_decode_out(*args, out=out)
        self.assertTrue(bool(torch.isnan(out).all()))
        with self.assertRaisesRegex(ValueError, "tqdecode: cache_order"):
            tqdecode.store(case.key, case.value, case.kv_cache, case.slot_mapping, case.Pi, case.centroids,
                           case.preset, cache_order="interleaved")


class VllmPluginTest(unittest.TestCase):
    def test_signature_is_the_installed_vllms(self):
        if importlib.util.find_spec("vllm") is None:
            self.skipTest("vLLM is not installed here: the signature is checked against its source where it is")
        from tqdecode import vllm_plugin
        source = importlib.import_module(vllm_plugin.SOURCE_MODULE)
        theirs = inspect.signature(getattr(source, vllm_plugin.FUNCTION)).parameters
        ours = inspect.signature(tqdecode.token_slots_decode_attention).parameters
        # vLLM revisions that add arguments (mask arguments) are served by route(); every argument tqdecode
        # takes must be vLLM's, at the same position with the same default.
        self.assertEqual(list(ours), list(theirs)[:len(ours)])
        for name, parameter in ours.items():
            self.assertEqual(parameter.default, theirs[name].default, name)

    def test_without_vllm_nothing_happens(self):
        from tqdecode import vllm_plugin
        if importlib.util.find_spec("vllm") is not None:
            self.skipTest("vLLM is installed here: the no-vLLM case cannot be checked")
        self.assertFalse(vllm_plugin.register())
        self.assertNotIn("vllm", sys.modules)

    def test_register_reroutes_the_source_and_its_importers(self):
        from tqdecode import vllm_plugin
        with tempfile.TemporaryDirectory() as root:
            # A stand-in vLLM with the module and a backend that imported the function by name.
            ops = os.path.join(root, "vllm", "v1", "attention", "ops")
            os.makedirs(ops)
            for folder in ("vllm", "vllm/v1", "vllm/v1/attention", "vllm/v1/attention/ops"):
                open(os.path.join(root, folder, "__init__.py"), "w").close()
            with open(os.path.join(ops, "triton_turboquant_decode.py"), "w") as source:
                source.write("def triton_turboquant_decode_attention(*args, **kwargs):\n    return 'triton'\n")
            with open(os.path.join(root, "vllm", "v1", "attention", "backend_stub.py"), "w") as backend:
                backend.write("from vllm.v1.attention.ops.triton_turboquant_decode import "
                              "triton_turboquant_decode_attention\n")
            sys.path.insert(0, root)
            try:
                backend = importlib.import_module("vllm.v1.attention.backend_stub")
                source = importlib.import_module(vllm_plugin.SOURCE_MODULE)
                original = source.triton_turboquant_decode_attention
                self.assertTrue(vllm_plugin.register())
                routed = source.triton_turboquant_decode_attention
                self.assertIsNot(routed, original)
                self.assertIs(backend.triton_turboquant_decode_attention, routed)
                self.assertTrue(vllm_plugin.register())  # the plugin hook and the engine may both call it
                self.assertIs(source.triton_turboquant_decode_attention, routed)
                # The engine's call (keywords, as vLLM's backend passes them) gives tqdecode's result; later vLLM
                # revisions' mask arguments pass when None and send the call to vLLM's function when set.
                case = Case("turboquant_4bit_nc")
                args, kwargs = case.args()
                names = ("query", "kv_cache", "block_table", "seq_lens", "Pi", "centroids", "scale", "mse_bits",
                         "key_packed_size", "value_quant_bits")
                call = {**dict(zip(names, args)), **kwargs, "norm_correction": True}
                expected = tqdecode.token_slots_decode_attention(**call)
                self.assertTrue(torch.equal(routed(**call), expected))
                self.assertTrue(torch.equal(routed(**call, sliding_window=None, mm_prefix_range=None), expected))
                self.assertEqual(routed(**call, sliding_window=1024), "triton")
                self.assertEqual(routed(**call, mm_prefix_range=torch.zeros(1, 2)), "triton")
                # fp8 keys where vLLM stores them as float8e4b15 (GPUs below sm_89) stay with vLLM, by keyword
                # or by position; other presets there, and fp8 keys elsewhere, come to tqdecode.
                fp8 = Case("turboquant_k8v4")
                fp8_args, fp8_kwargs = fp8.args()
                fp8_call = {**dict(zip(names, fp8_args)), **fp8_kwargs}
                self.assertTrue(fp8_call["key_fp8"])
                fp8_expected = tqdecode.token_slots_decode_attention(**fp8_call)
                self.assertTrue(torch.equal(routed(**fp8_call), fp8_expected))
                positional = [fp8_call[name] for name in names] + [True]
                with unittest.mock.patch.object(vllm_plugin, "_stores_e4b15_keys", return_value=True):
                    self.assertEqual(routed(**fp8_call), "triton")
                    self.assertEqual(routed(*positional), "triton")
                    self.assertTrue(torch.equal(routed(**call), expected))
                # A device this build has no kernels for (an architecture it was not built for) stays with vLLM.
                with unittest.mock.patch.object(vllm_plugin, "_serves", return_value=False):
                    self.assertEqual(routed(**call), "triton")
                # A geometry tqdecode refuses (head size 96) goes to vLLM, with one warning for all its calls.
                unserved = {**call, "query": torch.zeros(5, 8, 96, dtype=torch.bfloat16), "Pi": torch.eye(96)}
                with self.assertLogs(vllm_plugin._log.name, "WARNING") as logs:
                    self.assertEqual(routed(**unserved), "triton")
                self.assertIn("does not serve", logs.output[0])
                with self.assertNoLogs(vllm_plugin._log.name, "WARNING"):
                    self.assertEqual(routed(**unserved), "triton")
                self.assertTrue(torch.equal(routed(**call), expected))
                # A vLLM whose store writes group-4 MSE caches with 4-bit values in qgroup4 pages: those calls stay
                # with vLLM (call: group 4, 4-bit values), the others come to tqdecode.
                self.assertFalse(vllm_plugin._writes_qgroup4_pages())
                with open(os.path.join(ops, "triton_turboquant_store.py"), "w") as store:
                    store.write("def triton_turboquant_store(key, value, kv_cache, slot_mapping, PiT, midpoints, "
                                "mse_bits, key_packed_size, value_quant_bits, key_fp8=False, kv_group_size=None):\n"
                                "    pass\n")
                importlib.invalidate_caches()
                self.assertTrue(vllm_plugin._writes_qgroup4_pages())
                qgroup4 = vllm_plugin.route(source.triton_turboquant_decode_attention.__wrapped__, True)
                self.assertEqual(qgroup4(**call), "triton")
                self.assertTrue(torch.equal(qgroup4(**fp8_call), fp8_expected))  # fp8 keys: the slots
                group8 = Case("turboquant_4bit_nc", num_q_heads=16)
                group8_args, group8_kwargs = group8.args()
                group8_call = {**dict(zip(names, group8_args)), **group8_kwargs}
                self.assertTrue(torch.equal(qgroup4(**group8_call),
                                            tqdecode.token_slots_decode_attention(**group8_call)))
                # A tqdecode built without CUDA leaves vLLM's function in place.
                for module in (source, backend):
                    setattr(module, vllm_plugin.FUNCTION, original)
                with unittest.mock.patch.object(vllm_plugin, "_has_cuda_ops", return_value=False):
                    with self.assertLogs(vllm_plugin._log.name, "WARNING") as logs:
                        self.assertFalse(vllm_plugin.register())
                self.assertIn("built without CUDA", logs.output[0])
                self.assertIs(source.triton_turboquant_decode_attention, original)
                self.assertIs(backend.triton_turboquant_decode_attention, original)
            finally:
                sys.path.remove(root)
                for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
                    del sys.modules[name]


if __name__ == "__main__":
    unittest.main(verbosity=2)
