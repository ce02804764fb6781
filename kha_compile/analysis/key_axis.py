"""Which axis of an attention's scores holds the keys: the one the value product sums over.

A softmax usually normalises the scores over the keys, and the value product sums the probabilities
over that same axis. Some attentions normalise over the queries instead: keys and values pooled into a
few "interests" whose scores are normalised over the query axis, or bidirectional cross-attention,
which computes one score matrix and reads it both ways (softmax over its last axis for one direction,
over its first for the other). Which operand of the score product is the query and which the key does
not depend on the softmax: the keys are the operand whose tokens the value product sums over (the
values come from the same tokens), the queries the operand whose tokens the output keeps.

:func:`score_axis` follows an axis of the probabilities back to the score product's output, through
the softmax, masks, scaling, dropout, casts and layout ops (transposes, views); a rule compares it with
the axes of its operands.

Example::

    score_axis(g, score_einsum, probs, -2)     # -1: probs' axis -2 is the scores' last axis
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from .layout import LAYOUT_OPS, NotLayout, push_layout, same_shape, shape_of, varies

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph

__all__ = ["score_axis"]


def score_axis(g: MatchGraph, score: Node, probs: Node, axis: int) -> int | None:
    """The axis (negative) of ``score``'s output that axis ``axis`` of ``probs`` comes from, or None.

    ``probs`` is computed from ``score`` by ops that keep each element where it is (softmax, masks,
    scaling, dropout, casts) and layout ops; None when the path does anything else (a concatenation
    with other scores, a reduction), or is not one chain.

    Example::

        score_axis(g, qk_matmul, probs_transposed, -1)     # -2: the probabilities were transposed
    """
    shape = shape_of(score)
    if shape is None or len(shape) < 2 or score is probs:
        return None if shape is None or len(shape) < 2 else axis
    path = g.path_nodes(score, probs)
    if not path:
        return None
    chain = g.articulation(path)
    if not chain or chain[0] is not score or chain[-1] is not probs:
        return None
    # index tensors over the scores' two last axes, pushed along the chain as the layout ops move them
    idx = [torch.arange(shape[a]).view(-1, *[1] * (-a - 1)).expand(shape) for a in (-2, -1)]
    for prev, node in itertools.pairwise(chain):
        if node.target not in LAYOUT_OPS:
            if same_shape(prev, node):
                continue  # softmax, masks, scaling: every element stays where it is
            return None
        try:  # layout ops (a transpose of square scores keeps the shape but swaps the axes)
            idx = [push_layout(t, node, prev, g.constants) for t in idx]
        except (NotLayout, RuntimeError, IndexError, TypeError):
            return None
        if not all(isinstance(t, torch.Tensor) for t in idx):
            return None
    ranks = {t.dim() for t in idx}
    if len(ranks) != 1 or not -ranks.pop() <= axis < 0:
        return None
    moved = [a for a, t in zip((-2, -1), idx) if t.shape[axis] > 1 and varies(t, axis)]
    return moved[0] if len(moved) == 1 else None
