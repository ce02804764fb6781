"""KHA-Linear ``x @ T`` after a projection -> the projection with folded weight (and bias).

When gradients are off (``torch.is_grad_enabled()`` is False while compiling, or none of the
weight, bias and transforms requires grad), every KHA-Linear matmul is folded into the rows of the
projection that feeds it (``W[R_h] <- T^T W[R_h]``, ``b[R_h] <- b[R_h] T``, KHA_SPEC.md) and the
matmul disappears. The matmul is anchored by the module that traced it (``nn_module_stack``
holds a ``KHALinearTransform``). The fold is refused when anything else reads the transformed
features; the layout ops around it stay and cost nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, fx

from ...core.errors import KHAError
from ...model.slots import HeadSlot
from ...model.transforms.linear import KHALinearTransform
from ..graph import GraphContext, concrete, inside, is_matmul
from ..projection import Projection, features, fold_fn, slot_of, trace_back, view_descendants
from ..runtime import Recipe
from ..stats import RuleName, Verdict, fail, ok
from .base import Declined, Rule

__all__ = ["FoldLinearKHA"]


@dataclasses.dataclass(frozen=True)
class _Transform:
    matmul: fx.Node  # the ``x @ T`` node
    t: fx.Node  # its T input
    slot: HeadSlot | None  # the head slices of the projection output it reads, if it reads such


@dataclasses.dataclass
class _FoldMatch:
    anchor: fx.Node  # the projection op
    proj: Projection
    transforms: list[_Transform]
    readers: list[tuple[fx.Node, Tensor]]  # other consumers of the projection's features: (node, mask)
    width: int
    problem: str = ""

    def nodes(self) -> list[fx.Node]:
        return [self.anchor] + [t.matmul for t in self.transforms]


class FoldLinearKHA(Rule):
    """KHA-Linear ``x @ T`` after a projection -> the projection with folded weight (and bias).

    Anchored at the matmuls traced inside a :class:`KHALinearTransform`; every one that reaches
    the same projection through view ops is folded together. Applies only when gradients are off
    while compiling or none of the weight, bias and transforms requires grad.
    """

    name: ClassVar[RuleName] = "fold_linear"

    def pattern(self, ctx: GraphContext) -> Iterator[Any]:
        groups: dict[fx.Node, list[tuple[fx.Node, fx.Node]]] = {}
        projs: dict[fx.Node, Projection] = {}
        for node in ctx.graph.nodes:
            if not (is_matmul(node) and inside(node, KHALinearTransform)):
                continue
            t = node.args[1]
            tt = ctx.tensor_of(t)
            if tt is None or tt.dim() != 2 or tt.shape[0] != tt.shape[1] or not isinstance(t, fx.Node):
                yield Declined(node, "the transform T is not a (d, d) graph input")
                continue
            x = node.args[0]
            proj = trace_back(x, ctx) if isinstance(x, fx.Node) else None
            if proj is None:
                yield Declined(
                    node,
                    "its input is not a view of a projection whose weight is a graph input (linear, addmm or matmul)",
                )
                continue
            groups.setdefault(proj.node, []).append((node, t))
            projs[proj.node] = proj
        for p, members in groups.items():
            yield self._match(projs[p], members, ctx)

    @staticmethod
    def _match(proj: Projection, members: list[tuple[fx.Node, fx.Node]], ctx: GraphContext) -> _FoldMatch:
        ev = proj.node.meta.get("example_value")
        wt = ctx.tensor_of(proj.weight)
        assert wt is not None  # projection() checked it
        width = wt.shape[proj.out_axis]
        m = _FoldMatch(proj.node, proj, [], [], width)
        if not isinstance(ev, Tensor) or ev.dim() < 1:
            m.problem = "no example value for the projection output"
            return m
        try:
            shape = concrete(tuple(ev.shape))
        except KHAError:
            m.problem = "the projection output has a symbolic size without a hint"
            return m
        if shape[-1] != width:
            m.problem = f"the projection output has {shape[-1]} features, its weight {width}"
            return m
        values, readers = view_descendants(proj.node, width, shape)
        mine = {mm for mm, _ in members}
        for mm, t in members:
            s = mm.args[0]
            tt = ctx.tensor_of(t)
            assert tt is not None
            slot = slot_of(values[s], tt.shape[0]) if isinstance(s, fx.Node) and s in values else None
            m.transforms.append(_Transform(mm, t, slot))
        for u, v in readers:
            if u in mine and u.args[0] is v:
                continue
            m.readers.append((u, features(values[v], width)))
        return m

    def check(self, m: _FoldMatch, ctx: GraphContext) -> Verdict:
        if m.problem:
            return fail(m.problem)
        if not ctx.options.get("fold", True):
            return fail("folding is switched off (fold=False)")
        tensors = [ctx.tensor_of(m.proj.weight), ctx.tensor_of(m.proj.bias)]
        tensors += [ctx.tensor_of(t.t) for t in m.transforms]
        if ctx.grad_enabled and any(t is not None and t.requires_grad for t in tensors):
            return fail(
                "gradients are on and the weight or a transform requires grad; folding would cut "
                "them off, so the transforms stay matmuls"
            )
        folded = torch.zeros(m.width, dtype=torch.bool)
        for t in m.transforms:
            if t.slot is None:
                return fail(f"{t.matmul.name}: its input is not the head slices (…, H, Dh) of the projection output")
            idx = t.slot.index().reshape(-1)
            if folded[idx].any():
                return fail(f"{t.matmul.name}: two transforms act on the same projection features")
            folded[idx] = True
        for u, mask in m.readers:
            if (mask & folded).any():
                return fail(f"{u.name} also reads the transformed features of {m.anchor.name}")
        return ok()

    def rewrite(self, m: _FoldMatch, ctx: GraphContext) -> int:
        proj = m.proj
        srcs = [ctx.source(proj.weight), ctx.source(proj.bias)] + [ctx.source(t.t) for t in m.transforms]
        slots = [t.slot for t in m.transforms if t.slot is not None]
        new = ctx.add_inputs(Recipe(srcs, fold_fn(slots, proj.out_axis)), f"kha_folded_{m.anchor.name}")
        proj.replace(new[0], new[1] if proj.bias is not None else None)
        for t in m.transforms:
            x = t.matmul.args[0]
            assert isinstance(x, fx.Node)  # pattern() traced it back to the projection
            t.matmul.replace_all_uses_with(x)
            ctx.graph.erase_node(t.matmul)
        return len(m.transforms)
