"""Rule ``segment_softmax``: message-passing (graph) attention, a softmax built from scatter ops.

Graph attention layers (PyG's ``TransformerConv``, written out) score every edge, normalise the
scores over the edges that reach one target node, and sum the values of those edges:

    score = (q[dst] * k[src]).sum(-1) / sqrt(d)            # (E, H): one score per edge and head
    e = (score - scatter_max(score, dst)[dst]).exp()
    alpha = e / (scatter_sum(e, dst)[dst] + eps)             # the segment softmax
    out = scatter_sum(v[src] * alpha[..., None], dst)       # (N, H, Dh)

with ``scatter_sum`` written as ``index_add``, ``scatter_add`` or ``scatter_reduce(..., "sum")``.
The rule anchors on the division by the gathered segment sum; q and k are the two per-head
factors of the score's dot product (q the one gathered with the segment index, in either operand
order: ``(k[src] * q[dst]).sum(-1)`` too, the index written once or at each use), v the factor the
probabilities multiply before the scatter. The walk back follows the gathers along the edge axis.
A segment softmax whose scores are not a dot product of two per-head activations (GAT's additive
scores, ``(x * a).sum(-1)`` with a learned vector ``a``) is declined with that reason, so a graph
with attention always reports a site.

Example::

    SegmentSoftmaxRule().match(g, div_node)      # Anchor(div, "segment_softmax", {"q": .., "k": .., "v": ..})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch.fx import Node

from ..layout import INDEX_OPS, LAYOUT_OPS, shape_of, token_shape
from ..writes import index_args
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["SegmentSoftmaxRule"]

aten = torch.ops.aten

# scatter-sums: op -> position of the summed values
_SCATTER_SUM = {
    aten.index_add.default: 3,
    aten.index_add_.default: 3,
    aten.scatter_add.default: 3,
    aten.scatter_add_.default: 3,
    aten.scatter_reduce.two: 3,
    aten.index_put.default: 2,
    aten.index_put_.default: 2,
}
_PASS = {aten.add.Tensor, aten.clamp.default, aten.clamp_min.default, *LAYOUT_OPS}  # eps, clamps, views


def _is_sum(node: Node) -> bool:
    if node.target is aten.scatter_reduce.two:
        return len(node.args) > 4 and node.args[4] == "sum"
    if node.target in (aten.index_put.default, aten.index_put_.default):
        return len(node.args) > 3 and node.args[3] is True  # accumulate=True
    return node.target in _SCATTER_SUM


def _back(node: Any, ops: Any, depth: int = 8) -> Any:
    """``node`` seen back through ``ops`` (first argument), e.g. views and an added epsilon."""
    for _ in range(depth):
        if not isinstance(node, Node) or node.op != "call_function" or node.target not in ops or not node.args:
            return node
        node = node.args[0]
    return node


def _segment_sum(den: Any) -> tuple[Node, Node] | None:
    """(the scatter-sum node, the segment index) when ``den`` is a scatter-sum gathered back per edge."""
    gathered = _back(den, _PASS)
    if not isinstance(gathered, Node) or gathered.target not in INDEX_OPS:
        return None
    total = _back(gathered.args[0], _PASS)
    if not isinstance(total, Node) or total.op != "call_function" or not _is_sum(total):
        return None
    idx = sorted(index_args(gathered), key=lambda n: n.name)
    return total, idx[0] if idx else total


def _same_index(a: Any, b: Any, depth: int = 6) -> bool:
    """``a`` and ``b`` are one index: one node, or the same ops with the same arguments on one source
    (``edge_index[1]`` written at the gather and again at the scatter)."""
    if a is b:
        return True
    if depth == 0 or not isinstance(a, Node) or not isinstance(b, Node) or a.op != "call_function":
        return False
    if a.target is not b.target or len(a.args) != len(b.args) or a.kwargs != b.kwargs:
        return False
    return all(_same_index(x, y, depth - 1) if isinstance(x, Node) else x == y for x, y in zip(a.args, b.args))


def _gathered_by(factor: Any, segment: Node) -> bool:
    """True when ``factor`` is a gather (through views) whose index is the segment (target) index."""
    return any(_same_index(i, segment) for i in index_args(_back(factor, LAYOUT_OPS)))


def _dot_product(g: MatchGraph, score: Any, depth: int = 10) -> tuple[Node, Node] | str:
    """The two per-head factors of a dot-product score (``(a * b).sum(-1)`` or an einsum), or why not."""
    frontier = [score]
    for _ in range(depth):
        nxt: list[Node] = []
        for n in frontier:
            if not isinstance(n, Node) or n.op != "call_function":
                continue
            if n.target is aten.sum.dim_IntList:
                prod = n.args[0]
                if isinstance(prod, Node) and prod.target is aten.mul.Tensor:
                    a, b = prod.args[:2]
                    if isinstance(a, Node) and isinstance(b, Node):
                        if g.is_param(a) or g.is_param(b):
                            return (
                                "its scores are a product with learned vectors (additive attention, as GAT), not a "
                                "dot product of a query and a key per head; there is no q or k to transform"
                            )
                        return a, b
            if n.target is aten.einsum.default and isinstance(n.args[1], (list, tuple)) and len(n.args[1]) == 2:
                a, b = n.args[1]
                if isinstance(a, Node) and isinstance(b, Node) and not (g.is_param(a) or g.is_param(b)):
                    return a, b
            if n.target in (aten.exp.default, aten.softmax.int):
                continue
            nxt.extend(i for i in g.inputs(n) if i.op == "call_function")
        frontier = nxt
    return "no dot product of two per-head activations found behind its scores"


def _value(g: MatchGraph, probs: Node, depth: int = 6) -> Node | None:
    """The per-edge values the probabilities multiply before a scatter-sum (``v[src] * alpha[..., None]``)."""
    frontier = [probs]
    for _ in range(depth):
        nxt: list[Node] = []
        for n in frontier:
            for u in g.users(n):
                if u.target is aten.mul.Tensor and len(u.args) >= 2:
                    other = u.args[1] if u.args[0] is n else u.args[0]
                    if isinstance(other, Node) and len(shape_of(other) or ()) > len(shape_of(probs) or ()):
                        return other
                if u.op == "call_function" and (u.target in LAYOUT_OPS or u.target is aten.dropout.default):
                    nxt.append(u)
        frontier = nxt
    return None


class SegmentSoftmaxRule:
    """Anchor on ``exp(s) / scatter_sum(exp(s))[index]`` and read q, k, v of the message passing."""

    name = "segment_softmax"
    priority = 35

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target is not aten.div.Tensor or len(node.args) < 2:
            return None
        num, den = node.args[:2]
        num_src = _back(num, _PASS)
        if not isinstance(num_src, Node) or num_src.target is not aten.exp.default:
            return None
        found = _segment_sum(den)
        if found is None:
            return None
        total, segment = found
        summed = _back(total.args[_SCATTER_SUM[cast(Any, total.target)]], _PASS)
        if summed is not num_src and summed is not num:
            return None
        why = f"segment softmax {node.name} (exp / a scatter-sum of it over each target's edges)"
        factors = _dot_product(g, num_src.args[0])
        if isinstance(factors, str):
            return Anchor(node, self.name, {}, {}, f"{why}: {factors}")
        v = _value(g, node)
        if v is None:
            return Anchor(node, self.name, {}, {}, f"{why}: no per-edge values multiplied by its probabilities")
        q, k = factors
        if _gathered_by(k, segment) and not _gathered_by(q, segment):
            q, k = k, q  # the query is the factor gathered with the segment (target) index, whatever the order
        roles = {"q": q, "k": k, "v": v}
        dims = {r: (token_shape(n) or (0,))[-1] for r, n in roles.items()}
        return Anchor(node, self.name, roles, dims)


register_rule(SegmentSoftmaxRule())
