"""Several query tokens per sequence through the binding (docs/FORMAT.md
section 5b): ``tqdecode.varlen_decode_attention`` and the ops behind it,
``torch.ops.tqdecode.varlen_decode`` / ``varlen_decode_out`` (their
opcheck is in test_torch_ops.py's OpCheckTest).

Oracles: the same tokens sent as rows of the one-token op (each token its own
row, with its prefix as seq_len and its sequence's block-table row: the
pattern engines use today), which on the CPU is the same C++ reference and so
equal bit for bit; torch SDPA in fp32 over the cache as dequantized by the
reader of docs/FORMAT.md in test_torch_ops.py; and on CUDA the CPU op. GPU
tests skip, each with a message, without CUDA.
"""

import unittest

try:
    import torch
except ImportError:
    raise unittest.SkipTest("torch is not installed: the PyTorch binding tests need it")

import tqdecode
from test_torch_ops import CONFIGS, Config, Holder, errors, make_case, requires_cuda, sdpa_reference


def varlen_inputs(case, query_lens, seed=0):
    """(query [T, Hq, D] in the case's dtype, query_start_loc int32 [B + 1]) for
    `query_lens` new tokens per sequence of `case` (each at most its seq_len)."""
    generator = torch.Generator().manual_seed(seed)
    c = case.config
    for length, query_len in zip(case.seq_lens.tolist(), query_lens):
        assert 0 <= query_len <= length
    starts = torch.tensor([0] + list(query_lens), dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(int(starts[-1]), c.num_q_heads, c.head_dim, generator=generator).to(c.dtype)
    return query.to(case.kv_cache.device), starts.to(case.kv_cache.device)


def as_rows(case, query, starts):
    """The rows pattern: (block_table [T, max_blocks], seq_lens [T]) giving
    token j of sequence b its own row over its prefix seq_len - q + j + 1."""
    rows, prefixes = [], []
    lengths = case.seq_lens.tolist()
    bounds = starts.tolist()
    for b in range(len(lengths)):
        query_len = bounds[b + 1] - bounds[b]
        for j in range(query_len):
            rows.append(b)
            prefixes.append(lengths[b] - query_len + j + 1)
    device = case.kv_cache.device
    index = torch.tensor(rows, dtype=torch.long, device=device)
    return case.block_table[index].contiguous(), torch.tensor(prefixes, dtype=torch.int32, device=device)


def varlen(case, query, starts, **kwargs):
    return tqdecode.varlen_decode_attention(query, case.kv_cache, case.block_table, case.seq_lens, starts, case.Pi,
                                            case.centroids, case.scale, case.layout.key_bits,
                                            case.layout.value_bits, key_fp8=case.layout.key_fp8, sinks=case.sinks,
                                            **kwargs)


def rows_pattern(case, query, starts):
    block_table, prefixes = as_rows(case, query, starts)
    args, kwargs = case.decode_args()
    return tqdecode.turboquant_decode_attention(query, args[1], block_table, prefixes, *args[4:], **kwargs)


# Query lengths 0, 1, 2-8, 17 and 128 over the sequences of a case.
QUERY_LENS = {
    (37, 0, 1, 160, 95): (5, 0, 1, 128, 17),
    (300, 7, 140, 9): (128, 7, 17, 2),
}


def lengths_case(config, seq_lens, seed=0):
    config = Config(**{**config.__dict__, "seq_lens": seq_lens})
    return make_case(config, seed)


class VarlenCpuTest(unittest.TestCase):
    def test_equals_the_rows_pattern_of_the_one_token_op(self):
        for config in CONFIGS:
            for seq_lens, query_lens in QUERY_LENS.items():
                with self.subTest(config=config.name, seq_lens=seq_lens):
                    case = lengths_case(config, seq_lens)
                    query, starts = varlen_inputs(case, query_lens)
                    got = varlen(case, query, starts)
                    self.assertEqual(got.shape, query.shape)
                    self.assertEqual(got.dtype, query.dtype)
                    self.assertTrue(torch.equal(got, rows_pattern(case, query, starts)))

    def test_matches_causal_sdpa_over_the_dequantized_cache(self):
        for config in CONFIGS[:4]:
            with self.subTest(config=config.name):
                case = lengths_case(config, (300, 7, 140, 9), seed=3)
                query, starts = varlen_inputs(case, QUERY_LENS[(300, 7, 140, 9)], seed=4)
                block_table, prefixes = as_rows(case, query, starts)
                rows_case = type(case)(**{**case.__dict__, "query": query, "block_table": block_table,
                                          "seq_lens": prefixes})
                cosine, relative, peak = errors(varlen(case, query, starts).float(), sdpa_reference(rows_case))
                print(f"[ measure ] varlen {config.name}: cosine {cosine:.7f} rel_l2 {relative:.2e} peak {peak:.2e}")
                self.assertGreater(cosine, 0.9999)
                self.assertLess(relative, 1e-2)

    def test_output_buf_and_derived_max_query_len(self):
        case = lengths_case(CONFIGS[0], (37, 0, 1, 160, 95))
        query, starts = varlen_inputs(case, (5, 0, 1, 128, 17))
        fresh = varlen(case, query, starts)
        heads, head_dim = query.shape[1:]
        buffer = torch.full((query.shape[0] + 3, heads * head_dim), float("nan"), dtype=query.dtype)
        written = varlen(case, query, starts, max_query_len=128, output_buf=buffer)
        self.assertEqual(written.data_ptr(), buffer.data_ptr())
        self.assertTrue(torch.equal(written.view(fresh.shape), fresh))
        self.assertTrue(torch.isnan(buffer[query.shape[0]:]).all(), "rows past T were written")
        self.assertTrue(torch.equal(varlen(case, query, starts, max_query_len=200, buf_holder=Holder()), fresh))

    def test_no_tokens(self):
        case = lengths_case(CONFIGS[0], (37, 0, 1, 160, 95))
        query, starts = varlen_inputs(case, (0, 0, 0, 0, 0))
        self.assertEqual(varlen(case, query, starts).shape, (0, case.config.num_q_heads, case.config.head_dim))

    def test_bad_arguments_name_the_argument(self):
        case = lengths_case(CONFIGS[0], (37, 0, 1, 160, 95))
        query, starts = varlen_inputs(case, (5, 0, 1, 128, 17))
        decreasing = starts.clone()
        decreasing[2] = 4
        with self.assertRaisesRegex(ValueError, r"tqdecode: query_start_loc\[2\]"):
            varlen(case, query, decreasing)
        with self.assertRaisesRegex(ValueError, "tqdecode: max_query_len"):
            varlen(case, query, starts, max_query_len=100)  # sequence 3 has 128
        with self.assertRaisesRegex(ValueError, "tqdecode: query: 151 tokens .* max_query_len = 20"):
            varlen(case, query, starts, max_query_len=20)  # 5 sequences of at most 20 hold 100
        with self.assertRaisesRegex(ValueError, r"tqdecode: query_start_loc\[5\]"):
            varlen(case, query[:-1], starts, max_query_len=128)  # T != query_start_loc[B]
        too_short = case.seq_lens.clone()
        too_short[4] = 10
        with self.assertRaisesRegex(ValueError, r"tqdecode: seq_lens\[4\]"):
            tqdecode.varlen_decode_attention(query, case.kv_cache, case.block_table, too_short, starts, case.Pi,
                                             case.centroids, case.scale, 4, 4, sinks=case.sinks)
        with self.assertRaisesRegex(ValueError, "tqdecode: block_table: size 5 .* query_start_loc.shape"):
            varlen(case, query, starts[:-1])
        with self.assertRaisesRegex(ValueError, "tqdecode: query_start_loc: dtype"):
            varlen(case, query, starts.long())
        with self.assertRaisesRegex(ValueError, "tqdecode: query_start_loc: expected a torch.Tensor, got NoneType"):
            varlen(case, query, None)
        with self.assertRaisesRegex(ValueError, "tqdecode: max_query_len: expected an int, got str"):
            varlen(case, query, starts, max_query_len="many")


class VarlenCompileTest(unittest.TestCase):
    def test_compile_fullgraph_cpu(self):
        case = lengths_case(CONFIGS[0], (37, 0, 1, 160, 95))
        query, starts = varlen_inputs(case, (5, 0, 1, 128, 17))

        def step(q, s):
            return varlen(case, q, s, max_query_len=128)

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        self.assertTrue(torch.equal(compiled(query, starts), step(query, starts)))


@requires_cuda
class VarlenCudaTest(unittest.TestCase):
    def test_matches_the_cpu_op_and_the_rows_pattern(self):
        for config in CONFIGS:
            for seq_lens, query_lens in QUERY_LENS.items():
                with self.subTest(config=config.name, seq_lens=seq_lens):
                    cpu_case = lengths_case(config, seq_lens, seed=5)
                    query, starts = varlen_inputs(cpu_case, query_lens, seed=6)
                    expected = varlen(cpu_case, query, starts).float()
                    case = cpu_case.to("cuda")
                    query, starts = query.cuda(), starts.cuda()
                    got = varlen(case, query, starts).float().cpu()
                    rows = rows_pattern(case, query, starts).float().cpu()
                    for other in (expected, rows):
                        cosine, relative, peak = errors(got, other)
                        self.assertGreater(cosine, 0.9999)
                        self.assertLess(relative, 1e-2)
                        self.assertLess(peak, 2e-2)

    def test_cuda_graph_replays_new_offsets_and_lengths(self):
        cpu_case = lengths_case(CONFIGS[0], (300, 7, 140, 9), seed=7)
        case = cpu_case.to("cuda")
        query, starts = varlen_inputs(case, (128, 7, 17, 2), seed=8)
        output = torch.empty_like(query)

        def step():
            varlen(case, query, starts, max_query_len=128, output_buf=output)

        tqdecode.set_max_batch(16)
        step()  # warm-up: pools and constants outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        # The same T = 154 tokens, each sequence's at most max_query_len and its seq_len (300, 7, 140, 9).
        for new_lens in ((100, 7, 40, 7), (20, 7, 118, 9), (128, 0, 26, 0)):
            new_starts = torch.tensor([0, *new_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
            starts.copy_(new_starts)
            output.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            expected = varlen(cpu_case, query.cpu(), new_starts)
            self.assertFalse(torch.isnan(output).any())
            cosine, relative, _ = errors(output.float(), expected.float())
            self.assertGreater(cosine, 0.9999)
            self.assertLess(relative, 1e-2)
        tqdecode.set_max_batch(0)


if __name__ == "__main__":
    unittest.main()
