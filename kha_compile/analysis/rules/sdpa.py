"""Rule ``sdpa``: ``aten.scaled_dot_product_attention`` and its fused variants (flash, efficient, cuDNN)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from ..graph import SDPA_OPS
from ..layout import token_shape
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:
    from ..graph import MatchGraph

__all__ = ["SDPA_OPS", "SDPARule"]

aten = torch.ops.aten


class SDPARule:
    """q, k, v are the op's first three arguments, each (..., L, Dh)."""

    name = "sdpa"
    priority = 10

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target not in SDPA_OPS:
            return None
        q, k, v = node.args[:3]
        roles = {"q": q, "k": k, "v": v}
        dims = {r: (token_shape(n) or (0,))[-1] for r, n in roles.items()}
        return Anchor(node, self.name, roles, dims)  # type: ignore[arg-type]


register_rule(SDPARule())
