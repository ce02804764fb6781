"""Rule ``logsumexp_softmax``: a softmax written as ``exp(s - logsumexp(s))`` between ``q @ k^T`` and ``@ v``.

Reformer's local (and LSH) attention normalises its scores this way instead of calling softmax.
It is softmax attention: the rule anchors it like ``manual_softmax`` would (q, k from the score
product, v from the value product), so the form ``linear_attention`` (attention without a softmax)
does not claim it. Bucketed (LSH) attention is declined before by ``lsh_attention``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from . import register_rule
from .base import Anchor
from .linear_attention import earlier_product, pair_anchor, product_of

if TYPE_CHECKING:  # pragma: no cover
    from ..graph import MatchGraph

__all__ = ["LogsumexpSoftmaxRule"]

aten = torch.ops.aten
_LOGSUMEXP = {aten.logsumexp.default}


class LogsumexpSoftmaxRule:
    """Anchor on ``exp(s - logsumexp(s)) @ v`` for scores ``s = q @ k^T`` (through masks and scaling).

    Example::

        rule = LogsumexpSoftmaxRule()
        anchor = rule.match(g, node)   # None unless node is the value product of such an attention
    """

    name = "logsumexp_softmax"
    priority = 55

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:
        p = product_of(g, node)
        if p is None:
            return None
        scores = earlier_product(g, p.a, node)
        if scores is None:
            return None
        if not any(n.target in _LOGSUMEXP for n in g.path_nodes(scores.node, p.a)):
            return None
        return pair_anchor(g, self.name, scores, p, scores_first=True)


register_rule(LogsumexpSoftmaxRule())
