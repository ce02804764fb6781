"""Apply an insertion plan at module level: each entry's handler attaches its transforms."""

from __future__ import annotations

from torch import nn

from . import PlanEntry, get_handler

__all__ = ["insert"]


def insert(model: nn.Module, plan: list[PlanEntry]) -> int:
    """Apply the plan in place; returns the number of transforms inserted.

    Example::

        sites, plan = build_sites(model, raw, cap, cfg)
        insert(model, plan)
    """
    count = 0
    for entry in plan:
        module = model.get_submodule(entry.module_path)
        parent_path = entry.module_path.rpartition(".")[0]
        entry.parent = model.get_submodule(parent_path) if entry.module_path else None
        get_handler(entry.handler).attach(module, entry)
        count += len(entry.kinds)
    return count
