"""The fold primitive: fold a linear head transform into the rows (or columns) of a weight and bias.

For head h occupying output features R_h of a projection with weight W (output axis ``axis``)
and bias b, ``x -> x @ T`` after the projection equals the projection with

    W[R_h] <- T^T W[R_h]        b[R_h] <- b[R_h] T        (KHA_SPEC.md, "Folding")

computed in float32 and cast back. Nothing is written: callers commit the returned tensors.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..modules import HeadSlot

__all__ = ["fold_rows"]


def fold_rows(weight: Tensor, bias: Tensor | None, slot: HeadSlot, t: Tensor, axis: int
              ) -> tuple[Tensor, Tensor | None]:
    """New (weight, bias) with ``x -> x @ t`` folded into the head slices of ``slot``.

    Example::

        w2, b2 = fold_rows(lin.weight, lin.bias, HeadSlot("v", 0, 4, 16, 16), T, axis=0)
    """
    idx = slot.index().flatten().to(weight.device)  # (H*Dh,)
    t32 = t.detach().to(torch.float32)
    w = weight.detach().to(torch.float32)
    w_role = w.index_select(axis, idx)
    if axis == 0:  # (H*Dh, in) -> (H, Dh, in); row k of a head <- sum_j T[j, k] W[j]
        w_new = torch.einsum("jk,hji->hki", t32, w_role.reshape(slot.num_heads, slot.head_dim, -1))
        w = w.index_copy(0, idx, w_new.reshape(-1, w.shape[1]))
    else:  # (in, H*Dh) -> (in, H, Dh) @ T
        w_new = w_role.reshape(w.shape[0], slot.num_heads, slot.head_dim) @ t32
        w = w.index_copy(1, idx, w_new.reshape(w.shape[0], -1))
    b = None
    if bias is not None:
        b32 = bias.detach().to(torch.float32)
        b_new = b32.index_select(0, idx).reshape(slot.num_heads, slot.head_dim) @ t32
        b = b32.index_copy(0, idx, b_new.reshape(-1)).to(bias.dtype)
    return w.to(weight.dtype), b
