"""KHA-MLP on values: ``2 * ((v W_up) * sigmoid(v W_gate)) W_down``, one ``kha::mlp_value`` op; never folds.

The module runs :func:`~kha_compile.ops.mlp_value_auto`: the op on CUDA (fused Triton kernels) and in
every traced graph (torch.compile, torch.export, ONNX), autograd of the formula in plain eager mode
elsewhere (no recompute in backward; the op's CPU kernel is that formula anyway).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ...ops import mlp_value_auto  # (importing ops registers torch.ops.kha.mlp_value)
from ...ops.mlp_value_onnx import translate_mlp_value
from .base import IdentityInitModule, TransformKind, fill_whole, register_transform

__all__ = ["MLP", "KHAMLPValue", "MLPValueKind"]


class KHAMLPValue(IdentityInitModule):
    """KHA-MLP on values: ``2 * ((v W_up) * sigmoid(v W_gate)) W_down``, one fused op.

    W_up = W_down = I and W_gate = 0 at init, so ``2 * sigmoid(0) = 1`` and the output is v exactly.

    Example::

        t = KHAMLPValue(64)
        y = t(v)            # v: (..., 64); one torch.ops.kha.mlp_value in graphs and on CUDA
    """

    kind = "mlp"

    def __init__(self, head_dim: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.up = nn.Parameter(torch.empty(head_dim, head_dim, dtype=dtype, device=device))
        self.gate = nn.Parameter(torch.empty(head_dim, head_dim, dtype=dtype, device=device))
        self.down = nn.Parameter(torch.empty(head_dim, head_dim, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.up.is_meta:
            return
        with torch.no_grad():
            eye = torch.eye(self.head_dim, dtype=self.up.dtype, device=self.up.device)
            fill_whole(self.up, eye)
            self.gate.zero_()
            fill_whole(self.down, eye)

    def forward(self, v: Tensor) -> Tensor:  # (..., Dh) -> (..., Dh)
        return MLP.functional(v, self.up, self.gate, self.down)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"


class MLPValueKind(TransformKind):
    """Spec of KHA-MLP: values only, not linear (no fold), ships as ``kha::MLPValue`` in ONNX."""

    name = "mlp"
    roles = ("v",)
    module_cls = KHAMLPValue
    param_names = ("up", "gate", "down")
    foldable = False
    fold_substitute = "linear"  # MLA: MLP-value would break weight absorption (the paper uses linear there)
    priority = 20

    def functional(self, x: Tensor, *params: Tensor) -> Tensor:
        up, gate, down = params
        return mlp_value_auto(x, up, gate, down)

    def onnx_translations(self) -> dict[Any, Callable[..., Any]]:
        return {torch.ops.kha.mlp_value.default: translate_mlp_value}


MLP = register_transform(MLPValueKind())
