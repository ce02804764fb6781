"""Rule ``manual_softmax``: ``softmax(q @ k^T ...) @ v`` written out (matmul, bmm or baddbmm scores).

The value product may also be written channels first, ``v @ softmax(...)^T`` with v as (..., Dh, S)
(LeViT's and EfficientViT's convolutional attention): v's head vector is then on its axis -2.

Attention over channels (cross-covariance attention: XCiT, EdgeNeXt, DaViT's channel blocks) has the
same ops with q, k and v as (..., Dh, N): the scores are (Dh, Dh) per head, summed over the tokens.
The anchor carries that reading as its ``alternative`` (head vectors on axis -2 of q and v, -1 of
k^T), tried when the usual one leaves a role without its projection. A normal attention cannot
match it: its axis -2 holds tokens, along which no feature index varies.

Masks, ALiBi biases, scaling and logit soft-capping may sit between the scores and the softmax;
dropout, casts and head masks between the softmax and the value matmul.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from ..graph import SDPA_OPS, SOFTMAX_OPS
from ..key_axis import score_axis
from ..layout import shape_of, token_shape
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:
    from ..graph import MatchGraph

__all__ = ["SCORE_OPS", "SOFTMAX_OPS", "ManualSoftmaxRule"]

aten = torch.ops.aten

SCORE_OPS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.baddbmm.out}  # out=: a scratch buffer


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
        if score.target in (aten.baddbmm.default, aten.baddbmm.out):
            q, kt = score.args[1], score.args[2]
        else:
            q, kt = score.args[0], score.args[1]
        value_op, channels_first = _value_op(g, node)
        if value_op is None:
            return Anchor(node, self.name, {}, {}, f"softmax {node.name} has scores but no value matmul after it")
        v = value_op.args[0] if channels_first else value_op.args[1]
        kt_shape = shape_of(kt) or (0, 0)
        v_dim = (token_shape(v) or (0, 0))[-2 if channels_first else -1]
        dims = {"q": (token_shape(q) or (0,))[-1], "k": kt_shape[-2], "v": v_dim}
        roles = {"q": q, "k": kt, "v": v}
        axes = {"k": -2, "v": -2} if channels_first else {"k": -2}
        if _over_queries(g, score, value_op, channels_first):  # the values sum over the scores' rows
            dims["q"], dims["k"] = kt_shape[-2], (token_shape(q) or (0,))[-1]
            roles["q"], roles["k"] = kt, q
            axes = {"q": -2, "v": -2} if channels_first else {"q": -2}
            return Anchor(value_op, self.name, roles, dims, head_axes=axes)  # type: ignore[arg-type]
        over_channels = None
        if not channels_first:  # XCA: q, k, v as (..., Dh, N), scores (..., Dh, Dh) summed over the tokens
            q_shape, v_shape = token_shape(q) or (0, 0), token_shape(v) or (0, 0)
            over_channels = Anchor(
                value_op,
                self.name,
                roles,  # type: ignore[arg-type]
                {"q": q_shape[-2], "k": kt_shape[-1], "v": v_shape[-2]},
                head_axes={"q": -2, "k": -1, "v": -2},
            )
        return Anchor(value_op, self.name, roles, dims, head_axes=axes, alternative=over_channels)  # type: ignore[arg-type]


def _over_queries(g: MatchGraph, score: Node, value_op: Node, channels_first: bool) -> bool:
    """The value product sums the probabilities over the scores' axis -2, the rows of ``q @ k^T``
    (:mod:`..key_axis`): the softmax normalised over the queries, or the probabilities were transposed
    (one score matrix read both ways): the operands of the scores are then k and q^T, in that order."""
    if value_op.target is aten.baddbmm.default:
        return False
    probs = value_op.args[1] if channels_first else value_op.args[0]
    return isinstance(probs, Node) and score_axis(g, score, probs, -2 if channels_first else -1) == -2


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


def _is_last_two_swap(n: Node) -> bool:
    """``t.transpose(-2, -1)`` (or a permute that swaps only the last two axes)."""
    shape = token_shape(n)
    if shape is None or len(shape) < 2 or n.op != "call_function":
        return False
    rank = len(shape)
    if n.target is aten.transpose.int:
        return {d % rank for d in n.args[1:3]} == {rank - 2, rank - 1}  # type: ignore[operator]
    if n.target is aten.permute.default:
        perm = [int(d) % rank for d in n.args[1]]  # type: ignore[union-attr,arg-type]
        return perm == [*range(rank - 2), rank - 1, rank - 2]
    return False


def _value_op(g: MatchGraph, softmax: Node) -> tuple[Node | None, bool]:
    """(the probs @ v op after the softmax, False): through dropout, casts, head masks, and products
    with a parameter that mix the heads (talking heads); or (``v @ probs^T``, True): values channels
    first. (None, False) when there is none."""
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
                    return user, False
                if (
                    user.target in (aten.matmul.default, aten.bmm.default)
                    and len(user.args) > 1
                    and user.args[1] is n
                    and _is_last_two_swap(n)
                    and not g.is_weight(user.args[0])
                ):
                    return user, True
                if user.op == "call_function" and user.target not in SOFTMAX_OPS:
                    nxt.append(user)
        if not nxt:
            return None, False
        frontier = nxt
    return None, False


register_rule(ManualSoftmaxRule())
