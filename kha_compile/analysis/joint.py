"""One role fed by several projections: joint streams (a sequence-axis ``cat``) and sums.

* **Joint attention.** Text and image tokens have their own q/k/v projections, and the per-head
  outputs are concatenated along the sequence axis before QK-norm, RoPE and the attention
  (``cat([q_txt, q_img], dim=1)``); merged self- and cross-attention concatenate the keys and values
  of both sources the same way. KHA acts on each token's head vector, so one shared transform after
  each of those projections is exact KHA, MLP-value included. The index walk goes through such a
  ``cat`` as a layout op (:func:`through_cat`) when it joins along an axis that is neither the head
  nor the feature axis.
* **Sums.** ``q = W_a x + W_b y`` before the head split: a linear transform after each projection
  equals one after the sum, so linear KHA is exact there. MLP-value is not linear: a value that is
  a sum is skipped with that reason (the plan decides, it knows the kind).

Projections of one role must agree on the head layout (heads, head dim) at the attention.

Example::

    first, rest, join, problem = resolve_role(g, "q", target, matches)
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.fx import Node

from .layout import NotLayout, token_shape

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph
    from .match import RoleMatch

__all__ = ["cat_axis", "resolve_role", "through_cat"]

aten = torch.ops.aten


def cat_axis(node: Node) -> int | None:
    """The (non-negative) axis a ``cat`` node joins along, or None for another node.

    Example::

        cat_axis(node)      # 1 for torch.cat([q_txt, q_img], dim=1) on (B, S, H, Dh)
    """
    if node.op != "call_function" or node.target is not aten.cat.default:
        return None
    shape = token_shape(node)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if shape is None or not isinstance(dim, int):
        return None
    return dim % len(shape)


def through_cat(idx: Any, node: Node, prev: Node) -> Tensor:
    """The index tensor after ``cat([..., prev, ...], dim)`` along an axis where it does not vary.

    The other inputs of the cat are taken to carry the same head layout (each is checked from its
    own projection); along the joined axis (the sequence) the index is a broadcast copy anyway.
    Raises ``NotLayout`` when the cat joins heads or features.

    Example::

        idx = through_cat(idx, cat_node, prev)     # (B, St, H, Dh) index -> (B, St + Si, H, Dh)
    """
    axis = cat_axis(node)
    out = token_shape(node)
    if axis is None or out is None or not isinstance(idx, Tensor):
        raise NotLayout("not a cat with a static shape")
    if axis == len(out) - 1:
        raise NotLayout("cat along the feature axis")
    if idx.dim() != len(out) or bool((idx != idx.narrow(axis, 0, 1)).any()):
        raise NotLayout("cat along the head axis")
    return idx.narrow(axis, 0, 1).expand(out)


def _merge_node(g: MatchGraph, a: RoleMatch, b: RoleMatch, target: Node) -> Node | None:
    pa = set(g.path_nodes(a.projection.node, target))
    pb = set(g.path_nodes(b.projection.node, target))
    common = pa & pb
    return min(common, key=g.order.__getitem__) if common else None


def _is_sum(g: MatchGraph, matches: list[RoleMatch], target: Node) -> bool:
    """Every two of the projections first meet at an ``add`` of one branch each."""
    for a, b in itertools.combinations(matches, 2):
        merge = _merge_node(g, a, b, target)
        if merge is None or merge.target is not aten.add.Tensor or merge.kwargs.get("alpha", 1) != 1:
            return False
        pa = set(g.path_nodes(a.projection.node, merge))
        pb = set(g.path_nodes(b.projection.node, merge))
        ops = [x for x in merge.args[:2] if isinstance(x, Node)]
        if len(ops) != 2 or not ((ops[0] in pa and ops[1] in pb) or (ops[0] in pb and ops[1] in pa)):
            return False
    return True


def resolve_role(
    g: MatchGraph, role: str, target: Node, per_head: list[RoleMatch]
) -> tuple[RoleMatch | None, list[RoleMatch], str, str]:
    """(first match, the other projections, "cat" | "sum" | "", problem) for a role's per-head matches.

    The first match is the earliest projection in the graph (it owns the shared transform).

    Example::

        first, rest, join, problem = resolve_role(g, "q", sdpa.args[0], matches)    # join == "cat"
    """
    ordered = sorted(per_head, key=lambda m: g.order[m.projection.node])
    first = ordered[0]
    if len(ordered) == 1:
        return first, [], "", ""
    names = ", ".join(m.projection.module_path or m.projection.param for m in ordered)
    layouts = {(m.head_map.num_heads, m.head_map.head_dim) for m in ordered}
    if all(m.joined for m in ordered):
        join = "cat"
    elif _is_sum(g, ordered, target):
        join = "sum"
    else:
        return None, [], "", f"{role}: the head vector comes from several per-head projections ({names})"
    if len(layouts) > 1:
        shown = ", ".join(f"{m.projection.module_path}: {m.head_map.num_heads}x{m.head_map.head_dim}" for m in ordered)
        what = "concatenated along the sequence" if join == "cat" else "summed"
        return None, [], "", f"{role}: the projections {what} have different head layouts ({shown})"
    return first, ordered[1:], join, ""
