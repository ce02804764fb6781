"""Inline the higher-order ops that only wrap a region of ordinary ops, so the walk sees through them.

``torch.export`` records ``with torch.autocast(..., enabled=False):`` as a ``wrap_with_autocast``
call and ``with torch.no_grad():`` (inside a forward traced with grad) as a
``wrap_with_set_grad_enabled`` call: the ops of the region live in a subgraph, and the main graph
holds one opaque node. A RoPE step in such a region, or a whole attention, would then be invisible
to the rules and the walk. The analysis reads graphs only, so those calls are replaced by the ops
of their subgraph (nested ones too); every copied node keeps its metadata (module stack, shapes).

Example::

    n = inline_wrappers(exported.graph_module)     # number of wrapper calls inlined
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

__all__ = ["WRAPPER_NAMES", "inline_wrappers"]

log = logging.getLogger(__name__)

# higher-order ops whose subgraph runs once, as is, on the operands that follow it
WRAPPER_NAMES = frozenset({"wrap_with_set_grad_enabled", "wrap_with_autocast", "wrap", "tag_activation_checkpoint"})


def _hop_name(target: Any) -> str:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return ""


def _subgraph_arg(gm: GraphModule, node: Node) -> int | None:
    """Position of the wrapped subgraph among ``node``'s arguments (a ``get_attr`` of a GraphModule)."""
    for i, a in enumerate(node.args):
        if isinstance(a, Node) and a.op == "get_attr" and isinstance(getattr(gm, str(a.target), None), GraphModule):
            return i
    return None


def _inline_one(gm: GraphModule, node: Node, pos: int) -> bool:
    graph = gm.graph
    sub: GraphModule = getattr(gm, str(node.args[pos].target))  # type: ignore[union-attr]
    operands = list(node.args[pos + 1 :])
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(operands) or node.kwargs:
        return False
    env: dict[Node, Any] = dict(zip(placeholders, operands))
    result: Any = None
    with graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                result = sn.args[0]
                break
            if sn.op == "get_attr":  # a nested wrapper's subgraph: give it a name in the outer module
                name = f"_kha_inlined_{len(gm._modules)}_{sn.target}".replace(".", "_")
                gm.add_submodule(name, getattr(sub, str(sn.target)))
                new = graph.get_attr(name)
                new.meta = dict(sn.meta)
            else:
                new = graph.node_copy(sn, lambda n: env[n])
            env[sn] = new
    mapped = map_arg(result, lambda n: env[n])
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem and isinstance(mapped, (tuple, list)):
            value = mapped[user.args[1]]  # type: ignore[index]
            if isinstance(value, Node):
                user.replace_all_uses_with(value)
                graph.erase_node(user)
    if node.users and isinstance(mapped, Node):
        node.replace_all_uses_with(mapped)
    if node.users:  # a user we cannot redirect (an output that is not a node): keep the call, once
        node.meta["kha_inlined"] = True
    else:
        graph.erase_node(node)
    return True


def inline_wrappers(gm: GraphModule) -> int:
    """Replace every wrapping higher-order call in ``gm.graph`` by the ops of its subgraph, in place."""
    count = 0
    for _ in range(16):  # nested regions: a few rounds
        found = False
        for node in list(gm.graph.nodes):
            if (
                node.op != "call_function"
                or _hop_name(node.target) not in WRAPPER_NAMES
                or node.meta.get("kha_inlined")
            ):
                continue
            pos = _subgraph_arg(gm, node)
            if pos is not None and _inline_one(gm, node, pos):
                count += 1
                found = True
        if not found:
            break
    if count:
        log.debug("inlined %d wrapping higher-order calls (autocast, grad-mode regions)", count)
    return count
