"""Attention no rule claimed: a softmax over scores of two activations, reported so no site is silent.

The rules anchor on the attention forms they know. A graph can hold attention in a form none of
them recognises (block-local scores in 5-D, an einsum written with ``...``, a product the rules do
not follow). Each such softmax becomes an :class:`~.rules.Anchor` of the ``unmatched`` rule with
the reason it was not matched, so the report lists it as skipped: compared with the attention calls
of the traced modules, every one is matched or skipped with a reason, none is silently absent.

An attention softmax here: over the last axis of a tensor of rank >= 3 whose values come, through
masks, scaling, soft-capping, casts and views (no projection on the way), from a product
(``matmul``, ``bmm``, ``baddbmm``, ``einsum``) of two tensors of rank >= 3, at least one of them an
activation (a router's softmax over ``x @ W`` does not count: ``x @ W`` is a projection).

Example::

    extra = unclaimed(g, claimed={a.node for a in anchors} | softmaxes_used)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from .graph import SDPA_OPS, SOFTMAX_OPS, STOP
from .layout import shape_of
from .rules import Anchor

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph

__all__ = ["PRODUCT_OPS", "score_product", "unclaimed"]

aten = torch.ops.aten

PRODUCT_OPS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.baddbmm.out, aten.einsum.default}


def _operands(node: Node) -> list[Any]:
    if node.target is aten.einsum.default:
        ops = node.args[1] if len(node.args) > 1 else []
        return list(ops) if isinstance(ops, (list, tuple)) else []
    if node.target in (aten.baddbmm.default, aten.baddbmm.out):
        return list(node.args[1:3])
    return list(node.args[:2])


def _softmax_dim(node: Node) -> int | None:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dim if isinstance(dim, int) else None


def score_product(g: MatchGraph, softmax: Node, depth: int = 48) -> Node | None:
    """The product of two activations whose scores ``softmax`` normalises, or None.

    Example::

        score_product(g, softmax_node)     # the q @ k^T matmul node
    """

    def visit(n: Node) -> Any:
        if g.as_projection(n) is not None or n.target in SDPA_OPS or n.target in SOFTMAX_OPS:
            return STOP  # a projection (x @ W) or another attention: not these scores
        if n.target in PRODUCT_OPS:
            ops = [o for o in _operands(n) if isinstance(o, Node)]
            if len(ops) == 2 and all(len(shape_of(o) or ()) >= 3 for o in ops) and not all(g.is_param(o) for o in ops):
                return n
            return STOP
        return None

    return g.walk_back(softmax.args[0], visit, depth, values_only=False)


def _why(g: MatchGraph, softmax: Node, product: Node) -> str:
    shape = shape_of(softmax)
    what = f"softmax {softmax.name} over {list(shape) if shape else '?'} scores of {product.name} ({product.target})"
    eq = product.args[0] if product.target is aten.einsum.default else None
    if isinstance(eq, str) and "..." in eq:
        detail = f"the einsum {eq!r} uses '...', which the einsum_softmax rule does not read"
    elif _split_probs(softmax):
        detail = (
            "its probabilities are cut into pieces along the key axis (local and global tokens), each "
            "multiplied with its own values; no rule reads that split form"
        )
    elif shape is not None and len(shape) > 4:
        detail = f"the scores have {len(shape)} axes (block-local attention?), which no rule reads"
    else:
        detail = "no attention rule recognises this form (no value product found after it)"
    return f"{what} looks like attention, but {detail}; its q, k, v were not traced back to projections"


def _split_probs(softmax: Node, depth: int = 4) -> bool:
    """The softmax output (through dropout and casts) is sliced along its last axis."""
    frontier = [softmax]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u.target is aten.slice.Tensor and u.args[1] in (-1, len(shape_of(n) or ()) - 1):
                    return True
                if u.op == "call_function" and len(u.all_input_nodes) == 1:
                    nxt.append(u)
        frontier = nxt
    return False


def unclaimed(g: MatchGraph, claimed: set[Node]) -> list[Anchor]:
    """An ``unmatched`` anchor (with its reason) for every attention softmax no rule claimed.

    Example::

        [a.reason for a in unclaimed(g, claimed=set())]
    """
    out = []
    for node in g.graph.nodes:
        if node.op != "call_function" or node.target not in SOFTMAX_OPS or node in claimed:
            continue
        shape = shape_of(node)
        dim = _softmax_dim(node)
        if shape is None or len(shape) < 3 or dim is None or dim not in (-1, len(shape) - 1):
            continue
        product = score_product(g, node)
        if product is not None:
            out.append(Anchor(node, "unmatched", {}, {}, _why(g, node, product)))
    return out
