"""A foldable KHA transform after a projection -> the projection with folded weight (and bias).

When gradients are off (``torch.is_grad_enabled()`` is False while compiling, or none of the
weight, bias and transform parameters requires grad), every transform of a foldable kind (any
registered :class:`~kha_compile.model.transforms.TransformKind` with ``foldable = True``: KHA-Linear
and whatever a user registers) is folded into the rows of the projection that feeds it
(``W[R_h] <- T^T W[R_h]``, ``b[R_h] <- b[R_h] T`` with ``T = kind.fold_matrix_of(*params)``,
docs/method.md) and the transform disappears.

The transform is found by the module that traced it: the nodes whose ``nn_module_stack`` holds a
module of a foldable kind are one call of it; its one non-parameter input is the head slices of
a projection output, its parameter inputs are named by the kind's ``param_names``. The fold is a
node of the graph over the live parameters (:class:`~kha_compile.backend.projection.FoldCall`),
so it is never stale. The fold is refused when anything else reads the transformed features;
the layout ops around the transform stay and cost nothing.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor, fx

from ...core.errors import KHAError
from ...model.slots import HeadSlot
from ...model.transforms import TransformKind, transform_kinds
from ..graph import GraphContext, concrete, erase_dead
from ..projection import FoldCall, Projection, features, slot_of, trace_back, view_descendants
from ..stats import RuleName, Verdict, fail, ok
from .base import Declined, Rule

__all__ = ["FoldLinearKHA", "transform_calls"]

_OPS = ("call_function", "call_method", "call_module")


@dataclasses.dataclass(frozen=True)
class _Transform:
    out: fx.Node  # the node whose value is the transform's output
    x: fx.Node  # its input: head slices of a projection output
    kind: TransformKind
    params: tuple[fx.Node, ...]  # graph inputs, in the kind's ``param_names`` order
    nodes: tuple[fx.Node, ...]  # every node traced inside this call of the transform
    slot: HeadSlot | None = None  # the head slices of the projection output it reads, if it reads such


@dataclasses.dataclass
class _FoldMatch:
    anchor: fx.Node  # the projection op
    proj: Projection
    transforms: list[_Transform]
    readers: list[tuple[fx.Node, Tensor]]  # other consumers of the projection's features: (node, mask)
    width: int
    problem: str = ""

    def nodes(self) -> list[fx.Node]:
        return [self.anchor] + [n for t in self.transforms for n in t.nodes]


def _kind_of_type(t: Any, kinds: list[TransformKind]) -> TransformKind | None:
    for k in kinds:
        if (isinstance(t, type) and issubclass(t, k.module_cls)) or (
            isinstance(t, str) and t.endswith(k.module_cls.__name__)
        ):
            return k
    return None


def _components(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """``nodes`` split into groups connected by their own data edges (one group per call of a module)."""
    parent = {n: n for n in nodes}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in nodes:
        for a in n.all_input_nodes:
            if a in parent:
                parent[find(a)] = find(n)
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def transform_calls(graph: fx.Graph) -> list[tuple[TransformKind, list[fx.Node]]]:
    """Each call of a foldable transform module in ``graph``: its kind and the nodes traced inside it."""
    kinds = [k for k in transform_kinds().values() if k.foldable]
    by_module: dict[str, tuple[TransformKind, list[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op not in _OPS:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        for key, value in reversed(list(stack.items())):  # the innermost transform module
            kind = _kind_of_type(value[1], kinds) if isinstance(value, tuple) and len(value) >= 2 else None
            if kind is not None:
                by_module.setdefault(key, (kind, []))[1].append(node)
                break
    return [(kind, comp) for kind, nodes in by_module.values() for comp in _components(nodes)]


def _transform(kind: TransformKind, nodes: list[fx.Node], ctx: GraphContext) -> _Transform | str:
    """The call as a :class:`_Transform`, or why it is not one the fold can take."""
    inside = set(nodes)
    inputs = list({a: None for n in nodes for a in n.all_input_nodes if a not in inside})
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    params: dict[str, fx.Node] = {}
    others = []
    for a in inputs:
        leaf = ctx.names.get(a, "").rpartition(".")[2]
        if leaf in kind.param_names and leaf not in params and ctx.tensor_of(a) is not None:
            params[leaf] = a
        else:
            others.append(a)
    if set(params) != set(kind.param_names):
        missing = [p for p in kind.param_names if p not in params]
        return f"the {kind.name!r} transform's parameters {missing} are not graph inputs"
    if len(others) != 1 or len(outs) != 1:
        return f"the {kind.name!r} transform does not read one tensor and give one ({len(others)} in, {len(outs)} out)"
    x, out = others[0], outs[0]
    xv, ov = x.meta.get("example_value"), out.meta.get("example_value")
    if not (isinstance(xv, Tensor) and isinstance(ov, Tensor) and xv.shape == ov.shape):
        return f"the {kind.name!r} transform's output does not have its input's shape"
    return _Transform(out, x, kind, tuple(params[p] for p in kind.param_names), tuple(nodes))


class FoldLinearKHA(Rule):
    """A foldable KHA transform after a projection -> the projection with folded weight (and bias).

    Anchored at the calls of transform modules of a foldable kind; every one that reaches the same
    projection through view ops is folded together. Applies only when gradients are off while
    compiling or none of the weight, bias and transform parameters requires grad.
    """

    name: ClassVar[RuleName] = "fold_linear"

    def pattern(self, ctx: GraphContext) -> Iterator[Any]:
        groups: dict[fx.Node, list[_Transform]] = {}
        projs: dict[fx.Node, Projection] = {}
        for kind, nodes in transform_calls(ctx.graph):
            t = _transform(kind, nodes, ctx)
            if isinstance(t, str):
                yield Declined(nodes[-1], t)
                continue
            proj = trace_back(t.x, ctx)
            if proj is None:
                yield Declined(
                    t.out,
                    "its input is not a view of a projection whose weight is a graph input (linear, addmm or matmul)",
                )
                continue
            groups.setdefault(proj.node, []).append(t)
            projs[proj.node] = proj
        for p, members in groups.items():
            yield self._match(projs[p], members, ctx)

    @staticmethod
    def _match(proj: Projection, members: list[_Transform], ctx: GraphContext) -> _FoldMatch:
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
        for t in members:
            tensors = [ctx.tensor_of(p) for p in t.params]
            head_dim = t.kind.head_dim_of(*(x for x in tensors if x is not None))  # _transform checked them
            slot = slot_of(values[t.x], head_dim) if t.x in values else None
            m.transforms.append(dataclasses.replace(t, slot=slot))
        own = {(n, t.x) for t in m.transforms for n in t.nodes}
        for u, v in readers:
            if (u, v) not in own:
                m.readers.append((u, features(values[v], width)))
        return m

    def check(self, m: _FoldMatch, ctx: GraphContext) -> Verdict:
        if m.problem:
            return fail(m.problem)
        if not ctx.options.get("fold", True):
            return fail("folding is switched off (fold=False)")
        tensors = [ctx.tensor_of(m.proj.weight), ctx.tensor_of(m.proj.bias)]
        tensors += [ctx.tensor_of(p) for t in m.transforms for p in t.params]
        if ctx.grad_enabled and any(t is not None and t.requires_grad for t in tensors):
            return fail(
                "gradients are on and the weight or a transform requires grad; folding would cut "
                "them off, so the transforms stay as they are"
            )
        folded = torch.zeros(m.width, dtype=torch.bool)
        for t in m.transforms:
            if t.slot is None:
                return fail(f"{t.out.name}: its input is not the head slices (…, H, Dh) of the projection output")
            idx = t.slot.index().reshape(-1)
            if folded[idx].any():
                return fail(f"{t.out.name}: two transforms act on the same projection features")
            folded[idx] = True
        for u, mask in m.readers:
            if (mask & folded).any():
                return fail(f"{u.name} also reads the transformed features of {m.anchor.name}")
        return ok()

    def rewrite(self, m: _FoldMatch, ctx: GraphContext) -> int:
        proj = m.proj
        slots = [t.slot for t in m.transforms if t.slot is not None]
        target = FoldCall(
            slots,
            proj.out_axis,
            [(t.kind.fold_matrix_of, len(t.params)) for t in m.transforms],
            f"kha_fold_{m.anchor.name}",
        )
        args = (proj.weight, proj.bias, *(p for t in m.transforms for p in t.params))
        with ctx.graph.inserting_before(proj.node):
            folded = ctx.call(target, args, like=proj.node)
            w = ctx.call(operator.getitem, (folded, 0), like=proj.node)
            b = ctx.call(operator.getitem, (folded, 1), like=proj.node) if proj.bias is not None else None
        proj.replace(w, b)
        for t in m.transforms:
            t.out.replace_all_uses_with(t.x)
            erase_dead(ctx.graph, list(t.nodes))
        return len(m.transforms)
