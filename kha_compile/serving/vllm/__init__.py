"""kha_compile in vLLM: a plugin that serves a directory with KHA, and the checks behind it.

Installed next to vLLM (``pip install 'kha-compile[vllm]'``), kha_compile registers a vLLM plugin
(entry point ``vllm.general_plugins``, :mod:`.plugin`). ``vllm.LLM(model=dir)`` and ``vllm serve dir``
on a directory written by ``model.save_pretrained`` (and/or ``kc.save_pretrained``) of a KHA model
then run vLLM's own model class with the trained transforms inside its fused QKV projection
(:mod:`.quant`, :mod:`.method`): linear KHA folded into the weights at load, MLP-value KHA on the
value heads, under tensor parallelism too. A folded linear-KHA model is vanilla and needs no plugin.

This package imports no vLLM: :func:`read_served` and :func:`check_servable` read and check a
directory, :func:`vllm_advice` says whether and how vLLM can serve it (``kha-compile inspect DIR``).
Only :mod:`.plugin`, :mod:`.quant` and :mod:`.method`, which vLLM loads, need vLLM.

Example::

    from kha_compile.serving.vllm import vllm_advice
    print("\\n".join(vllm_advice("out").lines))
"""

from .advice import PLUGIN_ENTRY_POINT, VLLMAdvice, plugin_status, vllm_advice
from .served import (
    CPU_HEAD_SIZES,
    SUPPORTED_ARCHITECTURES,
    ServedAttention,
    ServedModel,
    check_servable,
    read_served,
)

__all__ = [
    "CPU_HEAD_SIZES",
    "PLUGIN_ENTRY_POINT",
    "SUPPORTED_ARCHITECTURES",
    "ServedAttention",
    "ServedModel",
    "VLLMAdvice",
    "check_servable",
    "plugin_status",
    "read_served",
    "vllm_advice",
]
