"""tqdecode for PyTorch: decode attention over a TurboQuant paged KV cache.

The entry point engines call once per layer per decode step is
:func:`turboquant_decode_attention` (the signature of the engine-side
launcher it replaces); :func:`varlen_decode_attention` takes several query
tokens per sequence (speculative-decoding verification, continuation
chunks) in the engines' varlen form. The ops behind it are ``torch.ops.tqdecode.*``
(schemas in ``python/csrc/ops.cpp``), with fake implementations so that
``torch.compile(fullgraph=True)`` traces them.

Cache format and decode math: ``docs/FORMAT.md``; launcher contract (paths,
buffer pool, CUDA graphs): ``docs/LAUNCHER.md``; usage: ``python/README.md``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._library import check_is_tensor, check_query, check_store, elements_distinct, fail, ops, output_rows

# The compiled library's version (CMakeLists.txt's project(); the package's metadata takes the same).
__version__: str = ops.version()

__all__ = [
    "CacheLayout",
    "DecodePath",
    "allocate_cache",
    "cache_layout",
    "decode_path",
    "device_check_report",
    "is_available",
    "runs_on_device",
    "make_model_constants",
    "pool_stats",
    "set_device_checks",
    "set_max_batch",
    "store",
    "store_check_report",
    "token_slots_decode_attention",
    "turboquant_decode_attention",
    "varlen_decode_attention",
]


class CacheLayout(NamedTuple):
    """The byte layout of a preset and geometry: the blocks order (docs/FORMAT.md
    section 4), or the token_slots order (section 4b, vLLM's CUDA cache)."""

    preset: str
    key_bits: int  # MSE codebook bits, or 8 for fp8 keys
    value_bits: int
    key_fp8: bool
    norm_correction: bool
    key_packed_size: int  # KD: key data bytes per (token, kv head)
    value_packed_size: int  # VD: value data bytes per (token, kv head)
    fields: int  # F: fp16 metadata fields per (token, kv head)
    slot_bytes: int  # the last dimension of the cache tensor: KD + VD + 2F (token_slots: rounded up to even)
    block_bytes: int  # natural bytes of one block

    def decode_kwargs(self) -> dict:
        """The engine parameters of :func:`turboquant_decode_attention` for this layout."""
        return {
            "mse_bits": self.key_bits,
            "key_packed_size": self.key_packed_size,
            "value_quant_bits": self.value_bits,
            "value_packed_size": self.value_packed_size,
            "key_fp8": self.key_fp8,
            "norm_correction": self.norm_correction,
        }


class DecodePath(NamedTuple):
    path: str  # "hopper", "cuda_generic" or "cpu_reference"; for cuda_generic the reason names its kernel (tensor-core or scalar)
    reason: str


def cache_layout(preset: str, head_dim: int, block_size: int, num_kv_heads: int,
                 cache_order: str = "blocks") -> CacheLayout:
    """The layout of a cache in ``cache_order`` ("blocks" or "token_slots");
    raises ValueError naming an unsupported argument."""
    key_bits, value_bits, key_fp8, norm_correction, *sizes = ops.cache_layout(preset, head_dim, block_size,
                                                                              num_kv_heads, cache_order)
    return CacheLayout(preset, key_bits, value_bits, bool(key_fp8), bool(norm_correction), *sizes)


def allocate_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset: str,
                   device=None, cache_order: str = "blocks") -> torch.Tensor:
    """A zeroed uint8 cache ``[num_blocks, block_size, num_kv_heads, slot_bytes]`` (natural block size;
    for "token_slots" vLLM's dense order: the heads of a token side by side, then the next token).

    Zeroed so that slots never written decode as zero keys and values, not garbage.
    """
    if _number(num_blocks, "num_blocks", int) < 1:
        fail("num_blocks", f"{num_blocks} is out of range; accepted: >= 1")
    layout = cache_layout(preset, head_dim, block_size, num_kv_heads, cache_order)
    return torch.zeros((num_blocks, block_size, num_kv_heads, layout.slot_bytes), dtype=torch.uint8, device=device)


def make_model_constants(preset: str, head_dim: int, seed: int = 0, rotation: str = "hadamard", device=None):
    """``(centroids, Pi, PiT)`` fp32 for a preset: Lloyd-Max levels for the exact
    sphere density and a ``rotation`` ("hadamard" or "dense") from ``seed``.
    ``(None, None, None)`` for fp8 keys, which use neither.
    """
    centroids, Pi, PiT = ops.make_model_constants(preset, head_dim, seed, rotation)
    if centroids.numel() == 0:
        return None, None, None
    return centroids.to(device), Pi.to(device), PiT.to(device)


def store(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
          Pi: Optional[torch.Tensor], centroids: Optional[torch.Tensor], preset: str, check: bool = False,
          cache_order: str = "blocks") -> None:
    """Encodes ``key``/``value`` ``[num_tokens, Hk, D]`` (fp32/fp16/bf16) into ``kv_cache`` in place.

    ``cache_order`` "blocks" encodes as docs/FORMAT.md section 3 says;
    "token_slots" as vLLM's CUDA store does (section 4b: raw key norm,
    midpoint bucketing, value codes from the fp32 minimum and scale), with
    the cache's strides taken from the tensor.

    ``slot_mapping[t] = block * block_size + slot`` (negative: skip the token;
    int64 or int32). ``Pi`` ``[D, D]`` and ``centroids`` are fp32 (unused by
    fp8 keys). Every token is checked before any byte is written: slot in
    range, each slot at most once per call, K/V finite (and their fp16 norm,
    scale and zero), and for MSE keys a finite ``Pi`` and finite
    ``centroids`` sorted ascending; when a check fails nothing is written.

    On CUDA the checks run on the device. By default (``check=False``) the
    call never synchronises and works inside CUDA graphs: a failure is
    counted in the device's report, read with :func:`store_check_report`.
    ``check=True`` synchronises the stream and raises ValueError naming the
    argument (not allowed while capturing a CUDA graph). The first store on a
    device allocates its report and must run outside graph capture. The CPU
    store always raises ValueError.
    """
    if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dtype == torch.int32:
        slot_mapping = slot_mapping.long()
    check_store(key, value, kv_cache, slot_mapping)
    ops.store(key.contiguous(), value.contiguous(), kv_cache, slot_mapping, Pi, centroids, preset, check, cache_order)


_STORE_FAILURES = ("ok", "slot_out_of_range", "duplicate_slot", "non_finite_key", "non_finite_value",
                   "invalid_centroids", "non_finite_rotation")


def store_check_report(device=None) -> dict:
    """Reads and clears what the device-side checks of the GPU stores on
    ``device`` (default: the current CUDA device) found since the last read,
    waiting for that device's current stream; not callable during CUDA-graph
    capture.

    ``{"checked_calls", "failed_calls", "failures": {"slot_out_of_range",
    "duplicate_slot", "non_finite_key", "non_finite_value",
    "invalid_centroids", "non_finite_rotation"}, "first_failure"}``:
    counts over every store call (graph replays included) and the reason of
    the first failed call, or None. Failed calls wrote nothing.
    """
    checked, failed, *failures, first = ops.store_check_report(_device_index(device))
    return {
        "checked_calls": checked,
        "failed_calls": failed,
        "failures": dict(zip(_STORE_FAILURES[1:], failures)),
        "first_failure": _STORE_FAILURES[first] if first else None,
    }


def _device_index(device) -> int:
    """The CUDA device index of ``device`` (default: the current one; 0 without CUDA)."""
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else 0
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _model_constants(query, Pi, centroids, PiT, key_fp8, buf_holder, keep=True):
    """``(centroids, PiT, stable)``: the constants as the ops take them (fp32,
    contiguous, on the query's device) and whether they were ready before
    this call.

    Derived once per constants and device and cached on ``buf_holder`` (a
    dict per device in its attribute ``_tqdecode_consts``, each entry keyed
    by data pointer and version and holding the sources, so an address is not
    reused while cached; one holder may serve several devices). With ``keep``
    False a derivation is used but not cached (``decode_path``: a decode after
    it must not take constants it never waited for as stable). Not cached
    while torch.compile traces: the derivation is then part of the graph.
    ``stable`` is False when they were derived in this call: the kernels that
    wrote them may be the ones just before the decode, so the decode must not
    read them early (programmatic launch). It is False on the first call that
    finds them cached too: the call that derived them may have failed before
    its decode, leaving their copies the stream's last kernels; from then on a
    decode has run after them.
    """
    if key_fp8:
        return None, None, True  # fp8 keys are neither rotated nor codebook-quantized
    if centroids is None:
        fail("centroids", "is required by MSE presets (key_fp8=False)")
    check_is_tensor(centroids, "centroids")
    if PiT is not None:
        check_is_tensor(PiT, "PiT")
    else:
        if Pi is None:
            fail("Pi", "is required by MSE presets (key_fp8=False) when PiT is not given")
        check_is_tensor(Pi, "Pi")
        head_dim = query.shape[-1]
        if Pi.dim() != 2 or Pi.shape[0] != head_dim or Pi.shape[1] != head_dim:
            fail("Pi", f"shape {list(Pi.shape)} is not [head_dim, head_dim] = [{head_dim}, {head_dim}]")
    source = Pi if PiT is None else PiT

    def derive():
        as_fp32 = {"device": query.device, "dtype": torch.float32}
        rotation = PiT.to(**as_fp32) if PiT is not None else Pi.to(**as_fp32).t()
        return centroids.to(**as_fp32).contiguous(), rotation.contiguous()

    if buf_holder is None or torch.compiler.is_compiling():
        return (*derive(), False)
    key = (PiT is None, source.data_ptr(), source._version, centroids.data_ptr(), centroids._version)
    per_device = getattr(buf_holder, "_tqdecode_consts", None)
    if per_device is None:
        per_device = buf_holder._tqdecode_consts = {}
    cached = per_device.get(query.device)
    if cached is not None and cached[0] == key:
        stable = cached[4]
        cached[4] = True
        return cached[2], cached[3], stable
    cached = [key, (source, centroids), *derive(), False]  # key, sources, centroids, PiT, used by a later call
    if keep:
        per_device[query.device] = cached
    return cached[2], cached[3], False


def _op_args(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, value_quant_bits, key_fp8, PiT,
             buf_holder, sinks, keep_constants=True, cache_order="blocks", norm_correction=False,
             query_start_loc=None):
    """The positional arguments of the decode ops (the varlen ops take
    query_start_loc and max_query_len after seq_lens). The ops check every
    argument before they launch anything (ValueError naming it), so only the
    query, which the constants' derivation reads, is checked here: an eager
    call pays for each check once."""
    check_query(query, query_start_loc is not None)
    if sinks is not None and isinstance(sinks, torch.Tensor):
        sinks = sinks.to(torch.float32).contiguous()  # engines may keep sinks in the model dtype
    centroids, PiT, stable = _model_constants(query, Pi, centroids, PiT, key_fp8, buf_holder, keep_constants)
    return (query, kv_cache, block_table, seq_lens, centroids, PiT, _number(scale, "scale", float),
            _number(mse_bits, "mse_bits", int), _number(value_quant_bits, "value_quant_bits", int), bool(key_fp8),
            sinks, stable, cache_order, bool(norm_correction))


def _number(value, argument, kind):
    """``kind(value)`` (int or float, as the ops take it), or ValueError naming the argument."""
    try:
        return kind(value)
    except (TypeError, ValueError):
        fail(argument, f"expected {'an int' if kind is int else 'a float'}, got {type(value).__name__} {value!r}")


def turboquant_decode_attention(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits,
                                key_packed_size, value_quant_bits, value_packed_size, key_fp8=False,
                                norm_correction=False, PiT=None, max_seq_len=0, mid_o_buf=None, output_buf=None,
                                lse_buf=None, buf_holder=None, max_num_kv_splits=32, sinks=None) -> torch.Tensor:
    """Decode attention, one query token per sequence (docs/FORMAT.md section 5).

    ``query`` ``[B, Hq, D]`` bf16/fp16; ``kv_cache`` uint8 ``[num_blocks,
    block_size, Hk, slot_bytes]`` (its stride(0) is the block stride);
    ``block_table`` int32 ``[B, max_blocks_per_seq]``; ``seq_lens`` int32
    ``[B]``; ``Pi`` ``[D, D]`` (or ``PiT``, its transpose) and ``centroids``
    for MSE presets; ``sinks`` ``[Hq]`` or None. The preset follows from
    ``(mse_bits, value_quant_bits, key_fp8)``.

    Returns ``[B, Hq, D]`` in the query dtype, a new tensor; with
    ``output_buf`` (``[N, Hq, D]`` or ``[N, Hq * D]``, N >= B, last dimension
    contiguous) the first B rows are written and ``output_buf[:B]`` is
    returned.

    Accepted and ignored, as the launcher this replaces does:
    ``key_packed_size`` and ``value_packed_size`` (the layout follows from the
    preset and head size; engines compute these sizes in different ways),
    ``norm_correction`` (folded into the stored key norm at store time, so
    decode is the same function either way), ``max_seq_len``, ``mid_o_buf``,
    ``lse_buf`` and ``max_num_kv_splits`` (the launcher sizes its split-KV
    partitions and buffers from the shapes, docs/LAUNCHER.md). Arguments are
    checked before anything is written: ValueError names the argument.
    """
    del key_packed_size, value_packed_size, norm_correction, max_seq_len, mid_o_buf, lse_buf, max_num_kv_splits
    args = _op_args(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, value_quant_bits, key_fp8,
                    PiT, buf_holder, sinks)
    if output_buf is None:
        return ops.decode(*args)
    rows, out = output_rows(output_buf, query, "output_buf")
    ops.decode_out(*args, out=out)
    return rows


# vLLM sends a request's continuation chunk of q tokens as q rows with seq_lens
# s, s + 1, ..., s + q - 1 and the request's block-table row expanded to q
# rows (stride 0). Rows read the cache once each; one varlen call reads it
# once for all of them (docs/VLLM.md). The stride marks the candidates, which
# go to the continuation_decode_out op: whether the lengths rise by one is
# decided on the device, without a synchronisation, so the route also runs
# under CUDA-graph capture and torch.compile: the rows' call runs with every
# length 0 where they are a chunk (zero outputs), then the chunk's varlen call
# with no token where they are not. From this many rows the route repays its
# extra launches on long contexts many times over; on short ones (a few
# thousand positions) it costs more than it saves below a few dozen rows
# (docs/VLLM.md has the measurements).
CONTINUATION_MIN_ROWS = 8
_MAX_QUERY_LEN = 1 << 16  # tqdecode::kMaxQueryLen: the most query tokens a varlen call gives one sequence


def _continuation_candidate(query, block_table) -> bool:
    """Whether these rows may be one request's chunk: enough of them over one
    block-table row repeated with stride 0."""
    return (CONTINUATION_MIN_ROWS <= query.shape[0] <= _MAX_QUERY_LEN and block_table.dim() == 2
            and block_table.stride(0) == 0)


def token_slots_decode_attention(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits,
                                 key_packed_size, value_quant_bits, key_fp8=False, norm_correction=False, PiT=None,
                                 mid_o_buf=None, output_buf=None, lse_buf=None, buf_holder=None,
                                 max_num_kv_splits=32) -> torch.Tensor:
    """Decode attention over vLLM's CUDA TurboQuant cache, the token_slots order
    (docs/FORMAT.md section 4b), with the signature of vLLM's
    ``triton_turboquant_decode_attention`` (no ``value_packed_size``, no
    ``sinks``).

    ``kv_cache`` uint8 ``[num_blocks, block_size, Hk, slot]`` with its strides
    as the engine hands it over (any order of tokens and heads, padded pages
    and slots); ``norm_correction`` True renormalises each token's centroid
    vector at decode time, as vLLM's decode does. Continuation chunks come as
    rows with per-token ``seq_lens`` and an expanded block table; from
    ``CONTINUATION_MIN_ROWS`` rows over one table row expanded with stride 0,
    whether the lengths rise by one (from at least 1, within the row's
    blocks) is decided on the device (no synchronisation, so also under
    CUDA-graph capture and torch.compile), and a chunk runs as one
    :func:`varlen_decode_attention` call: the same function, the request's
    cache read once instead of once per row. ``output_buf`` is written when
    it is a 3-D tensor of the query's dtype with at least ``[B, Hq, D]`` and
    distinct rows, and ``output_buf[:B, :Hq, :D]`` is returned; otherwise, as
    vLLM's launcher does, a new tensor is. The other engine arguments
    (``key_packed_size``, ``mid_o_buf``, ``lse_buf``, ``max_num_kv_splits``)
    are accepted and ignored. Arguments are checked before anything is written:
    ValueError names the argument.
    """
    del key_packed_size, mid_o_buf, lse_buf, max_num_kv_splits
    args = _op_args(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, value_quant_bits, key_fp8,
                    PiT, buf_holder, None, cache_order="token_slots", norm_correction=norm_correction)
    batch, heads, head_dim = query.shape
    out = None
    if (isinstance(output_buf, torch.Tensor) and output_buf.dim() == 3 and output_buf.dtype == query.dtype
            and output_buf.device == query.device and output_buf.shape[0] >= batch and output_buf.shape[1] >= heads
            and output_buf.shape[2] >= head_dim and output_buf.stride(2) == 1):
        rows = output_buf if output_buf.shape == query.shape else output_buf[:batch, :heads, :head_dim]
        out = rows if elements_distinct(rows) else None
    if not _continuation_candidate(query, block_table):
        if out is None:
            return ops.decode(*args)
        ops.decode_out(*args, out=out)
        return out
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ops.continuation_decode_out(*args, out=out)
    return out


def varlen_decode_attention(query, kv_cache, block_table, seq_lens, query_start_loc, Pi, centroids, scale, mse_bits,
                            value_quant_bits, key_fp8=False, max_query_len=None, PiT=None, output_buf=None,
                            buf_holder=None, sinks=None, cache_order="blocks", norm_correction=False) -> torch.Tensor:
    """Decode attention with several query tokens per sequence (docs/FORMAT.md
    section 5b): speculative-decoding verification, continuation chunks.

    The engines' varlen form: ``query`` ``[T, Hq, D]`` holds the new tokens of
    every sequence back to back, sequence b's at rows
    ``query_start_loc[b] .. query_start_loc[b + 1]`` (int32 ``[B + 1]``,
    from 0 to T; a sequence may have none); ``seq_lens`` int32 ``[B]`` counts
    each context *with* its new tokens, whose keys and values must already be
    in the cache; ``block_table`` int32 ``[B, max_blocks_per_seq]``. Token j
    of a sequence with q new tokens sits at position ``seq_lens[b] - q + j``
    and attends to positions 0 through its own. Cache, constants, ``scale``,
    ``sinks``, ``buf_holder``, ``cache_order`` and ``norm_correction`` as in
    :func:`turboquant_decode_attention` / :func:`token_slots_decode_attention`.

    ``max_query_len``: the most new tokens any sequence has. The CUDA grid
    and buffers are sized from it (never from the offsets' values), so a
    CUDA graph captured with it replays for any offsets and lengths up to
    it; pass it under CUDA-graph capture and torch.compile. None reads it
    from ``query_start_loc`` (a device synchronisation).

    Returns ``[T, Hq, D]`` in the query dtype, a new tensor; with
    ``output_buf`` (``[N, Hq, D]`` or ``[N, Hq * D]``, N >= T) the first T
    rows are written and ``output_buf[:T]`` is returned. The CPU op checks
    the offsets and lengths (ValueError naming the element); on CUDA they are
    clamped on the device, so inconsistent values cannot read or write
    outside the call's tensors.
    """
    check_is_tensor(query_start_loc, "query_start_loc")
    if max_query_len is not None:
        max_query_len = _number(max_query_len, "max_query_len", int)
    args = _op_args(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, value_quant_bits, key_fp8,
                    PiT, buf_holder, sinks, cache_order=cache_order, norm_correction=norm_correction,
                    query_start_loc=query_start_loc)
    if max_query_len is None:
        if torch.compiler.is_compiling() or (query.is_cuda and torch.cuda.is_current_stream_capturing()):
            fail("max_query_len", "is required under torch.compile and CUDA-graph capture (reading it from "
                                  "query_start_loc would synchronise); accepted: the most query tokens any sequence has")
        lengths = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = max(1, int(lengths.max())) if lengths.numel() else 1
    args = (*args[:4], query_start_loc, max_query_len, *args[4:])
    if output_buf is None:
        return ops.varlen_decode(*args)
    rows, out = output_rows(output_buf, query, "output_buf")
    ops.varlen_decode_out(*args, out=out)
    return rows


def decode_path(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, key_packed_size,
                value_quant_bits, value_packed_size, key_fp8=False, norm_correction=False, PiT=None, max_seq_len=0,
                mid_o_buf=None, output_buf=None, lse_buf=None, buf_holder=None, max_num_kv_splits=32,
                sinks=None) -> DecodePath:
    """Which kernel :func:`turboquant_decode_attention` would run for these
    arguments, and why (takes the same arguments; runs nothing)."""
    del key_packed_size, value_packed_size, norm_correction, max_seq_len, mid_o_buf, output_buf, lse_buf
    del max_num_kv_splits
    args = _op_args(query, kv_cache, block_table, seq_lens, Pi, centroids, scale, mse_bits, value_quant_bits, key_fp8,
                    PiT, buf_holder, sinks, keep_constants=False)
    return DecodePath(*ops.decode_path(*args))


def is_available() -> bool:
    """True when the fast Hopper kernel can run on the current CUDA device."""
    return bool(ops.is_available())


def runs_on_device(device=None) -> bool:
    """True when CUDA device ``device`` (default: the current one) exists and
    this build has kernels for it (its architecture, or PTX it compiles)."""
    if not torch.cuda.is_available():
        return False
    return bool(ops.runs_on_device(_device_index(device)))


def set_max_batch(max_batch: int) -> None:
    """Rows of the decode buffer pools (per device and shape signature): set
    it to the largest batch you capture in CUDA graphs.

    The ``TQDECODE_MAX_BATCH`` environment variable, when set, overrides it
    (docs/LAUNCHER.md); 0 restores the default, 512. Call it before capturing CUDA
    graphs: changing it releases the existing pools, so graphs captured
    earlier become invalid. Outside capture, a batch larger than the bucket
    grows its pool to the next power of two, with a warning on stderr; during
    capture that raises ValueError naming ``max_batch``, as does the first
    decode of a shape (warm up before capturing).
    """
    ops.set_max_batch(int(max_batch))


def pool_stats() -> dict:
    """The decode buffer pools: ``{"max_batch", "pools": [{"signature",
    "bucket_batch", "partition_rows", "bytes"}], "total_bytes"}``."""
    max_batch, signatures, buckets, partition_rows, sizes = ops.pool_stats()
    pools = [
        {"signature": signature, "bucket_batch": bucket, "partition_rows": rows, "bytes": size}
        for signature, bucket, rows, size in zip(signatures, buckets, partition_rows, sizes)
    ]
    return {"max_batch": max_batch, "pools": pools, "total_bytes": sum(sizes)}


def set_device_checks(enabled: bool) -> None:
    """Device-side input checks of the CUDA decode: off by default (on when
    the ``TQDECODE_DEVICE_CHECKS`` environment variable is ``1``).

    When on, each CUDA decode first runs a small kernel that checks every
    ``seq_lens[b]`` against the block table's coverage ``[0,
    block_table.shape[1] * block_size]`` and every block-table entry that
    length uses against ``[0, num_blocks)``. A sequence that fails reads
    nothing and gets an all-zero output row; :func:`device_check_report`
    says what failed. One extra launch per call and no synchronisation, so it
    works in CUDA graphs (a graph keeps the setting it was captured with).
    The CPU op always checks and raises ValueError instead.
    """
    ops.set_device_checks(bool(enabled))


def device_check_report(device=None) -> dict:
    """Reads and clears what the device-side checks found on ``device``
    (default: the current CUDA device) since the last read, waiting for that
    device's current stream; not callable during CUDA-graph capture.

    ``{"checked_calls", "failed_sequences", "bad_seq_lens",
    "bad_block_entries", "first_bad_seq_len", "first_bad_block_entry"}``:
    counts over every checked call (graph replays included), and the
    lowest-indexed failures, ``{"sequence", "value"}`` and ``{"sequence",
    "column", "value"}``, or None.
    """
    (checked_calls, failed_sequences, bad_seq_lens, bad_block_entries, length_sequence, length_value,
     entry_sequence, entry_column, entry_value) = ops.device_check_report(_device_index(device))
    return {
        "checked_calls": checked_calls,
        "failed_sequences": failed_sequences,
        "bad_seq_lens": bad_seq_lens,
        "bad_block_entries": bad_block_entries,
        "first_bad_seq_len": None if length_sequence < 0 else {"sequence": length_sequence, "value": length_value},
        "first_bad_block_entry": None if entry_sequence < 0 else {
            "sequence": entry_sequence, "column": entry_column, "value": entry_value},
    }
