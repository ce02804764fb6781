"""Products between a projection and the attention that mix tokens, not features: the walk goes through.

Linformer compresses the keys and values along the sequence (``E @ K``, or an ``nn.Linear`` over the
token axis of ``K^T``) after their projection and before the head split. Such a product contracts an
axis along which no feature number varies (tokens), and its other factor is the same for every
feature, so a per-head transform of the features commutes with it: ``E (K T) = (E K) T``. KHA stays
after the projection, where it folds, and the walk pushes the feature index through the product.

A product that contracts features, whose other factor differs per feature (a per-channel mixing), or
whose two factors both come from the projection (a bilinear form) does not commute: the walk stops
there (``NotLayout`` with the reason), and the match names the op in words (:func:`~.describe.op_words`).

Example::

    idx = through_product(idx, linear_node, prev, path_set)    # (B, D, N) -> (B, D, K)
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any, cast

import torch
from torch import Tensor
from torch.fx import Node

from .describe import op_words
from .layout import NotLayout, shape_of, token_shape, varies
from .params import einsum_subscripts
from .propagate import depthwise_channels

__all__ = ["MIXING_PRODUCTS", "temporal_conv", "through_product"]

aten = torch.ops.aten

MIXING_PRODUCTS = {
    aten.linear.default,
    aten.matmul.default,
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.einsum.default,
}


_CONV_OPS = {aten.conv1d.default, aten.convolution.default}


def temporal_conv(path: list[Node]) -> str:
    """Why a convolution over the sequence between the projection and the attention defeats KHA, or ''.

    Unlike a product over tokens, a convolution mixes the features of a head too (one kernel per
    channel pair), so a shared transform after the projection would not commute with it.

    Example::

        temporal_conv(g.path_nodes(proj.node, target))     # "" when there is none
    """
    for n in path:
        w = n.args[1] if n.op == "call_function" and n.target in _CONV_OPS and len(n.args) > 1 else None
        shape = shape_of(w) if isinstance(w, Node) else None
        if shape is not None and len(shape) == 3 and shape[-1] > 1 and depthwise_channels(n) is None:
            return (
                f"the head vector is mixed over the sequence by a convolution ({op_words(n)}, kernel {shape[-1]}) "
                "between its projection and the attention (compressed convolutional attention, as ZAYA's CCA); a "
                "shared transform after the projection would not commute with it"
            )
    return ""


def _matmul_specs(ra: int, rb: int, ro: int) -> tuple[str, str, str]:
    """Einsum letters of ``a @ b`` for operands of ranks ``ra``, ``rb`` (batch axes broadcast from the right)."""
    if ra < 2 or rb < 2:
        raise NotLayout("a product with a vector")
    batch = "".join(chr(ord("A") + i) for i in range(ro - 2))
    return batch[len(batch) - (ra - 2) :] + "mn", batch[len(batch) - (rb - 2) :] + "np", batch + "mp"


def _specs(node: Node, prev: Node) -> tuple[str, str, str, Any]:
    """(letters of ``prev``, of the other factor, of the output, the other factor) of a product node."""
    t, args = node.target, node.args
    out_rank = len(token_shape(node) or ())
    if t is aten.einsum.default:
        ops = list(cast(list, args[1]))
        if len(ops) != 2 or ops.count(prev) != 1:
            raise NotLayout("an einsum of other than two factors")
        ranks = [len(token_shape(o) or ()) for o in ops]
        ins, out = einsum_subscripts(cast(str, args[0]), ranks, out_rank)
        i = ops.index(prev)
        return ins[i], ins[1 - i], out, ops[1 - i]
    if t is aten.linear.default:
        if args[0] is not prev:
            raise NotLayout("the weight of a linear")
        r = len(token_shape(prev) or ())
        lead = "".join(chr(ord("A") + i) for i in range(r - 1))
        return lead + "n", "kn", lead + "k", args[1]
    a, b = (args[1], args[2]) if t is aten.addmm.default else (args[0], args[1])
    if (a is prev) == (b is prev):
        raise NotLayout("a product of a tensor with itself")
    sa, sb, so = _matmul_specs(len(token_shape(a) or ()), len(token_shape(b) or ()), out_rank)
    return (sa, sb, so, b) if a is prev else (sb, sa, so, a)


def through_product(idx: Tensor, node: Node, prev: Node, on_path: Collection[Node]) -> Tensor:
    """The feature index after a product of ``prev`` that mixes only axes no feature number varies along.

    Raises ``NotLayout`` with the reason in words when the product mixes features.

    Example::

        through_product(idx, node, prev, set(path))
    """
    mine, other_spec, out, other = _specs(node, prev)
    if len(set(mine)) != len(mine) or len(mine) != idx.dim():
        raise NotLayout("it takes a diagonal, or an operand of an unexpected rank")
    if isinstance(other, Node) and other in on_path:
        raise NotLayout(
            "it multiplies two tensors that both come from the projection (a bilinear form, not a mixing of tokens)"
        )
    other_shape = token_shape(other) or ()
    other_sizes = dict(zip(other_spec, other_shape))
    for axis, letter in enumerate(mine):
        if idx.shape[axis] <= 1 or not varies(idx, axis):
            continue
        if letter not in out:
            raise NotLayout(
                "it sums over the features of the head vector; a per-head transform before it does not commute with it"
            )
        if other_sizes.get(letter, 1) > 1:
            raise NotLayout(
                "it mixes tokens with weights that differ per feature; a transform shared by every feature does "
                "not commute with it"
            )
    kept = idx
    for axis in reversed(range(len(mine))):  # the contracted axes hold one set of features each: drop them
        if mine[axis] not in out:
            kept = kept.select(axis, 0)
    letters = [c for c in mine if c in out]
    kept = kept.permute(*sorted(range(len(letters)), key=lambda i: out.index(letters[i])))
    view = [kept.shape[sorted(letters, key=out.index).index(c)] if c in letters else 1 for c in out]
    shape = token_shape(node) or shape_of(node)
    if shape is None:
        raise NotLayout("it has no static shape")
    try:
        return kept.reshape(view).expand(shape)
    except RuntimeError as exc:
        raise NotLayout(str(exc)) from exc
