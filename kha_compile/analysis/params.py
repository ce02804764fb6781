"""Projections read off a parameter of any rank: which output features of the op come from which elements.

A projection op (``linear``, ``addmm``, ``mm``, ``matmul``, ``einsum``, ``tensordot``) contracts an
activation with a weight. Its output features are the weight's *output axes* (those that reach
the op's output), flattened in the weight's axis order. Two index tensors describe a projection:

* ``out_index`` — the op output's shape, holding the feature number of every element (broadcast
  over batch/sequence axes). The head map is read by pushing it through the layout ops to the
  attention, exactly as for an ``nn.Linear`` output (there it is ``arange(out)`` on the last axis).
* ``feature_map`` — feature number -> flat position over the *parameter's* output axes, found by
  pushing each parameter axis's ``arange`` through the layout ops between the parameter and the op.

Bias pieces (a bias argument, or a bias added right after the op, assembled from parameters and
zeros with ``cat``) get their own feature maps, so linear KHA can be folded into every parameter
that feeds the projection output.

Example::

    info = projection_info(node)       # (weight arg, weight output axes, out_index) or None
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, cast

import torch
from torch import Tensor
from torch.fx import Node
from torch.fx.node import Argument

from .layout import IDENTITY_OPS, LAYOUT_OPS, NotLayout, push_layout, shape_of, token_shape

__all__ = [
    "POINTWISE_CONVS",
    "PROJ_TARGETS",
    "ParamPiece",
    "bias_pieces",
    "conv_groups",
    "einsum_subscripts",
    "feature_axis_last",
    "param_chain",
    "post_bias",
    "projection_info",
    "root_param",
    "weight_source",
]

aten = torch.ops.aten

POINTWISE_CONVS = {
    aten.conv1d.default,  # pointwise (kernel 1) only: a linear over the channel axis of (B, C, T)
    aten.conv2d.default,  # pointwise (1x1) only: a linear over the channel axis of (B, C, H, W)
}
PROJ_TARGETS = {
    *POINTWISE_CONVS,
    aten.linear.default,
    aten.addmm.default,
    aten.matmul.default,
    aten.mm.default,
    aten.einsum.default,
    aten.tensordot.default,
}
_ZERO_OPS = {aten.zeros_like.default, aten.new_zeros.default, aten.zeros.default}
_ADD_OPS = {aten.add.Tensor}


@dataclasses.dataclass
class ParamPiece:
    """One parameter (or zero buffer) feeding features of a projection output.

    ``feature_map[f]`` is the flat position of feature ``f`` over the parameter's ``axes``
    (its output axes), or -1 where the feature does not come from this parameter.
    """

    name: str  # qualified name (traced paths)
    axes: tuple[int, ...]
    feature_map: Tensor
    kind: str = "weight"  # "weight" | "bias" | "buffer" (a buffer must hold zeros on the touched features)


def einsum_subscripts(eq: str, ndims: list[int], out_ndim: int) -> tuple[list[str], str]:
    """Split an einsum equation into per-operand letters and output letters, expanding '...'.

    Example::

        einsum_subscripts("...qd,...kd->...qk", [4, 4], 4)   # (['\u010e\u010fqd', '\u010e\u010fkd'], '\u010e\u010fqk')
    """
    eq = eq.replace(" ", "")
    if "->" not in eq:
        raise NotLayout("implicit einsum output")
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != len(ndims):
        raise NotLayout("einsum operand count")
    fill = [chr(0x100 + i) for i in range(16)]  # stand-in letters for the axes under '...'
    expanded = []
    for spec, nd in zip(ops, ndims):
        if "..." in spec:
            n = nd - (len(spec) - 3)
            spec = spec.replace("...", "".join(fill[16 - n :]) if n else "")
        expanded.append(spec)
    if "..." in out:
        n = out_ndim - (len(out) - 3)
        out = out.replace("...", "".join(fill[16 - n :]) if n else "")
    return expanded, out


def projection_info(node: Node) -> list[tuple[Node, Node, tuple[int, ...], Tensor]]:
    """Candidate (activation arg, weight arg, the weight arg's output axes, out_index) of a projection op.

    ``out_index`` has the op output's shape; element values are feature numbers (flat over the
    weight arg's output axes, in its axis order). The weight is the operand that is not the
    activation; which one is a parameter is decided by the caller (:func:`weight_source`).
    """
    if node.op != "call_function" or node.target not in PROJ_TARGETS:
        return []
    out_shape = token_shape(node)  # rows routed to one expert: a data-dependent count, as 1
    if out_shape is None:
        return []
    t = node.target
    x: Argument
    w: Argument
    if t in POINTWISE_CONVS:
        return _pointwise_conv(node, out_shape)
    if t is aten.einsum.default:
        raw = node.args[1]
        operands = [o for o in raw if isinstance(o, Node)] if isinstance(raw, (list, tuple)) else []
        if len(operands) != 2 or len(cast(list, raw)) != 2:
            return []
        cands = []
        for wi in (1, 0):
            x, w = operands[1 - wi], operands[wi]
            ws, xs = shape_of(w), shape_of(x)
            if ws is None or xs is None:
                continue
            try:
                specs, out = einsum_subscripts(
                    cast(str, node.args[0]), [len(xs), len(ws)] if wi else [len(ws), len(xs)], len(out_shape)
                )
            except NotLayout:
                return []
            wspec, xspec = specs[wi], specs[1 - wi]
            if len(set(wspec)) != len(wspec):
                continue
            if not any(c in xspec and c not in out for c in wspec):
                continue  # nothing contracted: a per-feature scale (a gated unit's gamma), not a projection
            axes = tuple(i for i, c in enumerate(wspec) if c in out)
            cands.append((x, w, axes, _einsum_index(wspec, ws, axes, out, out_shape)))
        return cands
    if t is aten.tensordot.default:
        x, w = node.args[0], node.args[1]
        ws = shape_of(w)
        if not isinstance(w, Node) or not isinstance(x, Node) or ws is None:
            return []
        dims_b = [d % len(ws) for d in cast("list[int]", node.args[3])]
        axes = tuple(i for i in range(len(ws)) if i not in dims_b)
        feats = torch.arange(_numel(ws, axes)).reshape([ws[a] for a in axes])
        lead = len(out_shape) - len(axes)
        return [(x, w, axes, feats.reshape((1,) * lead + feats.shape).expand(out_shape))]
    if t is aten.linear.default:
        x, w, axes = node.args[0], node.args[1], (0,)
    elif t is aten.addmm.default:
        x, w, axes = node.args[1], node.args[2], (1,)
    else:  # mm, matmul: x @ w
        x, w = node.args[0], node.args[1]
        ws = shape_of(w)
        if ws is None or len(ws) < 2 or not isinstance(w, Node) or not isinstance(x, Node):
            return []
        axes = tuple(i for i in range(len(ws)) if i != len(ws) - 2)
        if len(ws) > 2:  # a batched weight (..., d, n): output (..., m, n) with the weight's batch axes
            feats = torch.arange(_numel(ws, axes)).reshape([ws[a] for a in axes]).unsqueeze(-2)
            try:
                return [(x, w, axes, feats.expand(out_shape))]
            except RuntimeError:
                return []
    if not isinstance(w, Node) or not isinstance(x, Node):
        return []
    return [(x, w, axes, torch.arange(out_shape[-1]).expand(out_shape))]


def _pointwise_conv(node: Node, out_shape: tuple[int, ...]) -> list[tuple[Node, Node, tuple[int, ...], Tensor]]:
    """``conv1d``/``conv2d`` with kernel 1 (stride 1, no padding): features on the channel axis. A grouped
    one (SqueezeBERT) is a block-diagonal linear; :func:`conv_groups` tells the handler its groups."""
    x, w = node.args[0], node.args[1]
    ws = shape_of(w)
    rest = list(node.args[3:]) + [None] * 4
    stride, padding, dilation, groups = rest[:4]
    spatial = len(ws) - 2 if ws is not None else 0
    if (
        not isinstance(x, Node)
        or not isinstance(w, Node)
        or ws is None
        or spatial < 1
        or any(k != 1 for k in ws[2:])
        or not _all(stride, 1)
        or not _all(padding, 0)
        or not _all(dilation, 1)
        or not isinstance(groups, (int, type(None)))
    ):
        return []
    channel = len(out_shape) - 1 - spatial  # (B, C, T) or (B, C, H, W), or unbatched
    view = [1] * len(out_shape)
    view[channel] = ws[0]
    return [(x, w, (0,), torch.arange(ws[0]).reshape(view).expand(out_shape))]


def _all(value: Any, default: int) -> bool:
    """A conv's stride / padding / dilation argument is ``default`` on every axis (or left out)."""
    return value is None or value == default or (isinstance(value, (list, tuple)) and all(v == default for v in value))


def conv_groups(node: Node) -> int:
    """The number of groups of a ``conv1d`` projection node (1 for any other op).

    Example::

        conv_groups(node)     # 4 for SqueezeBERT's query conv
    """
    if node.target not in POINTWISE_CONVS or len(node.args) < 7:
        return 1
    groups = node.args[6]
    return groups if isinstance(groups, int) else 1


def feature_axis_last(node: Node, out_index: Tensor) -> Tensor:
    """``out_index`` with the feature axis last, as a bias added to the op's output broadcasts.

    Example::

        feature_axis_last(conv_node, idx)      # (B, C, T) -> (B, T, C)
    """
    if node.target not in POINTWISE_CONVS:
        return out_index
    return out_index.movedim(out_index.dim() - len(shape_of(node.args[1]) or (0, 0, 0)) + 1, -1)


def _numel(shape: tuple[int, ...], axes: tuple[int, ...]) -> int:
    n = 1
    for a in axes:
        n *= shape[a]
    return n


def _einsum_index(
    wspec: str, ws: tuple[int, ...], axes: tuple[int, ...], out: str, out_shape: tuple[int, ...]
) -> Tensor:
    feats = torch.arange(_numel(ws, axes)).reshape([ws[a] for a in axes])  # weight out axes, weight order
    letters = [wspec[a] for a in axes]
    order = sorted(range(len(letters)), key=lambda i: out.index(letters[i]))
    feats = feats.permute(order)  # output order
    shape = [1] * len(out)
    for i in order:
        shape[out.index(letters[i])] = ws[axes[i]]
    return feats.reshape(shape).expand(out_shape)


def param_chain(node: Any, params: dict[str, str]) -> tuple[Node, list[tuple[Node, Node]]] | None:
    """(the parameter placeholder behind ``node``, the layout ops on the way as (op, its data input)).

    Walks back from ``node`` through layout ops only; None when another op is on the way or the
    walk does not end at a parameter. The chain runs from ``node`` back to the parameter.

    Example::

        found = param_chain(weight_node, params)
        if found is not None:
            placeholder, chain = found   # chain == [] when weight_node is the parameter itself
    """
    chain: list[tuple[Node, Node]] = []
    cur = node
    while isinstance(cur, Node) and cur.op == "call_function":
        src = cur.args[0] if cur.args else None
        if cur.target not in LAYOUT_OPS or not isinstance(src, Node):
            return None
        chain.append((cur, src))
        cur = src
    if isinstance(cur, Node) and cur.op == "placeholder" and cur.name in params:
        return cur, chain
    return None


def root_param(node: Any, params: dict[str, str]) -> Node | None:
    """The parameter placeholder behind ``node`` through layout ops, or None."""
    found = param_chain(node, params)
    return found[0] if found is not None else None


def _axis_indices(
    node: Node, params: dict[str, str], constants: dict[str, Tensor]
) -> tuple[str, tuple[int, ...], list[Tensor]] | None:
    """(param name, param shape, per-axis index tensors at ``node``) through layout ops."""
    found = param_chain(node, params)
    if found is None:
        return None
    cur, chain = found
    shape = shape_of(cur)
    if shape is None or not shape:
        return None
    per_axis = []
    for a, n in enumerate(shape):
        view = [1] * len(shape)
        view[a] = n
        idx = torch.arange(n).reshape(view).expand(shape)
        try:
            for op, src in reversed(chain):
                idx = push_layout(idx, op, src, constants)
        except (NotLayout, RuntimeError, IndexError, TypeError):
            return None
        if not isinstance(idx, Tensor):
            return None
        per_axis.append(idx)
    return params[cur.name], shape, per_axis


def weight_source(
    node: Node, arg_axes: tuple[int, ...], params: dict[str, str], constants: dict[str, Tensor]
) -> ParamPiece | None:
    """The parameter seen through layout ops at ``node`` (a projection's weight arg), as a piece.

    ``arg_axes`` are the weight arg's output axes. Each parameter axis must follow only the output
    axes or only the contracted ones; the output axes of the parameter are those that follow the
    output. None when ``node`` is not a parameter seen that way.
    """
    direct = _direct_weight(node, arg_axes, params)
    if direct is not False:
        return direct
    found = _axis_indices(node, params, constants)
    if found is None:
        return None
    name, shape, per_axis = found
    nd = per_axis[0].dim()
    if any(a >= nd for a in arg_axes):
        return None
    rest = [a for a in range(nd) if a not in arg_axes]
    n_out = _numel(tuple(per_axis[0].shape), arg_axes)
    p_axes, cols = [], []
    for a, idx in enumerate(per_axis):
        m = idx.permute(*arg_axes, *rest).reshape(n_out, -1)  # (features, contracted)
        by_col = bool((m == m[:, :1]).all())
        by_row = bool((m == m[:1, :]).all())
        if by_col and not by_row:
            p_axes.append(a)
            cols.append(m[:, 0])
        elif not by_row and shape[a] != 1:
            return None  # one parameter axis follows both features and contracted axes
    if not p_axes:
        return None
    fmap = torch.zeros(n_out, dtype=torch.long)
    for a, c in zip(p_axes, cols):
        fmap = fmap * shape[a] + c
    if fmap.unique().numel() != fmap.numel():
        return None
    return ParamPiece(name, tuple(p_axes), fmap)


def _direct_weight(node: Node, arg_axes: tuple[int, ...], params: dict[str, str]) -> ParamPiece | Literal[False] | None:
    """:func:`weight_source` of a parameter used as it is (no layout op on the way), from its shape alone:
    its output axes are ``arg_axes`` (those of size 1 aside), read in their order. False when a layout op
    is on the way (the index tensors are pushed through it instead: as many elements as the weight)."""
    found = param_chain(node, params)
    if found is None or found[1] or len(set(arg_axes)) != len(arg_axes):
        return False
    shape = shape_of(found[0])
    if not shape or any(a >= len(shape) for a in arg_axes):
        return None
    out_shape = [shape[a] for a in arg_axes]
    p_axes = tuple(a for a in range(len(shape)) if a in arg_axes and shape[a] != 1)
    if not p_axes:
        return None
    fmap = torch.zeros(_numel(tuple(shape), arg_axes), dtype=torch.long)
    for a in p_axes:
        j = arg_axes.index(a)
        view = [1] * len(arg_axes)
        view[j] = shape[a]
        fmap = fmap * shape[a] + torch.arange(shape[a]).reshape(view).expand(out_shape).reshape(-1)
    return ParamPiece(params[found[0].name], p_axes, fmap)


def _global_positions(
    node: Any, params: dict[str, str], buffers: dict[str, str], table: list, depth: int = 0
) -> Tensor | None:
    """Index tensor of ``node``'s shape: id of each element's source (param offset + position, -1 for zero)."""
    if depth > 24 or not isinstance(node, Node):
        return None
    shape = shape_of(node)
    if shape is None:
        return None
    if node.op == "placeholder" and (node.name in params or node.name in buffers):
        base = sum(int(torch.Size(s).numel()) for _, s, _ in table)
        table.append((params.get(node.name) or buffers[node.name], shape, "bias" if node.name in params else "buffer"))
        return base + torch.arange(int(torch.Size(shape).numel())).reshape(shape)
    if node.op != "call_function":
        return None
    if node.target in _ZERO_OPS:
        return torch.full(shape, -1, dtype=torch.long)
    if node.target is aten.cat.default:
        inputs = cast("list[Node]", node.args[0])
        parts = [_global_positions(p, params, buffers, table, depth + 1) for p in inputs]
        found = [p for p in parts if p is not None]
        if len(found) != len(parts):
            return None
        return torch.cat(found, dim=cast(int, node.args[1]) if len(node.args) > 1 else 0)
    if node.target in LAYOUT_OPS or node.target in IDENTITY_OPS:
        src = node.args[0] if node.args else None
        inner = _global_positions(src, params, buffers, table, depth + 1)
        if inner is None or not isinstance(src, Node):
            return None
        try:
            return push_layout(inner, node, src, {})
        except (NotLayout, RuntimeError, IndexError, TypeError):
            return None
    return None


def bias_pieces(
    bias: Node, out_index: Tensor, n_features: int, params: dict[str, str], buffers: dict[str, str]
) -> tuple[list[ParamPiece], str]:
    """Parameter pieces of a bias added to a projection output (broadcast to ``out_index``'s shape)."""
    table: list = []
    pos = _global_positions(bias, params, buffers, table)
    if pos is None:
        return [], f"bias {bias.name} is not assembled from parameters and zeros"
    try:
        pos = pos.expand(out_index.shape) if pos.dim() <= out_index.dim() else None
    except RuntimeError:
        pos = None
    if pos is None:
        return [], f"bias {bias.name} does not broadcast over the projection output"
    per_feature = torch.full((n_features,), -2, dtype=torch.long)
    flat_f, flat_p = out_index.reshape(-1), pos.reshape(-1)
    per_feature[flat_f] = flat_p
    if not bool((per_feature[flat_f] == flat_p).all()):
        return [], f"bias {bias.name} differs along the batch axes of the projection output"
    pieces, base = [], 0
    for name, shape, kind in table:
        n = int(torch.Size(shape).numel())
        inside = (per_feature >= base) & (per_feature < base + n)
        if bool(inside.any()):
            fmap = torch.where(inside, per_feature - base, torch.full_like(per_feature, -1))
            pieces.append(ParamPiece(name, tuple(range(len(shape))), fmap, kind))
        base += n
    return pieces, ""


def post_bias(node: Node) -> Node | None:
    """The bias operand of an add that is the projection's only user (``einsum(...) + b``), if any."""
    users = list(node.users)
    if len(users) != 1:
        return None
    add = users[0]
    if add.op != "call_function" or add.target not in _ADD_OPS or len(add.args) < 2 or add.kwargs.get("alpha", 1) != 1:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0] if add.args[1] is node else None
    if not isinstance(other, Node) or shape_of(add) != shape_of(node):
        return None
    return other
