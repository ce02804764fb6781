"""Whether two graph nodes hold the same tensor: one node, or one source rearranged the same way.

Self-attention fed ``x.permute(1, 0, 2)`` three times has three projection inputs that are distinct
nodes but one tensor; the match uses :func:`same_values` to tell it from cross-attention.

Example::

    same_values(permute_1, transpose_1)    # True: both are x.permute(1, 0, 2)
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch.fx import Node

from .layout import LAYOUT_OPS, NotLayout, push_layout, shape_of

__all__ = ["same_values"]

_SAME_VALUES_MAX_NUMEL = 1 << 22  # index tensors pushed to compare two layout chains (int64: 32 MiB)


def _is_plain_layout(node: Node) -> bool:
    """A layout (or identity) op whose only tensor input is its first argument."""
    return (
        node.op == "call_function"
        and node.target in LAYOUT_OPS
        and bool(node.args)
        and isinstance(node.args[0], Node)
        and not any(isinstance(a, Node) for a in (*node.args[1:], *node.kwargs.values()))
    )


def _layout_chain(node: Node) -> tuple[Node, list[Node]]:
    """The tensor that ``node`` rearranges and the layout ops from it to ``node``, source first.

    Example::

        _layout_chain(permute_2)     # (x, [permute_2]) for permute_2 = x.permute(1, 0, 2)
    """
    chain: list[Node] = []
    while _is_plain_layout(node):
        chain.append(node)
        node = cast(Node, node.args[0])
    return node, chain[::-1]


def _pushed_index(source: Node, chain: list[Node]) -> torch.Tensor | None:
    """Where each element of the chain's output comes from in ``source`` (its flat index), or None."""
    shape = shape_of(source)
    if shape is None or math.prod(shape) > _SAME_VALUES_MAX_NUMEL:
        return None
    idx: object = torch.arange(math.prod(shape)).reshape(shape)
    prev = source
    try:
        for node in chain:
            idx = push_layout(idx, node, prev, {})
            prev = node
    except (NotLayout, RuntimeError, IndexError, TypeError, ValueError):
        return None
    return idx if isinstance(idx, torch.Tensor) else None


def same_values(a: Node, b: Node) -> bool:
    """True when ``a`` and ``b`` hold the same tensor: one node, or one source rearranged the same way.

    Self-attention fed ``x.permute(1, 0, 2)`` three times (or a permute and an equal transpose) has
    three projection inputs that are distinct nodes but one tensor: it is not cross-attention.

    Example::

        same_values(permute_1, transpose_1)    # True: both are x.permute(1, 0, 2)
    """
    if a is b:
        return True
    (sa, ca), (sb, cb) = _layout_chain(a), _layout_chain(b)
    if sa is not sb:
        return False

    def ops(chain: list[Node]) -> list[tuple[object, str, str]]:
        return [(n.target, repr(n.args[1:]), repr(sorted(n.kwargs.items()))) for n in chain]

    if ops(ca) == ops(cb):  # the same ops with the same arguments
        return True
    ia, ib = _pushed_index(sa, ca), _pushed_index(sb, cb)
    return ia is not None and ib is not None and ia.shape == ib.shape and bool(torch.equal(ia, ib))
