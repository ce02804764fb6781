"""``2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down`` -> one ``torch.ops.kha.mlp_value`` node."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, fx

from ..graph import MUL_FNS, MUL_METHODS, SIGMOID_FNS, SIGMOID_METHODS, GraphContext, erase_dead, is_call, is_matmul
from ..stats import RuleName, Verdict, fail, ok
from .base import Rule, RuleSetup

__all__ = ["FuseMLPValue"]

_Leaf = fx.Node | int | float


@dataclasses.dataclass
class _MLPMatch:
    anchor: fx.Node  # the node whose value the fused op replaces
    v: fx.Node
    up: Any
    gate: Any
    down: Any
    scale: float
    internal: list[fx.Node]  # nodes consumed by the pattern (all but ``anchor``)

    def nodes(self) -> list[fx.Node]:
        return [self.anchor, *self.internal]


def _mul_leaves(node: Any, internal: list[fx.Node], root: bool = True) -> list[_Leaf] | None:
    """Flatten a tree of ``*`` into its factors (nodes and numbers); internal mul nodes are collected."""
    if (
        isinstance(node, fx.Node)
        and is_call(node, MUL_FNS, MUL_METHODS)
        and len(node.args) == 2
        and not node.kwargs
        and (root or len(node.users) == 1)
    ):
        internal.append(node)
        out: list[_Leaf] = []
        for a in node.args:
            leaves = _mul_leaves(a, internal, root=False)
            if leaves is None:
                return None
            out.extend(leaves)
        return out
    if isinstance(node, (fx.Node, int, float)) and not isinstance(node, bool):
        return [node]
    return None


class FuseMLPValue(Rule):
    """``2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down`` -> ``torch.ops.kha.mlp_value(v, W_up, W_gate, W_down)``.

    Anchored at the final matmul; the factor 2 may sit anywhere in the product or after the
    down-projection (``2 *``, ``2.0 *``, ``* 2``), and the two factors in either order.
    ``KHAMLPValue`` already traces to the fused node; this catches the hand-written form.
    """

    name: ClassVar[RuleName] = "fuse_mlp_value"

    @classmethod
    def create(cls, setup: RuleSetup) -> Rule | None:
        return cls() if setup.options.get("fuse_mlp", True) else None

    def pattern(self, ctx: GraphContext) -> Iterator[_MLPMatch]:
        for node in ctx.graph.nodes:
            if not is_matmul(node):
                continue
            match = self._match_at(node)
            if match is not None:
                yield match

    @staticmethod
    def _match_at(mm: fx.Node) -> _MLPMatch | None:
        h, down = mm.args
        internal: list[fx.Node] = []
        leaves = _mul_leaves(h, internal)
        if leaves is None or not internal:
            return None
        scale = 1.0
        tensors = []
        for leaf in leaves:
            if isinstance(leaf, fx.Node):
                tensors.append(leaf)
            else:
                scale *= float(leaf)
        if len(tensors) != 2:
            return None
        sig = [t for t in tensors if is_call(t, SIGMOID_FNS, SIGMOID_METHODS)]
        if len(sig) != 1:
            return None
        s = sig[0]
        a = tensors[1] if tensors[0] is s else tensors[0]
        g = s.args[0] if s.args else None
        if not (isinstance(g, fx.Node) and is_matmul(g) and is_matmul(a)) or a.args[0] is not g.args[0]:
            return None
        anchor = mm
        if scale != 2.0 and len(mm.users) == 1:  # (h @ W_down) * 2
            (user,) = mm.users
            if is_call(user, MUL_FNS, MUL_METHODS) and len(user.args) == 2 and not user.kwargs:
                other = user.args[1] if user.args[0] is mm else user.args[0]
                if isinstance(other, (int, float)) and not isinstance(other, bool):
                    scale *= float(other)
                    anchor = user
        internal = [*internal, a, s, g] + ([mm] if anchor is not mm else [])
        v = a.args[0]
        assert isinstance(v, fx.Node)
        return _MLPMatch(anchor, v, a.args[1], g.args[1], down, scale, internal)

    def check(self, m: _MLPMatch, ctx: GraphContext) -> Verdict:
        if m.scale != 2.0:
            return fail(f"the product's constant factor is {m.scale:g}, not 2 (not the KHA-MLP formula)")
        for n in m.internal:
            outside = [u for u in n.users if u not in m.nodes()]
            if outside:
                return fail(f"intermediate {n.name} is also used by {outside[0].name}; fusing would compute it twice")
        v = ctx.value(m.v)
        ws = [ctx.value(w) for w in (m.up, m.gate, m.down)]
        if not isinstance(v, Tensor) or not all(isinstance(w, Tensor) for w in ws):
            return fail("no shape information for v or the weights")
        if v.dim() < 1:
            return fail("v is a scalar")
        d = v.shape[-1]
        for name, w in zip(("W_up", "W_gate", "W_down"), ws):
            if w.dim() != 2 or w.shape[0] != d or w.shape[1] != d:
                return fail(f"{name} has shape {tuple(w.shape)}, not ({d}, {d}) for v of shape {tuple(v.shape)}")
            if w.dtype != v.dtype or w.device != v.device:
                return fail(f"{name} is {w.dtype} on {w.device}, v is {v.dtype} on {v.device}")
        return ok()

    def rewrite(self, m: _MLPMatch, ctx: GraphContext) -> int:
        with ctx.graph.inserting_before(m.anchor):
            fused = ctx.call(torch.ops.kha.mlp_value.default, (m.v, m.up, m.gate, m.down), like=m.anchor)
        if "example_value" in m.anchor.meta:
            fused.meta["example_value"] = m.anchor.meta["example_value"]
        m.anchor.replace_all_uses_with(fused)
        erase_dead(ctx.graph, m.nodes())
        return 1
