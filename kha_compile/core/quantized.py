"""Which weights are stored quantized: what the trace, the carriers and fold must not treat as a plain matrix.

A quantized linear is an ``nn.Linear`` (bitsandbytes' ``Linear4bit`` and ``Linear8bitLt`` subclass it;
torchao's ``quantize_`` keeps ``nn.Linear`` and swaps its weight for a tensor subclass) whose weight is
packed integers (bitsandbytes: ``uint8`` 4-bit pairs of shape ``(n, 1)``, ``int8`` rows) or a tensor
subclass other than a sharded ``DTensor`` (torchao's ``Int8Tensor``, ``Int4Tensor``, ...). Nothing of
bitsandbytes or torchao is imported to tell. A linear that compressed-tensors quantizes (it sets
``quantization_scheme`` on the module and replaces its forward) counts too, whatever its weight holds.

Example::

    is_quantized_linear(model.model.layers[0].self_attn.q_proj)     # True after load_in_4bit=True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .optional import is_dtensor

__all__ = ["compute_dtype", "is_quantized_linear", "is_quantized_weight", "weights_kept_trainable"]

_CPU_REPACK = "support_avx512bf16_for_cpu"  # bitsandbytes' Linear4bit: repack on an eval forward without grad


def is_quantized_weight(t: object) -> bool:
    """True for a weight stored quantized: packed integers or a (non-DTensor) tensor subclass."""
    if not isinstance(t, Tensor) or t.is_meta:
        return False
    if not t.is_floating_point() and not t.is_complex():
        return True
    return is_traceable_wrapper_subclass(t) and not is_dtensor(t)


def is_quantized_linear(module: nn.Module) -> bool:
    """True for an ``nn.Linear`` (or subclass) whose weight is stored quantized (:func:`is_quantized_weight`),
    that compressed-tensors runs quantized (its ``quantization_scheme``; a forward of its own that fake-quantizes
    the weight, which torch.export cannot trace), or whose weight is still to be loaded (on the meta device) as a
    quantization library's parameter class (bitsandbytes' ``Params4bit``, ``Int8Params``: ``from_pretrained``
    builds them before the weights load)."""
    if not isinstance(module, nn.Linear):
        return False
    if getattr(module, "quantization_scheme", None) is not None:
        return True
    w = module._parameters.get("weight")
    if isinstance(w, Tensor) and w.is_meta:
        return type(w) not in (nn.Parameter, Tensor) and not is_dtensor(w)
    return is_quantized_weight(w)


def compute_dtype(module: nn.Module, default: torch.dtype | None = None) -> torch.dtype | None:
    """The floating dtype a quantized linear computes and returns in: its bias's, its ``compute_dtype``
    (bitsandbytes 4-bit), its weight's reported dtype (torchao), the quantization's original dtype, else ``default``.
    """
    bias = module._parameters.get("bias")
    if isinstance(bias, Tensor) and bias.is_floating_point():
        return bias.dtype
    declared = getattr(module, "compute_dtype", None)
    if isinstance(declared, torch.dtype) and declared.is_floating_point:
        return declared
    w = module._parameters.get("weight")
    if isinstance(w, Tensor) and w.is_floating_point():
        return w.dtype
    state_dtype = getattr(getattr(w, "quant_state", None), "dtype", None)
    if isinstance(state_dtype, torch.dtype) and state_dtype.is_floating_point:
        return state_dtype
    return default


@contextlib.contextmanager
def weights_kept_trainable(model: nn.Module) -> Iterator[None]:
    """Forwards in this block leave quantized weights in the layout they had.

    bitsandbytes' 4-bit linear, on a CPU with AVX-512 bf16, repacks its weight for an inference-only
    kernel at its first forward in eval mode without gradients; that kernel has no backward, so a
    model repacked by a forward the user never asked for (kha_compile's own check runs) would stop
    training its inputs' gradients. The repacking is turned off for the block, then put back.

    Example::

        with weights_kept_trainable(model), torch.no_grad():
            model(ids)
    """
    flagged = [(m, m.__dict__[_CPU_REPACK]) for m in model.modules() if m.__dict__.get(_CPU_REPACK)]
    for m, _ in flagged:
        m.__dict__[_CPU_REPACK] = False
    try:
        yield
    finally:
        for m, was in flagged:
            m.__dict__[_CPU_REPACK] = was
