"""``nn.MultiheadAttention``: projections are parameters used functionally (``in_proj_weight``).

The whole attention module gets the ``KHAMultiheadAttention`` class (same object and keys); head
slots are in the weight's row space (``param_space``), and the module folds its own in-projection
rows (:meth:`~kha_compile.model.mha.KHAMultiheadAttention.kha_fold`). An ``nn.TransformerEncoderLayer``
holding it becomes its host (its fast path reads the in-projection directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor, nn

from ..model.mha import KHAMultiheadAttention, attach_mha, detach_mha, release_hosts
from . import register_handler
from .base import PlanEntry, ProjectionHandler, owner_of

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = ["MHAHandler"]


class MHAHandler(ProjectionHandler):
    """Owns the in-projections of ``nn.MultiheadAttention``."""

    name = "mha"
    priority = 30
    param_space = True

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        owner = owner_of(model, m)
        if not isinstance(owner, nn.MultiheadAttention):
            return False, ""
        if owner.bias_k is not None or owner.add_zero_attn:
            return False, "nn.MultiheadAttention with add_bias_kv/add_zero_attn is not supported"
        return True, ""

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, KHAMultiheadAttention)

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        attach_mha(module, entry.kinds, handler=self.name, strategy=entry.strategy, host=entry.parent)  # type: ignore[arg-type]

    def detach(self, module: nn.Module) -> None:
        detach_mha(module)

    def cleanup(self, model: nn.Module) -> None:
        release_hosts(model)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        """New in-projection tensors with the linear transforms of ``roles`` folded in."""
        assert isinstance(module, KHAMultiheadAttention)  # owns() / attach() made it one
        return module.kha_fold(roles)


register_handler(MHAHandler())
