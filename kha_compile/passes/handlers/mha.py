"""``nn.MultiheadAttention``: projections are parameters used functionally (``in_proj_weight``).

The whole attention module gets the ``KHAMultiheadAttention`` class (same object and keys); head
slots are in the weight's row space (``param_space``), and fold rewrites the in-projection rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ...kinds import ROLES
from ...modules import HeadSlot, KHAMultiheadAttention, attach_mha, detach_mha, set_strategy, transforms_of
from ...transforms import kind_of
from ..rows import fold_rows
from .base import HANDLER_ATTR, PlanEntry, ProjectionHandler, owner_of

if TYPE_CHECKING:
    from ..match import RoleMatch

__all__ = ["MHAHandler"]


class MHAHandler(ProjectionHandler):
    """Owns the in-projections of ``nn.MultiheadAttention``."""

    name = "mha"
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
        attach_mha(module, entry.kinds)  # type: ignore[arg-type]  # accepts() checked the class
        setattr(module, HANDLER_ATTR, self.name)
        set_strategy(module, entry.strategy)

    def detach(self, module: nn.Module) -> None:
        module.__dict__.pop(HANDLER_ATTR, None)
        detach_mha(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        """New in-projection tensors with the linear transforms of ``roles`` folded in."""
        return self._folded(module, roles, detach=True)

    def weight_side(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]] | None:
        """The in-projection tensors to run torch's own forward with (differentiable fold)."""
        return self._folded(module, roles, detach=False)

    @staticmethod
    def _folded(module: nn.Module, roles: Sequence[str], *, detach: bool) -> list[tuple[str, Tensor]]:
        m = module
        assert isinstance(m, KHAMultiheadAttention)  # owns() / attach() made it one
        kha = transforms_of(m)
        E, H, Dh = m.embed_dim, m.num_heads, m.head_dim
        todo = [(i, r, kind_of(kha[r]).fold_matrix(kha[r])) for i, r in enumerate(ROLES) if r in roles]
        if not todo:
            return []
        p = m._parameters  # the parameters themselves (attribute reads may give the folded view)
        bias: Tensor | None = p.get("in_proj_bias")
        out: list[tuple[str, Tensor]] = []
        if m._qkv_same_embed_dim:  # packed [Wq; Wk; Wv] rows
            packed = p["in_proj_weight"]
            assert packed is not None
            w: Tensor = packed
            for i, r, t in todo:
                w, bias = fold_rows(w, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)
            out.append(("in_proj_weight", w))
        else:
            for i, r, t in todo:
                wr = p[f"{r}_proj_weight"]
                assert wr is not None
                wf, _ = fold_rows(wr, None, HeadSlot(r, 0, H, Dh, Dh), t, 0, detach=detach)
                out.append((f"{r}_proj_weight", wf))
                if bias is not None:  # the bias stays packed: fold into its [i*E, (i+1)*E) slice
                    rows = torch.empty(bias.shape[0], 1, dtype=bias.dtype, device=bias.device)
                    _, bias = fold_rows(rows, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)
        if bias is not None:
            out.append(("in_proj_bias", bias))
        return out
