"""Rule ``flex_attention``: the ``torch.ops.higher_order.flex_attention`` op.

``flex_attention(q, k, v, score_mod, block_mask, scale, ...)`` reads q (B, Hq, L, E), k (B, Hkv, S, E)
and v (B, Hkv, S, Ev): the head vector is the last axis of each, and GQA (``enable_gqa``, Hkv < Hq)
shows in the head maps read from the projections. A score_mod or block_mask works on the scores
of each head, after the head vectors are formed, so it does not change where KHA goes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch.fx import Node

from ..layout import shape_of
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["FLEX_OPS", "FlexAttentionRule"]


def _flex_ops() -> set[Any]:
    ops = set()
    hop = getattr(torch.ops.higher_order, "flex_attention", None)
    if hop is not None:
        ops.add(hop)
    return ops


FLEX_OPS = _flex_ops()


class FlexAttentionRule:
    """Anchor on the flex_attention higher-order op; q, k, v are its first three arguments.

    Example::

        rule = FlexAttentionRule()
        anchor = rule.match(g, node)   # None unless node is a flex_attention call
    """

    name = "flex_attention"
    priority = 40

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target not in FLEX_OPS:
            return None
        if len(node.args) < 3 or not all(isinstance(a, Node) for a in node.args[:3]):
            return Anchor(node, self.name, {}, {}, "flex_attention call without q, k, v graph inputs")
        q, k, v = (cast(Node, a) for a in node.args[:3])
        qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
        if qs is None or ks is None or vs is None:
            return Anchor(node, self.name, {}, {}, "flex_attention inputs have symbolic shapes")
        if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
            return Anchor(node, self.name, {}, {}, f"flex_attention inputs are not 4-D (q {qs}, k {ks}, v {vs})")
        if qs[-1] != ks[-1]:
            return Anchor(node, self.name, {}, {}, f"q and k head dims differ ({qs[-1]} vs {ks[-1]})")
        return Anchor(node, self.name, {"q": q, "k": k, "v": v}, {"q": qs[-1], "k": ks[-1], "v": vs[-1]})


register_rule(FlexAttentionRule())
