"""Keys and values compressed block by block by a small learned MLP: the role's projection is the one behind it.

Native sparse attention (and other compressed-memory attention) runs a second attention branch over
keys and values compressed block by block: each block of ``l`` consecutive head vectors is flattened
into one vector (``(..., T, Dh) -> (..., T / l, l * Dh)``, tokens merged into features) and a small
learned MLP turns it into one head vector. The walk back from such a branch's keys stops at the
MLP's last layer, a linear whose output is a head vector: read that way, the MLP's layers would be
the keys' projection (a low-rank latent, MLA) and get a second T^K after the one on the real
projection the other branches read.

The MLP is part of what the attention does with the keys, not their projection. :func:`compressed_input`
finds the node whose head vectors the MLP compresses (before the tokens are merged into features);
the walk reads the role's projection and head map there, so every branch sees the one T per role
right after the projection.

Example::

    src = compressed_input(g, proj, "layers.0.attn")    # the (B, KV, T, Dh) keys the compressor reads, or None
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.fx import Node

from .graph import module_path_of
from .layout import LAYOUT_OPS, shape_of

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph, Projection
    from .match import RawSite

__all__ = ["behind_compression", "compressed_input", "compression_note", "merges_blocks"]

aten = torch.ops.aten

_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def merges_blocks(node: Node) -> bool:
    """``node`` reshapes (..., T, Dh) into (..., T / l, l * Dh) with l > 1: blocks of tokens into features."""
    if node.op != "call_function" or node.target not in _RESHAPES or not isinstance(node.args[0], Node):
        return False
    src, out = shape_of(node.args[0]), shape_of(node)
    if not src or not out or len(src) < 2 or len(out) < 2 or src[:-2] != out[:-2]:
        return False
    rows, feats = src[-2], src[-1]
    return bool(out[-1] > feats and out[-1] % feats == 0 and out[-2] * (out[-1] // feats) == rows)


def _inside(node: Node, scope: str) -> bool:
    path = module_path_of(node)
    return bool(scope) and (path == scope or path.startswith(scope + "."))


def compressed_input(g: MatchGraph, proj: Projection, scope: str, depth: int = 12) -> Node | None:
    """The head vectors that ``proj`` (the last layer of a compression MLP of the attention module
    ``scope``) compresses block by block, or None when ``proj`` reads no such blocks.

    The walk goes back from ``proj``'s input through the MLP: its other layers (projections of the same
    module), value ops that keep the shape (activations, biases, norms) and layout ops, to the reshape
    that merges blocks of tokens into features; the node before it holds the head vectors.
    """
    node = proj.input_node
    for _ in range(depth):
        if node.op != "call_function" or not _inside(node, scope):
            return None  # the walk left the attention module: the MLP reads the hidden stream
        if merges_blocks(node):
            src = node.args[0]
            return src if isinstance(src, Node) else None
        inner = g.as_projection(node)
        if inner is not None:
            if not scope or not inner.module_path.startswith(scope + "."):
                return None  # a projection of another module: the hidden stream, not a compressor's layer
            node = inner.input_node
            continue
        ins = [a for a in node.args if isinstance(a, Node)]
        if not ins or (node.target not in LAYOUT_OPS and shape_of(ins[0]) != shape_of(node)):
            return None
        node = ins[0]
    return None


def behind_compression(
    g: MatchGraph, site: RawSite, scope: str, walk: Callable[..., tuple[list[Any], list[str]]]
) -> None:
    """Roles of ``site`` read through a compression MLP: their match moves to the projection behind it.

    ``walk(g, role, node, dim, projection, axis, passed)`` is the match's walk from a projection to a
    role's node (``(matches, reasons)``). The role then gets its one transform right after the real
    projection (which the site's other branches read too), not a second one on the MLP's output.
    """
    for role, m in list(site.roles.items()):
        src = compressed_input(g, m.projection, scope)
        dim = (shape_of(src) or (0,))[-1] if src is not None else 0
        if src is None or site.joint.get(role) or dim != m.head_map.head_dim:
            continue  # blocks of head vectors compressed into head vectors of the same size, nothing else
        projs, _ = g.find_projections(src)
        own = [p for p in projs if p.module_path == scope or p.module_path.startswith(scope + ".")]
        found = [x for p in own for x in walk(g, role, src, dim, p, -1, set())[0]]
        if len(found) == 1:
            mlp = m.projection.module_path.rpartition(".")[0] or m.projection.module_path
            site.roles[role] = dataclasses.replace(found[0], compressed_by=mlp)


def compression_note(by: dict[str, str]) -> str:
    """The report note for roles read through a compression MLP ({role: MLP path}; '' when none).

    Example::

        compression_note({"k": "attn.compress_k"})   # "k: compressed block by block by attn.compress_k ..."
    """
    if not by:
        return ""
    roles = ",".join(by)
    mlps = ", ".join(dict.fromkeys(by.values()))
    return (
        f"{roles}: compressed block by block by {mlps} (a learned MLP, part of the attention, not a projection): "
        "one transform per role right after the projection, which every branch reads"
    )
