"""Fold linear KHA transforms exactly into the projections that produced the head vectors.

One primitive, :func:`~kha_compile.model.rows.fold_rows` (re-exported here): for head h occupying
output features R_h of a projection with weight W and bias b,

    W[R_h] <- T^T W[R_h]        b[R_h] <- b[R_h] T        (docs/method.md, "Folding")

where T is the transform kind's ``fold_matrix``. Each module's projection handler computes its new
tensors; every one is computed and checked (finite) before any is written, so a refused fold
changes nothing. Afterwards the handler detaches the module: classes and ``state_dict`` keys are
exactly the original model's. A quantized weight (bitsandbytes, torchao) is folded in float and
requantized in its own format (:mod:`kha_compile.model.quantized`), or refused with a ``FoldError``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from ..core.errors import FoldError
from ..core.quantized import is_quantized_weight
from ..handlers import adapter, handler_of, projection_handlers
from ..model.adapter import unwrap_model
from ..model.carrier import kha_modules, transforms_of
from ..model.quantized import dequantized, requantized, set_quantized_weight
from ..model.rows import fold_rows, weight_out_axis
from ..model.sharded import refuse_sharded
from ..model.transforms import kind_of
from ..model.wrappers import sees_through_wrappers
from ..store.hf import record_config

__all__ = ["fold", "fold_rows", "weight_out_axis"]

log = logging.getLogger(__name__)


def _stored(module: nn.Module, name: str) -> Tensor:
    """The stored tensor behind ``name`` (dotted, relative to ``module``), not a parametrized view of it."""
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    stored: Tensor | None = owner._parameters.get(attr)
    if stored is None:
        stored = owner._buffers.get(attr)
    if stored is None:
        raise FoldError(
            f"cannot fold into {type(owner).__name__}.{attr}: not a parameter or buffer. Nothing was changed."
        )
    return stored


def _foldable_roles(module: nn.Module) -> list[str]:
    """The roles of ``module`` that fold: of a linear kind, and not held where they cannot (k = v)."""
    fixed = set(handler_of(module).fixed_roles(module))
    return [r for r, t in transforms_of(module).items() if kind_of(t).foldable and r not in fixed]


def _requantized(
    modules: list[tuple[str, nn.Module]], updates: list[tuple[nn.Module, str, Tensor]]
) -> dict[int, nn.Parameter]:
    """Update index -> the folded float weight requantized in the format of the quantized weight it replaces."""
    names = {id(m): n for n, m in modules}
    out: dict[int, nn.Parameter] = {}
    for i, (m, pname, value) in enumerate(updates):
        if pname == "weight" and is_quantized_weight(m._parameters.get("weight")):
            try:
                out[i] = requantized(m, value)
            except FoldError as exc:
                raise FoldError(f"{names.get(id(m), type(m).__name__)}: {exc}") from exc
    return out


def _set_requantized(
    modules: list[tuple[str, nn.Module]], updates: list[tuple[nn.Module, str, Tensor]], requant: dict[int, nn.Parameter]
) -> None:
    """Store the requantized weights; log what requantizing changed against the float fold (the format's rounding)."""
    names = {id(m): n for n, m in modules}
    for i, weight in requant.items():
        m, _, value = updates[i]
        set_quantized_weight(m, weight)
        with torch.no_grad():
            change = float((dequantized(m).float() - value.float()).abs().max())
            scale = float(value.float().abs().max()) or 1.0
        log.info(
            "fold: %s requantized as %s: largest change against the float fold %.3g (%.2g of its largest entry)",
            names.get(id(m), type(m).__name__),
            type(weight).__name__,
            change,
            change / scale,
        )


@sees_through_wrappers
def fold(model: nn.Module, strict: bool = True) -> nn.Module:
    """Fold every linear KHA transform into its projection; returns ``model`` (changed in place).

    ``strict=True`` refuses (``FoldError``, model untouched) when an MLP-value transform exists,
    since it is not linear; ``strict=False`` folds the linear ones and keeps the MLP-value ones.

    Example::

        kc.fold(model)                    # vanilla architecture, original state_dict keys
        kc.fold(model, strict=False)      # keeps v="mlp", folds q/k linear
    """
    adapter.sync(model)  # KHA that PEFT wrapped as base_layer moves out to the adapter wrapper first
    modules = kha_modules(model)
    if modules:
        refuse_sharded(model, "fold")  # FSDP2/TP: gather first; nothing is changed
    if not modules:
        log.info("fold: %s carries no KHA transforms; nothing to do", type(model).__name__)
        return model
    foldable = {id(m): _foldable_roles(m) for _, m in modules}
    mlp = [f"{n}.kha.{r}" for n, m in modules for r, t in transforms_of(m).items() if not kind_of(t).foldable]
    fixed = [
        f"{n}.kha.{r}"
        for n, m in modules
        for r in handler_of(m).fixed_roles(m)
        if kind_of(transforms_of(m)[r]).foldable
    ]
    if (mlp or fixed) and strict:
        shown = ", ".join((mlp + fixed)[:4]) + (f" and {len(mlp + fixed) - 4} more" if len(mlp + fixed) > 4 else "")
        why = "MLP-value KHA is not linear and stays an op" if mlp else "these transforms do not fold where they sit"
        raise FoldError(
            f"cannot fold: {why} ({shown}). Nothing was changed. "
            "Use kc.fold(model, strict=False) to fold only the linear transforms that fold, and "
            "kc.export_onnx(...) to ship the rest as ops."
            + (
                " (Roles that read the same features of one projection (k = v, q = k, one projection called for "
                "two roles) carry their transforms on the attention arguments: they cannot both fold into one weight.)"
                if fixed
                else ""
            )
        )
    # 1. compute every new tensor; nothing is written yet
    updates: list[tuple[nn.Module, str, Tensor]] = []
    for name, m in modules:
        roles = foldable[id(m)]
        try:
            updates.extend((m, pname, value) for pname, value in handler_of(m).fold(m, roles))
        except FoldError as exc:
            raise FoldError(f"{name}: {exc}") from exc
    bad = [f"{type(m).__name__}.{pname}" for m, pname, v in updates if not v.is_meta and not torch.isfinite(v).all()]
    if bad:
        raise FoldError(
            f"fold produced non-finite values in {bad[:3]}; the KHA weights hold inf/NaN. Nothing was changed."
        )
    requant = _requantized(modules, updates)  # a quantized weight: folded in float, stored in its own format
    # 2. commit: into the stored parameter (a KHA-parametrized attribute reads as the folded value)
    targets = [(_stored(m, pname), value) for i, (m, pname, value) in enumerate(updates) if i not in requant]
    with torch.no_grad():
        for stored, value in targets:
            stored.copy_(value)
    _set_requantized(modules, updates, requant)
    folded = 0
    for _, m in modules:
        linear_roles = foldable[id(m)]
        folded += len(linear_roles)
        handler_of(m).drop(m, linear_roles)
    for handler in projection_handlers():
        handler.cleanup(model)
    adapter.unwatch(model)
    record_config(unwrap_model(model))
    log.info("fold: folded %d linear KHA transforms; %d MLP-value transforms kept", folded, len(mlp))
    return model
