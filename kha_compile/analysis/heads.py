"""Heads written as separate modules: single-head attention calls that are the heads of one attention.

Some models write multi-head attention as a ``ModuleList`` of per-head q and k projections (v too,
or one value projection shared by all heads), one attention call per head, and the outputs
concatenated, stacked, summed or averaged. Each call is a single-head site on its own; KHA needs
one transform per role shared by all heads. :func:`group_heads` merges those sites into one:

* the sites are single-head (every role), with the same attention rule and head dims;
* their outputs meet (through layout ops, casts and scalar scaling) in a ``cat``, a ``stack`` or a
  sum whose every operand is one of those outputs — a residual add (``x + head(x)``) is not;
* their modules are one module or the numbered elements of one list in the module where they meet.

The merged site keeps the first head's matches as its roles and lists the other heads'
projections as joint ones (``join[role] == "heads"``): the first projection owns the shared
transform, the others apply it too (the plan treats them as joint streams), and each folds it into
its own weight. A projection shared by every head (one value projection) is one kv head.

Example::

    sites = group_heads(g, find_sites_raw)     # 4 single-head sites of heads.0..3 -> 1 site, 4 heads
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from .graph import module_path_of
from .layout import LAYOUT_OPS

if TYPE_CHECKING:  # pragma: no cover
    from .graph import MatchGraph
    from .match import RawSite, RoleMatch

__all__ = ["group_heads", "is_single_head"]

aten = torch.ops.aten

_SCALAR_OPS = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.mul.Scalar, aten.div.Scalar}
_REDUCE_OPS = {aten.mean.dim, aten.sum.dim_IntList, aten.mean.default, aten.sum.default}
_JOIN_OPS = {aten.cat.default, aten.stack.default}


def is_single_head(site: RawSite) -> bool:
    """Every role of a complete site has one head (a candidate head of a multi-head attention)."""
    return (
        not site.reason
        and set(site.roles) == {"q", "k", "v"}
        and not site.joint
        and all(m.head_map.num_heads == 1 for m in site.roles.values())
    )


def _sources(g: MatchGraph, outputs: dict[Node, int]) -> dict[Node, frozenset[int]]:
    """Node -> the site outputs it is made of alone (through layout ops, scalar scaling, joins, sums)."""
    src: dict[Node, frozenset[int]] = {n: frozenset([i]) for n, i in outputs.items()}
    for n in g.graph.nodes:
        if n.op != "call_function" or n in src:
            continue
        nodes = [a for a in n.args if isinstance(a, Node)]
        t = n.target
        if t in _JOIN_OPS:
            items = n.args[0] if isinstance(n.args[0], (list, tuple)) else []
            if items and all(isinstance(a, Node) and a in src for a in items):
                src[n] = frozenset().union(*(src[a] for a in items))
        elif t is aten.add.Tensor and len(nodes) == 2 and all(a in src for a in nodes):
            src[n] = src[nodes[0]] | src[nodes[1]]
        elif (
            len(nodes) == 1
            and nodes[0] is n.args[0]
            and nodes[0] in src
            and not n.kwargs.get("alpha")
            and (t in LAYOUT_OPS or t in _SCALAR_OPS or t in _REDUCE_OPS)
        ):
            src[n] = src[nodes[0]]
    return src


def _shape_key(path: str, at: str) -> str | None:
    """``path`` relative to ``at`` with numbers as ``#`` (``heads.2.attn`` -> ``heads.#.attn``), or None."""
    if path == at:
        return ""
    if at and not path.startswith(at + "."):
        return None
    rel = path[len(at) + 1 :] if at else path
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1#", rel)


def _groups(g: MatchGraph, singles: list[RawSite]) -> list[list[int]]:
    """Lists of positions in ``singles`` that are the heads of one attention."""
    outputs = {s.node: i for i, s in enumerate(singles)}
    src = _sources(g, outputs)
    parent = list(range(len(singles)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for n, members in src.items():
        if len(members) < 2 or not (n.target in _JOIN_OPS or n.target is aten.add.Tensor):
            continue
        at = module_path_of(n)
        keys = {_shape_key(module_path_of(singles[i].node), at) for i in members}
        if None in keys or len(keys) != 1:
            continue  # not one module, or not the elements of one list in the module where they meet
        first, *rest = sorted(members)
        for i in rest:
            parent[root(i)] = root(first)
    out: dict[int, list[int]] = {}
    for i in range(len(singles)):
        out.setdefault(root(i), []).append(i)
    return [m for m in out.values() if len(m) > 1]


def _compatible(sites: list[RawSite]) -> bool:
    first = sites[0]
    return all(
        s.anchor == first.anchor
        and all(s.roles[r].head_map.head_dim == first.roles[r].head_map.head_dim for r in "qkv")
        for s in sites
    )


def _merged(g: MatchGraph, sites: list[RawSite]) -> RawSite:
    first = sites[0]
    joint: dict[str, list[RoleMatch]] = {}
    heads: dict[str, int] = {}
    for r in "qkv":
        unique: dict[Node, RoleMatch] = {}
        for s in sites:
            unique.setdefault(s.roles[r].projection.node, s.roles[r])
        matches = list(unique.values())
        heads[r] = len(matches)
        if len(matches) > 1:
            joint[r] = matches[1:]
    common = _common_module([module_path_of(s.node) for s in sites])
    return dataclasses.replace(
        first,
        name=common or first.name,
        joint=joint,
        join=dict.fromkeys(joint, "heads"),
        heads=heads,
    )


def _common_module(paths: list[str]) -> str:
    """The module holding the heads: their own (several calls in one module) or the owner of their list."""
    if len(set(paths)) == 1:
        return paths[0]
    common: list[str] = []
    for pieces in zip(*(p.split(".") for p in paths)):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join(common[:-1])  # heads.0, heads.1 -> the list "heads" -> its owner


def group_heads(g: MatchGraph, sites: list[RawSite]) -> list[RawSite]:
    """``sites`` with the single-head sites that are heads of one attention merged into one site each.

    Example::

        [s.heads for s in group_heads(g, sites)]    # [{"q": 4, "k": 4, "v": 1}] for 4 heads, one v
    """
    singles = [s for s in sites if is_single_head(s)]
    if len(singles) < 2:
        return sites
    merged: dict[int, RawSite] = {}
    drop: set[int] = set()
    for members in _groups(g, singles):
        group = [singles[i] for i in sorted(members, key=lambda i: g.order[singles[i].node])]
        if not _compatible(group):
            continue
        merged[id(group[0])] = _merged(g, group)
        drop.update(id(s) for s in group[1:])
    return [merged.get(id(s), s) for s in sites if id(s) not in drop]
