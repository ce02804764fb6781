"""Module-call projections whose weight is (out, in): ``nn.Linear`` and any module computing ``x W^T + b``.

The fallback handler: it owns every projection that is a module's own forward call (after the
more specific handlers declined). Fold needs the weight orientation (see ``weight_out_axis``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from . import register_handler
from .base import ModuleProjectionHandler, owner_of

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = ["LinearHandler"]


class LinearHandler(ModuleProjectionHandler):
    """Owns module-call projections (``nn.Linear`` and linear-like modules)."""

    name = "linear"
    priority = 100  # the fallback: after every specific handler

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        owner = owner_of(model, m)
        if owner is None:
            return False, f"{m.role}: projection owner {m.projection.module_path!r} is not a submodule"
        if m.projection.is_module_call and not m.projection.features_last:
            return False, (
                f"{m.role}: the features of {m.projection.module_path} are not on the last axis of its output "
                f"({type(owner).__name__}); no insertion handler takes that projection"
            )
        if m.projection.is_module_call:
            return True, ""
        return False, (
            f"{m.role}: weight {m.projection.param} is used functionally inside "
            f"{type(owner).__name__} ({m.projection.module_path}); no insertion handler for it"
        )


register_handler(LinearHandler())
