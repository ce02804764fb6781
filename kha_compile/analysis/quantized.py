"""Quantized linears read as the linears they are, for the analysis trace only.

torch.export cannot run bitsandbytes' 4-bit and 8-bit linears on fake tensors (``Params4bit`` is
not built on fake tensors; ``Linear8bitLt`` reads ``weight.CB``), and torchao's weight tensor
subclasses leave ops (``aten.view`` on ``Int8Tensor``, ``_weight_int8pack_mm``) that are no
projection of a parameter. The analysis asks only which parameter produces each head vector, so
while it traces, each quantized linear (:func:`~kha_compile.core.quantized.is_quantized_linear`)
is replaced by a plain ``nn.Linear`` of the same in/out features, dtype and path whose weight is
one stored element broadcast to its shape (no memory per weight). The model gets its own modules
back when the trace ends, whatever happens.

Example::

    with plain_linears(model):
        exported = torch.export.export(model, (ids,), strict=False)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.errors import UnsupportedModelError
from ..core.quantized import compute_dtype, is_quantized_linear

__all__ = ["TracedCarrier", "TracedLinear", "plain_linears"]


class TracedLinear(nn.Linear):
    """A quantized linear as the analysis sees it: ``x W^T + b`` in the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        b = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return F.linear(x, w, b)


class TracedCarrier(TracedLinear):
    """A quantized linear that carries KHA, as the analysis sees it: its transforms on ``x W^T + b``.

    Its ``kha`` child is the carrier's own (same parameters, same paths in the trace), and the
    carrier's own ``kha_transform`` applies them, so the self-check sees the rewrite as it runs."""

    def forward(self, x: Tensor) -> Tensor:
        return self.__dict__["_carrier_transform"](super().forward(x))


def _stand_in(module: nn.Linear, dtype: torch.dtype) -> TracedLinear:
    device = next(iter(module.parameters(recurse=False))).device  # compressed-tensors: weight_packed, no weight
    carrier = "kha" in module._modules and callable(getattr(module, "kha_transform", None))
    cls = TracedCarrier if carrier else TracedLinear
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    stand_in.in_features, stand_in.out_features = module.in_features, module.out_features
    one = torch.zeros((), dtype=dtype, device=device)
    shape = (module.out_features, module.in_features)
    stand_in.weight = nn.Parameter(one.expand(shape), requires_grad=False)
    bias = module._parameters.get("bias")
    if isinstance(bias, nn.Parameter) and bias.is_floating_point():
        stand_in.bias = bias
    else:
        stand_in.register_parameter("bias", None)
    if carrier:  # the rewritten model (apply's self-check): its transforms stay where they are
        stand_in._modules["kha"] = module._modules["kha"]
        stand_in.__dict__["_carrier_transform"] = module.kha_transform
    stand_in.train(module.training)
    return stand_in


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point() and type(p) in (nn.Parameter, Tensor):
            return p.dtype
    return torch.get_default_dtype()


@contextlib.contextmanager
def plain_linears(model: nn.Module) -> Iterator[int]:
    """Replace every quantized linear in ``model`` by a :class:`TracedLinear` until the block ends; yields how many."""
    found = [
        (path, m)
        for path, m in model.named_modules(remove_duplicate=False)
        if path and is_quantized_linear(m)  # a KHA carrier too (TracedCarrier): its transforms kept
    ]
    packed = [path for path, m in found if "weight" not in m._parameters]
    if packed:
        # compressed-tensors decompresses its packed weights in a forward pre-hook on the model's first call;
        # run on fake tensors, that would leave the model broken
        raise UnsupportedModelError(
            f"{packed[0]} (and {len(packed) - 1} more linears) still hold compressed-tensors' packed weights: "
            "compressed-tensors decompresses them on the model's first forward. Run one forward (model(**inputs)) "
            "before kc.apply, or load with quantization_config=CompressedTensorsConfig(dequantize=True). "
            "The model is unchanged."
        )
    if not found:
        yield 0
        return
    dtype = _model_dtype(model)
    swaps: list[tuple[nn.Module, str, nn.Module]] = []
    stand_ins: dict[int, TracedLinear] = {}  # one module shared by two paths stays one stand-in
    try:
        for path, module in found:
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            if id(module) not in stand_ins:
                stand_ins[id(module)] = _stand_in(module, compute_dtype(module, dtype) or dtype)
            swaps.append((parent, attr, module))
            parent._modules[attr] = stand_ins[id(module)]
        yield len(stand_ins)
    finally:
        for parent, attr, module in reversed(swaps):
            parent._modules[attr] = module
