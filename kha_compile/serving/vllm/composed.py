"""KHA around a real quantization method in vLLM: a quantized base (compressed-tensors, ...) with its KHA (needs vLLM).

vLLM runs one quantization method per model. A directory whose base is quantized records kha_compile's
method with the real one's config inside it (``"wraps"``, :func:`kha_compile.store.hf.compose_quantization`),
so vLLM picks kha_compile's, and :class:`.quant.KHAQuantConfig` builds the real method's config from that
entry and asks it for every layer's method. :class:`WrappedQKVMethod` wraps the one it gives each fused QKV
projection of an attention with KHA: the real method creates, loads and runs the quantized weight (its
int8 GEMM, ...), and every KHA transform runs on the head slices of its output, the linear ones too: folding
them into a quantized weight would requantize it (fold before quantizing to serve them at no cost).
:class:`CheckedMethod` wraps every other linear layer's method only to check, after loading, that every
attention's KHA found its layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from ...model.slots import HeadSlot
from ...model.transforms import TransformKind, get_transform
from .method import PlacementCheck, add_kha, check_bias_first, transform_heads
from .served import ServedAttention

__all__ = ["CheckedMethod", "WrappedQKVMethod", "wrap"]

_NAMED: dict[tuple[type, str], type] = {}


def wrap(cls: type[CheckedMethod], *args: Any) -> CheckedMethod:
    """``cls(*args)`` (``args[1]`` the real method) as a class of the real method's name: vLLM's linear layers
    choose their weight loader by that name (``WEIGHT_LOADER_V2_SUPPORTED``), and must choose the real one's.

    Example::

        wrap(CheckedMethod, config, real)       # type(...).__name__ == "CompressedTensorsLinearMethod"
    """
    name = type(args[1]).__name__
    named = _NAMED.get((cls, name))
    if named is None:
        named = _NAMED[(cls, name)] = type(name, (cls,), {"__doc__": cls.__doc__, "__module__": cls.__module__})
    return named(*args)


class CheckedMethod(QuantizeMethodBase):
    """The real method of a linear layer, unchanged, plus the check that every KHA was placed.

    Example::

        layer.quant_method = CheckedMethod(config, real.get_quant_method(layer, prefix))
    """

    def __init__(self, config: PlacementCheck, inner: QuantizeMethodBase) -> None:
        super().__init__()
        self._placement = config
        self.inner = inner

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.inner.create_weights(layer, *args, **kwargs)

    def apply(self, layer: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        return self.inner.apply(layer, *args, **kwargs)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._placement.check_placed()
        self.inner.process_weights_after_loading(layer)

    def __getattr__(self, name: str) -> Any:  # what vLLM asks of the real method (its kernel, flags)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class WrappedQKVMethod(CheckedMethod):
    """A fused QKV projection run by the real quantization method, with KHA on the head slices of its output.

    Example::

        layer.quant_method = WrappedQKVMethod(config, real_method, served.attentions["model.layers.0.self_attn"])
    """

    def __init__(self, config: PlacementCheck, inner: QuantizeMethodBase, attention: ServedAttention) -> None:
        super().__init__(config, inner)
        self.attention = attention
        self.kinds: dict[str, TransformKind] = {r: get_transform(k) for r, k in attention.kinds.items()}
        self.slots: dict[str, HeadSlot] = {}
        self.running = list(self.kinds)  # every role at run time: nothing folds into a quantized weight

    def create_weights(self, layer: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.inner.create_weights(layer, *args, **kwargs)
        dtype = kwargs.get("params_dtype", args[4] if len(args) > 4 else torch.get_default_dtype())
        self.slots = add_kha(layer, self.attention, self.kinds, dtype)
        check_bias_first(layer, self.attention, self.running)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = self.inner.apply(layer, x, bias)  # (T, q + k + v) of this rank, from the quantized weight
        return transform_heads(layer, y, self.running, self.kinds, self.slots)
