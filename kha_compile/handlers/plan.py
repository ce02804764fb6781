"""Turn matched sites into report entries and an insertion plan.

A plan entry says: this module (a projection such as ``nn.Linear`` or ``Conv1D``, or an
``nn.MultiheadAttention`` whose projections are parameters) gets these transforms on these
head slots. The projection handler (first that accepts wins) is chosen by what owns the
projection weight; :func:`kha_compile.handlers.insert.insert` has it attach.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable
from typing import cast

from torch import nn

from ..analysis.compression import compression_note
from ..analysis.layout import slot_from_map
from ..analysis.match import RawSite, RoleMatch
from ..analysis.one_score import tied_kinds, tied_note
from ..analysis.rules.base import form_note
from ..analysis.shared_roles import sharing_words
from ..analysis.trace import Capture
from ..core.errors import UnsupportedModelError
from ..core.kinds import Role, SiteKind
from ..core.report import AttentionSite
from ..model.carrier import transforms_of
from ..model.config import KHAConfig
from ..model.slots import HeadSlot, union_slots
from ..model.transforms import get_transform, kind_of
from . import PlanEntry, ProjectionHandler, choose_handler

__all__ = ["MLA_NOTE", "PlanEntry", "build_sites", "current_transforms"]

log = logging.getLogger(__name__)

MLA_NOTE = (
    "MLA: linear KHA only (MLP-value would break weight absorption, as in the paper); T^Q acts on the "
    "whole query head (no-RoPE and RoPE parts, folded into the query projection), T^K on the per-head "
    "no-RoPE key part only (folded into kv_b_proj): the decoupled RoPE key is one piece shared by all "
    "heads, and mixing it per head would make it per-head and break the shared cache"
)


def _slot(role: str, m: RoleMatch, param_space: bool) -> HeadSlot:
    hm = m.head_map
    if param_space:  # features of the weight's output axis (e.g. rows of in_proj_weight)
        hm = dataclasses.replace(hm, index=m.projection.feature_map[hm.index])
    affine = slot_from_map(hm)
    if affine is None:  # any other fixed set of features per head: an index map
        return HeadSlot.indexed(cast(Role, role), hm.index)
    offset, stride = affine
    return HeadSlot(cast(Role, role), offset, hm.num_heads, hm.head_dim, stride)


def _calls(raw: RawSite) -> int:
    """The attention calls a site stands for: one per head where heads are separate modules."""
    return max(raw.heads.values(), default=1)


def _skipped(raw: RawSite, name: str, reason: str) -> AttentionSite:
    return AttentionSite(name, "skipped", reason, anchor=raw.anchor, found=sorted(raw.roles), calls=_calls(raw))


def build_sites(
    model: nn.Module, raw_sites: list[RawSite], cap: Capture, cfg: KHAConfig | None
) -> tuple[list[AttentionSite], list[PlanEntry]]:
    """Report entries for every site (expanded to every repeated block) and the insertion plan."""
    sites: list[AttentionSite] = []
    plan: dict[str, PlanEntry] = {}
    for raw in raw_sites:
        copies = _copies(raw, cap)
        if raw.reason or set(raw.roles) != {"q", "k", "v"}:
            sites.extend(_skipped(raw, name, _renamed(raw.reason, rn) or "incomplete match") for name, rn in copies)
            continue
        q, k, v = (raw.roles[r] for r in "qkv")
        n_q, n_k = (raw.heads.get(r, raw.roles[r].head_map.num_heads) for r in "qk")
        kind: SiteKind = (
            "mla" if raw.mla else "cross" if raw.cross else ("mha" if n_k == n_q else "mqa" if n_k == 1 else "gqa")
        )
        # handlers look at the real modules: the traced paths of a repeated block name its first copy
        first = copies[0][1]
        handlers = {r: choose_handler(model, _realized(raw.roles[r], first)) for r in "qkv"}
        bad = [why for h, why in handlers.values() if h is None]
        kinds: dict[str, str] = {r: k for r, k in cfg.roles().items()} if cfg is not None else {}
        note = MLA_NOTE if kind == "mla" else heads_note(raw) or form_note(raw.anchor)
        if kind == "mla":  # weight absorption needs linear transforms: each kind's foldable stand-in
            asked, kinds = kinds, {r: _foldable(k) for r, k in kinds.items()}
            if swapped := [f"{r}={asked[r]!r} asked, {k!r} put" for r, k in kinds.items() if k != asked[r]]:
                note = f"{note}; {', '.join(swapped)}"
                log.warning("%s (MLA): %s; MLP-value would break weight absorption", raw.name, ", ".join(swapped))
        tie_role, tie_why = "", ""
        if raw.tied:  # one score matrix read both ways: T^Q and T^K are one transform (analysis.one_score)
            kinds, tie_role, tie_why = tied_kinds(kinds)
        slots: dict[str, HeadSlot] = {}
        for r in kinds:
            handler = handlers[r][0]
            if handler is not None and handler.plans_roles:
                continue  # positions live in the handler's own plan (plan_role below)
            slots[r] = _slot(r, raw.roles[r], handler is not None and handler.param_space)
        joint, why = plan_joint(model, raw, kinds, first)  # joint streams / sums: the other projections of a role
        bad.extend(why)
        if tie_role:  # the other side holds the one transform
            bad.extend(_tie_other_side(raw, tie_role, handlers, joint))
        bad.extend(_shared_features(raw, kinds))
        for name, rename in copies:
            if bad:
                sites.append(_skipped(raw, name, _renamed("; ".join(bad), rename)))
                continue
            paths = {r: rename(raw.roles[r].projection.module_path) for r in "qkv"}
            homes = {  # where each role's transform is planned: its projection, or the attention call (k = v)
                r: rename(h.entry_path(raw.roles[r])) if (h := handlers[r][0]) is not None else paths[r] for r in "qkv"
            }
            merged, conflicts = _merge_with_planned(plan, kinds, homes, slots, handlers)
            taken = {p: e.handler for p, e in plan.items()}
            for r in kinds:  # one module, two handlers (an attention-argument home that also calls a projection)
                if taken.setdefault(homes[r], _name(handlers[r][0])) != _name(handlers[r][0]):
                    conflicts.append(
                        f"{r}: {homes[r] or 'the model'} would carry KHA of two handlers ({taken[homes[r]]} and "
                        f"{_name(handlers[r][0])}); leave {r} without KHA or make its projection a module"
                    )
            if conflicts:
                sites.append(_skipped(raw, name, "; ".join(conflicts)))
                continue
            paths_own = {r: raw.roles[r].projection.module_path for r in "qkv"}
            others = {
                r: [rename(p) for p in dict.fromkeys(m.projection.module_path for m in ms) if p != paths_own[r]]
                for r, ms in raw.joint.items()
            }
            site = AttentionSite(
                name,
                "matched",
                kind=kind,
                num_heads=n_q,
                num_kv_heads=n_k,
                head_dim=q.head_map.head_dim,
                v_head_dim=v.head_map.head_dim,
                q_proj=paths["q"],
                k_proj=paths["k"],
                v_proj=paths["v"],
                rope=q.rope or k.rope,
                qk_norm=q.qk_norm or k.qk_norm,
                anchor=raw.anchor,
                note=note,
                joint=others,
                join=dict(raw.join),
                calls=_calls(raw),
            )
            current_transforms(model, site, homes)
            if raw.tied:  # q and k carry the one transform
                site.note = "; ".join(x for x in (site.note, tied_note(raw, rename), tie_why) if x)
                one = site.transforms.get("q") or site.transforms.get("k")
                site.transforms.update({r: one for r in "qk" if one})
            shown = [r for r in "qkv" if r in kinds] if kinds else list("qkv")  # roles with a transform
            notes = [
                h.describe(model, {r: raw.roles[r] for r in shown if handlers[r][0] is h}, rename)
                for h in {id(h): h for h, _ in handlers.values() if h is not None}.values()
            ]
            notes.append(
                _renamed(
                    compression_note({r: m.compressed_by for r, m in raw.roles.items() if m.compressed_by}), rename
                )
            )
            if merged:
                notes.append(
                    f"heads split over several attention calls: {', '.join(sorted(merged))} share one transform "
                    "over all the heads those calls read from the projection"
                )
            site.note = "; ".join(x for x in (site.note, *notes) if x)
            sites.append(site)
            for r, tk in kinds.items():
                path = homes[r]
                entry = plan.setdefault(
                    path,
                    PlanEntry(
                        path,
                        _name(handlers[r][0]),
                        [],
                        {},
                        int(raw.roles[r].projection.feature_map.numel()),
                        cfg.strategy if cfg is not None else "auto",
                    ),
                )
                handler = handlers[r][0]
                if handler is not None and handler.plans_roles:
                    handler.plan_role(entry, r, raw.roles[r], tk)
                    continue
                planned = [i for i, s in enumerate(entry.slots) if s.role == r]
                if planned:
                    if r in merged:  # this call reads other heads of the projection: the slot covers both
                        entry.slots[planned[0]] = merged[r]
                    continue
                entry.slots.append(slots[r])
                entry.kinds[r] = tk
            for r, js in joint.items():
                for jpath, jhandler, jslot, width in js:
                    _add_borrower(plan, rename(jpath), jhandler, jslot, width, kinds[r], paths[r], cfg)
    _share_tied(model, plan)
    return sites, list(plan.values())


def _merge_with_planned(
    plan: dict[str, PlanEntry],
    kinds: dict[str, str],
    homes: dict[str, str],
    slots: dict[str, HeadSlot],
    handlers: dict[str, tuple[ProjectionHandler | None, str]],
) -> tuple[dict[str, HeadSlot], list[str]]:
    """Slots of roles whose projection an earlier site already planned with other heads, merged.

    One projection read by several attention calls, each over a part of its heads (diffusers'
    sliced attention, a differential attention's two halves), gets one transform per role over all
    those heads. Returns (role -> merged slot, reasons the heads cannot be one role's heads).
    """
    merged: dict[str, HeadSlot] = {}
    conflicts: list[str] = []
    for r in kinds:
        handler = handlers[r][0]
        entry = plan.get(homes[r])
        if entry is None or r not in slots or (handler is not None and handler.plans_roles):
            continue
        old = next((s for s in entry.slots if s.role == r), None)
        if old is None or old == slots[r]:
            continue
        union = union_slots(old, slots[r])
        if union is None:
            conflicts.append(
                f"{r}: {homes[r]} is read by another attention call with other heads of {r} "
                f"({old.num_heads} x {old.head_dim} there, {slots[r].num_heads} x {slots[r].head_dim} here) "
                "that overlap in part; one shared transform cannot cover both"
            )
        elif union != old:
            merged[r] = union
    return merged, conflicts


def heads_note(raw: RawSite) -> str:
    """The report note of a site whose heads are separate modules, or routed to experts ('' otherwise)."""
    routed = [
        r
        for r, how in raw.join.items()
        if how == "cat" and len({m.projection.param for m in [raw.roles[r], *raw.joint[r]]}) == 1
    ]
    if routed:
        weight = ".".join(raw.roles[routed[0]].projection.param.split(".")[-2:])
        return (
            f"{','.join(routed)}: routed heads (mixture of attention heads): each token's heads come from the "
            f"experts its router picks, calls of one weight ({weight}) on the tokens routed to each "
            f"({1 + len(raw.joint[routed[0]])} calls); the shared transform acts on every expert's output before "
            "the routing puts it back in token order (linear KHA folds into every expert's rows)"
        )
    if "heads" not in raw.join.values():
        return ""
    counts = ", ".join(f"{r}: {raw.heads.get(r, 1)}" for r in "qkv")
    owners = ", ".join(f"{r}: {raw.roles[r].projection.module_path}" for r in "qkv" if raw.join.get(r) == "heads")
    return (
        f"heads written as separate modules ({counts} projections), one attention call each: one site, one "
        f"shared transform per role (held by {owners}), applied after every head's projection and folded "
        "into each"
    )


def _share_tied(model: nn.Module, plan: dict[str, PlanEntry]) -> None:
    """Projection modules whose weight is one tied parameter (Zamba2's shared blocks) share one
    transform per role: the first registers it, the others hold it, so fold stays exact."""
    first: dict[int, PlanEntry] = {}
    root: dict[str, str] = {}
    for entry in plan.values():
        if entry.borrow or entry.extra is not None:  # functional entries parametrize; not shared here
            continue
        try:
            weight = model.get_submodule(entry.module_path).get_parameter("weight")
        except AttributeError:
            continue
        owner = first.setdefault(id(weight), entry)
        if owner is entry:
            continue
        if owner.kinds != entry.kinds or sorted(map(str, owner.slots)) != sorted(map(str, entry.slots)):
            raise UnsupportedModelError(
                f"{entry.module_path} and {owner.module_path} share one weight but would get different KHA "
                f"({entry.kinds} vs {owner.kinds}); their transforms could not be folded into it."
            )
        entry.borrow = dict.fromkeys(entry.kinds, owner.module_path)
        root[entry.module_path] = owner.module_path
    for entry in plan.values():  # a projection that borrowed from a tied one borrows from its owner
        entry.borrow = {r: root.get(p, p) for r, p in entry.borrow.items()}


def _shared_features(raw: RawSite, kinds: dict[str, str]) -> list[str]:
    """Roles with a transform that read the same output features as another role (k = v, q = k, one
    projection called for two roles) and whose attention argument was not found: a transform after
    the projection would change the other role too, which is not KHA, so the site is skipped."""
    lost: dict[str, list[str]] = {}  # what is shared -> the roles with a transform and no attention argument
    for r in kinds:
        m = raw.roles[r]
        if m.shares and m.at_attention is None:
            lost.setdefault(sharing_words(m), []).append(
                r + (" (joined from several projections)" if raw.joint.get(r) else "")
            )
    return [
        f"{words}; a KHA transform after the projection would change the other role too, and no attention call "
        f"was found to take it on the {' and '.join(roles)} argument{'s' if len(roles) > 1 else ''} instead"
        for words, roles in lost.items()
    ]


def _tie_other_side(
    raw: RawSite,
    role: str,
    handlers: dict[str, tuple[ProjectionHandler | None, str]],
    joint: dict[str, list[tuple[str, ProjectionHandler, HeadSlot, int]]],
) -> list[str]:
    """A tied site's other q/k projection holds ``role``'s one transform (a joint stream of it), unless it is
    the same module (one projection run on both sides: its transform covers both calls); the problems.
    Both sides must be projection modules, so that each direction gets the same transform on both."""
    other = "k" if role == "q" else "q"
    sides = [raw.roles[r].projection for r in (role, other)]
    if sides[0].module_path == sides[1].module_path:
        return []
    for r, proj in zip((role, other), sides):
        handler = handlers[r][0]
        if handler is None or not handler.module_call or handler.plans_roles:
            how = f"carried by the {handler.name} handler" if handler is not None else handlers[r][1] or "no handler"
            return [
                f"q, k: one score matrix read both ways needs one transform shared by {sides[0].module_path} and "
                f"{sides[1].module_path}, and {proj.param} is not a projection module KHA can share one with ({how})"
            ]
    m, handler = raw.roles[other], cast(ProjectionHandler, handlers[other][0])
    width = int(m.projection.feature_map.numel())
    joint.setdefault(role, []).append((sides[1].module_path, handler, _slot(role, m, handler.param_space), width))
    return []


def _realized(m: RoleMatch, rename: Callable[[str], str]) -> RoleMatch:
    """``m`` with the module and parameter paths of the real model (``rename`` of the traced ones)."""
    proj = m.projection
    pieces = [dataclasses.replace(p, name=rename(p.name)) for p in proj.pieces]
    real = dataclasses.replace(proj, param=rename(proj.param), module_path=rename(proj.module_path), pieces=pieces)
    return dataclasses.replace(m, projection=real)


def plan_joint(
    model: nn.Module, raw: RawSite, kinds: dict[str, str], rename: Callable[[str], str] = lambda p: p
) -> tuple[dict[str, list[tuple[str, ProjectionHandler, HeadSlot, int]]], list[str]]:
    """(role -> [(path, handler, slot, out features)] of the other projections sharing its transform, problems).

    A projection that is the role's own (the same module called again, e.g. on global tokens) needs
    nothing more. The others must be module calls (``linear``, ``conv1d``) with an affine layout;
    a value that is a sum gets no MLP-value (not linear).

    Example::

        joint, problems = plan_joint(model, raw, {"v": "mlp"})   # {"v": [("img_v", handler, slot, 32)]}
    """
    out: dict[str, list[tuple[str, ProjectionHandler, HeadSlot, int]]] = {}
    bad: list[str] = []
    for r, matches in raw.joint.items():
        if r not in kinds:
            continue
        own = raw.roles[r].projection.module_path
        if raw.join.get(r) == "sum" and not get_transform(kinds[r]).foldable:
            names = ", ".join([own, *(m.projection.module_path for m in matches)])
            bad.append(
                f"{r}: the head vector is a sum of projections ({names}); {kinds[r]} KHA is not linear, so it "
                "cannot go after each of them (a linear kind can)"
            )
            continue
        for m in matches:
            path = m.projection.module_path
            if path == own:
                continue  # one projection module called on several token sets: its carrier covers every call
            handler, why = choose_handler(model, _realized(m, rename))
            if handler is None or not handler.module_call or handler.plans_roles:
                carrier = why or (f"carried by the {handler.name} handler" if handler else "no handler")
                if raw.join.get(r) == "heads":  # EfficientViT-MSRA's per-head 1x1 ConvNorms over (B, C, H, W)
                    paths = ", ".join([own, *(o.projection.module_path for o in matches)])
                    bad.append(
                        f"{r}: heads written as separate modules ({paths}) need one transform shared by their "
                        f"projections, and {path} is not a module KHA can share one with ({carrier}; only "
                        "projections with features on the last axis can: linear, conv1d)"
                    )
                    break  # one line for the role, naming every head's projection
                bad.append(
                    f"{r}: {path} joins {own} (joint streams) but is not a projection module KHA can share "
                    f"a transform with ({carrier})"
                )
                continue
            s = _slot(r, m, handler.param_space)
            out.setdefault(r, []).append((path, handler, s, int(m.projection.feature_map.numel())))
    return out, bad


def _add_borrower(
    plan: dict[str, PlanEntry],
    path: str,
    handler: ProjectionHandler,
    slot: HeadSlot,
    width: int,
    kind: str,
    owner: str,
    cfg: KHAConfig | None,
) -> None:
    entry = plan.setdefault(
        path, PlanEntry(path, handler.name, [], {}, width, cfg.strategy if cfg is not None else "auto")
    )
    if slot.role in entry.kinds:
        for i, planned in enumerate(entry.slots):
            if planned.role == slot.role and planned != slot:
                union = union_slots(planned, slot)
                if union is not None:  # another attention call reads other heads of this stream (sliced attention)
                    entry.slots[i] = union
                break
        return
    if entry.kinds.keys() - entry.borrow.keys():
        raise UnsupportedModelError(
            f"{path} carries KHA of its own and shares another projection's for {slot.role} (joint "
            "streams in an order kha_compile does not support); pass a KHAConfig without that role."
        )
    entry.slots.append(slot)
    entry.kinds[slot.role] = kind
    entry.borrow[slot.role] = owner


def _copies(raw: RawSite, cap: Capture) -> list[tuple[str, Callable[[str], str]]]:
    """(real site name, path renamer) for every repeated block a traced site stands for."""
    group = cap.group_of(raw.name)
    if group is None:
        return [(raw.name, lambda p: p)]
    list_path, pos = group
    traced_prefix = f"{list_path}.{pos}."
    out: list[tuple[str, Callable[[str], str]]] = []
    for orig in cap.groups[list_path][pos]:
        real_prefix = f"{list_path}.{orig}."

        def rename(p: str, a: str = traced_prefix, b: str = real_prefix) -> str:
            if p == a[:-1]:  # the block itself (a weight used functionally in the block's own forward)
                return b[:-1]
            return b + p[len(a) :] if p.startswith(a) else p

        out.append((rename(raw.name), rename))
    return out


_PATH = re.compile(r"[A-Za-z_][\w]*(?:\.[\w]+)+")


def _renamed(text: str, rename: Callable[[str], str]) -> str:
    """``text`` with every dotted module path in it renamed for one copy of a repeated block.

    Example::

        _renamed("q: blocks.0.qk is ...", rename)     # "q: blocks.1.qk is ..." for the second block
    """
    return _PATH.sub(lambda m: rename(m.group(0)), text)


def _name(handler: ProjectionHandler | None) -> str:
    if handler is None:  # pragma: no cover - build_sites never plans a role without a handler
        raise AssertionError("planned a role without a projection handler")
    return handler.name


def current_transforms(model: nn.Module, site: AttentionSite, paths: dict[str, str]) -> None:
    """Fill ``site.transforms`` with what the model carries now (after apply)."""
    for r in "qkv":
        if r not in paths:
            continue
        try:
            mod = model.get_submodule(paths[r])
        except AttributeError:
            continue
        kha = transforms_of(mod)
        if r in kha:
            site.transforms[r] = kind_of(kha[r]).name


def _foldable(kind: str) -> str:
    spec = get_transform(kind)
    return kind if spec.foldable or spec.fold_substitute is None else spec.fold_substitute
