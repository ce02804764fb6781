"""Values written into another tensor: KV caches filled in place, and scatters along the token axis.

Reference decoders keep keys and values in a cache and read it back for the attention:

* slice assignment, ``cache_k[:b, pos:pos + L] = xk`` then ``cache_k[:b, :pos + L]`` (Meta's Llama
  code): ``copy_`` into a view of a buffer, a list element or an argument;
* ``index_put_`` / ``index_copy_`` at ``input_pos`` (gpt-fast), whose result is the cache;
* ``zeros.index_add(0, idx, rows)`` / ``scatter_add`` / ``slice_scatter``: rows placed (or summed)
  along a token axis (routed experts put their outputs back in token order).

Each keeps every head vector intact when the write addresses token (batch, sequence) positions
only: the head map of the written tensor is the written piece's, broadcast over the axes it
does not fill (:func:`through_write`). A write that addresses the head or feature axis is not a
layout (``NotLayout``). Index arguments are positions, not data: :data:`INDEX_ARGS` says which
arguments the walk from an attention back to its projections must not follow.

Example::

    idx = through_write(idx, index_put_node, values_node)     # (B, H, L, Dh) -> (B, H, max_len, Dh)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

from .layout import NotLayout, shape_of, varies

__all__ = ["INDEX_ARGS", "WRITE_OPS", "index_args", "through_write", "written_value"]

aten = torch.ops.aten

# op -> position of the values it writes into its first argument (the result has that argument's shape)
WRITE_OPS: dict[Any, int] = {
    aten.index_put_.default: 2,
    aten.index_put.default: 2,
    aten._unsafe_index_put.default: 2,
    aten.index_copy_.default: 3,
    aten.index_copy.default: 3,
    aten.index_add_.default: 3,
    aten.index_add.default: 3,
    aten.scatter_add.default: 3,
    aten.scatter_add_.default: 3,
    aten.scatter.src: 3,
    aten.scatter_.src: 3,
    aten.scatter_reduce.two: 3,
    aten.scatter_reduce_.two: 3,
    aten.slice_scatter.default: 1,
    aten.select_scatter.default: 1,
}
# op -> positions of arguments that are indices (positions, not values that flow into the result)
INDEX_ARGS: dict[Any, tuple[int, ...]] = {
    aten.index.Tensor: (1,),
    aten._unsafe_index.Tensor: (1,),
    aten.gather.default: (2,),
    aten.index_select.default: (2,),
    aten.index_put_.default: (1,),
    aten.index_put.default: (1,),
    aten._unsafe_index_put.default: (1,),
    aten.index_copy_.default: (2,),
    aten.index_copy.default: (2,),
    aten.index_add_.default: (2,),
    aten.index_add.default: (2,),
    aten.scatter_add.default: (2,),
    aten.scatter_add_.default: (2,),
    aten.scatter.src: (2,),
    aten.scatter_.src: (2,),
    aten.scatter_reduce.two: (2,),
    aten.scatter_reduce_.two: (2,),
    aten.index_fill.int_Scalar: (2,),
    aten.index_fill_.int_Scalar: (2,),
}


def index_args(node: Node) -> set[Node]:
    """The nodes ``node`` reads as indices (positions), not as values.

    Example::

        index_args(gather_node)      # {topk_indices}
    """
    out: set[Node] = set()
    for pos in INDEX_ARGS.get(node.target, ()) if node.op == "call_function" else ():
        arg = node.args[pos] if len(node.args) > pos else None
        for a in arg if isinstance(arg, (list, tuple)) else [arg]:
            if isinstance(a, Node):
                out.add(a)
    return out


def written_value(node: Node) -> Node | None:
    """The values a write op puts into its first argument (``index_put_(cache, idx, v)``: ``v``)."""
    pos = WRITE_OPS.get(node.target) if node.op == "call_function" else None
    arg = node.args[pos] if pos is not None and len(node.args) > pos else None
    return arg if isinstance(arg, Node) else None


def _addressed_axes(node: Node, rank: int) -> set[int]:
    """Axes of the written tensor that an index or a dim argument of ``node`` addresses."""
    t = node.target if node.op == "call_function" else None
    if t in (aten.index_put_.default, aten.index_put.default, aten._unsafe_index_put.default):
        indices = node.args[1] if len(node.args) > 1 else ()
        return {a for a, ind in enumerate(indices or ()) if ind is not None}  # type: ignore[arg-type]
    if t in WRITE_OPS:
        dim = node.args[2] if t in (aten.slice_scatter.default, aten.select_scatter.default) else node.args[1]
        if len(node.args) <= 2 and t is aten.slice_scatter.default:
            dim = node.kwargs.get("dim", 0)
        return {dim % rank} if isinstance(dim, int) else set(range(rank))
    return set()


def through_write(idx: Any, node: Node, piece: Node) -> Tensor:
    """The index tensor of ``node`` (a tensor ``piece`` was written into) from the piece's.

    The write may address token positions only: along every axis it addresses, or where the piece
    is smaller than the whole, the piece's index must be a broadcast copy (no head or feature
    varies there); the whole then holds the same head map, broadcast. Raises ``NotLayout``
    otherwise (a write into part of the head or feature axis).

    Example::

        through_write(idx, cache_placeholder, xk_view)     # cache_k[:b, pos:pos + L] = xk
    """
    out = shape_of(node)
    if out is None or not isinstance(idx, Tensor):
        raise NotLayout("a write without a static shape")
    if node.op == "call_function" and node.target is aten.select_scatter.default and isinstance(node.args[2], int):
        idx = idx.unsqueeze(node.args[2] % len(out))
    if idx.dim() > len(out):
        raise NotLayout("the written piece has more axes than the tensor written into")
    idx = idx.reshape((1,) * (len(out) - idx.dim()) + tuple(idx.shape))
    addressed = _addressed_axes(node, len(out))
    for a in range(len(out)):
        if idx.shape[a] == out[a] and a not in addressed:
            continue
        if a == len(out) - 1 and idx.shape[a] != out[a]:
            raise NotLayout("written into part of the feature axis")
        if idx.shape[a] > 1 and varies(idx, a):
            raise NotLayout(f"written along axis {a}, which holds heads or features")
        idx = idx.narrow(a, 0, 1)
    return idx.expand(out)
