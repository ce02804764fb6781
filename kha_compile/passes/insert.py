"""Turn matched sites into a plan, and apply it at module level.

A plan entry says: this module (a projection such as ``nn.Linear`` or ``Conv1D``, or an
``nn.MultiheadAttention`` whose projections are parameters) gets these transforms on these
head slots. Handlers are chosen by what owns the projection weight.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

from torch import nn

from ..config import KHAConfig
from ..errors import KHAError
from ..modules import HeadSlot, attach, attach_mha, is_kha_projection, KHAMultiheadAttention
from ..report import AttentionSite
from .layout import slot_from_map
from .match import RawSite, RoleMatch
from .trace import Capture

__all__ = ["PlanEntry", "build_sites", "insert", "kha_modules"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PlanEntry:
    module_path: str
    handler: str  # "projection" | "mha"
    slots: list[HeadSlot]
    kinds: dict[str, str]  # role -> transform kind
    out_features: int


def _slot(role: str, m: RoleMatch, param_space: bool) -> Optional[HeadSlot]:
    hm = m.head_map
    if param_space:  # features of the weight's output axis (e.g. rows of in_proj_weight)
        hm = dataclasses.replace(hm, index=m.projection.feature_map[hm.index])
    affine = slot_from_map(hm)
    if affine is None:
        return None
    offset, stride = affine
    return HeadSlot(role, offset, hm.num_heads, hm.head_dim, stride)


def _handler(model: nn.Module, m: RoleMatch) -> tuple[str, str]:
    """(handler name, reason when none fits) for the module owning a role's projection."""
    try:
        owner = model.get_submodule(m.projection.module_path)
    except AttributeError:
        return "", f"{m.role}: projection owner {m.projection.module_path!r} is not a submodule"
    if isinstance(owner, nn.MultiheadAttention):
        if owner.bias_k is not None or owner.add_zero_attn:
            return "", "nn.MultiheadAttention with add_bias_kv/add_zero_attn is not supported"
        return "mha", ""
    if m.projection.is_module_call:
        return "projection", ""
    return "", (f"{m.role}: weight {m.projection.param} is used functionally inside "
                f"{type(owner).__name__} ({m.projection.module_path}); no insertion handler for it")


def build_sites(model: nn.Module, raw_sites: list[RawSite], cap: Capture, cfg: Optional[KHAConfig]
                ) -> tuple[list[AttentionSite], list[PlanEntry]]:
    """Report entries for every site (expanded to every repeated block) and the insertion plan."""
    sites: list[AttentionSite] = []
    plan: dict[str, PlanEntry] = {}
    for raw in raw_sites:
        copies = _copies(raw, cap)
        if raw.reason or set(raw.roles) != {"q", "k", "v"}:
            for name, _ in copies:
                sites.append(AttentionSite(name, "skipped", raw.reason or "incomplete match", anchor=raw.anchor))
            continue
        q, k, v = (raw.roles[r] for r in "qkv")
        kind = "mla" if raw.mla else "cross" if raw.cross else (
            "mha" if k.head_map.num_heads == q.head_map.num_heads else
            "mqa" if k.head_map.num_heads == 1 else "gqa")
        handlers = {r: _handler(model, raw.roles[r]) for r in "qkv"}
        bad = [why for h, why in handlers.values() if not h]
        kinds = cfg.roles() if cfg is not None else {}
        note = "MLA: linear KHA only; MLP-value would break weight absorption (as in the paper)" if kind == "mla" else ""
        if kind == "mla" and kinds.get("v") == "mlp":
            kinds["v"] = "linear"
        slots = {}
        for r in kinds:
            param_space = handlers[r][0] == "mha"
            s = _slot(r, raw.roles[r], param_space)
            if s is None:
                bad.append(f"{r}: head layout of {raw.roles[r].projection.module_path} is not affine")
            slots[r] = s
        for name, rename in copies:
            if bad:
                sites.append(AttentionSite(name, "skipped", "; ".join(bad), anchor=raw.anchor))
                continue
            paths = {r: rename(raw.roles[r].projection.module_path) for r in "qkv"}
            site = AttentionSite(
                name, "matched", kind=kind, num_heads=q.head_map.num_heads, num_kv_heads=k.head_map.num_heads,
                head_dim=q.head_map.head_dim, v_head_dim=v.head_map.head_dim,
                q_proj=paths["q"], k_proj=paths["k"], v_proj=paths["v"], rope=q.rope or k.rope,
                qk_norm=q.qk_norm or k.qk_norm, anchor=raw.anchor, note=note)
            _current_transforms(model, site, paths, handlers)
            sites.append(site)
            for r, tk in kinds.items():
                path = paths[r]
                entry = plan.setdefault(path, PlanEntry(path, handlers[r][0], [], {},
                                                        int(raw.roles[r].projection.feature_map.numel())))
                if any(s.role == r for s in entry.slots):
                    continue
                entry.slots.append(slots[r])
                entry.kinds[r] = tk
    return sites, list(plan.values())


def _copies(raw: RawSite, cap: Capture) -> list[tuple[str, Callable[[str], str]]]:
    """(real site name, path renamer) for every repeated block a traced site stands for."""
    group = cap.group_of(raw.name)
    if group is None:
        return [(raw.name, lambda p: p)]
    list_path, pos = group
    traced_prefix = f"{list_path}.{pos}."
    out = []
    for orig in cap.groups[list_path][pos]:
        real_prefix = f"{list_path}.{orig}."
        rename = (lambda p, a=traced_prefix, b=real_prefix: b + p[len(a):] if p.startswith(a) else p)
        out.append((rename(raw.name + ".")[:-1], rename))
    return out


def _current_transforms(model: nn.Module, site: AttentionSite, paths: dict[str, str], handlers) -> None:
    """Fill ``site.transforms`` with what the model carries now (after apply)."""
    for r in "qkv":
        try:
            mod = model.get_submodule(paths[r])
        except AttributeError:
            continue
        kha = getattr(mod, "kha", None) if (is_kha_projection(mod) or isinstance(mod, KHAMultiheadAttention)) else None
        if kha is not None and r in kha:
            site.transforms[r] = type(kha[r]).kind


def insert(model: nn.Module, plan: list[PlanEntry]) -> int:
    """Apply the plan in place; returns the number of transforms inserted."""
    count = 0
    for entry in plan:
        module = model.get_submodule(entry.module_path)
        if entry.handler == "mha":
            attach_mha(module, entry.kinds)
        elif entry.handler == "adapter":  # a PEFT wrapper: T(base(x) + adapters(x))
            from .handlers import adapter

            adapter.attach(module, tuple(entry.slots), entry.kinds, entry.out_features)
        elif entry.handler == "projection":
            attach(module, tuple(entry.slots), entry.kinds, entry.out_features)
        else:  # pragma: no cover - build_sites never plans without a handler
            raise KHAError(f"no insertion handler for {entry.module_path}")
        count += len(entry.kinds)
    return count


def kha_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module in ``model`` that currently carries KHA transforms."""
    return [(n, m) for n, m in model.named_modules() if is_kha_projection(m) or isinstance(m, KHAMultiheadAttention)]
