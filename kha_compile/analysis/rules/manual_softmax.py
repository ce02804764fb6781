"""Rule ``manual_softmax``: ``softmax(q @ k^T ...) @ v`` written out (matmul, bmm or baddbmm scores).

Masks, ALiBi biases, scaling and logit soft-capping may sit between the scores and the softmax;
dropout, casts and head masks between the softmax and the value matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from ..graph import SDPA_OPS, SOFTMAX_OPS
from ..layout import shape_of
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:
    from ..graph import MatchGraph

__all__ = ["SCORE_OPS", "SOFTMAX_OPS", "ManualSoftmaxRule"]

aten = torch.ops.aten

SCORE_OPS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default}


class ManualSoftmaxRule:
    """Anchors on the value matmul after a softmax whose input comes from a q @ k^T score op."""

    name = "manual_softmax"
    priority = 20

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target not in SOFTMAX_OPS:
            return None
        score = _score_op(g, node)
        if score is None:
            return None
        if score.target is aten.baddbmm.default:
            q, kt = score.args[1], score.args[2]
        else:
            q, kt = score.args[0], score.args[1]
        value_op = _value_op(g, node)
        if value_op is None:
            return Anchor(node, self.name, {}, {}, f"softmax {node.name} has scores but no value matmul after it")
        v = value_op.args[1]
        kt_shape = shape_of(kt) or (0, 0)
        dims = {"q": (shape_of(q) or (0,))[-1], "k": kt_shape[-2], "v": (shape_of(v) or (0,))[-1]}
        roles = {"q": q, "k": kt, "v": v}
        return Anchor(value_op, self.name, roles, dims, head_axes={"k": -2})  # type: ignore[arg-type]


def _score_op(g: MatchGraph, softmax: Node) -> Node | None:
    """The q @ k^T op behind the softmax (through masks, biases, scaling, soft-capping, casts)."""
    frontier = [softmax.args[0]]
    for _ in range(10):
        nxt: list[Node] = []
        for n in frontier:
            if not isinstance(n, Node) or n.op != "call_function":
                continue
            if n.target in SCORE_OPS and not any(isinstance(a, Node) and a.name in g.params for a in n.args):
                return n
            if n.target in SOFTMAX_OPS or n.target in SDPA_OPS:
                continue
            nxt.extend(i for i in n.all_input_nodes if i.op == "call_function")
        if not nxt:
            return None
        frontier = nxt  # type: ignore[assignment]
    return None


def _value_op(g: MatchGraph, softmax: Node) -> Node | None:
    """The probs @ v op after the softmax (through dropout, casts, head masks, and products with a
    parameter that mix the heads: talking heads)."""
    frontier = [softmax]
    for _ in range(6):
        nxt = []
        for n in frontier:
            for user in n.users:
                if (
                    user.target in SCORE_OPS
                    and user.args
                    and user.args[0] is n
                    and not (len(user.args) > 1 and g.is_weight(user.args[1]))
                ):
                    return user
                if user.op == "call_function" and user.target not in SOFTMAX_OPS:
                    nxt.append(user)
        if not nxt:
            return None
        frontier = nxt
    return None


register_rule(ManualSoftmaxRule())
