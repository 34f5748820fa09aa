"""Routes vLLM's TurboQuant decode on CUDA GPUs to tqdecode (docs/VLLM.md).

vLLM's TurboQuant backend decodes its token-interleaved cache with
``triton_turboquant_decode_attention`` from
``vllm.v1.attention.ops.triton_turboquant_decode``, once per layer and step.
:func:`register` replaces that function with one that calls
:func:`tqdecode.token_slots_decode_attention`, which takes the same
arguments, reads the same cache bytes and computes the same function. A call
with an argument that function does not take set (some vLLM revisions add
masks, ``sliding_window`` and ``mm_prefix_range``), a geometry tqdecode does
not serve (its head sizes and group sizes), or a cache some vLLM revisions
lay out otherwise (group-4 "qgroup4" pages) goes to vLLM's own function
instead. It is vLLM's general-plugin hook (the
``vllm.general_plugins`` entry point of the root ``pyproject.toml``), which
vLLM calls in every process it starts. Importing this module does not import
vLLM.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
import sys

SOURCE_MODULE = "vllm.v1.attention.ops.triton_turboquant_decode"
FUNCTION = "triton_turboquant_decode_attention"
STORE_MODULE = "vllm.v1.attention.ops.triton_turboquant_store"
# A child of vLLM's logger, whose handler vLLM's logging configuration sets
# (the root logger has none at INFO there).
_log = logging.getLogger("vllm.tqdecode")


def _has_cuda_ops() -> bool:
    """Whether this tqdecode's binding has its CUDA kernels (a build without
    nvcc has only the CPU ops, which cannot serve vLLM's CUDA tensors)."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key("tqdecode::decode", "CUDA")


def register() -> bool:
    """Routes vLLM's TurboQuant decode in this process to tqdecode.

    Replaces the function in its module and in every module already imported
    that holds it by name (the backend does ``from ... import``); modules
    imported later find the replacement. Returns False, and changes nothing,
    when vLLM is not installed or has no such function, or (with a warning)
    when this tqdecode was built without its CUDA kernels. Calling it again
    (the plugin hook and an engine may both) changes nothing more.
    """
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        source = importlib.import_module(SOURCE_MODULE)
    except ImportError:
        return False
    replaced = getattr(source, FUNCTION, None)
    if replaced is None:
        return False
    if getattr(replaced, "_tqdecode_route", False):
        return True
    if not _has_cuda_ops():
        _log.warning("tqdecode was built without CUDA (no nvcc at build time): vLLM keeps its own %s", FUNCTION)
        return False
    routed = route(replaced, _writes_qgroup4_pages())
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, FUNCTION, None) is replaced:
            setattr(module, FUNCTION, routed)
    from . import __version__

    _log.info("vLLM's %s now runs tqdecode %s's token_slots_decode_attention", FUNCTION, __version__)
    return True


def _writes_qgroup4_pages() -> bool:
    """Whether this vLLM's store lays out the caches of MSE keys with 4-bit
    values at group size 4 in "qgroup4" pages (a plane of key codes, one of
    value codes, then the fields) instead of the token-interleaved slots
    tqdecode reads: revisions whose store takes ``kv_group_size``."""
    try:
        store = importlib.import_module(STORE_MODULE)
    except ImportError:
        return False
    function = getattr(store, "triton_turboquant_store", None)
    return hasattr(store, "_tq_fused_store_mse_qgroup4") or (
        function is not None and "kv_group_size" in inspect.signature(function).parameters)


@functools.cache
def _serves(device) -> bool:
    """Whether tqdecode serves tensors on `device`: its CPU ops, or kernels
    for a CUDA device's architecture in this build."""
    from . import runs_on_device

    return device.type == "cpu" or (device.type == "cuda" and runs_on_device(device))


@functools.cache
def _stores_e4b15_keys(device) -> bool:
    """Whether vLLM stores fp8 keys on `device` as Triton's float8e4b15 (CUDA
    GPUs below sm_89, vLLM's ``_use_fp8_e4b15``) rather than the e4m3fn
    tqdecode reads."""
    import torch

    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def route(original, qgroup4_pages=False):
    """``original`` (vLLM's decode function) as tqdecode serves it: a call
    :func:`tqdecode.token_slots_decode_attention` can name goes there, with
    any argument it does not take dropped when None; a call that sets such an
    argument, passes more positional arguments than it takes, runs on a device
    this build has no kernels for, has fp8 keys on a GPU where vLLM stores
    them as float8e4b15, or (``qgroup4_pages``: a vLLM whose store writes
    them) MSE keys with 4-bit values at group size 4, goes to ``original``.
    So does a call tqdecode refuses (ValueError: a head size or group size it
    has no kernels for), and every later call of that geometry, with one
    warning naming the reason."""
    from . import token_slots_decode_attention

    signature = inspect.signature(token_slots_decode_attention)
    taken = tuple(signature.parameters)
    defaults = {name: p.default for name, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
    refused = set()  # geometries tqdecode refused: (query dtype and shape past B, cache shape past its blocks, preset)

    @functools.wraps(original)
    def decode_attention(*args, **kwargs):
        others = [name for name in kwargs if name not in taken]
        if len(args) > len(taken) or any(kwargs[name] is not None for name in others):
            return original(*args, **kwargs)
        bound = signature.bind_partial(*args, **{name: kwargs[name] for name in kwargs if name in taken})
        call = {**defaults, **bound.arguments}
        query, kv_cache, key_fp8 = call.get("query"), call.get("kv_cache"), call["key_fp8"]
        if query is None or kv_cache is None or not _serves(query.device) or (
                key_fp8 and _stores_e4b15_keys(query.device)):
            return original(*args, **kwargs)
        if (qgroup4_pages and not key_fp8 and call.get("value_quant_bits") == 4
                and query.shape[1] == 4 * kv_cache.shape[2]):
            return original(*args, **kwargs)
        geometry = (query.dtype, tuple(query.shape[1:]), tuple(kv_cache.shape[1:]), call.get("mse_bits"),
                    call.get("value_quant_bits"), bool(key_fp8))
        if geometry in refused:
            return original(*args, **kwargs)
        try:
            return token_slots_decode_attention(*args, **{name: kwargs[name] for name in kwargs if name in taken})
        except ValueError as error:
            refused.add(geometry)
            _log.warning("tqdecode does not serve this call (%s); vLLM's %s serves this geometry", error, FUNCTION)
            return original(*args, **kwargs)

    decode_attention._tqdecode_route = True
    return decode_attention
