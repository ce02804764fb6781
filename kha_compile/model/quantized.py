"""Fold into a quantized weight: dequantize, fold in float, requantize in the same format.

``kc.fold`` on a KHA model whose base is quantized reads each quantized projection weight back as
the float matrix it stands for (the library's own dequantization), folds the linear transforms into
it (:func:`~kha_compile.model.rows.fold_rows`, as for a float weight), and stores the result
quantized again in the weight's own format:

- bitsandbytes 4-bit (``Params4bit``, nf4 and fp4, its block size, double quantization and storage
  type; a weight bitsandbytes repacked for its CPU inference kernel is unpacked first);
- bitsandbytes 8-bit (``Int8Params``, LLM.int8's row-wise absmax);
- torchao's ``Int8Tensor`` (per-row or per-tensor weight-only int8) and ``IntxUnpackedToInt8Tensor``
  (``IntxWeightOnlyConfig``: int1..int8 per group).

The requantized weight carries the format's own rounding once more, so the folded model differs from
the quantized model with KHA by about one quantization step of the folded weight; ``kc.fold`` logs
that difference per weight. Any other quantized weight is refused with a :class:`FoldError` that says
to fold before quantizing. bitsandbytes and torchao are imported only when such a weight is folded.

Example::

    w = dequantized(q_proj)                          # (out, in) float
    new = requantized(q_proj, fold_rows(w, ...)[0])  # same format as q_proj.weight
    set_quantized_weight(q_proj, new)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import FoldError
from ..core.quantized import compute_dtype

__all__ = ["dequantized", "requantized", "set_quantized_weight"]

FOLD_FIRST = (
    "Fold before quantizing: kc.fold(model) on the model with KHA in its float weights, then quantize the folded "
    "model (it has the original architecture). Nothing was changed."
)


def _format(w: Tensor) -> str:
    return f"{type(w).__module__.partition('.')[0]}.{type(w).__name__}"


def _refuse(module: nn.Module, why: str) -> FoldError:
    return FoldError(f"cannot fold into the quantized weight of {type(module).__name__} ({why}). {FOLD_FIRST}")


def _bnb_4bit_data(w: Any) -> tuple[Tensor, Any]:
    """The packed data and quant state of a 4-bit weight in bitsandbytes' canonical layout."""
    qs = w.quant_state
    if getattr(qs, "packing_format_for_cpu", False):  # repacked for the CPU inference kernel
        from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse

        return _convert_weight_packed_for_cpu_inverse(w.data, qs)
    return w.data, qs


def dequantized(module: nn.Module) -> Tensor:
    """The quantized weight of ``module`` as the (out, in) float matrix it stands for, in its compute dtype."""
    w: Any = module._parameters.get("weight")
    if w is None:
        raise _refuse(module, "it has no weight")
    dtype = compute_dtype(module, torch.get_default_dtype())
    name = _format(w)
    try:
        if name == "bitsandbytes.Params4bit":
            import bitsandbytes.functional as bf

            data, qs = _bnb_4bit_data(w)
            return bf.dequantize_4bit(data, qs).to(dtype)
        if name == "bitsandbytes.Int8Params":
            scb = getattr(w, "SCB", None)
            if scb is None:  # the first forward moves it into the module's matmul state
                scb = getattr(getattr(module, "state", None), "SCB", None)
            if scb is None:
                raise _refuse(module, "bitsandbytes 8-bit weight without its row scales")
            return (w.data.float() * scb.float()[:, None] / 127).to(dtype)
        if name in ("torchao.Int8Tensor", "torchao.IntxUnpackedToInt8Tensor"):
            return w.dequantize().to(dtype)
    except FoldError:
        raise
    except Exception as exc:  # the library's own dequantization failed: say so, never a raw error
        raise _refuse(module, f"{name} could not be dequantized: {type(exc).__name__}: {exc}") from exc
    raise _refuse(module, f"kha_compile cannot dequantize and requantize a {name} weight")


def requantized(module: nn.Module, value: Tensor) -> nn.Parameter:
    """``value`` (out, in, float) quantized in the format of ``module``'s weight, as a frozen parameter."""
    w: Any = module._parameters["weight"]
    name = _format(w)
    value = value.detach()
    try:
        if name == "bitsandbytes.Params4bit":
            import bitsandbytes as bnb

            new = bnb.nn.Params4bit(
                value.contiguous(),
                requires_grad=False,
                blocksize=w.blocksize,
                compress_statistics=w.compress_statistics,
                quant_type=w.quant_type,
                quant_storage=w.quant_storage,
                module=module,
            )
            return new._quantize(value.device)
        if name == "bitsandbytes.Int8Params":
            import bitsandbytes as bnb

            new8 = bnb.nn.Int8Params(value.contiguous(), requires_grad=False, has_fp16_weights=False)
            return new8._quantize(value.device)
        if name == "torchao.Int8Tensor":
            from torchao.quantization.granularity import PerRow, PerTensor

            block = tuple(w.block_size)
            granularity = PerTensor() if block == tuple(w.shape) else PerRow()
            if granularity == PerRow() and block != (1, w.shape[1]):
                raise _refuse(module, f"torchao Int8Tensor with block size {block}")
            q = type(w).from_hp(value.to(w.dtype), granularity, act_quant_kwargs=w.act_quant_kwargs)
            return nn.Parameter(q, requires_grad=False)
        if name == "torchao.IntxUnpackedToInt8Tensor":
            from torchao.quantization.quant_primitives import MappingType

            symmetric = not bool(torch.count_nonzero(w.zero_point))
            q = type(w).from_hp(
                value.to(w.dtype),
                tuple(w.block_size),
                w.target_dtype,
                mapping_type=MappingType.SYMMETRIC if symmetric else MappingType.ASYMMETRIC,
                activation_quantization=w.activation_quantization,
            )
            return nn.Parameter(q, requires_grad=False)
    except FoldError:
        raise
    except Exception as exc:  # the library's own quantization failed: say so, never a raw error
        raise _refuse(module, f"{name} could not be requantized: {type(exc).__name__}: {exc}") from exc
    raise _refuse(module, f"kha_compile cannot dequantize and requantize a {name} weight")


def set_quantized_weight(module: nn.Module, weight: nn.Parameter) -> None:
    """Store a requantized ``weight`` in ``module`` (and reset what the library keeps beside it)."""
    module._parameters["weight"] = weight
    state = getattr(module, "state", None)
    if state is not None and hasattr(state, "SCB"):  # bitsandbytes 8-bit: the next forward reads the new weight
        state.CB = None
        state.SCB = None
    if hasattr(weight, "quant_state") and hasattr(module, "quant_state"):
        module.quant_state = weight.quant_state
