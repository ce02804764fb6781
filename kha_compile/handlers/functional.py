"""Projection handler for weights used functionally and for weights of any rank (einsum, tensordot).

Covers ``F.linear(x, self.qkv.weight, cat(q_bias, zeros, v_bias))`` inside an attention module,
``x @ self.w.t()``, ``einsum("bsd,dhk->bshk", x, self.w)`` with a ``(d_model, heads, head_dim)``
or ``(heads, d_model, head_dim)`` parameter, ``tensordot``, and a module whose own forward is such
an einsum with a head-shaped output. Which KHA each form gets:

* **linear** (q, k, v): the parameters are parametrized (:mod:`kha_compile.model.parametrized`): the
  weight and every bias piece read through their attribute return ``P`` with ``T`` folded into
  each head slice, so the projection output of every head is ``y_h T`` exactly, and fold writes
  that same tensor back into the (N-d) parameter. Zero pieces of an assembled bias stay zero.
* **MLP-value** (v): the module whose forward calls the projection is given a forward that
  intercepts that call (a ``TorchFunctionMode``) and applies the transform to the head slices of
  its output, after a bias added right after the op. Not foldable; exports as the fused op.

The transforms live in a ``kha`` child of the module owning the weight. Hooks: ``accepts``,
``add_role`` (planning), ``attach``, ``detach``, ``fold`` and ``describe`` (site note).

Example::

    ok, why = accepts(model, role_match)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..analysis.match import RoleMatch
from ..analysis.params import POINTWISE_CONVS, conv_groups
from ..core.errors import AlreadyAppliedError, InternalError
from ..model.carrier import KHATransforms, is_kha_projection, make_transform, set_handler, transforms_of
from ..model.parametrized import (
    ParamSlot,
    ProjectionCall,
    fold_linked,
    functional_class_for,
    intercept_call,
    is_kha_functional,
    link_param,
    unlink,
)
from ..model.transforms import get_transform
from . import register_handler
from .base import ProjectionHandler

__all__ = [
    "FunctionalEntry",
    "FunctionalHandler",
    "accepts",
    "add_role",
    "attach",
    "describe",
    "detach",
    "fold",
    "is_kha_functional",
    "name",
    "param_space",
]

log = logging.getLogger(__name__)

name = "functional"
param_space = False  # HeadSlots are not used: positions in the parameters come from add_role


def _owner_attr(path: str) -> tuple[str, str]:
    owner, _, attr = path.rpartition(".")
    return owner, attr


def _param_slots(m: RoleMatch) -> tuple[list[tuple[str, str, ParamSlot]], str]:
    """(param path, kind, slot) for every parameter piece carrying this role's heads, or a reason."""
    out = []
    index = m.head_map.index  # (H, Dh) projection features
    for piece in m.projection.pieces:
        pos = piece.feature_map[index]  # (H, Dh) positions over the piece's axes, -1 where not this piece
        covered = (pos >= 0).all(dim=1)
        partial = (pos >= 0).any(dim=1) & ~covered
        if bool(partial.any()):
            return [], (
                f"{m.role}: a head of {m.projection.param} takes only part of its bias from "
                f"{piece.name}; linear KHA cannot be folded into it"
            )
        if bool(covered.any()):
            out.append((piece.name, piece.kind, ParamSlot(m.role, piece.axes, pos[covered].clone())))
    return out, ""


def _relative(home: str, path: str) -> str | None:
    """``path`` relative to the module at ``home`` ("" for itself), or None when it is not inside it."""
    if not home:
        return path
    if path == home:
        return ""
    return path[len(home) + 1 :] if path.startswith(home + ".") else None


def accepts(model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
    """Whether this handler carries KHA for a role whose projection is functional or N-d.

    Declines (with no reason) module-call projections whose features are the output's last axis:
    those are the module handlers' (``linear``, ``conv1d``).
    """
    proj = m.projection
    if proj.is_module_call and proj.features_last:
        return False, ""
    groups = conv_groups(proj.node)
    if groups > 1:  # a grouped pointwise conv: block-diagonal, so a head must read one group of inputs
        per_group = int(proj.feature_map.numel()) // groups
        group_of_head = m.head_map.index // per_group
        if bool((group_of_head != group_of_head[:, :1]).any()):
            return False, (
                f"{m.role}: the heads of {proj.param} span several of its {groups} conv groups; a shared "
                "transform would mix output channels that read different inputs"
            )
    if proj.pieces_reason:
        return False, f"{m.role}: {proj.pieces_reason} (projection on {proj.param})"
    slots, why = _param_slots(m)
    if why:
        return False, why
    try:
        home = model.get_submodule(proj.module_path)
    except AttributeError:
        return False, f"{m.role}: {proj.module_path!r} (calling the projection on {proj.param}) is not a submodule"
    if isinstance(home, nn.MultiheadAttention):
        return False, ""  # the mha handler's; it says why when it declines
    if is_kha_projection(home):
        return False, f"{m.role}: {proj.param} is used inside {type(home).__name__}, which another handler owns"
    for path, kind, slot in slots:
        owner, attr = _owner_attr(path)
        if _relative(proj.module_path, owner) is None:
            return False, (
                f"{m.role}: {path} is not inside {proj.module_path or 'the model'}, whose forward uses it; "
                "kha_compile parametrizes only parameters of the module that calls the projection"
            )
        mod = model.get_submodule(owner)
        if isinstance(mod, nn.MultiheadAttention) or is_kha_projection(mod):
            return False, f"{m.role}: {path} belongs to {type(mod).__name__}, which another handler owns"
        if kind == "buffer":
            value = getattr(mod, attr, None)
            if not isinstance(value, Tensor) or value.is_meta:
                return False, f"{m.role}: bias piece {path} is a buffer whose values cannot be checked"
            flat = value.detach().movedim(slot.axes, tuple(range(-len(slot.axes), 0))).reshape(-1)
            if bool((flat[slot.index.reshape(-1)] != 0).any()):
                return False, (
                    f"{m.role}: bias piece {path} is a non-zero buffer; linear KHA folds only into "
                    "parameters (register it as a parameter, or leave this role without KHA)"
                )
    return True, ""


@dataclasses.dataclass
class RolePlan:
    """What one role needs, in paths relative to the home module: parametrized pieces, the call."""

    kind: str
    head_dim: int
    params: list[tuple[str, str, ParamSlot]]  # linear: (module path, attribute, slot)
    call: tuple[str, str, int, int, tuple[int, ...], Tensor, bool] | None  # mlp: weight owner, attr, ...


@dataclasses.dataclass
class FunctionalEntry:
    """The ``extra`` of a plan entry handled here: one per module calling projections (the ``kha`` home)."""

    roles: dict[str, RolePlan] = dataclasses.field(default_factory=dict)


def _call_plan(m: RoleMatch) -> tuple[tuple[int, ...], Tensor, bool]:
    """(feature axes, (H, Dh) positions in the flattened output, bias added after the op)."""
    idx = m.projection.out_index
    if idx is None:  # pragma: no cover - every projection carries it
        raise InternalError("projection without an output index; this is a bug")
    axes = tuple(a for a in range(idx.dim()) if idx.shape[a] > 1 and bool((idx != idx.narrow(a, 0, 1)).any()))
    moved = idx.movedim(axes, tuple(range(idx.dim() - len(axes), idx.dim())))
    feats = moved.reshape(-1, int(torch.Size([idx.shape[a] for a in axes]).numel()))[0]  # position -> feature
    inv = torch.empty_like(feats)
    inv[feats] = torch.arange(feats.numel())
    node = m.projection.node
    inside = (torch.ops.aten.linear.default, torch.ops.aten.addmm.default, *POINTWISE_CONVS)
    post = node.target not in inside and any(p.kind != "weight" for p in m.projection.pieces)
    return axes, inv[m.head_map.index], post


def add_role(entry: Any, role: str, m: RoleMatch, kind: str) -> None:
    """Record ``role`` (kind "linear" | "mlp") of a matched site in a plan entry (``entry.extra``).

    Paths are kept relative to the home (the module calling the projection), so one traced block
    plans every repeated copy.
    """
    extra = entry.extra if isinstance(getattr(entry, "extra", None), FunctionalEntry) else FunctionalEntry()
    entry.extra = extra
    if role in extra.roles:
        return  # shared layers: the same projection serves several calls
    home = m.projection.module_path
    slots, _ = _param_slots(m)
    params: list[tuple[str, str, ParamSlot]] = []
    call = None
    if get_transform(kind).foldable:
        for path, pkind, slot in slots:
            if pkind != "buffer":  # zero buffer pieces stay zero under T
                owner, attr = _owner_attr(path)
                params.append((_relative(home, owner) or "", attr, slot))
    else:
        axes, positions, post = _call_plan(m)  # refuses a projection without an output index
        owner, attr = _owner_attr(m.projection.param)
        ndim = int(cast(Tensor, m.projection.out_index).dim())
        call = (_relative(home, owner) or "", attr, m.projection.occurrence, ndim, axes, positions, post)
    extra.roles[role] = RolePlan(kind, m.head_map.head_dim, params, call)
    entry.kinds[role] = kind


def describe(model: nn.Module, roles: dict[str, RoleMatch], rename: Callable[[str], str] = lambda p: p) -> str:
    """The site-report note for the roles this handler carries: which form gets which KHA, and how."""
    if not roles:
        return ""
    by_param: dict[str, list[str]] = {}
    for r, m in roles.items():
        by_param.setdefault(rename(m.projection.param), []).append(r)
    parts = []
    for param, rs in by_param.items():
        proj = roles[rs[0]].projection
        op = str(proj.node.target).split(".")[-2] if "." in str(proj.node.target) else str(proj.node.target)
        nd = len(proj.pieces[0].axes) + 1 if proj.pieces else 2
        pieces = [rename(p.name) for p in proj.pieces if p.kind != "buffer"]
        try:
            owner_mod = model.get_submodule(rename(proj.module_path))
            where = getattr(type(owner_mod), "_kha_base_class", type(owner_mod)).__name__ + ".forward"
        except AttributeError:
            where = proj.module_path or "forward"
        form = "N-d weight" if nd > 2 or not proj.features_last else "functional weight"
        parts.append(
            f"{','.join(rs)}: {form} {param} via {op}: linear KHA parametrizes {', '.join(pieces)} "
            f"(exact fold); MLP-value intercepts the {op} call in {where}"
        )
    return "; ".join(parts)


def _switch(module: nn.Module) -> None:
    if is_kha_projection(module) or isinstance(module, nn.MultiheadAttention):
        raise AlreadyAppliedError(
            f"{type(module).__name__} already carries KHA from another handler; kha_compile cannot also "
            "parametrize its parameters."
        )
    if not is_kha_functional(module):
        module.__class__ = functional_class_for(type(module))


def attach(module: nn.Module, entry: Any) -> nn.Module:
    """Give the home ``module`` its ``kha`` transforms and wire parameters and calls to them."""
    extra: FunctionalEntry = entry.extra
    ref = next(iter(module.parameters()), None)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    device = ref.device if ref is not None else None
    transforms = KHATransforms(
        {r: make_transform(p.kind, p.head_dim, dtype=dtype, device=device) for r, p in extra.roles.items()}
    )
    plans = [
        (
            r,
            p,
            [module.get_submodule(path) for path, _, _ in p.params],
            module.get_submodule(p.call[0]) if p.call is not None else None,
        )
        for r, p in extra.roles.items()
    ]
    for _, _, mods, _ in plans:  # resolve everything before changing anything
        for mod in [module, *mods]:
            _switch(mod)
    module.kha = transforms
    for role, plan, mods, w_owner in plans:
        t = transforms[role]
        for mod, (_, attr, slot) in zip(mods, plan.params):
            link_param(mod, attr, slot, t)
        if plan.call is not None:
            _, attr, occ, ndim, axes, positions, post = plan.call
            intercept_call(module, ProjectionCall(w_owner, attr, occ, ndim, axes, {role: positions}, {role: t}, post))
    return module


def detach(module: nn.Module) -> nn.Module:
    """Undo :func:`attach` for a home: every touched module gets its class back."""
    unlink(module)
    return module


def fold(module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
    """New values (dotted names relative to the home ``module``) with the linear ``roles`` folded in."""
    return fold_linked(module, roles)


class FunctionalHandler(ProjectionHandler):
    """The registry form of this handler: the functions above."""

    name = "functional"
    priority = 10
    param_space = False
    plans_roles = True

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        return accepts(model, m)

    def owns(self, module: nn.Module) -> bool:
        return is_kha_functional(module) and "kha" in module._modules

    def plan_role(self, entry: Any, role: str, m: RoleMatch, kind: str) -> None:
        add_role(entry, role, m, kind)

    def describe(
        self, model: nn.Module, roles: dict[str, RoleMatch], rename: Callable[[str], str] = lambda p: p
    ) -> str:
        return describe(model, roles, rename)

    def attach(self, module: nn.Module, entry: Any) -> None:
        attach(module, entry)
        set_handler(module, self.name)

    def detach(self, module: nn.Module) -> None:
        set_handler(module, None)
        detach(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        return fold(module, roles)

    def drop(self, module: nn.Module, roles: Sequence[str]) -> None:
        if set(roles) >= set(transforms_of(module)):
            set_handler(module, None)
        unlink(module, set(roles))


register_handler(FunctionalHandler())
