"""The head map: which output features of a projection form head h, dim j.

An index tensor ``arange(out_features)``, broadcast to the projection output's shape, is pushed
through the pure layout ops (view, reshape, transpose, permute, split, getitem, select, slice,
unflatten, expand, index with constant indices, ...) between the projection and the attention
op. Where it reaches a tensor whose last axis is the head dimension, the varying axis is the
head axis, and the values are the feature numbers. Fused [Q|K|V], interleaved [H, 3, Dh] and
merged (B*H) layouts come out of the same rule, with no per-model tables.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.fx import Node

__all__ = [
    "CONSTANT",
    "IDENTITY_OPS",
    "INDEX_OPS",
    "LAYOUT_OPS",
    "HeadMap",
    "NotLayout",
    "constant_index",
    "push_layout",
    "read_head_map",
    "shape_of",
    "slot_from_map",
    "token_shape",
    "varies",
]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class HeadMap:
    num_heads: int
    head_dim: int
    index: Tensor  # (H, Dh) int64 feature numbers


def shape_of(node: Any) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if isinstance(val, torch.Tensor):
        try:
            return tuple(int(s) for s in val.shape)
        except Exception:  # symbolic sizes; an unbacked (data-dependent) size raises a guard error
            return None
    return None


def same_shape(a: Any, b: Any) -> bool:
    """Both nodes are tensors of one shape, symbolic sizes included (``u1 + 23`` equals only itself)."""
    va, vb = (n.meta.get("val") if isinstance(n, Node) else None for n in (a, b))
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    return [str(s) for s in va.shape] == [str(s) for s in vb.shape]


def token_shape(node: Any) -> tuple[int, ...] | None:
    """``shape_of``, with each data-dependent size (rows routed to one expert: ``u0``) as 1.

    Such sizes only count tokens; an index tensor of feature numbers is a broadcast copy along them.

    Example::

        token_shape(expert_linear)      # (1, 32) for a (u0, 32) output
    """
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    out = []
    for s in val.shape:
        try:
            out.append(int(s))
        except Exception:  # an unbacked (data-dependent) size
            out.append(1)
    return tuple(out)


def _to_output_shape(method: str) -> Callable:
    """Reshape or expand the index tensor to the node's (static) output shape."""

    def run(idx: Tensor, node: Node, *_a, **_k) -> Tensor:
        shape = shape_of(node)
        if shape is None:  # data-dependent token counts (as 1, as in the index): features must keep their count
            shape = token_shape(node)
            if shape is None or math.prod(shape) != idx.numel():
                raise NotLayout("no static shape")
        return getattr(idx, method)(shape)

    return run


_to_shape, _expand = _to_output_shape("reshape"), _to_output_shape("expand")


def _call(fn: Callable) -> Callable:
    def run(idx: Tensor, node: Node, *args, **kwargs):
        return fn(idx, *args, **kwargs)

    return run


def _identity(idx: Tensor, node: Node, *_a, **_k) -> Tensor:
    return idx


class NotLayout(Exception):
    pass


def _as_strided(idx: Tensor, node: Node, size: Any, stride: Any, offset: Any = None) -> Tensor:
    """``as_strided`` read off the storage: the input's elements are written to the storage positions
    its strides address (from the traced metadata), then read back with the op's strides
    (Longformer's overlapping chunks). Every position read must be one the input wrote."""
    src = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    if not isinstance(src, Tensor):
        raise NotLayout("as_strided of an input without metadata")
    try:
        s_stride, s_off = [int(x) for x in src.stride()], int(src.storage_offset())
        size, stride = [int(x) for x in size], [int(x) for x in stride]
        off = s_off if offset is None else int(offset)
    except Exception as exc:  # symbolic strides
        raise NotLayout("as_strided with symbolic strides") from exc
    if tuple(idx.shape) != tuple(src.shape):
        raise NotLayout("as_strided: the index does not have the input's shape")
    extent = 1 + max(
        s_off + sum((n - 1) * st for n, st in zip(idx.shape, s_stride)),
        off + sum((n - 1) * st for n, st in zip(size, stride)),
    )
    storage = torch.full((extent,), -1, dtype=idx.dtype)
    storage.as_strided(tuple(idx.shape), s_stride, s_off).copy_(idx)
    out = storage.as_strided(size, stride, off).clone()
    if bool((out < 0).any()):
        raise NotLayout("as_strided reads storage its input does not hold")
    return out


# Index value of a channel that holds a constant, not a feature (``F.pad(v, ..., value=1.0)`` on the head vector).
CONSTANT = -1


def _pad(idx: Tensor, node: Node, pad: list[int], *rest: Any, **kw: Any) -> Tensor:
    """``F.pad``. On axes the index does not vary along (sequence, spatial) the padded positions hold
    the same features as their neighbours (a zero there stays zero under any KHA transform, which
    maps 0 to 0). On an axis that carries features only a constant pad that appends is a layout: the
    new channels hold :data:`CONSTANT`, no feature (the ones column ReLU linear attention appends to
    its values to carry the normaliser: Sana, EfficientViT). A transform at the projection acts before
    them and leaves them as they are."""
    mode = rest[0] if rest else kw.get("mode", "constant")
    for i in range(len(pad) // 2):
        axis, before, after = idx.dim() - 1 - i, pad[2 * i], pad[2 * i + 1]
        if (before or after) and varies(idx, axis):
            if node.target is not aten.constant_pad_nd.default and mode != "constant":
                raise NotLayout(f"a {mode} pad on an axis that carries features (it copies features)")
            if before < 0 or after < 0:
                raise NotLayout("a pad that crops an axis that carries features")
            shape = list(idx.shape)
            parts = []
            for n in (before, after):
                shape[axis] = n
                parts.append(torch.full(shape, CONSTANT, dtype=idx.dtype))
            idx = torch.cat([parts[0], idx, parts[1]], axis)
            continue
        if before < 0 or after < 0:
            idx = idx.narrow(axis, max(-before, 0), idx.shape[axis] - max(-before, 0) - max(-after, 0))
        edge = idx.narrow(axis, 0, 1)  # every position of this axis holds the same features
        idx = torch.cat(
            [edge.repeat_interleave(max(before, 0), axis), idx, edge.repeat_interleave(max(after, 0), axis)], axis
        )
    return idx


# Ops whose output features are a rearrangement of the input's (target -> how to apply to an index tensor).
LAYOUT_OPS: dict[Any, Callable] = {}
for _op in (
    "view.default",
    "reshape.default",
    "_unsafe_view.default",
    "view_copy.default",
    "unsqueeze.default",
    "squeeze.dim",
    "squeeze.dims",
    "squeeze.default",
    "unflatten.int",
    "flatten.using_ints",
):
    _pkt, _ovl = _op.split(".")
    LAYOUT_OPS[getattr(getattr(aten, _pkt), _ovl)] = _to_shape
LAYOUT_OPS.update(
    {
        aten.transpose.int: _call(torch.transpose),
        aten.permute.default: _call(torch.permute),
        aten.t.default: _call(torch.t),
        aten.numpy_T.default: _call(lambda t: t.permute(*reversed(range(t.dim())))),
        aten.slice.Tensor: _call(
            lambda t, dim=0, start=None, end=None, step=1: aten.slice.Tensor(t, dim, start, end, step)
        ),
        aten.select.int: _call(torch.select),
        aten.narrow.default: _call(torch.narrow),
        aten.expand.default: _expand,
        aten.split.Tensor: _call(lambda t, size, dim=0: torch.split(t, size, dim)),
        aten.split_with_sizes.default: _call(lambda t, sizes, dim=0: torch.split(t, sizes, dim)),
        aten.chunk.default: _call(lambda t, chunks, dim=0: torch.chunk(t, chunks, dim)),
        aten.unbind.int: _call(lambda t, dim=0: torch.unbind(t, dim)),
        aten.movedim.int: _call(torch.movedim),
        aten.repeat.default: _call(lambda t, sizes: t.repeat(sizes)),
        aten.repeat_interleave.self_int: _call(
            lambda t, r, dim=None, output_size=None: torch.repeat_interleave(t, r, dim)
        ),
        operator.getitem: _call(operator.getitem),
        aten.as_strided.default: _as_strided,
        aten.pad.default: _pad,
        aten.constant_pad_nd.default: _pad,
        # complex RoPE (Llama-2 reference code): pairs of features become one complex number and back
        aten.view_as_complex.default: _call(lambda t: torch.view_as_complex(t.double().contiguous())),
        aten.view_as_real.default: _call(lambda t: torch.view_as_real(t).round().long() if t.is_complex() else t),
    }
)


LAYOUT_OPS.update(
    {
        aten.reshape_as.default: _to_shape,  # the other tensor gives only its shape (LeViT)
        aten.view_as.default: _to_shape,
        aten.expand_as.default: _expand,
        aten.unfold.default: _call(lambda t, dim, size, step: t.unfold(dim, size, step)),  # windows (HaloNet)
    }
)
SHAPE_OF_OTHER = {aten.reshape_as.default, aten.view_as.default, aten.expand_as.default}
# Ops that keep every feature where it is (casts, copies, dropout, identity-like).
IDENTITY_OPS = {
    aten.contiguous.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.detach_.default,  # a lifted constant index (an indexed head slot) is detached in place
    aten.to.dtype,
    aten.to.device,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.lift_fresh_copy.default,
    aten.dropout.default,
    aten.type_as.default,
}
for _same in IDENTITY_OPS:
    LAYOUT_OPS[_same] = _identity
# indexing: constant indices anywhere, computed ones along token axes only (see ``_index``)
INDEX_OPS = {aten.index.Tensor, aten._unsafe_index.Tensor, aten.gather.default, aten.index_select.default}


def push_layout(idx: Any, node: Node, data_input: Node, constants: dict[str, Tensor]) -> Any:
    """Apply the layout op ``node`` to the index tensor standing in for its input ``data_input``.

    Raises ``NotLayout`` when ``node`` is not a pure layout op of that input.
    """
    fn = LAYOUT_OPS.get(node.target)
    if node.target in INDEX_OPS:
        return _index(idx, node, data_input, constants)
    if fn is None:
        raise NotLayout(f"{node.target} is not a layout op")
    if not node.args or node.args[0] is not data_input:
        raise NotLayout("data input is not the first argument")
    if node.target in IDENTITY_OPS:  # casts and copies (x.type_as(v) reads only v's dtype)
        return idx
    if node.target in SHAPE_OF_OTHER:  # x.reshape_as(y): y gives its (static) shape only
        return fn(idx, node)
    rest = [a for a in node.args[1:]]
    if any(isinstance(a, Node) for a in rest):
        raise NotLayout("non-constant layout argument")
    return fn(idx, node, *rest, **dict(node.kwargs))


# ops that compute index tensors from constants alone (``torch.arange(H)[None, :, None]``): evaluated
_CONST_OPS = {
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.mul.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    *LAYOUT_OPS,
}
_CONST_MAX_NUMEL = 1 << 20


def constant_index(node: Any, constants: dict[str, Tensor], depth: int = 0) -> Tensor | None:
    """The value of an index computed from constants only (lifted constants, ``arange``, views), or None.

    Example::

        constant_index(arange_node, {})     # tensor([0, 1, 2, 3])
    """
    if not isinstance(node, Node) or depth > 16:
        return None
    if node.op == "placeholder":
        val = constants.get(node.name)
        return val.to("cpu") if val is not None and val.device.type != "meta" else None
    if node.op != "call_function" or node.target not in _CONST_OPS:
        return None

    def value(a: Any) -> Any:
        if isinstance(a, Node):
            v = constant_index(a, constants, depth + 1)
            if v is None:
                raise NotLayout("not a constant")
            return v
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        return a

    kwargs = {k: v for k, v in node.kwargs.items() if k not in ("device", "pin_memory", "layout")}
    try:
        out = cast(Callable, node.target)(*value(node.args), **value(kwargs))
    except (NotLayout, RuntimeError, TypeError, ValueError, IndexError):
        return None
    return out if isinstance(out, Tensor) and out.numel() <= _CONST_MAX_NUMEL else None


def _computed(ind: Node, idx: Tensor, axes: list[int], what: str) -> Tensor:
    """A stand-in for a computed index along ``axes``: zeros of its shape, valid while ``idx`` (the
    feature numbers) does not vary along those axes (a gather along tokens keeps every head vector)."""
    shape, val = token_shape(ind), ind.meta.get("val")  # a data-dependent count of picks as 1
    if shape is None:
        raise NotLayout(f"{what} with a computed index of symbolic shape")
    if isinstance(val, Tensor) and val.dtype is torch.bool:
        raise NotLayout(f"{what} with a boolean mask (a data-dependent shape)")
    for a in axes:
        if idx.shape[a] > 1 and varies(idx, a):
            raise NotLayout(f"{what} along axis {a}, which holds heads or features, with a computed index")
    return torch.zeros(shape, dtype=torch.long)


def _index(idx: Tensor, node: Node, data_input: Node, constants: dict[str, Tensor]) -> Tensor:
    """``x[i0, i1, ...]``, ``gather`` and ``index_select`` on the index tensor.

    Constant indices (or indices computed from constants) are applied as they are; a computed index
    (top-k query selection, sampled keys, graph edges) is followed along the token (batch, sequence)
    axes and refused along the head or feature axes.
    """
    if node.args[0] is not data_input:
        raise NotLayout("data input is not indexed")
    t = node.target
    if t in (aten.gather.default, aten.index_select.default):
        dim, ind = node.args[1], node.args[2]
        if not isinstance(dim, int) or not isinstance(ind, Node):
            raise NotLayout("a gather without a constant dim")
        dim %= idx.dim()
        const = constant_index(ind, constants)
        what = "gather" if t is aten.gather.default else "index_select"
        use = const if const is not None else _computed(ind, idx, [dim], what)
        if t is aten.gather.default:
            return torch.gather(idx, dim, use.long())
        return torch.index_select(idx, dim, use.long().reshape(-1))
    indices: list[Tensor | None] = []
    raw_indices: Any = node.args[1]
    for axis, ind in enumerate(raw_indices):
        if ind is None:
            indices.append(None)
            continue
        while isinstance(ind, Node) and ind.op == "call_function" and ind.target in IDENTITY_OPS:
            ind = ind.args[0]  # lift_fresh_copy(constant), casts
        val = constant_index(ind, constants)
        if val is None:
            if not isinstance(ind, Node):
                raise NotLayout("index with a computed (non-constant) tensor")
            val = _computed(ind, idx, [axis], "index")
        indices.append(val)
    return aten.index.Tensor(idx, indices)


def varies(idx: Tensor, axis: int) -> bool:
    """True when the index tensor ``idx`` holds different values along ``axis`` (heads or features there).

    Example::

        varies(torch.arange(4).expand(3, 4), 0)     # False: a broadcast copy along axis 0
    """
    if idx.stride(axis) == 0:  # a broadcast (expanded) axis is constant by construction
        return False
    axis %= idx.dim()
    for a in range(idx.dim()):  # the other broadcast axes hold copies: one of each is compared
        if a != axis and idx.stride(a) == 0 and idx.shape[a] > 1:
            idx = idx.narrow(a, 0, 1)
    return bool((idx != idx.narrow(axis, 0, 1)).any())


def read_head_map(idx: Tensor) -> HeadMap | None:
    """Read (H, Dh) -> feature off an index tensor whose last axis is the head dimension.

    The index must vary along the last axis and along at most one other axis (the head axis,
    possibly merged with batch as B*H); every other axis is a broadcast copy. Channels that hold
    :data:`CONSTANT` in every head (a ones column padded on) are not part of the map.
    """
    if not isinstance(idx, Tensor) or idx.dim() < 1 or idx.shape[-1] < 1:
        return None
    const = idx == CONSTANT
    if bool(const.any()):  # constant channels appended to the head vector: the map is of the others
        keep = ~const.reshape(-1, idx.shape[-1]).all(0)
        if bool(const[..., keep].any()) or not bool(keep.any()):
            return None  # a constant where other heads or tokens have a feature: not one head layout
        idx = idx[..., keep]
    dh = idx.shape[-1]
    if dh > 1 and not varies(idx, -1):
        return None
    varying = [a for a in range(idx.dim() - 1) if idx.shape[a] > 1 and varies(idx, a)]
    if len(varying) > 1:
        return None
    if not varying:
        rows = idx.reshape(-1, dh)[:1]
    else:
        axis = varying[0]
        other = [0] * (idx.dim() - 1)
        sel = idx
        for a in reversed(range(idx.dim() - 1)):
            if a != axis:
                sel = sel.select(a, other[a])
        rows = sel  # (n, Dh)
        n = rows.shape[0]
        period = next((p for p in range(1, n + 1) if n % p == 0 and torch.equal(rows, rows[:p].repeat(n // p, 1))), n)
        rows = rows[:period]
    if len(set(rows.flatten().tolist())) != rows.numel():
        return None  # a feature appears twice: not a head split
    return HeadMap(rows.shape[0], dh, rows.clone())


def slot_from_map(head_map: HeadMap) -> tuple[int, int] | None:
    """(offset, head_stride) when feature(h, j) = offset + h*stride + j; None for other maps."""
    idx = head_map.index
    offset = int(idx[0, 0])
    j = torch.arange(head_map.head_dim)
    if not torch.equal(idx[0], offset + j):
        return None
    stride = int(idx[1, 0] - idx[0, 0]) if head_map.num_heads > 1 else head_map.head_dim
    h = torch.arange(head_map.num_heads).unsqueeze(1)
    if not torch.equal(idx, offset + h * stride + j):
        return None
    return offset, stride
