"""Find every per-head attention in an exported graph and the projections that feed q, k and v.

Rules, each with a reason when it declines:

* attention rules (:mod:`.rules`: ``sdpa``, ``manual_softmax``, ...) anchor on attention ops and
  name the nodes that carry q, k and v (:class:`.rules.Anchor`);
* for each of q, k, v the walk goes back to the projection that produced it (a linear, addmm or
  matmul against a parameter, :mod:`.graph`), through layout ops and through whatever the
  insertion point must precede (rotary embeddings, QK-norm, scaling, repeat_kv); :mod:`.layout`
  reads the head map.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
from typing import cast

import torch
from torch.fx import Node

from .attention_calls import AttentionArg
from .completeness import unclaimed
from .compression import behind_compression
from .describe import op_words
from .graph import (
    ALLOC_OPS,
    NORM_OPS,
    PROJ_OPS,
    SDPA_OPS,
    SOFTMAX_OPS,
    TRIG_OPS,
    MatchGraph,
    Projection,
    module_path_of,
)
from .heads import group_heads
from .joint import resolve_role, through_cat
from .layout import (
    INDEX_OPS,
    LAYOUT_OPS,
    HeadMap,
    NotLayout,
    push_layout,
    read_head_map,
    same_shape,
    shape_of,
    token_shape,
    varies,
)
from .one_score import tie_one_score
from .propagate import foreign_at, propagated_head_map
from .rules import Anchor, attention_rules
from .rules.linear_attention import LINEAR_ATTENTION, one_site_per_attention
from .same_values import same_values
from .shared_roles import split_shared
from .token_mixing import MIXING_PRODUCTS, temporal_conv, through_product
from .writes import through_write, written_value

__all__ = ["MatchGraph", "Projection", "RawSite", "RoleMatch", "find_sites", "sites_in"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_DEBUG = os.environ.get("KHA_MATCH_DEBUG")  # a node name: explain every decision that touches it


@dataclasses.dataclass
class RoleMatch:
    role: str
    projection: Projection
    head_map: HeadMap  # in the projection's output feature space
    shared_piece: bool  # the head vector also takes features shared by all heads (MLA decoupled RoPE)
    rope: bool
    qk_norm: bool
    joined: bool = False  # the walk went through a sequence-axis cat with other projections (joint streams)
    # another role reads the same features of this projection (k = v, q = k, one projection called for
    # two roles): the role's transform goes on the attention call's argument instead (.shared_roles)
    at_attention: AttentionArg | None = None
    shares: tuple[str, ...] = ()  # the roles reading these features, this one included ("q", "k")
    shares_calls: bool = False  # ... through different calls of the projection
    compressed_by: str = ""  # the MLP that compresses the role's head vectors block by block (.compression)


@dataclasses.dataclass
class RawSite:
    name: str  # traced module path of the attention
    anchor: str  # the rule's name: "sdpa" | "manual_softmax" | ...
    node: Node
    roles: dict[str, RoleMatch]
    reason: str = ""  # why it was skipped, when roles is incomplete
    mla: bool = False
    cross: bool = False
    # role -> the other projections feeding it (joint streams, sums; see .joint) and how they join
    joint: dict[str, list[RoleMatch]] = dataclasses.field(default_factory=dict)
    join: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> "cat" | "sum" | "heads"
    heads: dict[str, int] = dataclasses.field(default_factory=dict)  # role -> heads, when heads are modules (.heads)
    targets: dict[str, tuple[Node, int]] = dataclasses.field(default_factory=dict)  # role -> (anchor node, head axis)
    tied: bool = False  # q and k read one score matrix both ways (.one_score): T^Q and T^K are one transform

    def all_roles(self) -> list[RoleMatch]:
        """Every role match of the site, the other projections of joint roles included."""
        return [*self.roles.values(), *(m for ms in self.joint.values() for m in ms)]


def _trig_near(node: Node, depth: int = 8) -> bool:
    frontier, seen = [node], set()
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if n.op == "call_function" and n.target in TRIG_OPS:
                return True
            for inp in n.all_input_nodes:
                if inp not in seen:
                    seen.add(inp)
                    nxt.append(inp)
        frontier = nxt
    return False


def _role_match(
    g: MatchGraph, role: str, target: Node, expect_dim: int, proj: Projection, head_axis: int = -1
) -> tuple[RoleMatch | None, str, bool]:
    """Push the projection's feature index to ``target`` and read the head map at the head split.

    ``head_axis``: the axis of ``target`` holding the head vector (the last, unless the rule says
    otherwise: K^T, an einsum over (B*H, Dh, T) tensors). The flag is True when the projection's
    features reach the attention on another axis than the head vector's (a product over tokens,
    Linformer's compression): the role's projection may be further back (:mod:`.token_mixing`).
    """
    path = g.path_nodes(proj.node, target)
    if not path:
        return None, f"{role}: no path from {op_words(proj.node)} [{proj.node.name}] to [{target.name}]", False
    chain = g.articulation(path)
    shape = token_shape(proj.node)  # rows routed to one expert have a data-dependent count
    if shape is None:
        return None, f"{role}: {op_words(proj.node)} [{proj.node.name}] has a symbolic shape", False
    idx = proj.out_index if proj.out_index is not None else torch.arange(shape[-1]).expand(shape)
    # expected head dim at each chain node: the anchor's, or a piece of it before a last-axis cat
    expect = [expect_dim] * len(chain)
    shared = False
    for i in range(len(chain) - 2, -1, -1):
        nxt, cur = chain[i + 1], chain[i]
        cur_shape, nxt_shape = shape_of(cur), shape_of(nxt)
        if cur in g.writes.get(nxt, ()) and cur_shape and nxt_shape and cur_shape[-1] < nxt_shape[-1]:
            expect[i] = cur_shape[-1]  # written into a last-axis slice of a buffer
            shared = True
        elif (
            nxt.target is aten.cat.default
            and cur in cast(list, nxt.args[0])
            and cur_shape
            and nxt_shape
            and (nxt.args[1] if len(nxt.args) > 1 else 0) in (-1, len(nxt_shape) - 1)
            and cur_shape[-1] != nxt_shape[-1]
            and nxt_shape[-1] == expect[i + 1]  # the cat builds the head vector (not q|k|v split again later)
        ):
            expect[i] = cur_shape[-1]
            shared = True
        else:
            expect[i] = expect[i + 1]
    found: HeadMap | None = None
    stop = ""
    joined = False
    elsewhere = False  # the projection's features are not on the head vector at the attention
    path_set = set(path)
    seen: list[tuple[Node, torch.Tensor]] = []  # chain nodes with a tensor index, in order
    region: tuple[Node, str] | None = None  # (where, why) a region that changed the shape opened, while in flight
    for i, node in enumerate(chain):
        if region is not None:  # inside a region that changed the shape: wait for one it started from
            back = _region_entry(seen, node)
            if back is None:
                continue
            if _mixes_features(g, region[0], node):  # a convolution or product in it: not a value region
                stop, region = region[1], None
                break
            idx, region = back, None
        elif i > 0:
            prev = chain[i - 1]
            if isinstance(idx, tuple):  # a tuple op (split, unbind) whose one used element is not on the chain
                gets = [u for u in prev.users if u.target is operator.getitem and u in path_set]
                if len(gets) == 1 and isinstance(gets[0].args[1], int):
                    idx, prev = idx[gets[0].args[1]], gets[0]
            direct = bool(node.args) and node.args[0] is prev and node.target not in ALLOC_OPS
            try:
                if node.target is aten.cat.default and prev in cast(list, node.args[0]) and expect[i - 1] == expect[i]:
                    idx = through_cat(idx, node, prev)  # joint streams: a sequence-axis cat is layout
                    joined = True
                elif direct and (node.target in LAYOUT_OPS or node.target in INDEX_OPS):
                    idx = push_layout(idx, node, prev, g.constants)
                elif prev in g.writes.get(node, ()) or (written_value(node) is prev and prev is not None):
                    idx = through_write(idx, node, prev)  # a cache written in place, rows scattered back
                elif same_shape(node, prev):
                    pass  # a value op or region that keeps each feature in place (RoPE, norm, scaling)
                elif isinstance(idx, tuple) and (back := _region_entry(seen, node)) is not None:
                    idx = back  # RoPE on pairs: split or unbound, then written back whole (Wan's empty_like + slices)
                elif isinstance(idx, tuple) and node.target is not None:
                    raise NotLayout(f"tuple consumed by {node.target}")
                elif node.target in MIXING_PRODUCTS and isinstance(idx, torch.Tensor):
                    idx = through_product(idx, node, prev, path_set)  # a product over tokens (Linformer)
                else:
                    raise NotLayout("it changes the shape")
            except (NotLayout, RuntimeError, IndexError, TypeError) as exc:
                at = f"{op_words(node)} [{node.name}]"
                if node.target in LAYOUT_OPS or node.target in INDEX_OPS:
                    # a layout op we could not evaluate: the head map after it is unknown
                    return None, f"{role}: cannot follow the layout op {at}: {exc}", False
                if isinstance(idx, torch.Tensor) and node.target not in ALLOC_OPS:
                    # RoPE on interleaved pairs stacked back (Mochi: stack([cos, sin], -1).flatten(-2)): a value
                    # region that returns to its entry's shape keeps each feature in place, as one op of one shape does
                    region = (prev, f"stopped at {at}: {exc}")
                    continue
                stop = f"stopped at {at}: {exc}"
                break
        if isinstance(idx, torch.Tensor):
            seen.append((node, idx))
        here = idx
        if node is target and isinstance(idx, torch.Tensor) and head_axis % max(idx.dim(), 1) != idx.dim() - 1:
            here = idx.movedim(head_axis, -1)  # the head vector on another axis at the attention
        if node is target and isinstance(here, torch.Tensor) and here.dim() and here.shape[-1] > 1:
            elsewhere = not varies(here, -1)  # the features went to another axis (tokens, after a product)
        if isinstance(here, torch.Tensor) and here.shape[-1] == expect[i]:
            hm = read_head_map(here)
            if hm is not None:
                found = hm  # keep the last one: nearest the attention, before repeat_kv mixes copies in
    if region is not None:  # never came back to its entry's shape: the head map after it is unknown
        stop = region[1]
    if found is not None and stop and foreign_at(g, path, proj, target):
        found = None  # read before the stop, from features that are split off before the attention
    if found is None and (found := propagated_head_map(g, path, proj, target, expect[-1], head_axis)) is not None:
        shared = False  # q, k, v split apart and joined again (a short convolution over all three)
    if elsewhere and found is None:
        return None, f"{role}: the features of {op_words(proj.node)} are not the head vector at the attention", True
    if found is None:
        conv = temporal_conv(path)
        if conv:
            return None, f"{role}: {conv}", False
        where = f"{op_words(proj.node)} [{proj.node.name}] and the attention's {role} [{target.name}]"
        return None, f"{role}: no head split found between {where}" + (f" ({stop})" if stop else ""), False
    rope = any(_trig_near(inp) for n in path for inp in g.inputs(n) if inp not in path_set) or any(
        n.target is aten.view_as_complex.default for n in path
    )
    qk_norm = any(n.target in NORM_OPS for n in path if n.op == "call_function")
    return RoleMatch(role, proj, found, shared, rope, qk_norm, joined), "", elsewhere


def _region_entry(seen: list[tuple[Node, torch.Tensor]], node: Node) -> torch.Tensor | None:
    """The index at the nearest earlier chain node of ``node``'s shape, when a region comes back to it.

    A region that takes a tensor apart (``unbind`` of RoPE's pairs, Wan) or changes its shape with
    value ops (pairs stacked, or rotated as ``(..., Dh/2, 1, 2)`` products and summed: Mochi, PRX)
    and gives back one of the shape it started from keeps each feature in place, as a value region
    between two nodes of one shape does.
    """
    for earlier, idx in reversed(seen):
        if same_shape(earlier, node):
            return idx
    return None


_CONV_OPS = {aten.conv1d.default, aten.convolution.default}
_MIXING_OPS = {*_CONV_OPS, aten.conv2d.default, aten.conv3d.default, *PROJ_OPS, *SOFTMAX_OPS, *SDPA_OPS}


def _mixes_features(g: MatchGraph, start: Node, end: Node) -> bool:
    """A convolution, product or attention on some path from ``start`` to ``end``: the region between
    them mixes features (or tokens) and is no value region, whatever shape it gives back."""
    return any(n.op == "call_function" and n.target in _MIXING_OPS for n in g.path_nodes(start, end))


def _latent_input(g: MatchGraph, proj: Projection, scope: str, depth: int = 16) -> bool:
    """True when the projection reads a low-rank latent: another projection of the same attention
    module (``scope``), seen through a norm (MLA's kv_a_proj -> kv_a_layernorm -> kv_b_proj)."""
    return _latent_projection(g, proj, scope, depth) is not None


def _token_source(node: Node) -> Node:
    """The tensor ``node`` selects tokens of or rearranges: back through layout ops, gathers along
    tokens and splits (routed experts take ``x[batch_index].split(sizes)``)."""
    for _ in range(32):
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], Node):
            return node
        if node.target not in LAYOUT_OPS and node.target not in INDEX_OPS:
            return node
        node = node.args[0]
    return node


def _query_input(g: MatchGraph, proj: Projection, scope: str) -> Node:
    """What the query projection reads, seen through a low-rank latent of the same module (DeepSeek's
    q_a_proj -> q_a_norm -> q_b_proj) and through token selection (routed heads)."""
    latent = _latent_projection(g, proj, scope)
    return _token_source(latent.input_node if latent is not None else proj.input_node)


def _latent_projection(g: MatchGraph, proj: Projection, scope: str, depth: int = 16) -> Projection | None:
    """The projection of the same attention module (``scope``) whose output ``proj`` reads, if any."""
    frontier = [proj.input_node]
    seen = set()
    for _ in range(depth):
        nxt: list[Node] = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            other = g.as_projection(n)
            if other is not None:
                return other if bool(scope) and other.module_path.startswith(scope + ".") else None
            if (
                n.target in (aten.add.Tensor, aten.sub.Tensor)
                and sum(isinstance(a, Node) and shape_of(a) == shape_of(n) for a in n.args[:2]) == 2
            ):
                continue  # a residual add: the input is the model's hidden stream, not a latent
            if n.target is aten.embedding.default:
                continue
            nxt.extend(i for i in n.all_input_nodes if i.op != "placeholder")
        frontier = nxt
    return None


def _anchors(g: MatchGraph) -> list[Anchor]:
    """The anchor of each attention op: the first registered rule that recognises it; then an
    ``unmatched`` anchor for each attention softmax no rule claimed (:mod:`.completeness`)."""
    rules = attention_rules()
    out = []
    claimed: set[Node] = set()
    for node in g.graph.nodes:
        if node.op != "call_function" or node in claimed:  # an earlier anchor's attention op: no second site
            continue
        for rule in rules:
            anchor = rule.match(g, node)
            if anchor is not None:
                out.append(anchor)
                claimed.update((node, anchor.node))
                break
    extra = unclaimed(g, claimed)
    return sorted(out + extra, key=lambda a: g.order[a.node]) if extra else out


def _walk_role(
    g: MatchGraph, role: str, piece: Node, dim: int, proj: Projection, axis: int, passed: set[Node]
) -> tuple[list[RoleMatch], list[str]]:
    """The role's matches from ``proj``, or from the projections behind it when its features are not the
    head vector at the attention (Linformer's ``E`` mixes tokens: ``k`` behind it is the role's); the reasons."""
    m, why, behind = _role_match(g, role, piece, dim, proj, axis)
    if behind and proj.node not in passed and len(passed) < 8:
        passed.add(proj.node)
        walks = [_walk_role(g, role, piece, dim, p, axis, passed) for p in g.find_projections(proj.input_node)[0]]
        ms, ws = [x for w in walks for x in w[0]], [x for w in walks for x in w[1]]
        if ms or m is None:
            return (ms, ws) if ms else ([], ws or [why])
    return ([m], []) if m is not None else ([], [why])


def _softmax_feature_map(anchor: Anchor, piece: Node) -> bool:
    """In attention without a softmax, the role's operand is a softmax of its heads, seen through layout ops
    only: a feature map (CoaT's ``k.softmax(dim=2)`` right before ``k^T v``), which the walk may pass. A
    softmax further back (DeepSeek-V4's Sinkhorn-normalised stream mixing) is not one."""
    return anchor.rule == LINEAR_ATTENTION and _token_source(piece).target in SOFTMAX_OPS


def _match_roles(g: MatchGraph, anchor: Anchor, site: RawSite, unprojected: set[str] | None = None) -> list[str]:
    """Walk each role of ``anchor`` back to its projections and fill ``site``; the problems of the roles that fail.

    ``unprojected`` receives the roles none of whose pieces reaches any projection."""
    problems: list[str] = []
    roles, dims = anchor.roles, anchor.head_dims
    for role, target in roles.items():
        # the role's node, and other pieces of the same heads (local + global tokens), each walked back
        targets = [(target, anchor.head_axes.get(role, -1)), *anchor.extra.get(role, ())]
        matches: list[RoleMatch] = []
        whys: list[str] = []
        reached = False
        for piece, axis in targets:
            projs, why = g.find_projections(piece, through_softmax=_softmax_feature_map(anchor, piece))
            reached = reached or bool(projs)
            if not projs:
                at = f"{op_words(piece)} [{piece.name}]"
                whys.append(f"{role}: no projection found walking back from {at}" + (f" ({why})" if why else ""))
            passed: set[Node] = set()
            for proj in projs:
                ms, ws = _walk_role(g, role, piece, dims[role], proj, axis, passed)
                matches.extend(dataclasses.replace(m, joined=True) if len(targets) > 1 else m for m in ms)
                whys.extend(ws)
        if not reached and unprojected is not None:
            unprojected.add(role)
        if whys and len(targets) > 1:  # a piece of a joint role not traced: KHA would miss part of it
            matches = []
        if not matches:
            problems.append("; ".join(dict.fromkeys(whys)))
            continue
        per_head = [m for m in matches if m.head_map.num_heads > 1] or matches
        chosen, others, join, problem = resolve_role(g, role, target, per_head)
        if chosen is None:
            problems.append(problem)
            continue
        if len(matches) > len(per_head):
            chosen = dataclasses.replace(chosen, shared_piece=True)
        site.roles[role] = chosen
        if others:
            site.joint[role], site.join[role] = others, join
    return problems


def find_sites(exported, aliases: dict[str, str] | None = None) -> list[RawSite]:
    """Every attention site in the graph, matched or with the reason it was skipped.

    ``aliases``: other paths of modules reachable by several -> their first path (``Capture.aliases``).
    """
    return sites_in(MatchGraph(exported, aliases))


def sites_in(g: MatchGraph) -> list[RawSite]:
    """:func:`find_sites` on a graph view already built (the self-check reads the same view after)."""
    sites = []
    for anchor in _anchors(g):
        node, rule, roles, reason = anchor.node, anchor.rule, anchor.roles, anchor.reason
        name = module_path_of(node) or node.name
        key = list(node.meta.get("nn_module_stack") or {"": None})[-1]
        if "@" in key:  # a module called more than once (shared layers): one site per call
            name += "@" + key.rpartition("@")[2]
        site = RawSite(
            name, rule, node, {}, reason, targets={r: (n, anchor.head_axes.get(r, -1)) for r, n in roles.items()}
        )
        if reason:
            sites.append(site)
            continue
        unprojected: set[str] = set()
        problems = _match_roles(g, anchor, site, unprojected)
        alt = anchor.alternative
        if problems and alt is not None:  # the op read another way (attention over channels)
            other = RawSite(name, alt.rule, alt.node, {}, "")
            if not _match_roles(g, alt, other):
                site, anchor, roles = other, alt, alt.roles
                site.targets = {r: (n, alt.head_axes.get(r, -1)) for r, n in roles.items()}
                problems = []
        if problems and rule == LINEAR_ATTENTION and {"q", "k"} <= unprojected:
            # two products of other activations (DeepSeek-V4's hyper-connections mix residual streams with
            # weights normalised by Sinkhorn): no q or k projected from tokens, so no attention
            log.debug("%s: a product pair whose q and k come from no projection: no attention", name)
            continue
        if problems:
            site.reason = "; ".join(problems)
        behind_compression(g, site, name, _walk_role)  # a compression MLP's blocks: the projection behind it
        if set(site.roles) == {"q", "k", "v"}:
            q, k, v = (site.roles[r] for r in "qkv")
            site.mla = (
                k.shared_piece
                or v.shared_piece
                or _latent_input(g, k.projection, name)
                or _latent_input(g, v.projection, name)
            )
            site.cross = (
                not site.mla
                and not same_values(q.projection.input_node, k.projection.input_node)
                and _query_input(g, q.projection, name) is not _token_source(k.projection.input_node)
            )
        if _DEBUG and _DEBUG in {n.name for n in roles.values()} | {node.name}:
            log.warning("KHA_MATCH_DEBUG %s: roles=%s reason=%s", node.name, list(site.roles), site.reason)
        sites.append(site)
    sites = one_site_per_attention(sites)  # one attention without softmax written as several product pairs
    sites = group_heads(g, sites)  # heads written as separate modules: one site, one transform per role
    split_shared(g, sites)  # roles reading the same features of one projection: on the attention's arguments
    tie_one_score(g, sites)  # one score matrix read both ways: one transform for q and k, after the projections
    return sites
