"""Rule ``einsum_softmax``: ``softmax(einsum("...id,...jd->...ij", q, k) ...)`` then an einsum with v.

Libraries written with einops-style code (x-transformers, many research models) compute the scores
and the weighted sum of values with ``torch.einsum``. The score einsum contracts exactly one letter
(the head dim) between q and k; the value einsum contracts the key axis of the probabilities with
v, whose remaining letter is v's head dim. Masks, biases, scaling and casts may sit between the
scores and the softmax, dropout between the softmax and the value einsum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch.fx import Node

from ..layout import NotLayout, shape_of
from ..params import einsum_subscripts
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["EinsumSoftmaxRule"]

aten = torch.ops.aten
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}


def _parse(node: Node) -> tuple[list[str], str, list[Node]] | None:
    """(input subscripts, output subscript, operands) of a two-operand einsum node."""
    if node.op != "call_function" or node.target is not aten.einsum.default or len(node.args) < 2:
        return None
    eq, operands = node.args[0], node.args[1]
    if (
        not isinstance(eq, str)
        or "->" not in eq
        or not isinstance(operands, (list, tuple))
        or len(operands) != 2
        or not all(isinstance(o, Node) for o in operands)
    ):
        return None
    ops = [cast(Node, o) for o in operands]
    shapes = [shape_of(o) for o in ops]
    out_shape = shape_of(node)
    if any(s is None for s in shapes) or out_shape is None:
        return None
    try:  # '...' (block-local attention over (B, blocks, ...)) becomes stand-in letters
        ins, out = einsum_subscripts(eq, [len(s) for s in shapes if s is not None], len(out_shape))
    except NotLayout:
        return None
    if len(ins) != 2:
        return None
    return ins, out, ops


def _contracted(ins: list[str], out: str) -> list[str]:
    return [c for c in ins[0] if c in ins[1] and c not in out]


class EinsumSoftmaxRule:
    """Anchor on softmax(einsum(q, k)) -> einsum(p, v); q, k, v are the einsum operands.

    Example::

        rule = EinsumSoftmaxRule()
        anchor = rule.match(g, softmax_node)   # None unless einsums surround the softmax
    """

    name = "einsum_softmax"
    priority = 30

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        if node.op != "call_function" or node.target not in _SOFTMAX:
            return None
        score = self._score(g, node)
        if score is None:
            return None
        (sq, sk), sout, (q, k) = score
        c = _contracted([sq, sk], sout)
        if len(c) != 1:
            return Anchor(node, self.name, {}, {}, f"score einsum contracts {c or 'nothing'}, not one head dim")
        qs, ks = shape_of(q), shape_of(k)
        if qs is None or ks is None:
            return Anchor(node, self.name, {}, {}, "score einsum inputs have symbolic shapes")
        value = self._value(g, node)
        if value is None:
            return Anchor(
                node, self.name, {}, {}, f"softmax {node.name} has einsum scores but no value einsum after it"
            )
        vnode, (sp, sv), vout, v = value
        vdims = [ch for ch in sv if ch in vout and ch not in sp]
        vs = shape_of(v)
        if len(vdims) != 1 or vs is None:
            return Anchor(node, self.name, {}, {}, f"value einsum {vnode.name} does not leave one head dim of v")
        axes = {"q": sq.index(c[0]), "k": sk.index(c[0]), "v": sv.index(vdims[0])}
        dims = {"q": qs[axes["q"]], "k": ks[axes["k"]], "v": vs[axes["v"]]}
        return Anchor(vnode, self.name, {"q": q, "k": k, "v": v}, dims, head_axes=axes)

    @staticmethod
    def _score(g: MatchGraph, softmax: Node) -> Any:
        frontier: list[Any] = [softmax.args[0]]
        for _ in range(10):  # masks, biases, scaling, soft-capping, casts
            nxt: list[Node] = []
            for n in frontier:
                if not isinstance(n, Node) or n.op != "call_function":
                    continue
                parsed = _parse(n)
                if parsed is not None and not any(g.is_param(o) for o in parsed[2]):
                    ins, out, ops = parsed
                    return (ins[0], ins[1]), out, (ops[0], ops[1])
                if n.target in _SOFTMAX:
                    continue
                nxt.extend(i for i in n.all_input_nodes if i.op == "call_function")
            if not nxt:
                return None
            frontier = nxt
        return None

    @staticmethod
    def _value(g: MatchGraph, softmax: Node) -> Any:
        """The einsum of the probabilities with v (either operand order); an einsum with a parameter
        (talking heads: ``einsum("bhij,hg->bgij", p, W)`` mixes the heads) is stepped over."""
        frontier = [softmax]
        for _ in range(6):  # dropout, casts, head masks, head mixing
            nxt: list[Node] = []
            for n in frontier:
                for user in n.users:
                    parsed = _parse(user)
                    if parsed is not None and n in parsed[2]:
                        ins, out, ops = parsed
                        i = ops.index(n)
                        if not g.is_param(ops[1 - i]):
                            return user, (ins[i], ins[1 - i]), out, ops[1 - i]
                    if user.op == "call_function" and user.target not in _SOFTMAX:
                        nxt.append(user)
            if not nxt:
                return None
            frontier = nxt
        return None


register_rule(EinsumSoftmaxRule())
