"""Rule ``einsum_softmax``: ``softmax(einsum("...id,...jd->...ij", q, k) ...)`` then an einsum with v.

Libraries written with einops-style code (x-transformers, many research models) compute the scores
and the weighted sum of values with ``torch.einsum``. The score einsum contracts one letter (the
head dim) between q and k; the value einsum contracts the key axis of the probabilities with v,
whose remaining letter is v's head dim. Masks, biases, scaling and casts may sit between the
scores and the softmax, dropout between the softmax and the value einsum.

Tied attention over the rows of an alignment (ESM-MSA's and AlphaFold's tied row attention,
``einsum("rinhd,rjnhd->hnij", q, k)``) contracts a row axis with the head dim: the scores are summed
over rows. The head dim is then the contracted letter on the last axis of q (or k), and v's the
carried letter on its last axis; a per-head transform of the features commutes with the sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch.fx import Node

from ..key_axis import score_axis
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


def _reads_params(g: MatchGraph, node: Node, limit: int = 400) -> bool:
    """True when a parameter is among the inputs ``node`` is computed from (within ``limit`` nodes)."""
    seen, stack = {node}, [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n.op == "placeholder" and n.name in g.params:
            return True
        for i in n.all_input_nodes:
            if i not in seen:
                seen.add(i)
                stack.append(i)
    return bool(stack)  # gave up: assume it does


def _contracted(ins: list[str], out: str) -> list[str]:
    return [c for c in ins[0] if c in ins[1] and c not in out]


def _carried(sp: str, sv: str, vout: str) -> list[str]:
    """The letters of v the value einsum carries to its output, not in the probabilities: v's head dim.

    Tied attention over the rows of an alignment also carries the row axis (``hnij,rjnhd->rinhd``):
    the head dim is then the one on v's last axis.
    """
    carried = [ch for ch in sv if ch in vout and ch not in sp]
    return [sv[-1]] if len(carried) > 1 and sv[-1] in carried else carried


def _key_axis_cat(node: Any, depth: int = 6) -> Node | None:
    """A ``cat`` along the last axis the scores went through (masks and scaling on the way)."""
    for _ in range(depth):
        if not isinstance(node, Node) or node.op != "call_function":
            return None
        shape = shape_of(node)
        if node.target is aten.cat.default and shape is not None:
            dim = node.args[1] if len(node.args) > 1 else 0
            return node if isinstance(dim, int) and dim % len(shape) == len(shape) - 1 else None
        node = node.args[0] if node.args else None
    return None


def _over_queries(g: MatchGraph, score: Node, vnode: Node, v: Node, sp: str, vout: str, sq: str, sk: str) -> bool:
    """The value einsum sums the probabilities over the score letter of the first operand (:mod:`..key_axis`):
    the softmax normalised over the queries, or one score matrix read the other way; the first operand
    is then the keys."""
    ops = cast(list, vnode.args[1])
    probs = ops[1] if ops[0] is v else ops[0]
    summed = [c for c in sp if c not in vout]
    if len(summed) != 1 or shape_of(score) is None:
        return False
    axis = score_axis(g, score, probs, sp.index(summed[0]) - len(sp))
    sout = _parse(score)
    if axis is None or sout is None:
        return False
    letter = sout[1][axis]
    return letter in sq and letter not in sk


def _through_identity(node: Node) -> list[Node]:
    """``node`` and its users through dropout and casts (the nodes a slice of the probabilities hangs on)."""
    out: list[Node] = []
    frontier = [node]
    for _ in range(3):
        nxt: list[Node] = []
        for n in frontier:
            out.append(n)
            nxt.extend(u for u in n.users if u.target in (aten.dropout.default, aten._to_copy.default, aten.to.dtype))
        frontier = nxt
    return out + [u for n in out for u in n.users]


def _sliced_keys(softmax: Node) -> bool:
    shape = shape_of(softmax)
    nodes = _through_identity(softmax)
    return shape is not None and any(
        n.target is aten.slice.Tensor and isinstance(n.args[1], int) and n.args[1] % len(shape) == len(shape) - 1
        for n in nodes[1:]
    )


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
        (sq, sk), sout, (q, k), _ = score
        c = _contracted([sq, sk], sout)
        if len(c) > 1:  # tied attention: the scores also sum over rows of an alignment (MSA row attention)
            c = [ch for ch in (sq[-1], sk[-1]) if ch in c][:1] or c
        if len(c) != 1:
            return Anchor(
                node,
                self.name,
                {},
                {},
                f"score einsum contracts {c or 'nothing'}, not one head dim (nor a head dim on the last axis of q "
                "or k, with other axes summed over)",
            )
        qs, ks = shape_of(q), shape_of(k)
        if qs is None or ks is None:
            return Anchor(node, self.name, {}, {}, "score einsum inputs have symbolic shapes")
        value = self._value(g, node)
        if value is None:
            return Anchor(
                node, self.name, {}, {}, f"softmax {node.name} has einsum scores but no value einsum after it"
            )
        vnode, (sp, sv), vout, v = value
        if _over_queries(g, score[3], vnode, v, sp, vout, sq, sk):  # the values sum over q's tokens
            (sq, q), (sk, k) = (sk, k), (sq, q)
            qs, ks = ks, qs
        vdims = _carried(sp, sv, vout)
        vs = shape_of(v)
        if len(vdims) != 1 or vs is None:
            return Anchor(node, self.name, {}, {}, f"value einsum {vnode.name} does not leave one head dim of v")
        axes = {"q": sq.index(c[0]), "k": sk.index(c[0]), "v": sv.index(vdims[0])}
        dims = {"q": qs[axes["q"]], "k": ks[axes["k"]], "v": vs[axes["v"]]}
        extra = self._pieces(g, node, q, k, v)
        return Anchor(vnode, self.name, {"q": q, "k": k, "v": v}, dims, head_axes=axes, extra=extra)

    def _pieces(self, g: MatchGraph, softmax: Node, q: Node, k: Node, v: Node) -> dict[str, tuple]:
        """Local plus global tokens (PEGASUS-X): scores of several key sets joined by a ``cat`` along
        the key axis, the probabilities cut along it again, each piece times its own values. The
        other key and value tensors are pieces of the same heads: (node, head axis) per role."""
        extra: dict[str, list] = {"k": [], "v": []}
        cat = _key_axis_cat(softmax.args[0])
        for inp in cast(list, cat.args[0]) if cat is not None else []:
            found = self._score(g, softmax, start=inp)
            if found is not None and found[2][0] is q and found[2][1] is not k:
                (_, sk2), sout2, (_, k2), _ = found
                c2 = _contracted([found[0][0], sk2], sout2)
                if len(c2) == 1:
                    extra["k"].append((k2, sk2.index(c2[0])))
        for _, (sp, sv), vout, v2 in self._values(g, softmax):
            vdims = _carried(sp, sv, vout)
            if v2 is not v and len(vdims) == 1:
                extra["v"].append((v2, sv.index(vdims[0])))
        return {r: tuple(ns) for r, ns in extra.items() if ns}

    @staticmethod
    def _score(g: MatchGraph, softmax: Node, start: Any = None) -> Any:
        frontier: list[Any] = [softmax.args[0] if start is None else start]
        for _ in range(10):  # masks, biases, scaling, soft-capping, casts
            nxt: list[Node] = []
            for n in frontier:
                if not isinstance(n, Node) or n.op != "call_function":
                    continue
                parsed = _parse(n)
                # not a projection (an einsum with a weight); a query made of parameters is fine
                if (
                    parsed is not None
                    and g.as_projection(n) is None
                    and not all(g.is_param(o) for o in parsed[2])
                    and all(_reads_params(g, o) for o in parsed[2])  # not a product of masks (Longformer's)
                ):
                    ins, out, ops = parsed
                    return (ins[0], ins[1]), out, (ops[0], ops[1]), n
                if n.target in _SOFTMAX:
                    continue
                nxt.extend(i for i in n.all_input_nodes if i.op == "call_function")
            if not nxt:
                return None
            frontier = nxt
        return None

    def _values(self, g: MatchGraph, softmax: Node) -> list[Any]:
        """Every value einsum of a softmax whose probabilities are cut along the key axis."""
        out = []
        for piece in softmax.users if _sliced_keys(softmax) else []:
            for user in _through_identity(piece):
                if user.target is aten.slice.Tensor:
                    found = self._value(g, user, depth=3)
                    if found is not None:
                        out.append(found)
        return out

    @staticmethod
    def _value(g: MatchGraph, softmax: Node, depth: int = 12) -> Any:
        """The einsum of the probabilities with v (either operand order); an einsum with a parameter
        (talking heads: ``einsum("bhij,hg->bgij", p, W)`` mixes the heads) is stepped over."""
        frontier = [softmax]
        for _ in range(depth):  # dropout, casts, head masks, head mixing
            nxt: list[Node] = []
            for n in frontier:
                for user in n.users:
                    parsed = _parse(user)
                    if parsed is not None and n in parsed[2]:
                        ins, out, ops = parsed
                        i = ops.index(n)
                        if not g.is_weight(ops[1 - i]):  # a weight here mixes the heads (talking heads)
                            return user, (ins[i], ins[1 - i]), out, ops[1 - i]
                    if user.op == "call_function" and user.target not in _SOFTMAX:
                        nxt.append(user)
            if not nxt:
                return None
            frontier = nxt
        return None


register_rule(EinsumSoftmaxRule())
