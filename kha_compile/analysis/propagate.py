"""The head map read by pushing a projection's feature index over every node between it and a target.

The walk of :mod:`.match` pushes one index along the nodes every path goes through. Where q, k and
v are split apart and joined again before they reach the attention (the linear-attention layers of
hybrid LLMs: ``cat([q, k, v], -1)``, a depthwise short convolution over the sequence, a split), no
single chain carries the features: this module pushes an index through every node of the subgraph
instead, in graph order:

* layout and index ops (:func:`.layout.push_layout`), tuple elements (``getitem``);
* ``cat`` of pieces, the pieces that do not come from the projection marked unknown (-1);
* a depthwise convolution (one filter per channel, ``groups`` = channels): each output channel is
  its input channel mixed over the sequence only, so the channel axis keeps its features;
* value ops that keep the shape of their one indexed input (activations, casts, masks, norms).

Products, projections, softmax and other convolutions stop it. The head map is read at the target
when every feature there is known. A shared transform put on the projection's output then runs
*before* the convolution: the placement the spec asks for (after the projection, before everything
else that touches the head vector). It does not commute with the convolution (each channel has its
own filter), which is no more a problem than its not commuting with RoPE.

Example::

    head_map = propagated_head_map(g, path, proj, q_node, 16)    # HeadMap(4 heads, 16 dims) or None
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from .layout import (
    INDEX_OPS,
    LAYOUT_OPS,
    HeadMap,
    NotLayout,
    constant_index,
    push_layout,
    read_head_map,
    shape_of,
    varies,
)

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph, Projection

__all__ = ["depthwise_channels", "propagated_head_map"]

aten = torch.ops.aten

_CONV_OPS = {aten.conv1d.default, aten.convolution.default, aten._convolution.default}
_STOP_OPS = {
    aten.matmul.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.baddbmm.out,
    aten.mm.default,
    aten.addmm.default,
    aten.linear.default,
    aten.einsum.default,
    aten.tensordot.default,
    aten.softmax.int,
    aten._softmax.default,
    aten._safe_softmax.default,
    aten.scaled_dot_product_attention.default,
    aten.conv2d.default,
    aten.conv3d.default,
    aten.sum.dim_IntList,
    aten.mean.dim,
}
_UNKNOWN = -1
_MAX_NUMEL = 1 << 22


def _conv_groups(node: Node) -> int | None:
    if node.target is aten.conv1d.default:
        groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    elif node.target is aten.convolution.default or node.target is aten._convolution.default:
        groups = node.args[8] if len(node.args) > 8 else None
    else:
        return None
    return groups if isinstance(groups, int) else None


def depthwise_channels(node: Node) -> int | None:
    """The channel count of a depthwise 1-D convolution over (B, C, L) (one filter per channel), or None.

    Example::

        depthwise_channels(conv1d_node)     # 192 for nn.Conv1d(192, 192, 4, groups=192)
    """
    if node.op != "call_function" or node.target not in _CONV_OPS or len(node.args) < 2:
        return None
    x, w = node.args[0], node.args[1]
    xs, ws, out = (shape_of(n) if isinstance(n, Node) else None for n in (x, w, node))
    groups = _conv_groups(node)
    if xs is None or ws is None or out is None or groups is None or len(xs) != 3 or len(ws) != 3:
        return None
    channels = xs[1]
    if groups != channels or ws[0] != channels or ws[1] != 1 or out[1] != channels:
        return None
    return channels


def _through_depthwise(idx: torch.Tensor, node: Node) -> torch.Tensor:
    out = shape_of(node)
    if out is None or idx.dim() != 3 or varies(idx, -1):
        raise NotLayout("depthwise convolution of an index that varies along the sequence")
    return idx[..., :1].expand(out)


def tuple_item(node: Node, known: dict[Node, Any]) -> Any:
    """What ``known`` holds for item ``node.args[1]`` of the tuple node ``node.args[0]`` (a getitem node)."""
    src, pos = node.args[0], node.args[1]
    value = known.get(src) if isinstance(src, Node) else None
    if not isinstance(value, (tuple, list)) or not isinstance(pos, int):
        raise NotLayout("getitem of no indexed tuple")
    return value[pos]


def cat_known(node: Node, known: dict[Node, Any], fill: int = _UNKNOWN) -> torch.Tensor:
    """The index tensor of ``aten.cat`` node ``node``: each piece's known index, ``fill`` for a piece from
    elsewhere (its static shape). Raises NotLayout for a computed list or a piece of no static shape."""
    pieces = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(pieces, (list, tuple)) or not isinstance(dim, int):
        raise NotLayout("cat of a computed list")
    parts = []
    for p in pieces:
        value = known.get(p) if isinstance(p, Node) else None
        if isinstance(value, torch.Tensor):
            parts.append(value)
            continue
        shape = shape_of(p) if isinstance(p, Node) else None
        if shape is None:
            raise NotLayout("cat of a piece without a static shape")
        parts.append(torch.full(shape, fill, dtype=torch.long))
    return torch.cat(parts, dim)


def _index_copy(g: MatchGraph, node: Node, known: dict[Node, Any]) -> torch.Tensor:
    base, dim, index, source = node.args[:4]
    value = known.get(base) if isinstance(base, Node) else None
    positions = constant_index(index, g.constants)
    if not isinstance(value, torch.Tensor) or positions is None or not isinstance(dim, int):
        raise NotLayout("index_copy of an unknown base or at computed positions")
    written = known.get(source) if isinstance(source, Node) else None
    if not isinstance(written, torch.Tensor):
        shape = shape_of(source)
        if shape is None:
            raise NotLayout("index_copy of a source without a static shape")
        written = torch.full(shape, _UNKNOWN, dtype=torch.long)
    return value.index_copy(dim, positions.long(), written.expand(shape_of(source) or written.shape))


def _kha_own(g: MatchGraph, node: Node, ins: list[Node]) -> bool:
    """``node`` is one of KHA's own transforms (a product with a ``.kha.`` parameter): features stay per head."""
    others = [a for a in node.all_input_nodes if a not in ins]
    return bool(others) and all(a.op == "placeholder" and ".kha." in f".{g.params.get(a.name, '')}" for a in others)


def _push(g: MatchGraph, node: Node, known: dict[Node, Any]) -> Any:
    """The index of ``node``'s output from the indices of its inputs; raises NotLayout where it cannot."""
    ins = [i for i in g.inputs(node) if i in known]
    if not ins:
        raise NotLayout("no indexed input")
    if node.target is operator.getitem:
        return tuple_item(node, known)
    if node.target is aten.cat.default:
        return cat_known(node, known)
    if node.target is aten.index_copy.default:  # head slots written back in place (KHA's own carriers)
        return _index_copy(g, node, known)
    first = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    if first is not None and depthwise_channels(node) is not None and first in known:
        return _through_depthwise(known[first], node)
    if first is not None and (node.target in LAYOUT_OPS or node.target in INDEX_OPS) and first in known:
        return push_layout(known[first], node, first, g.constants)
    if (node.target in _STOP_OPS or node.target in _CONV_OPS) and not _kha_own(g, node, ins):
        raise NotLayout(f"{node.target} mixes features or tokens")
    out = shape_of(node)
    values = [known[i] for i in ins]
    if out is None or not all(isinstance(v, torch.Tensor) and tuple(v.shape) == out for v in values):
        raise NotLayout(f"{node.target} changes the shape")
    if any(not torch.equal(values[0], v) for v in values[1:]):
        raise NotLayout(f"{node.target} combines different features")
    return values[0]  # a value op that keeps every feature in place


def _propagate(g: MatchGraph, path: list[Node], proj: Projection) -> dict[Node, Any]:
    """The index of every node of ``path`` the projection's features can be pushed to."""
    shape = shape_of(proj.node)
    if shape is None or not path or path[0] is not proj.node or math.prod(shape) > _MAX_NUMEL:
        return {}
    start = proj.out_index if proj.out_index is not None else torch.arange(shape[-1]).expand(shape)
    known: dict[Node, Any] = {proj.node: start}
    for node in path[1:]:
        if node.op != "call_function":
            continue
        try:
            known[node] = _push(g, node, known)
        except (NotLayout, RuntimeError, IndexError, TypeError, ValueError):
            continue
    return known


def propagated_head_map(
    g: MatchGraph, path: list[Node], proj: Projection, target: Node, expect_dim: int, head_axis: int = -1
) -> HeadMap | None:
    """The head map at ``target`` from ``proj``'s features pushed over every node of ``path``, or None.

    ``path``: the nodes on some path from the projection to the target, in graph order
    (:meth:`.graph.MatchGraph.path_nodes`).
    """
    idx = _propagate(g, path, proj).get(target)
    if not isinstance(idx, torch.Tensor) or idx.dim() < 1:
        return None
    if head_axis % idx.dim() != idx.dim() - 1:
        idx = idx.movedim(head_axis, -1)
    if idx.shape[-1] != expect_dim or bool((idx < 0).any()):
        return None
    return read_head_map(idx)


def foreign_at(g: MatchGraph, path: list[Node], proj: Projection, target: Node) -> bool:
    """True when every feature at ``target`` comes from another projection: ``proj``'s features were
    joined with others (``cat([q, k, v])``) and split off again before the target.

    Example::

        foreign_at(g, path, k_proj, q_node)     # True: the q piece of cat([q, k, v]) after the split
    """
    idx = _propagate(g, path, proj).get(target)
    return isinstance(idx, torch.Tensor) and idx.numel() > 0 and bool((idx < 0).all())
