"""The fold primitive: fold a linear head transform into the rows (or columns) of a weight and bias.

For head h occupying output features R_h of a projection with weight W (output axis ``axis``)
and bias b, ``x -> x @ T`` after the projection equals the projection with

    W[R_h] <- T^T W[R_h]        b[R_h] <- b[R_h] T        (docs/method.md, "Folding")

computed in float32 (float64 when the weight or T is float64) and cast back. Nothing is written: callers commit the returned tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .slots import HeadSlot

__all__ = ["base_class", "fold_rows", "projection_output", "weight_out_axis"]


def fold_rows(
    weight: Tensor, bias: Tensor | None, slot: HeadSlot, t: Tensor, axis: int, *, detach: bool = True
) -> tuple[Tensor, Tensor | None]:
    """New (weight, bias) with ``x -> x @ t`` folded into the head slices of ``slot``.

    ``detach=False`` keeps the autograd graph (weight-side execution: gradients reach W, b and t).

    Example::

        w2, b2 = fold_rows(lin.weight, lin.bias, HeadSlot("v", 0, 4, 16, 16), T, axis=0)
    """
    keep = (lambda x: x.detach()) if detach else (lambda x: x)
    wide = torch.promote_types(torch.promote_types(t.dtype, weight.dtype), torch.float32)
    t32 = _at_least_float32(keep(t), wide)
    w = _at_least_float32(keep(weight), wide)
    H, Dh = slot.num_heads, slot.head_dim
    whole = slot.rows is None and slot.offset == 0 and slot.head_stride == Dh and H * Dh == w.shape[axis]
    if whole:  # every row/column is a head's, in order
        if axis == 0:  # (H*Dh, in) -> (H, Dh, in); row k of a head <- sum_j T[j, k] W[j]
            w = torch.bmm(t32.t().expand(H, Dh, Dh), w.reshape(H, Dh, -1)).reshape(w.shape)
        else:  # (in, H*Dh) -> (in, H, Dh) @ T
            w = (w.reshape(w.shape[0], H, Dh) @ t32).reshape(w.shape)
        idx = None
    else:
        idx = slot.index().flatten().to(weight.device)  # (H*Dh,)
        if axis == 0:
            w_new = torch.bmm(t32.t().expand(H, Dh, Dh), w.index_select(0, idx).reshape(H, Dh, -1))
            w_new = w_new.reshape(H * Dh, w.shape[1])
            w = w.index_copy(0, idx, w_new)
        else:
            w_new = (w.index_select(1, idx).reshape(w.shape[0], H, Dh) @ t32).reshape(w.shape[0], H * Dh)
            w = w.index_copy(1, idx, w_new)
    b = None
    if bias is not None:
        b32 = _at_least_float32(keep(bias), wide)
        b_role = b32 if idx is None else b32.index_select(0, idx)  # (H*Dh,)
        b_new = (b_role.reshape(H, Dh) @ t32).reshape(-1)  # b[R_h] <- b[R_h] T
        b = b_new if idx is None else b32.index_copy(0, idx, b_new)
        b = b if b.dtype == bias.dtype else b.to(bias.dtype)
    return (w if w.dtype == weight.dtype else w.to(weight.dtype)), b


def _at_least_float32(x: Tensor, wide: torch.dtype) -> Tensor:
    """``x`` in ``wide``: float32, or float64 where the fold's inputs are (a float64 model folds in float64)."""
    return x if x.dtype == wide else x.to(wide)


def projection_output(y: object, out_features: int | None) -> int | None:
    """Index of the projection output in a module's tuple output (``(y, scale)`` of a quantized linear).

    The first tensor element with ``out_features`` features on its last axis (any tensor when
    ``out_features`` is None); None when there is none.

    Example::

        projection_output((torch.randn(2, 8), None), 8)     # 0
    """
    if not isinstance(y, (tuple, list)):
        return None
    for i, item in enumerate(y):
        if isinstance(item, Tensor) and item.dim() > 0 and out_features in (None, item.shape[-1]):
            return i
    return None


def base_class(module: nn.Module) -> type[nn.Module]:
    """The module's class before KHA (its own class when it carries none)."""
    cls: type[nn.Module] = getattr(type(module), "_kha_base_class", type(module))
    return cls


def weight_out_axis(module: nn.Module, out_features: int | None = None) -> int | None:
    """Which axis of ``module.weight`` indexes output features: 0 (``y = x W^T``), 1 (``y = x W``), None.

    Told by the weight's shape when ``out_features`` settles it, else by behaviour: one small
    probe through the module's own forward (e.g. GPT-2's Conv1D stores (in, out)).

    Example::

        weight_out_axis(nn.Linear(4, 8))     # 0
    """
    if isinstance(module, nn.Linear):
        return 0
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        return None
    if out_features is not None and w.shape[0] != w.shape[1] and out_features in tuple(w.shape):
        return 0 if w.shape[0] == out_features else 1
    if w.is_meta:
        return None
    b = getattr(module, "bias", None)
    b = b.detach().float() if isinstance(b, Tensor) else 0.0
    w32 = w.detach().float()
    gen = torch.Generator().manual_seed(0)
    forward = base_class(module).forward
    tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 2e-2
    for axis, n_in, ref_w in ((1, w.shape[0], w32), (0, w.shape[1], w32.t())):
        x = torch.randn(2, n_in, generator=gen)
        try:
            with torch.no_grad():
                y = forward(module, x.to(w.dtype).to(w.device))
        except Exception:  # the forward does not take this input shape: not this orientation
            continue
        if not isinstance(y, Tensor):  # a module returning (y, scale): its projection element
            i = projection_output(y, None)
            y = y[i] if i is not None else y
        ref = x.to(w.device) @ ref_w + b
        if (
            isinstance(y, Tensor)
            and y.shape == ref.shape
            and torch.allclose(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max().clamp_min(1)))
        ):
            return axis
    return None
