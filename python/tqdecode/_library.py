"""Loads the compiled ops (``_C.so``) and registers their fake implementations.

The fakes let ``torch.compile(fullgraph=True)`` trace the ops: they compute
output shapes and run the same cheap dtype / device / shape checks as the
C++ side, so a bad call fails with the same ``ValueError`` at trace time.
Checks that need the cache layout (key_packed_size, geometry, ...) run in C++.
"""

from __future__ import annotations

import pathlib

import torch


def _load() -> None:
    built = sorted(pathlib.Path(__file__).parent.glob("_C*.so"))
    if not built:
        raise ImportError(
            "tqdecode: the PyTorch binding is not built; run "
            "`cmake -S . -B build -G Ninja -DTQDECODE_PYTHON=ON && cmake --build build --target tqdecode_torch` "
            "in the repository root (see python/README.md)"
        )
    torch.ops.load_library(str(built[0]))


_load()
ops = torch.ops.tqdecode


def fail(argument: str, message: str):
    """Raises the ValueError the C++ side raises: "tqdecode: <argument>: <message>"."""
    raise ValueError(f"tqdecode: {argument}: {message}")


def check_is_tensor(value, argument) -> None:
    if not isinstance(value, torch.Tensor):
        fail(argument, f"expected a torch.Tensor, got {type(value).__name__}")


def elements_distinct(tensor) -> bool:
    """Whether no two elements share memory: ordered by stride, each dimension
    of several elements steps past the extent of those inside it (the C++
    ops' rule; true of every dense, padded or permuted layout)."""
    if tensor.is_contiguous():  # the common case, without the Python loop
        return True
    extent = 1
    for stride, size in sorted((tensor.stride(dim), size) for dim, size in enumerate(tensor.shape) if size > 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True


def _check_tensor(tensor, argument, dtypes, dim, shape, device):
    check_is_tensor(tensor, argument)
    if tensor.device != device:
        fail(argument, f"is on {tensor.device}; every tensor of the call must be on {device}")
    if tensor.dtype not in dtypes:
        accepted = ", ".join(str(dtype) for dtype in dtypes)
        fail(argument, f"dtype {tensor.dtype} is not supported; accepted: {accepted}")
    if tensor.dim() != dim:
        fail(argument, f"has {tensor.dim()} dimensions; expected {dim}: {shape}")


def _check_batch(tensor, argument, batch, varlen=False):
    if tensor.shape[0] != batch:
        source = "query_start_loc.shape[0] - 1" if varlen else "query.shape[0]"
        fail(argument, f"size {tensor.shape[0]} in dimension 0 does not match the batch size {source} = {batch}")


def check_query(query, varlen=False) -> None:
    """The query's checks: ``[batch, Hq, D]``, or ``[num_tokens, Hq, D]`` for several tokens per sequence."""
    check_is_tensor(query, "query")
    rows = "[num_tokens, num_q_heads, head_dim]" if varlen else "[batch, num_q_heads, head_dim]"
    _check_tensor(query, "query", (torch.bfloat16, torch.float16), 3, rows, query.device)
    if query.stride(2) != 1:
        fail("query", f"the head_dim dimension must have stride 1 (strides {list(query.stride())})")


def check_decode(query, kv_cache, block_table, seq_lens, sinks, query_start_loc=None) -> None:
    """The decode checks that need no cache layout; with ``query_start_loc``
    those of several query tokens per sequence (query ``[num_tokens, Hq, D]``,
    batch ``query_start_loc.shape[0] - 1``)."""
    check_query(query, query_start_loc is not None)
    device = query.device
    _check_tensor(kv_cache, "kv_cache", (torch.uint8,), 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]", device)
    _check_tensor(block_table, "block_table", (torch.int32,), 2, "[batch, max_blocks_per_seq]", device)
    _check_tensor(seq_lens, "seq_lens", (torch.int32,), 1, "[batch]", device)
    batch = query.shape[0]
    if query_start_loc is not None:
        _check_tensor(query_start_loc, "query_start_loc", (torch.int32,), 1, "[batch + 1]", device)
        if query_start_loc.shape[0] < 1:
            fail("query_start_loc", "is empty; expected [batch + 1] offsets starting at 0")
        batch = query_start_loc.shape[0] - 1
    _check_batch(block_table, "block_table", batch, query_start_loc is not None)
    _check_batch(seq_lens, "seq_lens", batch, query_start_loc is not None)
    if sinks is not None:
        _check_tensor(sinks, "sinks", (torch.float32,), 1, "[num_q_heads]", device)
        if sinks.shape[0] != query.shape[1]:
            fail("sinks", f"size {sinks.shape[0]} does not match num_q_heads query.shape[1] = {query.shape[1]}")


def check_output(out, query, argument) -> None:
    _check_tensor(out, argument, (query.dtype,), 3, "[batch, num_q_heads, head_dim]", query.device)
    if out.shape != query.shape:
        fail(argument, f"shape {list(out.shape)} does not match the query shape {list(query.shape)}")
    if out.stride(2) != 1:
        fail(argument, f"the head_dim dimension must have stride 1 (strides {list(out.stride())})")
    if not elements_distinct(out):
        fail(argument, f"elements overlap (strides {list(out.stride())}); accepted: distinct rows, heads and dims, "
                       "e.g. stride(1) >= head_dim")


def output_rows(output_buf, query, argument):
    """``(rows, out)`` for a caller's output buffer: ``rows = output_buf[:B]``
    (what the call returns) and ``out``, the same memory as ``[B, Hq, D]``
    (what the decode writes). Accepted: ``[N, Hq, D]`` or ``[N, Hq * D]`` with
    N >= B, the query's dtype and device, the last dimension contiguous."""
    batch, heads, head_dim = query.shape
    check_is_tensor(output_buf, argument)
    accepted = f"accepted: [N, {heads}, {head_dim}] or [N, {heads * head_dim}] with N >= batch {batch}"
    shape = list(output_buf.shape)
    if shape[1:] not in ([heads, head_dim], [heads * head_dim]) or shape[0] < batch:
        fail(argument, f"shape {shape} is not accepted; {accepted}")
    rows = output_buf if shape[0] == batch else output_buf[:batch]
    if rows.dim() == 2:
        if rows.stride(1) != 1:
            fail(argument, f"the last dimension must be contiguous (stride {rows.stride(1)}); {accepted}")
        out = rows.as_strided((batch, heads, head_dim), (rows.stride(0), head_dim, 1))
    else:
        out = rows
    check_output(out, query, argument)
    return rows, out


def check_store(key, value, kv_cache, slot_mapping) -> None:
    if not isinstance(key, torch.Tensor):
        fail("key", f"expected a torch.Tensor, got {type(key).__name__}")
    device = key.device
    kv_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    _check_tensor(key, "key", kv_dtypes, 3, "[num_tokens, num_kv_heads, head_dim]", device)
    _check_tensor(value, "value", (key.dtype,), 3, "[num_tokens, num_kv_heads, head_dim]", device)
    if value.shape != key.shape:
        fail("value", f"shape {list(value.shape)} does not match the key shape {list(key.shape)}")
    _check_tensor(kv_cache, "kv_cache", (torch.uint8,), 4, "[num_blocks, block_size, num_kv_heads, slot_bytes]", device)
    _check_tensor(slot_mapping, "slot_mapping", (torch.int64,), 1, "[num_tokens]", device)
    if slot_mapping.shape[0] != key.shape[0]:
        fail("slot_mapping", f"size {slot_mapping.shape[0]} does not match num_tokens key.shape[0] = {key.shape[0]}")


@torch.library.register_fake("tqdecode::store")
def _store_fake(key, value, kv_cache, slot_mapping, Pi, centroids, preset, check=False, cache_order="blocks"):
    check_store(key, value, kv_cache, slot_mapping)


@torch.library.register_fake("tqdecode::decode")
def _decode_fake(query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits,
                 key_fp8=False, sinks=None, constants_stable=True, cache_order="blocks", norm_correction=False):
    check_decode(query, kv_cache, block_table, seq_lens, sinks)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("tqdecode::decode_out")
def _decode_out_fake(query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits,
                     key_fp8=False, sinks=None, constants_stable=True, cache_order="blocks", norm_correction=False, *,
                     out):
    check_decode(query, kv_cache, block_table, seq_lens, sinks)
    check_output(out, query, "out")


@torch.library.register_fake("tqdecode::varlen_decode")
def _varlen_decode_fake(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, centroids, PiT, scale,
                        mse_bits, value_quant_bits, key_fp8=False, sinks=None, constants_stable=True,
                        cache_order="blocks", norm_correction=False):
    check_decode(query, kv_cache, block_table, seq_lens, sinks, query_start_loc)
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.register_fake("tqdecode::varlen_decode_out")
def _varlen_decode_out_fake(query, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, centroids, PiT,
                            scale, mse_bits, value_quant_bits, key_fp8=False, sinks=None, constants_stable=True,
                            cache_order="blocks", norm_correction=False, *, out):
    check_decode(query, kv_cache, block_table, seq_lens, sinks, query_start_loc)
    check_output(out, query, "out")


@torch.library.register_fake("tqdecode::continuation_decode_out")
def _continuation_decode_out_fake(query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits,
                                  value_quant_bits, key_fp8=False, sinks=None, constants_stable=True,
                                  cache_order="blocks", norm_correction=False, *, out):
    check_decode(query, kv_cache, block_table, seq_lens, sinks)
    check_output(out, query, "out")


@torch.library.register_fake("tqdecode::continuation_route")
def _continuation_route_fake(seq_lens, capacity):
    return seq_lens.new_empty(seq_lens.shape[0] + 3)


@torch.library.register_fake("tqdecode::decode_path")
def _decode_path_fake(query, kv_cache, block_table, seq_lens, centroids, PiT, scale, mse_bits, value_quant_bits,
                      key_fp8=False, sinks=None, constants_stable=True, cache_order="blocks", norm_correction=False):
    # The choice depends on the device and on the cache's address alignment,
    # which fake tensors do not have: the answer exists only when the op runs.
    check_decode(query, kv_cache, block_table, seq_lens, sinks)
    return "unknown", "fake tensors: the path is chosen when the op runs on real tensors"


@torch.library.register_fake("tqdecode::make_model_constants")
def _make_model_constants_fake(preset, head_dim, seed=0, rotation="hadamard"):
    # The shapes follow from the preset's key bits (a host-side lookup that
    # reads no tensor); fp8 keys have no constants.
    key_bits, _, key_fp8 = ops.cache_layout(preset, head_dim, 16, 1)[:3]
    levels, side = (0, 0) if key_fp8 else (1 << key_bits, head_dim)
    return torch.empty(levels), torch.empty(side, side), torch.empty(side, side)
