"""Random-feature maps of q and k in attention without a softmax (FAVOR+, Performer).

Random-feature linear attention does not put the head vectors of q and k into its products: it puts
``phi(x) = exp(x W^T - |x|^2 / 2 - max) / sqrt(m)``, where ``W`` (m, Dh) is a fixed random projection
(a buffer or a constant, never trained) that maps each head vector of Dh features to m random
features. The products' q and k operands then hold m random features on the axis where other forms
hold the head vector, and no head map reaches them from the projection.

KHA goes where the specification puts it, right after the projection and before the feature map, so
linear KHA still folds. The rule's role node for q and k is therefore the input ``x`` of the random
projection, with the axis the projection contracts (the head vector): :func:`before_random_features`
finds it, walking back from the product's operand through the value ops of the feature map (exp,
the subtracted max, the norm term, the scaling) to a product of an activation with a fixed matrix.

A product with a trained parameter (a learned feature map) is not this: the match reads it as a projection.

Example::

    found = before_random_features(g, q_prime, -1)   # (q, -1): q's head vector before phi, or None
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from .graph import SDPA_OPS, SOFTMAX_OPS, STOP
from .layout import NotLayout, shape_of
from .params import einsum_subscripts

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph

__all__ = ["RANDOM_FEATURES", "before_random_features"]

aten = torch.ops.aten

RANDOM_FEATURES = "random_features"  # the anchor of linear attention whose q and k go through random features
_PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.mm.default, aten.einsum.default, aten.linear.default}
_DEPTH = 12


def _operands(node: Node) -> list[Any]:
    if node.target is aten.einsum.default:
        ops = node.args[1] if len(node.args) > 1 else None
        return list(ops) if isinstance(ops, (list, tuple)) else []
    return list(node.args[:2])


def _contracted_axis(node: Node, x: Node, w: Node) -> int | None:
    """The (negative) axis of ``x`` that the product ``node`` of ``x`` and the fixed ``w`` contracts."""
    sx, sw, so = shape_of(x), shape_of(w), shape_of(node)
    if sx is None or sw is None or so is None:
        return None
    if node.target is aten.linear.default:
        return -1 if node.args[0] is x else None  # x W^T: x's last axis
    if node.target is not aten.einsum.default:
        return -1 if node.args[0] is x else None  # x @ W^T (mm, bmm, matmul): x's last axis
    try:
        ins, out = einsum_subscripts(node.args[0], [len(sx), len(sw)], len(so))  # type: ignore[arg-type]
    except NotLayout:
        return None
    sx_letters, sw_letters = (ins[0], ins[1]) if _operands(node)[0] is x else (ins[1], ins[0])
    contracted = [c for c in sx_letters if c in sw_letters and c not in out]
    return sx_letters.index(contracted[0]) - len(sx_letters) if len(contracted) == 1 else None


def _random_projection(g: MatchGraph, node: Node) -> tuple[Node, int, int] | None:
    """(x, x's contracted axis, random features m) when ``node`` is ``x`` times a fixed matrix, else None."""
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return None
    ops = _operands(node)
    if len(ops) != 2 or not all(isinstance(o, Node) for o in ops):
        return None
    for x, w in (ops, ops[::-1]):
        if not g.is_param(w, params=False) or g.is_param(x, params=False) or g.is_param(x):
            continue
        axis = _contracted_axis(node, x, w)
        sw, so = shape_of(w), shape_of(node)
        if axis is None or sw is None or so is None or len(sw) < 2:
            return None
        return x, axis, int(so[-1])
    return None


def before_random_features(g: MatchGraph, node: Node, axis: int) -> tuple[Node, int] | None:
    """``(x, head axis of x)`` when ``node`` is a random-feature map of ``x`` whose features lie on ``axis``.

    The walk goes back from ``node`` through value ops (not through a softmax, an attention op, a
    projection or another product) to a product of an activation ``x`` with a fixed matrix (a buffer
    or constant) giving as many random features as ``node`` has on ``axis``.

    Example::

        before_random_features(g, k_prime_t, -2)     # (k, -1) for phi(k)^T in phi(k)^T @ v
    """
    shape = shape_of(node)
    if shape is None or not shape:
        return None
    m = shape[axis]

    def visit(n: Node) -> Any:
        found = _random_projection(g, n)
        if found is not None:
            return found
        if n.target in _PRODUCTS or n.target in SOFTMAX_OPS or n.target in SDPA_OPS or g.as_projection(n):
            return STOP
        return None

    found = g.walk_back(node, visit, _DEPTH)
    if found is None or found[2] != m or m == 1:
        return None
    return found[0], found[1]
