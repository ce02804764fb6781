"""Fold linear KHA transforms exactly into the projections that produced the head vectors.

One primitive, :func:`fold_rows`: for head h occupying output features R_h of a projection with
weight W (output axis ``axis``) and bias b,

    W[R_h] <- T^T W[R_h]        b[R_h] <- b[R_h] T        (KHA_SPEC.md, "Folding")

computed in float32 and cast back. Every new tensor is computed and checked (finite) before any
is written, so a refused fold changes nothing. Afterwards the module gets its original class
back: classes and ``state_dict`` keys are exactly the original model's.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor, nn

from ..errors import FoldError
from ..modules import HeadSlot, KHAMultiheadAttention, detach, detach_mha, is_kha_projection
from ..parallel.fsdp import refuse_sharded

__all__ = ["fold", "fold_rows", "weight_out_axis"]

log = logging.getLogger(__name__)


def fold_rows(weight: Tensor, bias: Optional[Tensor], slot: HeadSlot, t: Tensor, axis: int
              ) -> tuple[Tensor, Optional[Tensor]]:
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


def weight_out_axis(module: nn.Module) -> Optional[int]:
    """Which axis of ``module.weight`` indexes output features: 0 (nn.Linear), 1 (Conv1D), None."""
    if isinstance(module, nn.Linear):
        return 0
    w = getattr(module, "weight", None)
    cls = getattr(type(module), "_kha_base_class", type(module))
    if cls.__name__ == "Conv1D" and isinstance(w, Tensor) and w.dim() == 2 \
            and getattr(module, "nf", None) == w.shape[1]:
        return 1
    return None


def _mha_updates(m: KHAMultiheadAttention) -> list[tuple[str, Tensor]]:
    """New in-projection tensors of an nn.MultiheadAttention with its linear roles folded."""
    E, H, Dh = m.embed_dim, m.num_heads, m.head_dim
    roles = [(i, r) for i, r in enumerate("qkv") if r in m.kha and m.kha[r].kind == "linear"]
    if not roles:
        return []
    bias = m.in_proj_bias
    out = []
    if m._qkv_same_embed_dim:  # packed [Wq; Wk; Wv] rows
        w = m.in_proj_weight
        for i, r in roles:
            w, bias = fold_rows(w, bias, HeadSlot(r, i * E, H, Dh, Dh), m.kha[r].weight, 0)
        out.append(("in_proj_weight", w))
    else:
        for i, r in roles:
            w, _ = fold_rows(getattr(m, f"{r}_proj_weight"), None, HeadSlot(r, 0, H, Dh, Dh), m.kha[r].weight, 0)
            out.append((f"{r}_proj_weight", w))
            if bias is not None:  # the bias stays packed: fold into its [i*E, (i+1)*E) slice
                rows = torch.empty(bias.shape[0], 1, dtype=bias.dtype, device=bias.device)
                _, bias = fold_rows(rows, bias, HeadSlot(r, i * E, H, Dh, Dh), m.kha[r].weight, 0)
    if bias is not None:
        out.append(("in_proj_bias", bias))
    return out


def fold(model: nn.Module, strict: bool = True) -> nn.Module:
    """Fold every linear KHA transform into its projection; returns ``model`` (changed in place).

    ``strict=True`` refuses (``FoldError``, model untouched) when an MLP-value transform exists,
    since it is not linear; ``strict=False`` folds the linear ones and keeps the MLP-value ones.

    Example::

        kc.fold(model)                    # vanilla architecture, original state_dict keys
        kc.fold(model, strict=False)      # keeps v="mlp", folds q/k linear
    """
    modules = [(n, m) for n, m in model.named_modules() if is_kha_projection(m) or isinstance(m, KHAMultiheadAttention)]
    if modules:
        refuse_sharded(model, "fold")  # FSDP2/TP: gather first; nothing is changed
    if not modules:
        log.info("fold: %s carries no KHA transforms; nothing to do", type(model).__name__)
        return model
    mlp = [f"{n}.kha.{r}" for n, m in modules for r, t in m.kha.items() if t.kind != "linear"]
    if mlp and strict:
        shown = ", ".join(mlp[:4]) + (f" and {len(mlp) - 4} more" if len(mlp) > 4 else "")
        raise FoldError(f"cannot fold: MLP-value KHA is not linear and stays an op ({shown}). Nothing was changed. "
                        "Use kc.fold(model, strict=False) to fold only the linear transforms, and "
                        "kc.export_onnx(...) to ship the MLP-value op as a fused node.")
    # 1. compute every new tensor; nothing is written yet
    updates: list[tuple[nn.Module, str, Tensor]] = []
    for name, m in modules:
        if isinstance(m, KHAMultiheadAttention):
            updates.extend((m, pname, value) for pname, value in _mha_updates(m))
            continue
        axis = weight_out_axis(m)
        linear_slots = [s for s in m._kha_slots if s.role in m.kha and m.kha[s.role].kind == "linear"]
        if linear_slots and axis is None:
            raise FoldError(f"cannot fold into {name} ({type(m)._kha_base_class.__name__}): only nn.Linear and "
                            "transformers' Conv1D weights are folded. Nothing was changed.")
        w, b = m.weight, getattr(m, "bias", None)
        for s in linear_slots:
            w, b = fold_rows(w, b, s, m.kha[s.role].weight, axis)
        if linear_slots:
            updates.append((m, "weight", w))
            if b is not None:
                updates.append((m, "bias", b))
    bad = [f"{type(m).__name__}.{pname}" for m, pname, v in updates if not v.is_meta and not torch.isfinite(v).all()]
    if bad:
        raise FoldError(f"fold produced non-finite values in {bad[:3]}; the KHA weights hold inf/NaN. "
                        "Nothing was changed.")
    # 2. commit
    with torch.no_grad():
        for m, pname, value in updates:
            getattr(m, pname).copy_(value)
    folded = 0
    for name, m in modules:
        linear_roles = [r for r, t in m.kha.items() if t.kind == "linear"]
        folded += len(linear_roles)
        for r in linear_roles:
            del m.kha[r]
        if len(m.kha) == 0:
            detach_mha(m) if isinstance(m, KHAMultiheadAttention) else detach(m)
    log.info("fold: folded %d linear KHA transforms; %d MLP-value transforms kept", folded, len(mlp))
    return model
