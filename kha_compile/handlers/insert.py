"""Apply an insertion plan at module level: each entry's handler attaches its transforms."""

from __future__ import annotations

import torch
from torch import nn

from ..core.quantized import is_quantized_weight
from ..model.carrier import KHATransforms, transforms_of
from . import PlanEntry, get_handler

__all__ = ["insert"]


def insert(model: nn.Module, plan: list[PlanEntry]) -> int:
    """Apply the plan in place; returns the number of transforms inserted.

    Example::

        sites, plan = build_sites(model, raw, cap, cfg)
        insert(model, plan)
    """
    count = 0
    dtype = _model_dtype(model)
    for entry in sorted(plan, key=lambda e: bool(e.borrow)):  # owners first: borrowers share their transforms
        module = model.get_submodule(entry.module_path)
        parent_path = entry.module_path.rpartition(".")[0]
        entry.parent = model.get_submodule(parent_path) if entry.module_path else None
        if entry.borrow:  # joint streams: the owner's transform object, held here without registering it
            entry.borrowed = KHATransforms(
                {r: transforms_of(model.get_submodule(owner))[r] for r, owner in entry.borrow.items()}
            )
        entry.model_dtype = dtype
        get_handler(entry.handler).attach(module, entry)
        count += len(entry.kinds) - len(entry.borrow)
    return count


def _model_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter that is not stored quantized (its embeddings, norms)."""
    for p in model.parameters():
        if p.is_floating_point() and not is_quantized_weight(p):
            return p.dtype
    return None
