"""A Hugging Face transformers KV cache backed by tqdecode.

``TQDecodeCache`` stores each attention layer's keys and values with
:func:`tqdecode.store` in a paged TurboQuant cache (one cache tensor per
layer, block tables and slot mappings built as an engine builds them) and
computes every decode step's attention with
:func:`tqdecode.turboquant_decode_attention` (CUDA when the tensors are on a
GPU, the CPU reference otherwise). A prefill into an empty cache attends over
the unquantized prompt, as engines do, and stores it; later steps read only
the compressed cache. The first and last ``boundary_layers`` layers keep an
ordinary cache in the model's dtype.

Usage (transformers 5)::

    from tqdecode.hf_cache import TQDecodeCache, use_tqdecode_attention
    use_tqdecode_attention(model)            # registers the "tqdecode" attention
    cache = TQDecodeCache(model.config, preset="turboquant_4bit_nc")
    model.generate(input_ids, past_key_values=cache, max_new_tokens=64)

The attention hook: the model's attention module calls ``cache.update`` and
then the attention function named by ``config._attn_implementation``. A
compressed layer's ``update`` only hands the new keys and values to the
``"tqdecode"`` attention function, which stores them (skipping padding, read
from the attention mask) and computes the attention. Layers without a
pending step (bf16 boundary layers, other caches) run PyTorch SDPA, so the
model stays usable with any cache.
"""

from __future__ import annotations

import threading
import warnings

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import tqdecode

__all__ = ["ATTENTION_NAME", "TQDecodeCache", "TQDecodeLayer", "register_attention", "use_tqdecode_attention"]

ATTENTION_NAME = "tqdecode"

# The compressed layer whose update() ran last on this thread and whose
# attention call has not run yet. The model calls a layer's attention right
# after its update, on the same thread, so this links the two calls.
_pending = threading.local()


class TQDecodeLayer(CacheLayerMixin):
    """One attention layer's KV cache in tqdecode's paged format.

    Per sequence ``b`` of the batch: ``seq_lens[b]`` tokens stored (padding is
    never stored), in the blocks listed in ``block_table[b]``, handed out
    from this layer's pool in the order sequences need them. The pool grows
    (doubling; block ids stay valid) when it runs out.
    """

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, preset: str, block_size: int, seed: int):
        super().__init__()
        self.preset = preset
        self.block_size = block_size
        self.seed = seed
        self.positions = 0  # positions processed per sequence, padding included (what HF's masks count)
        self.kv_cache = None
        self.seq_lens = None  # int32 [B], on the cache's device
        self.block_table = None  # int32 [B, blocks], on the cache's device
        self.blocks_held = []
        self.blocks_used = 0
        self.pending = None  # (key, value) of the last update, until its attention call stores them

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, num_kv_heads, _, head_dim = key_states.shape
        self.dtype, self.device, self.head_dim = key_states.dtype, key_states.device, head_dim
        self.layout = tqdecode.cache_layout(self.preset, head_dim, self.block_size, num_kv_heads)
        self.centroids, self.Pi, self.PiT = tqdecode.make_model_constants(
            self.preset, head_dim, seed=self.seed, device=self.device)
        self.kv_cache = tqdecode.allocate_cache(batch, self.block_size, num_kv_heads, head_dim, self.preset,
                                                device=self.device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.block_table = torch.zeros((batch, 0), dtype=torch.int32, device=self.device)
        self.blocks_held = [0] * batch  # blocks in each sequence's block_table row
        self.blocks_used = 0
        self.positions = 0
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Hands ``key_states``/``value_states`` ``[B, Hk, q, D]`` to the next
        ``"tqdecode"`` attention call, which stores them; returns them as they are."""
        if self.pending is not None:
            raise RuntimeError(
                "tqdecode: this layer's previous keys and values were never stored: the model's attention "
                f"implementation must be {ATTENTION_NAME!r} (tqdecode.hf_cache.use_tqdecode_attention(model)), and a "
                "forward that failed midway leaves the cache inconsistent (start a new one)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.seq_lens.shape[0]:
            raise ValueError(f"tqdecode: key_states: batch {key_states.shape[0]} differs from the cache's "
                             f"{self.seq_lens.shape[0]}; use a new cache for a new batch")
        self.pending = (key_states, value_states)
        _pending.layer = self
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
        """Stores the pending keys and values, then computes the attention of ``query`` ``[B, Hq, q, D]``.

        Returns ``([B, q, Hq, D], None)`` as transformers' attention functions do.
        """
        self.pending = None
        batch, _, query_len, head_dim = query.shape
        positions_before = self.positions
        self.positions += query_len
        valid = _new_token_mask(attention_mask, batch, query_len, positions_before, query.device)
        stored_before = self.seq_lens.clone()
        self._store(key, value, valid)
        if positions_before == 0:
            # Prefill into an empty cache: exact attention over the unquantized prompt.
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        # One decode row per query token: row (b, i) sees the tokens stored before
        # this step plus the valid new tokens up to and including i.
        rows = query.transpose(1, 2).reshape(batch * query_len, query.shape[1], head_dim)
        if query_len == 1:
            seq_lens, block_table = self.seq_lens, self.block_table
        else:
            seq_lens = (stored_before[:, None] + valid.cumsum(1, dtype=torch.int32)).reshape(-1).to(torch.int32)
            block_table = self.block_table.repeat_interleave(query_len, dim=0)
        # The op takes bf16 or fp16 queries; other model dtypes run it in bf16.
        op_dtype = rows.dtype if rows.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        rows = rows.to(op_dtype)
        out = tqdecode.turboquant_decode_attention(
            rows, self.kv_cache, block_table, seq_lens, self.Pi, self.centroids, scaling,
            **self.layout.decode_kwargs(), PiT=self.PiT, output_buf=torch.empty_like(rows))
        return out.to(query.dtype).view(batch, query_len, query.shape[1], head_dim), None

    def _store(self, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor) -> None:
        """Stores the valid tokens of ``key``/``value`` ``[B, Hk, q, D]`` after each sequence's stored tokens."""
        if not bool(valid.any()):
            return
        batch, num_kv_heads, query_len, head_dim = key.shape
        new_lens = self.seq_lens + valid.sum(1, dtype=torch.int32)
        self._reserve(new_lens)
        position = self.seq_lens[:, None].long() + valid.long().cumsum(1) - 1  # logical position of each new token
        position = position.clamp(min=0)
        block = self.block_table.long().gather(1, position // self.block_size)
        slots = torch.where(valid, block * self.block_size + position % self.block_size, -1)
        tqdecode.store(key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim),
                       value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim),
                       self.kv_cache, slots.reshape(-1), self.Pi, self.centroids, self.preset)
        self.seq_lens = new_lens

    def _reserve(self, new_lens: torch.Tensor) -> None:
        """Gives every sequence the blocks that ``new_lens`` tokens need."""
        needed = [-(-n // self.block_size) for n in new_lens.tolist()]
        fresh = sum(max(n - held, 0) for n, held in zip(needed, self.blocks_held))
        if fresh == 0:
            return
        if self.blocks_used + fresh > self.kv_cache.shape[0]:
            self._grow(self.blocks_used + fresh)
        table = torch.zeros((len(needed), max(max(needed), self.block_table.shape[1])), dtype=torch.int32)
        table[:, : self.block_table.shape[1]] = self.block_table.cpu()
        for b, n in enumerate(needed):
            for column in range(self.blocks_held[b], n):
                table[b, column] = self.blocks_used
                self.blocks_used += 1
            self.blocks_held[b] = max(n, self.blocks_held[b])
        self.block_table = table.to(self.device)

    def _grow(self, min_blocks: int) -> None:
        """Reallocates the cache with at least ``min_blocks`` blocks (at least twice as many), keeping its contents."""
        num_blocks = max(min_blocks, 2 * self.kv_cache.shape[0])
        grown = tqdecode.allocate_cache(num_blocks, self.block_size, self.kv_cache.shape[2], self.head_dim,
                                        self.preset, device=self.device)
        grown[: self.kv_cache.shape[0]] = self.kv_cache
        self.kv_cache = grown

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.positions + query_length, 0

    def get_seq_length(self) -> int:
        return self.positions

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.kv_cache = self.seq_lens = self.block_table = self.pending = None
        self.blocks_held = []
        self.blocks_used = self.positions = 0
        self.is_initialized = False

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("tqdecode: the compressed cache does not support beam search, cropping or "
                                  "reordering the batch (greedy and sampled generation are supported)")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = offload = prefetch = _unsupported


def _new_token_mask(attention_mask, batch: int, query_len: int, positions_before: int, device) -> torch.Tensor:
    """bool ``[B, q]``: which new tokens are real (not padding), read from the
    last query row of the boolean SDPA mask (None: no padding)."""
    if attention_mask is None:
        return torch.ones((batch, query_len), dtype=torch.bool, device=device)
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise ValueError(f"tqdecode: attention_mask: expected the boolean 4-D mask of the {ATTENTION_NAME!r} "
                         f"attention, got {attention_mask.dtype} with {attention_mask.dim()} dims")
    last_row = attention_mask[:, 0, -1, positions_before: positions_before + query_len]
    return last_row.expand(batch, query_len).to(device)


def tqdecode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"tqdecode"`` attention function: tqdecode for the layer whose
    update() just ran, PyTorch SDPA for any other layer."""
    layer = getattr(_pending, "layer", None)
    if layer is None or layer.pending is None or layer.pending[0] is not key:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    _pending.layer = None
    for unsupported in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(unsupported) is not None:
            layer.pending = None  # so the next call is not taken for this one
            raise NotImplementedError(f"tqdecode: attention with {unsupported} is not supported")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    return layer.attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def register_attention() -> None:
    """Registers the ``"tqdecode"`` attention (and its mask: SDPA's) with transformers."""
    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, tqdecode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_tqdecode_attention(model) -> None:
    """Registers the ``"tqdecode"`` attention and makes ``model`` use it."""
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)


class TQDecodeCache(Cache):
    """A transformers ``Cache`` whose layers store keys and values in tqdecode's compressed paged cache.

    ``config``: the model's config (``model.config``); ``preset``: a tqdecode
    preset (``turboquant_4bit_nc``, ``turboquant_k3v4_nc``,
    ``turboquant_3bit_nc``, ``turboquant_k8v4``); ``boundary_layers``: the
    first and last that many layers keep an ordinary cache in the model's
    dtype (engines keep 2); ``block_size``: tokens per cache block;
    ``seed``: the rotation's seed. Every layer must be full attention.
    """

    def __init__(self, config, preset: str = "turboquant_4bit_nc", boundary_layers: int = 2, block_size: int = 16,
                 seed: int = 0):
        text_config = config.get_text_config(decoder=True)
        num_layers = text_config.num_hidden_layers
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        tqdecode.cache_layout(preset, head_dim, block_size, num_kv_heads)  # ValueError naming what is unsupported
        if boundary_layers < 0:
            raise ValueError(f"tqdecode: boundary_layers: {boundary_layers} is negative; accepted: 0 or more")
        layer_types = getattr(text_config, "layer_types", None)
        if layer_types is None and getattr(text_config, "sliding_window", None) is not None and getattr(
                text_config, "use_sliding_window", True):
            raise ValueError(f"tqdecode: config: sliding_window {text_config.sliding_window} makes every layer "
                             "attend to a window; the cache supports full attention only")
        layer_types = layer_types or ["full_attention"] * num_layers
        for index, kind in enumerate(layer_types):
            if kind != "full_attention":
                raise ValueError(f"tqdecode: layer {index} is {kind!r}; the cache supports full attention only")
        layers = [
            DynamicLayer() if index < boundary_layers or index >= num_layers - boundary_layers
            else TQDecodeLayer(preset, block_size, seed)
            for index in range(num_layers)
        ]
        if not any(isinstance(layer, TQDecodeLayer) for layer in layers):
            warnings.warn(f"tqdecode: {num_layers} layers with boundary_layers={boundary_layers} leave none to "
                          "compress: every layer keeps an ordinary cache", stacklevel=2)
        super().__init__(layers=layers)
        self.config = config
        self.preset = preset
        self.boundary_layers = boundary_layers

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if isinstance(self.layers[layer_idx], TQDecodeLayer) and self.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(
                f"tqdecode: the model's attention implementation is {self.config._attn_implementation!r}; it must be "
                f"{ATTENTION_NAME!r} for a TQDecodeCache (call tqdecode.hf_cache.use_tqdecode_attention(model))")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def compressed_layers(self) -> list[int]:
        """Indices of the layers stored by tqdecode."""
        return [index for index, layer in enumerate(self.layers) if isinstance(layer, TQDecodeLayer)]
