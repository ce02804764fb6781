"""KHA-Linear: ``x @ T`` over the head axis, T shared by every head of its role; folds exactly."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import IdentityInitModule, TransformKind, fill_whole, register_transform

__all__ = ["LINEAR", "KHALinearTransform", "LinearKind"]


class KHALinearTransform(IdentityInitModule):
    """KHA-Linear: ``x @ T`` over the head dimension, T shared by every head of its role.

    Identity at init, so the model's outputs do not change.

    Example::

        t = KHALinearTransform(64)
        y = t(x)            # x: (..., 64)
    """

    kind = "linear"

    def __init__(self, head_dim: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.weight = nn.Parameter(torch.empty(head_dim, head_dim, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            return
        with torch.no_grad():
            fill_whole(self.weight, torch.eye(self.head_dim, dtype=self.weight.dtype, device=self.weight.device))

    def forward(self, x: Tensor) -> Tensor:  # (..., Dh) -> (..., Dh)
        return LINEAR.functional(x, self.weight)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}"


class LinearKind(TransformKind):
    """Spec of KHA-Linear: any role, folds as its own weight T."""

    name = "linear"
    roles = ("q", "k", "v")
    module_cls = KHALinearTransform
    param_names = ("weight",)
    foldable = True
    priority = 10

    def functional(self, x: Tensor, *params: Tensor) -> Tensor:
        (t,) = params
        return x @ t  # (..., Dh) @ (Dh, Dh)

    def fold_matrix_of(self, *params: Tensor) -> Tensor:
        (t,) = params
        return t  # x @ T: T itself (the base class would compute I @ T, the same values)

    def matrices(self, module: nn.Module) -> dict[str, Tensor]:
        return {"T": self.fold_matrix(module).detach()}


LINEAR = register_transform(LinearKind())
