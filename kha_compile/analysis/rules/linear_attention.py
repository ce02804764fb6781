"""Rule ``linear_attention``: attention without a softmax, written out (linear attention, retention).

Two products of activations make an attention without a softmax, in either order of evaluation:

* scores first (quadratic, "parallel" form): ``(q @ k^T * D) @ v``, the scores reaching the value
  product through masks, decays (retention's ``gamma^(i-j)``), normalisers or a pointwise kernel
  (``exp(s - logsumexp(s))``, ``(1 - acos(s) / pi)^t``), but no softmax (that is ``manual_softmax``);
* state first (linear, "recurrent" form): ``phi(q) @ (phi(k)^T @ v)``, the state ``k^T v`` reaching
  the query product through a cumulative sum, a decay or a recurrence over chunks or tokens.

Products are ``matmul``/``bmm`` or two-operand ``einsum`` contracting one axis. The anchor is the
second product; q, k and v are the operands of the two products, each with the axis that holds its
head vector (the contracted axis of q; k's contracted axis in the scores, its free axis in the
state; v's free axis), so the walk back to the projections reads the head maps through the
feature maps (elu + 1, ...) that sit between. One attention written as several such pairs (per
chunk, per token in a recurrence, intra- plus inter-chunk) gives one anchor per pair; the match
keeps one site for all the anchors with the same q, k and v heads (:func:`one_site_per_attention`).

Example::

    rule = LinearAttentionRule()
    anchor = rule.match(g, node)   # None unless node is the second product of such a pair
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from ..graph import SDPA_OPS, SOFTMAX_OPS, STOP
from ..layout import NotLayout, same_shape, shape_of
from ..params import einsum_subscripts
from ..random_features import RANDOM_FEATURES, before_random_features
from . import register_rule
from .base import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph
    from ..match import RawSite

__all__ = [
    "LINEAR_ATTENTION",
    "LinearAttentionRule",
    "Product",
    "earlier_product",
    "one_site_per_attention",
    "pair_anchor",
    "product_of",
]

aten = torch.ops.aten

LINEAR_ATTENTION = "linear_attention"
_PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.einsum.default}
_DEPTH = 12


@dataclasses.dataclass(frozen=True)
class Product:
    """A product of two tensors contracting one axis: ``a`` (..., free, c) with ``b`` (..., c, free), any order."""

    node: Node
    a: Node
    b: Node
    a_contract: int  # negative axes
    a_free: int
    b_contract: int
    b_free: int
    a_out: int = -2  # the output axis of a's free axis (matmul: -2), and of b's (-1)
    b_out: int = -1

    def swapped(self) -> Product:
        """The same product with its operands named the other way round."""
        return Product(
            self.node,
            self.b,
            self.a,
            self.b_contract,
            self.b_free,
            self.a_contract,
            self.a_free,
            self.b_out,
            self.a_out,
        )


def _einsum_pair(node: Node, ops: list[Any]) -> Product | None:
    """The product of an einsum contracting one axis of two operands; further operands may only scale
    its output (all their letters in the output: Performer's ``'...de,...nd,...n->...ne'`` with the
    normaliser). ``'...'`` becomes stand-in letters."""
    shapes = [shape_of(o) if isinstance(o, Node) else None for o in ops]
    out_shape = shape_of(node)
    if out_shape is None or any(s is None for s in shapes):
        return None
    try:
        ins, out = einsum_subscripts(node.args[0], [len(s) for s in shapes if s is not None], len(out_shape))  # type: ignore[arg-type]
    except NotLayout:
        return None
    if len(ins) < 2:  # one operand: a transpose, a diagonal or a sum, no product
        return None
    pair = [i for i, letters in enumerate(ins) if not all(c in out for c in letters)]
    if len(ins) > 2:
        if len(pair) != 2:
            return None
    else:
        pair = [0, 1]
    a, b = (ins[i] for i in pair)
    contracted = [c for c in a if c in b and c not in out]
    a_free = [c for c in a if c not in b]
    b_free = [c for c in b if c not in a]
    if len(contracted) != 1 or len(a_free) != 1 or len(b_free) != 1 or any(c not in out for c in a_free + b_free):
        return None
    c = contracted[0]
    return Product(
        node,
        ops[pair[0]],
        ops[pair[1]],
        a.index(c) - len(a),
        a.index(a_free[0]) - len(a),
        b.index(c) - len(b),
        b.index(b_free[0]) - len(b),
        out.index(a_free[0]) - len(out),
        out.index(b_free[0]) - len(out),
    )


def product_of(g: MatchGraph, node: Node) -> Product | None:
    """``node`` as a product of two activations of rank >= 3 (no parameter, no constant), or None.

    Example::

        product_of(g, matmul_node)      # Product(node, q, kt, -1, -2, -2, -1)
    """
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return None
    if node.target is aten.einsum.default:
        eq, ops = node.args[0], node.args[1] if len(node.args) > 1 else None
        if not isinstance(eq, str) or not isinstance(ops, (list, tuple)) or not all(isinstance(o, Node) for o in ops):
            return None
        found = _einsum_pair(node, list(ops))
    else:
        a, b = node.args[:2]
        found = Product(node, a, b, -1, -2, -2, -1) if isinstance(a, Node) and isinstance(b, Node) else None
    if found is None:
        return None
    a, b = found.a, found.b
    sa, sb = shape_of(a), shape_of(b)
    if sa is None or sb is None or len(sa) < 3 or len(sb) < 3 or g.is_param(a) or g.is_param(b):
        return None
    return found


def earlier_product(g: MatchGraph, start: Node, exclude: Node) -> Product | None:
    """The nearest product of activations ``start`` descends from through value ops (masks, decays,
    sums over chunks), not through a softmax, an attention op or a projection."""

    def visit(n: Node) -> Any:
        found = product_of(g, n) if n is not exclude else None
        if found is not None:
            return found
        if n.target in SOFTMAX_OPS or n.target in SDPA_OPS or n.target in _PRODUCTS or g.as_projection(n):
            return STOP
        return None

    return g.walk_back(start, visit, _DEPTH)


_REPEATS = {
    aten.repeat_interleave.self_int,
    aten.repeat_interleave.self_Tensor,
    aten.repeat.default,
    aten.expand.default,
}


def _shared_by_heads(g: MatchGraph, q: Node) -> bool:
    """The query operand is copied across heads (``repeat_interleave``/``repeat``/``expand`` between its
    projection and the product): one query for several heads, as the C of a state-space layer (Mamba-2's
    SSD shares C and B by the heads of a group). Attention never shares its queries. Copies of what no
    projection computes (RoPE's cos/sin tables expanded over the heads: SanaVideo) do not count."""

    def visit(n: Node) -> Any:
        if n.target in _REPEATS and isinstance(n.args[0], Node) and g.find_projections(n.args[0])[0]:
            src, out = shape_of(n.args[0]), shape_of(n)  # a copy of activations, not of a RoPE table
            if src is None or out is None or len(src) != len(out) or any(o > i for i, o in zip(src[:-1], out[:-1])):
                return True
        if n.target in _PRODUCTS or g.as_projection(n) is not None:
            return STOP
        return None

    return bool(g.walk_back(q, visit, 2 * _DEPTH))


_SELECTIONS = {
    aten.topk.default,
    aten.sort.default,
    aten.sort.stable,
    aten.argsort.default,
    aten.argsort.stable,
    aten.argmax.default,
    aten.argmin.default,
}


def _only_selects(g: MatchGraph, node: Node) -> bool:
    """The product's result only picks tokens (it reaches a top-k, sort or argmax and nothing else that
    computes): a scorer such as DeepSeek sparse attention's lightning indexer, ``sum_h w_h relu(q_h k^T)``
    whose top-k positions mask the real attention. It weighs no values, so it is no attention for KHA."""
    frontier: list[Node] = [node]
    seen: set[Node] = set()
    selects = False
    for _ in range(_DEPTH):
        nxt: list[Node] = []
        for n in frontier:
            for u in g.users(n):
                if u in seen:
                    continue
                seen.add(u)
                if u.op == "output" or u.target in _PRODUCTS or u.target in SDPA_OPS or g.as_projection(u):
                    return False  # the result is computed with further: values, an output
                if u.target in _SELECTIONS:
                    selects = True
                    continue
                nxt.append(u)
        if not nxt:
            return selects
        frontier = nxt
    return False


def _softmax_scores(g: MatchGraph, node: Node) -> bool:
    """The product's result is normalised by a softmax (through scaling, masks, casts: ops of its shape):
    it is the scores of a softmax attention, which the softmax rules match. Keys pooled over the
    sequence by learned weights first, ``q @ (k^T @ w)``, look like a state ``k^T v`` with the pooling
    weights as values; they are not an attention without softmax."""
    frontier: list[Node] = [node]
    for _ in range(_DEPTH // 2):
        nxt = [u for n in frontier for u in g.users(n) if same_shape(u, node)]
        if any(u.target in SOFTMAX_OPS for u in nxt):
            return True
        frontier = [u for u in nxt if u.target not in _PRODUCTS and u.target not in SDPA_OPS]
        if not frontier:
            return False
    return False


class LinearAttentionRule:
    """Anchor on the second product of an attention without softmax (see the module docstring)."""

    name = LINEAR_ATTENTION
    priority = 60

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        p = product_of(g, node)
        if p is None or _only_selects(g, node) or _softmax_scores(g, node):
            return None
        scores = earlier_product(g, p.a, node)
        if scores is not None:  # (q @ k^T ...) @ v
            return pair_anchor(g, self.name, scores, p, scores_first=True)
        state = earlier_product(g, p.b, node)
        if state is None:
            return None
        return pair_anchor(g, self.name, state, p, scores_first=False)  # q @ (k^T @ v ...)


def _reading(
    g: MatchGraph,
    rule: str,
    node: Node,
    roles: dict[str, Node],
    axes: dict[str, int],
    alternative: Anchor | None = None,
) -> Anchor | None:
    if _shared_by_heads(g, roles["q"]):
        return None  # a state-space layer (Mamba-2): no per-head queries, so no attention heads for KHA
    q_in, k_in = (before_random_features(g, roles[r], axes[r]) for r in ("q", "k"))
    if q_in is not None and k_in is not None:  # FAVOR+: q, k through a fixed random projection and exp; KHA before
        roles = {**roles, "q": q_in[0], "k": k_in[0]}
        axes = {**axes, "q": q_in[1], "k": k_in[1]}
        rule = RANDOM_FEATURES
    dims = {}
    for r, n in roles.items():
        shape = shape_of(n)
        if shape is None:
            return None
        dims[r] = shape[axes[r]]
    head_axes = {r: a for r, a in axes.items() if a != -1}
    return Anchor(node, rule, roles, dims, head_axes=head_axes, alternative=alternative)


def _k_operand_is_a(first: Product, second: Product) -> bool | None:
    """Whether k is ``first.a``, when ``second`` takes ``first``'s output as it is: k is the operand of
    ``first`` whose free axis ``second`` contracts (the key tokens of the scores, the key features of the
    state). None when there is something between the two products (the axes are not followed there)."""
    if second.a is first.node:
        axis = second.a_contract
    elif second.b is first.node:
        axis = second.b_contract
    else:
        return None
    rank = len(shape_of(first.node) or ())
    if not rank:
        return None
    if axis % rank == first.a_out % rank:
        return True
    return False if axis % rank == first.b_out % rank else None


def pair_anchor(g: MatchGraph, rule: str, first: Product, second: Product, *, scores_first: bool) -> Anchor | None:
    """The anchor of the product pair: scores first (``first`` = q @ k^T, ``second`` = scores @ v) or state
    first (``first`` = k^T @ v, ``second`` = q @ state); None for a state-space layer (queries shared by heads).

    ``first @ x`` reads both ways: scores times values, or, channels first, a state times the queries
    (Sana's ``(v @ k^T) @ q`` over (B, H, D, N)). The second reading is the anchor's ``alternative``: a
    wrong reading puts a role's head axis on tokens, where no feature of a projection varies, so its walk
    fails and the match tries the other.

    Example::

        pair_anchor(g, "linear_attention", scores, value_product, scores_first=True)
    """
    k_is_a = _k_operand_is_a(first, second)
    if k_is_a is not None and k_is_a != (not scores_first):  # an einsum naming k and v (or q and k) the other way
        first = first.swapped()
    if not scores_first:
        roles = {"q": second.a, "k": first.a, "v": first.b}
        axes = {"q": second.a_contract, "k": first.a_free, "v": first.b_free}
        return _reading(g, rule, second.node, roles, axes)
    state = _reading(
        g,
        rule,
        second.node,
        {"q": second.b, "k": first.b, "v": first.a},
        {"q": second.b_contract, "k": first.b_free, "v": first.a_free},
    )
    roles = {"q": first.a, "k": first.b, "v": second.b}
    axes = {"q": first.a_contract, "k": first.b_contract, "v": second.b_free}
    return _reading(g, rule, second.node, roles, axes, alternative=state)


def _key(site: RawSite) -> tuple:
    return tuple(
        (r, m.projection.node.name, tuple(m.head_map.index.flatten().tolist())) for r, m in sorted(site.roles.items())
    )


def one_site_per_attention(sites: list[RawSite]) -> list[RawSite]:
    """One site for the anchors of one attention without softmax: those with the same q, k, v heads.

    A site whose roles are incomplete is kept only when no site of the same module matched.

    Example::

        sites = one_site_per_attention(sites)      # the 4 chunk pairs of one retention layer: 1 site
    """
    pairs = (LINEAR_ATTENTION, RANDOM_FEATURES)
    matched_names = {s.name for s in sites if s.anchor in pairs and not s.reason}
    out: list[RawSite] = []
    seen: set[tuple] = set()
    for s in sites:
        if s.anchor not in pairs:
            out.append(s)
            continue
        if s.reason:
            key: tuple = (s.name, "skipped")
            if s.name in matched_names:
                continue
        else:
            key = _key(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


register_rule(LinearAttentionRule())
