"""Where a role enters the attention call: the call, its argument, the head axis there.

When two roles read the same features of one projection (``k = v``: DeepSeek-V4's ``kv_proj``;
``q = k``; one projection called for queries and for keys, :mod:`.shared_roles`), a transform after
the projection would change both. KHA then acts on each role's path where they part, at the
attention call itself: the transform of each role goes on the argument of the attention op that
carries it. :func:`attention_arg` names that
argument in terms the model's runtime can find again in a forward: the module whose forward makes
the call, the op family and its operands' ranks, how many such calls precede it there (nested
modules included, in graph order as in call order), the argument position and the head axis.

Example::

    arg = attention_arg(g, sdpa_node, kv_node, -1, "v")   # AttentionArg("layers.0.attn", "sdpa", 0, 2, -1)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from .graph import SDPA_OPS, module_path_of
from .layout import shape_of

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph

__all__ = ["FAMILIES", "AttentionArg", "attention_arg", "family_of", "operand_ranks"]

aten = torch.ops.aten

# family -> the aten ops of the graph; the runtime finds the same family by torch function name
FAMILIES: dict[str, set[Any]] = {
    "sdpa": set(SDPA_OPS),
    "matmul": {aten.matmul.default},
    "bmm": {aten.bmm.default},
    "baddbmm": {aten.baddbmm.default, aten.baddbmm.out},
    "einsum": {aten.einsum.default},
}


def family_of(node: Node) -> str | None:
    """The attention-call family of an op node ("sdpa", "matmul", ...), or None."""
    if node.op != "call_function":
        return None
    return next((f for f, ops in FAMILIES.items() if node.target in ops), None)


@dataclasses.dataclass(frozen=True)
class AttentionArg:
    """One argument of one attention call, found again at run time by family and occurrence."""

    home: str  # traced path of the module whose forward makes the call
    family: str  # "sdpa" | "matmul" | "bmm" | "baddbmm" | "einsum"
    occurrence: int  # calls of the family with these ranks before it in the home's forward (nested ones too)
    position: int  # argument position (einsum: operand position)
    axis: int  # the axis of that argument that holds the head vector
    ranks: tuple[int, ...] = ()  # ranks of the call's operands (q, k, v of sdpa; both factors of a product)


def operand_ranks(node: Node) -> tuple[int, ...]:
    """Ranks of an attention-family call's operands: sdpa's q, k, v; the factors of a product; einsum's operands."""
    family = family_of(node)
    if family == "einsum":
        ops = node.args[1] if isinstance(node.args[1], (list, tuple)) else []
    elif family == "sdpa":
        ops = node.args[:3]
    else:
        ops = node.args[1:3] if family == "baddbmm" else node.args[:2]
    return tuple(len(shape_of(o) or ()) for o in ops)


def attention_arg(g: MatchGraph, anchor: Node, target: Node, axis: int, role: str) -> AttentionArg | None:
    """The attention call that reads ``target`` (the anchor, or the score op before it), or None.

    Example::

        attention_arg(g, value_matmul, v_node, -1, "v")
    """
    users = [u for u in target.users if family_of(u) is not None]
    if anchor not in users:  # the score product of this attention (one tensor may feed the products of several)
        users = [u for u in users if g.path_nodes(u, anchor)]
    if not users:
        return None
    call = anchor if anchor in users else min(users, key=g.order.__getitem__)
    family = family_of(call)
    stack = call.meta.get("nn_module_stack") or {}
    if family is None or not stack:
        return None
    args = call.args[1] if family == "einsum" else call.args
    if not isinstance(args, (list, tuple)) or target not in args:
        return None
    found = [i for i, a in enumerate(args) if a is target]  # q = k: one tensor at both operands of the scores
    position = "qkv".index(role) if family == "sdpa" else found[-1] if role == "k" else found[0]
    if position >= len(args) or args[position] is not target:
        return None
    home = module_path_of(call)
    scope = g.scope.get(list(stack)[-1], []) if home else list(g.graph.nodes)  # the root's forward: all of it
    ranks = operand_ranks(call)  # KHA's own small products (x @ T) never count: other ranks
    occurrence = sum(
        1 for n in scope if family_of(n) == family and g.order[n] < g.order[call] and operand_ranks(n) == ranks
    )
    return AttentionArg(home, family, occurrence, position, axis, ranks)
