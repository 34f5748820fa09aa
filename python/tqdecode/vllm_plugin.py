"""Routes vLLM's TurboQuant decode on CUDA GPUs to tqdecode (docs/VLLM.md).

vLLM's TurboQuant backend decodes its token-interleaved cache with
``triton_turboquant_decode_attention`` from
``vllm.v1.attention.ops.triton_turboquant_decode``, once per layer and step.
:func:`register` replaces that function with one that calls
:func:`tqdecode.token_slots_decode_attention`, which takes the same
arguments, reads the same cache bytes and computes the same function. A call
with an argument that function does not take set (some vLLM revisions add
masks, ``sliding_window`` and ``mm_prefix_range``) goes to vLLM's own
function instead. It is vLLM's general-plugin hook (the
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
_log = logging.getLogger(__name__)


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
    when this tqdecode was built without its CUDA kernels.
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
    if not _has_cuda_ops():
        _log.warning("tqdecode was built without CUDA (no nvcc at build time): vLLM keeps its own %s", FUNCTION)
        return False
    routed = route(replaced)
    for module in list(sys.modules.values()):
        if module is not None and getattr(module, FUNCTION, None) is replaced:
            setattr(module, FUNCTION, routed)
    from . import __version__

    _log.info("vLLM's %s now runs tqdecode %s's token_slots_decode_attention", FUNCTION, __version__)
    return True


def route(original):
    """``original`` (vLLM's decode function) as tqdecode serves it: a call
    :func:`tqdecode.token_slots_decode_attention` can name goes there, with
    any argument it does not take dropped when None; a call that sets such an
    argument, or passes more positional arguments than it takes, goes to
    ``original``."""
    from . import token_slots_decode_attention

    taken = tuple(inspect.signature(token_slots_decode_attention).parameters)

    @functools.wraps(original)
    def decode_attention(*args, **kwargs):
        others = [name for name in kwargs if name not in taken]
        if len(args) > len(taken) or any(kwargs[name] is not None for name in others):
            return original(*args, **kwargs)
        for name in others:
            del kwargs[name]
        return token_slots_decode_attention(*args, **kwargs)

    return decode_attention
