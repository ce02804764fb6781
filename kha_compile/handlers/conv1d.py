"""Module-call projections whose weight is stored (in, out), ``y = x W + b`` (GPT-2's ``Conv1D``).

Told apart by the weight's orientation (its shape against the output features the graph reads,
or a probe of the module's forward when the weight is square), never by class name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..model.rows import weight_out_axis
from . import register_handler
from .base import ModuleProjectionHandler, owner_of

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = ["Conv1DHandler"]


class Conv1DHandler(ModuleProjectionHandler):
    """Owns module-call projections with a transposed (in, out) weight."""

    name = "conv1d"
    priority = 40

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        owner = owner_of(model, m)
        if (
            owner is None
            or not m.projection.is_module_call
            or not m.projection.features_last
            or isinstance(owner, nn.Linear)
        ):
            return False, ""
        out_features = int(m.projection.feature_map.numel())
        return (weight_out_axis(owner, out_features) == 1), ""

    def owns(self, module: nn.Module) -> bool:
        return super().owns(module) and weight_out_axis(module, getattr(module, "_kha_out_features", None)) == 1


register_handler(Conv1DHandler())
