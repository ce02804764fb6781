"""Projection ops on the graph and the views after them: what the fold and deploy rules share.

The path from a projection op (``linear``, Conv1D's ``addmm``, ``matmul``) to a transform is
replayed on a meta stand-in whose token axes have stride 0, so any chain of views (``narrow``,
``reshape``, ``unflatten``, ``split`` ...) of separate, fused or interleaved projections gives the
head slot exactly.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import torch
from torch import Tensor, fx

from ..core.errors import KHAError
from ..core.kinds import Role
from ..model.rows import fold_rows
from ..model.slots import HeadSlot
from .graph import LINEAR_FNS, MATMUL_FNS, GraphContext, concrete

__all__ = [
    "FoldCall",
    "Projection",
    "ProjectionKind",
    "features",
    "fold_fn",
    "is_view",
    "projection",
    "same",
    "slot_of",
    "trace_back",
    "view_descendants",
]

ProjectionKind = Literal["linear", "addmm", "matmul"]  # linear: W (out, in); addmm, matmul: W (in, out)

_VIEW_METHODS = {
    "narrow",
    "view",
    "reshape",
    "unflatten",
    "flatten",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "split",
    "chunk",
    "contiguous",
    "__getitem__",
    "view_as",
}
_VIEW_FUNCTIONS: set[Any] = {
    torch.narrow,
    torch.reshape,
    torch.flatten,
    torch.unflatten,
    torch.transpose,
    torch.permute,
    torch.unsqueeze,
    torch.squeeze,
    torch.split,
    torch.chunk,
    operator.getitem,
}


@dataclasses.dataclass(frozen=True)
class Projection:
    """A projection op whose weight (and bias) are graph inputs: ``y = linear(x, W, b)`` and kin."""

    node: fx.Node
    kind: ProjectionKind
    weight: fx.Node
    bias: fx.Node | None

    @property
    def out_axis(self) -> int:
        """The weight axis that indexes output features."""
        return 0 if self.kind == "linear" else 1

    def replace(self, weight: fx.Node, bias: fx.Node | None) -> None:
        """Point the op at a new weight (and bias) node."""
        n = self.node
        if self.kind == "linear":
            n.update_arg(1, weight)
            if bias is not None:
                if len(n.args) > 2:
                    n.update_arg(2, bias)
                else:
                    n.update_kwarg("bias", bias)
        elif self.kind == "addmm":
            n.update_arg(2, weight)
            if bias is not None:
                n.update_arg(0, bias)
        else:
            n.update_arg(1, weight)


def projection(node: Any, ctx: GraphContext) -> Projection | None:
    """``node`` as a foldable projection op, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    kind: ProjectionKind
    if node.target in LINEAR_FNS:
        w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        kind = "linear"
    elif node.target is torch.addmm and len(node.args) == 3 and not node.kwargs:
        b, _, w = node.args
        kind = "addmm"
    elif node.target in MATMUL_FNS and len(node.args) == 2:
        w, b, kind = node.args[1], None, "matmul"
    else:
        return None
    wt = ctx.tensor_of(w)
    if wt is None or wt.dim() != 2 or not isinstance(w, fx.Node):
        return None
    if b is not None:
        bt = ctx.tensor_of(b)
        if bt is None or bt.dim() != 1 or not isinstance(b, fx.Node):
            return None
    return Projection(node, kind, w, b)


def is_view(node: fx.Node) -> bool:
    """A pure layout op (view, reshape, split, getitem, ...)."""
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    )


def _simulate_view(node: fx.Node, value: Any, base: Tensor) -> Any:
    """Run the view op ``node`` on the stand-in ``value`` (meta, token axes of stride 0).

    Returns the stand-in of its output, or None when the op is not a pure view of its input.
    """
    rest = []
    try:
        for a in node.args[1:]:
            if isinstance(a, fx.Node):
                ev = a.meta.get("example_value")
                if isinstance(ev, Tensor) or ev is None:
                    return None
                a = ev
            rest.append(concrete(a))
        kwargs = {k: concrete(v) for k, v in node.kwargs.items()}
    except KHAError:
        return None
    if any(isinstance(v, fx.Node) for v in kwargs.values()):
        return None
    try:
        if node.op == "call_method":
            assert isinstance(node.target, str)
            if node.target == "contiguous":
                return value  # same values, same order
            out = getattr(value, node.target)(*rest, **kwargs)
        else:
            assert callable(node.target)
            out = node.target(value, *rest, **kwargs)
    except Exception:
        return None
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not all(isinstance(o, Tensor) and o._base is base for o in outs):
        return None  # a copy (reshape that could not view, advanced indexing): not followed
    return out


def features(value: Any, width: int) -> Tensor:
    """Boolean mask (width,) of the projection features a stand-in value reads."""
    mask = torch.zeros(width, dtype=torch.bool)
    for v in value if isinstance(value, (tuple, list)) else (value,):
        sizes = [s if st != 0 else 1 for s, st in zip(v.shape, v.stride())]
        if 0 in sizes:
            continue
        idx = torch.arange(width).as_strided(sizes, v.stride(), v.storage_offset())
        mask[idx.reshape(-1)] = True
    return mask


def slot_of(value: Any, head_dim: int) -> HeadSlot | None:
    """The HeadSlot a stand-in (…, H, Dh) covers: token axes stride 0, one head axis, Dh contiguous."""
    if not isinstance(value, Tensor) or value.dim() < 1 or value.shape[-1] != head_dim:
        return None
    if head_dim > 1 and value.stride(-1) != 1:
        return None
    axes = [(s, st) for s, st in zip(value.shape[:-1], value.stride()[:-1]) if s != 1 and st != 0]
    if len(axes) > 1:
        return None
    heads, stride = axes[0] if axes else (1, head_dim)
    if heads > 1 and stride < head_dim:
        return None
    # the backend folds by position: which role these heads carry is not known here
    return HeadSlot(cast(Role, "?"), int(value.storage_offset()), int(heads), head_dim, int(stride))


def trace_back(node: fx.Node, ctx: GraphContext, limit: int = 16) -> Projection | None:
    """Walk from ``node`` back through view ops to a projection op."""
    cur: Any = node
    for _ in range(limit):
        if not isinstance(cur, fx.Node):
            return None
        proj = projection(cur, ctx)
        if proj is not None:
            return proj
        if not is_view(cur) or not cur.args:
            return None
        cur = cur.args[0]
    return None


def view_descendants(
    p: fx.Node, width: int, shape: Sequence[int]
) -> tuple[dict[fx.Node, Any], list[tuple[fx.Node, fx.Node]]]:
    """Stand-ins of every view reachable from ``p``, and the (consumer, viewed node) pairs that read them."""
    base = torch.empty(width, device="meta")
    values: dict[fx.Node, Any] = {p: base.as_strided(tuple(shape), (0,) * (len(shape) - 1) + (1,))}
    readers: list[tuple[fx.Node, fx.Node]] = []
    todo = [p]
    while todo:
        cur = todo.pop()
        for u in cur.users:
            if u in values:
                continue
            if (
                is_view(u)
                and u.args
                and u.args[0] is cur
                and all(n is cur or n not in values for n in u.all_input_nodes)
            ):
                out = _simulate_view(u, values[cur], base)
                if out is not None:
                    values[u] = out
                    todo.append(u)
                    continue
            readers.append((u, cur))
    return values, readers


def fold_fn(slots: Sequence[HeadSlot], out_axis: int) -> Callable[..., tuple[Tensor, ...]]:
    """``fn(W, b, *T) -> (W', b')`` (``(W',)`` without bias): :func:`~kha_compile.model.rows.fold_rows` per slot.

    Example::

        w2, b2 = fold_fn([slot], 0)(lin.weight, lin.bias, T)
    """

    def fn(weight: Tensor, bias: Tensor | None, *ts: Tensor) -> tuple[Tensor, ...]:
        w, b = weight, bias
        for slot, t in zip(slots, ts):
            w, b = fold_rows(w, b, slot, t.to(weight.device), out_axis)
        w = w.detach().contiguous()
        return (w,) if b is None else (w, b.detach())

    return fn


class FoldCall:
    """Graph target ``(W, b, *params) -> (W', b')`` (``(W',)`` without bias): the fold as a node of the graph.

    ``matrices[i] = (fn, n)``: slot ``i`` folds ``fn(*its n params)`` (a kind's ``fold_matrix_of``, or
    the identity for a precomputed matrix). Being a node, the fold reads the live parameters on
    every call; nothing is cached (see :mod:`kha_compile.backend.runtime` for its cost).

    Example::

        fold = FoldCall([slot], 0, [(get_transform("linear").fold_matrix_of, 1)], "kha_fold_q_proj")
        w2, b2 = fold(lin.weight, lin.bias, T)
    """

    def __init__(
        self,
        slots: Sequence[HeadSlot],
        out_axis: int,
        matrices: Sequence[tuple[Callable[..., Tensor], int]],
        name: str,
    ):
        self.slots = tuple(slots)
        self.out_axis = out_axis
        self.matrices = tuple(matrices)
        self._fold = fold_fn(self.slots, out_axis)
        self.__name__ = name  # how the generated graph code names it
        self.__module__ = __name__

    def __call__(self, weight: Tensor, bias: Tensor | None, *params: Tensor) -> tuple[Tensor, ...]:
        it = iter(params)
        ts = [fn(*(next(it) for _ in range(n))) for fn, n in self.matrices]
        return self._fold(weight, bias, *ts)

    def __repr__(self) -> str:
        return f"FoldCall({self.__name__}, {len(self.slots)} slot(s))"


def same(t: Tensor) -> Tensor:
    """The identity: the fold matrix of a matrix that is already one."""
    return t
