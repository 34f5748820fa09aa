"""Routes vLLM's TurboQuant decode on CUDA GPUs to tqdecode (docs/VLLM.md).

vLLM's TurboQuant backend decodes its token-interleaved cache with
``triton_turboquant_decode_attention`` from
``vllm.v1.attention.ops.triton_turboquant_decode``, once per layer and step.
:func:`register` replaces that function with
:func:`tqdecode.token_slots_decode_attention`, which takes the same
arguments, reads the same cache bytes and computes the same function. It is
vLLM's general-plugin hook (the ``vllm.general_plugins`` entry point of
``python/pyproject.toml``), which vLLM calls in every process it starts.
Importing this module does not import vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

SOURCE_MODULE = "vllm.v1.attention.ops.triton_turboquant_decode"
FUNCTION = "triton_turboquant_decode_attention"


def register() -> bool:
    """Routes vLLM's TurboQuant decode in this process to tqdecode.

    Replaces the function in its module and in every module already imported
    that holds it by name (the backend does ``from ... import``); modules
    imported later find the replacement. Returns False, and changes nothing,
    when vLLM is not installed or has no such function.
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
    from . import token_slots_decode_attention

    for module in list(sys.modules.values()):
        if module is not None and getattr(module, FUNCTION, None) is replaced:
            setattr(module, FUNCTION, token_slots_decode_attention)
    return True
