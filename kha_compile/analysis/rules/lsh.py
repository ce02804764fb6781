"""Rule ``lsh_attention``: attention over tokens sorted into buckets by a hash of q or k; declined with the reason.

LSH attention (Reformer) hashes the query/key vectors (random rotations, an argmax), sorts the
tokens by bucket, gathers q, k and v in that order and attends within chunks of the sorted
sequence. Which tokens see each other is then a discrete function of the keys: a transform on q or
k moves tokens between buckets (no gradient reaches that choice), so it changes the attention
pattern, not only the scores within it. KHA is defined for heads that attend over the keys they are
given; kha_compile does not put it into bucketed attention and reports the site as skipped.

The rule looks at each attention the other rules would anchor (a softmax over ``q @ k^T``, or the
value product of an attention without softmax) and declines it when q or k reaches the scores
through a gather whose indices come from a sort of values computed from the same projection.
It runs first (priority 5), so the forms it declines are not matched by the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from ..completeness import score_product
from ..graph import SOFTMAX_OPS
from ..layout import INDEX_OPS
from . import register_rule
from .base import Anchor
from .linear_attention import earlier_product, product_of

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["SORT_OPS", "LSHAttentionRule"]

aten = torch.ops.aten

SORT_OPS = {aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable}
_GATHERS = {*INDEX_OPS, aten.take_along_dim.default}
_DEPTH = 32


def _flatten(args: Any) -> list[Node]:
    out: list[Node] = []
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(a, Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(_flatten(a))
    return out


def _ancestors(g: MatchGraph, start: Any, depth: int = _DEPTH) -> set[Node]:
    """Nodes ``start`` (a node or nodes) is computed from, its own included, not walking past projections."""
    seen: set[Node] = set()
    frontier: list[Any] = _flatten(start)
    for _ in range(depth):
        nxt: list[Node] = []
        for n in frontier:
            if not isinstance(n, Node) or n in seen:
                continue
            seen.add(n)
            if n.op != "call_function" or g.as_projection(n) is not None:
                continue
            nxt.extend(n.all_input_nodes)
        if not nxt:
            break
        frontier = nxt
    return seen


def _sorted_by_hash(g: MatchGraph, operand: Node) -> Node | None:
    """The sort whose order ``operand`` is gathered in, when the sort key is computed from a projection that
    also feeds ``operand`` (a hash of q or k); None otherwise."""
    above = _ancestors(g, operand)
    projections = {n for n in above if g.as_projection(n) is not None}
    for n in above:
        if n.op != "call_function" or n.target not in _GATHERS:
            continue
        for sort in _ancestors(g, list(n.args[1:])):  # the positions gathered
            if sort.op == "call_function" and sort.target in SORT_OPS:
                key = sort.args[0]
                if projections & _ancestors(g, key, depth=2 * _DEPTH):
                    return sort
    return None


def _operands(op: Node) -> tuple[Any, Any] | None:
    """The two operands of a score product (matmul, bmm, baddbmm or a two-operand einsum)."""
    if op.target in (aten.baddbmm.default, aten.baddbmm.out):
        return op.args[1], op.args[2]
    if op.target is aten.einsum.default:
        ops = op.args[1] if len(op.args) > 1 else None
        return (ops[0], ops[1]) if isinstance(ops, (list, tuple)) and len(ops) == 2 else None
    return (op.args[0], op.args[1]) if len(op.args) > 1 else None


class LSHAttentionRule:
    """Decline attention whose q or k is gathered in the order of a sort by a hash of q or k."""

    name = "lsh_attention"
    priority = 5

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function":
            return None
        scores: tuple[Any, Any] | None = None
        if node.target in SOFTMAX_OPS:
            op = score_product(g, node)
            scores = _operands(op) if op is not None else None
        else:
            p = product_of(g, node)
            earlier = earlier_product(g, p.a, node) if p is not None else None
            if earlier is not None:
                scores = (earlier.a, earlier.b)
        if scores is None:
            return None
        for role, operand in zip("qk", scores):
            if not isinstance(operand, Node):
                continue
            sort = _sorted_by_hash(g, operand)
            if sort is not None:
                return Anchor(
                    node,
                    self.name,
                    {},
                    {},
                    f"LSH attention: the tokens are sorted into buckets by a hash of q/k ({sort.name}) and {role} "
                    "reaches the scores in that order; a transform on q or k would move tokens between buckets "
                    "(a discrete choice no gradient reaches) and change which tokens attend to each other, not "
                    "only the scores, so KHA is not applied to bucketed attention",
                )
        return None


register_rule(LSHAttentionRule())
