"""KHA on projections that are not modules: parametrized weights and intercepted projection calls.

A weight used functionally (``F.linear(x, self.qkv.weight, bias)``, ``einsum("bsd,dhk->bshk", x,
self.w)``) has no module output to wrap. Two mechanisms cover it, both switching the class of an
existing module to a ``KHAFunctional<Base>`` subclass (same object, parameters and keys):

* **linear KHA** parametrizes the parameters: reading ``module.weight`` (or a bias piece such as
  ``q_bias``) returns the parameter with ``T`` folded into each head's slice,
  ``P[..., pos(h, :)] @ T`` — wherever and however the parameter is read, the projection output
  of head h is ``y_h T``. The stored parameter and its ``state_dict`` key do not change, and fold
  writes exactly the tensor the forward used (:func:`fold_param` is the one primitive).
* **MLP-value** is not linear: the module whose forward computes the projection runs it under a
  ``TorchFunctionMode`` that recognises the projection call on that weight (by identity, through
  layout ops, counted in call order as in the traced graph) and applies the transform to the
  head slices of its output (after the bias add, when the bias is added right after the op).

The transforms live in a ``kha`` child of the module owning the weight (``...qkv.kha.v.up``); other
modules hold references to them that are not registered, so every parameter appears once.

Example::

    slot = ParamSlot("v", (0,), torch.arange(32, 48).view(2, 8))
    w_folded = fold_param(lin.weight, [(slot, t.weight)])
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..core.errors import FoldError, InternalError, TracedPathError
from ..core.mixins import mixin_class, module_class_named
from .carrier import KHATransforms
from .transforms import kind_of

__all__ = [
    "KHAFunctional",
    "ParamSlot",
    "ProjectionCall",
    "fold_linked",
    "fold_param",
    "functional_class_for",
    "intercept_call",
    "is_kha_functional",
    "link_param",
    "raw_parameters",
    "restore_class",
    "unlink",
]


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """One role's heads inside one parameter: ``index[h, j]`` is the flat position over ``axes``."""

    role: str
    axes: tuple[int, ...]
    index: Tensor  # (H, Dh) int64


def fold_param(value: Tensor, slots: list[tuple[ParamSlot, Tensor]]) -> Tensor:
    """``value`` with ``x -> x @ T`` applied to the head slices of each slot (differentiable).

    The parameter is seen as a matrix (contracted positions, output positions); the columns of
    head h become ``cols_h @ T``. With ``T = I`` the result equals ``value`` exactly.

    Example::

        w2 = fold_param(w, [(ParamSlot("v", (0,), idx), t)])     # w: (out, in), idx: (H, Dh) rows
    """
    if not slots:
        return value
    axes = slots[0][0].axes
    nd = value.dim()
    dest = tuple(range(nd - len(axes), nd))
    moved = value.movedim(axes, dest)  # (..., *out axes)
    lead = moved.shape[: nd - len(axes)]
    m = moved.reshape(-1, int(torch.Size(moved.shape[nd - len(axes) :]).numel()))  # (contracted, out)
    for slot, t in slots:
        if slot.axes != axes:
            raise InternalError(f"slots over different axes {slot.axes} and {axes} of one parameter; this is a bug.")
        idx = slot.index.to(m.device)
        cols = m.index_select(1, idx.reshape(-1)).reshape(m.shape[0], *idx.shape)  # (C, H, Dh)
        new = cols @ t.to(m.dtype)
        m = m.index_copy(1, idx.reshape(-1), new.reshape(m.shape[0], -1))
    out = m.reshape(*lead, *moved.shape[nd - len(axes) :]).movedim(dest, axes)
    # the parameter's own memory layout: ops then take the same kernels as with the original, bit for bit
    return out.contiguous() if value.is_contiguous() else out


@dataclasses.dataclass
class ProjectionCall:
    """A projection call to intercept in a module's forward (MLP-value on a functional weight).

    ``occurrence``: the n-th projection-like call that consumes this weight during the forward.
    ``positions``: per role, (H, Dh) positions in the output flattened over ``feature_axes``.
    """

    weight_owner: Any  # nn.Module (held by reference, not registered)
    weight_attr: str
    occurrence: int
    ndim: int
    feature_axes: tuple[int, ...]
    positions: dict[str, Tensor]
    transforms: dict[str, nn.Module]
    post_add: bool = False  # the bias is added right after the op: transform the sum


_PROJ_NAMES = {
    "linear",
    "matmul",
    "__matmul__",
    "__rmatmul__",
    "mm",
    "addmm",
    "einsum",
    "tensordot",
    "bmm",
    "conv1d",  # a pointwise (kernel 1) Conv1d projection in (B, C, T) layout
    "conv2d",  # a pointwise (1x1) Conv2d projection in (B, C, H, W) layout
}
_LAYOUT_NAMES = {
    "t",
    "T",
    "mT",
    "transpose",
    "permute",
    "view",
    "reshape",
    "unsqueeze",
    "squeeze",
    "contiguous",
    "to",
    "type_as",
    "chunk",
    "split",
    "unbind",
    "__getitem__",
    "narrow",
    "flatten",
    "unflatten",
    "movedim",
    "expand",
    "float",
    "half",
    "bfloat16",
    "__get__",
    "view_as",
    "reshape_as",
    "clone",
}
_ADD_NAMES = {"add", "__add__", "__radd__", "__iadd__", "add_"}


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # Tensor.T and friends arrive as the property getter
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
        else:
            out.append(a)
    return out


def _apply_call(y: Tensor, call: ProjectionCall) -> Tensor:
    """Apply each role's transform to its head positions of a projection output ``y``."""
    if y.dim() != call.ndim:
        raise TracedPathError(
            f"the projection on {call.weight_attr} returned {y.dim()} dims at run time, {call.ndim} when "
            "traced; re-run kc.apply with example inputs that take this code path."
        )
    nd = y.dim()
    perm = [a for a in range(nd) if a not in call.feature_axes] + list(call.feature_axes)
    moved = y.permute(perm) if perm != list(range(nd)) else y  # feature axes last (permute: a layout op)
    lead = moved.shape[: nd - len(call.feature_axes)]
    flat = moved.reshape(*lead, -1)  # (..., F)
    for role, pos in call.positions.items():
        p = pos.to(y.device)
        heads = flat.index_select(-1, p.reshape(-1)).reshape(*lead, *p.shape)  # (..., H, Dh)
        new = call.transforms[role](heads).reshape(*lead, -1)
        flat = flat.index_copy(flat.dim() - 1, p.reshape(-1), new)
    out = flat.reshape(moved.shape)
    if perm == list(range(nd)):
        return out
    inverse = [perm.index(a) for a in range(nd)]
    out = out.permute(inverse)
    # the projection's own memory layout (a conv's (B, C, H, W)): what reads it next (SDPA's kernel
    # choice, a matmul's blocking) then rounds as in the original model, so identity at init is exact
    return out.contiguous() if y.is_contiguous() and not out.is_contiguous() else out


class _Intercept(TorchFunctionMode):
    """Applies MLP-value transforms to the outputs of the projection calls of one forward."""

    def __init__(self, calls: list[ProjectionCall], weights: list[Tensor]) -> None:
        super().__init__()
        self.groups: dict[int, list[ProjectionCall]] = {}  # weight id -> its calls
        for call, w in zip(calls, weights):
            self.groups.setdefault(id(w), []).append(call)
        self.tracked: dict[int, int] = {id(w): id(w) for w in weights}  # tensor id -> weight id
        self.keep: list[Any] = list(weights)  # ids stay valid while the forward runs
        self.seen: dict[int, int] = dict.fromkeys(self.groups, 0)
        self.pending: dict[int, ProjectionCall] = {}
        self.done = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _name(func)
        inputs = _flat((args, kwargs))
        if name in _ADD_NAMES and self.pending:
            for a in inputs:
                call = self.pending.pop(id(a), None) if isinstance(a, Tensor) else None
                if call is not None:
                    self.done += 1
                    return _apply_call(out, call)
        hits = {self.tracked[id(a)] for a in inputs if isinstance(a, Tensor) and id(a) in self.tracked}
        if not hits:
            return out
        if name in _PROJ_NAMES and isinstance(out, Tensor):
            for w in hits:
                n = self.seen[w]
                self.seen[w] += 1
                call = next((c for c in self.groups[w] if c.occurrence == n), None)
                if call is None:
                    continue
                if call.post_add:
                    self.pending[id(out)] = call
                    self.keep.append(out)
                    return out
                self.done += 1
                return _apply_call(out, call)
            return out
        if name in _LAYOUT_NAMES:
            w = next(iter(hits))
            for o in _flat(out):
                if isinstance(o, Tensor):
                    self.tracked[id(o)] = w
                    self.keep.append(o)
        return out


_RAW: list[bool] = []  # non-empty inside raw_parameters()


@contextlib.contextmanager
def raw_parameters() -> Iterator[None]:
    """Parametrized parameters read as stored (the analysis trace sees the original projections).

    Example::

        with raw_parameters():
            exported = torch.export.export(model, args, strict=False)
    """
    _RAW.append(True)
    try:
        yield
    finally:
        _RAW.pop()


class KHAFunctional(nn.Module):
    """Mixin of a module whose parameters are parametrized by KHA or whose forward is intercepted.

    Not instantiated directly: :func:`functional_class_for` gives an existing module a subclass
    of this mixin and its own class. Per-instance state (in ``__dict__``, not registered):
    ``_kha_pslots`` {param name: [(ParamSlot, transform)]} for linear KHA, ``_kha_calls``
    [ProjectionCall] for MLP-value.
    """

    _kha_base_class: ClassVar[type[Any]]  # the class it was made from (set by functional_class_for)

    def __getattr__(self, name: str) -> Any:
        pslots = self.__dict__.get("_kha_pslots")
        if pslots and name in pslots and not _RAW:
            cache = self.__dict__.get("_kha_cache")
            if cache is not None and name in cache:
                return cache[name]
            raw = cast(Tensor, super().__getattr__(name))  # a registered parameter (name in pslots)
            value = fold_param(raw, [(s, kind_of(t).fold_matrix(t)) for s, t in pslots[name]])
            if cache is not None:
                cache[name] = value
            return value
        return super().__getattr__(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls = self.__dict__.get("_kha_calls")
        if not calls:
            return super().forward(*args, **kwargs)
        owners = {id(c.weight_owner): c.weight_owner for c in calls}
        for m in owners.values():  # one parametrized value per forward, so identities hold
            m.__dict__["_kha_cache"] = {}
        try:
            weights = [getattr(c.weight_owner, c.weight_attr) for c in calls]
            mode = _Intercept(calls, weights)
            with mode:
                out = super().forward(*args, **kwargs)
            if mode.done != len(calls):
                raise TracedPathError(
                    f"{type(self).__name__}: {len(calls) - mode.done} of {len(calls)} KHA projection calls "
                    "did not run in this forward (a code path other than the traced one); re-apply KHA "
                    "with example inputs that take this path."
                )
            return out
        finally:
            for m in owners.values():
                m.__dict__.pop("_kha_cache", None)


def functional_class_for(base_cls: type) -> type:
    """The ``KHAFunctional<Base>`` subclass of a module class (created once)."""
    if issubclass(base_cls, KHAFunctional):
        return base_cls
    return mixin_class(KHAFunctional, base_cls, f"KHAFunctional{base_cls.__name__}", __name__, _kha_base_class=base_cls)


def is_kha_functional(module: Any) -> bool:
    return isinstance(module, KHAFunctional)


def restore_class(module: nn.Module) -> None:
    """Give ``module`` its original class back when it carries no KHA state any more."""
    if not isinstance(module, KHAFunctional):
        return
    d = module.__dict__
    if d.get("_kha_pslots") or d.get("_kha_calls") or "kha" in module._modules:
        return
    for attr in ("_kha_pslots", "_kha_calls", "_kha_cache", "_kha_links"):
        d.pop(attr, None)
    module.__class__ = type(module)._kha_base_class


def link_param(mod: nn.Module, attr: str, slot: ParamSlot, transform: nn.Module) -> None:
    """Parametrize ``mod.<attr>``: reading it gives the parameter with ``transform`` folded into ``slot``."""
    if not is_kha_functional(mod):
        mod.__class__ = functional_class_for(type(mod))
    mod.__dict__.setdefault("_kha_pslots", {}).setdefault(attr, []).append((slot, transform))


def intercept_call(home: nn.Module, call: ProjectionCall) -> None:
    """Have ``home``'s forward apply ``call``'s transforms to the output of that projection call."""
    if not is_kha_functional(home):
        home.__class__ = functional_class_for(type(home))
    home.__dict__.setdefault("_kha_calls", []).append(call)


def unlink(home: nn.Module, roles: set[str] | None = None) -> None:
    """Drop the parametrizations and calls of ``home``'s transforms (of ``roles``, or all).

    The transforms leave ``home.kha``; every module that no longer carries KHA state gets its class back.
    """
    kha = home._modules.get("kha")
    if not isinstance(kha, KHATransforms):
        return
    gone = [t for r, t in kha.items() if roles is None or r in roles]
    for mod in home.modules():
        pslots = mod.__dict__.get("_kha_pslots", {})
        for attr in list(pslots):
            pslots[attr] = [(s, t) for s, t in pslots[attr] if not any(t is g for g in gone)]
            if not pslots[attr]:
                del pslots[attr]
    calls = home.__dict__.get("_kha_calls")
    if calls:
        home.__dict__["_kha_calls"] = [c for c in calls if not any(t is g for t in c.transforms.values() for g in gone)]
    for r in [r for r, t in kha.items() if any(t is g for g in gone)]:
        del kha[r]
    if len(kha) == 0:
        del home.kha
    for mod in list(home.modules()):
        restore_class(mod)


def fold_linked(home: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
    """New values (dotted names relative to ``home``) of the parameters its foldable ``roles`` parametrize.

    Computes only. Write them to the stored parameters (``module.get_parameter(name)``), not through
    attribute access, which returns the parametrized value.
    """
    kha = home._modules.get("kha")
    if not isinstance(kha, KHATransforms):
        return []
    wanted = [kha[r] for r in roles if r in kha and kind_of(kha[r]).foldable]
    out = []
    for path, mod in home.named_modules():
        pslots = mod.__dict__.get("_kha_pslots") if is_kha_functional(mod) else None
        for attr, slots in (pslots or {}).items():
            lin = [(s, kind_of(t).fold_matrix(t)) for s, t in slots if any(t is w for w in wanted)]
            if not lin:
                continue
            raw = mod._parameters.get(attr)
            if raw is None:
                raise FoldError(f"cannot fold into {type(mod).__name__}.{attr}: not a parameter. Nothing was changed.")
            with torch.no_grad():
                out.append(
                    (f"{path}.{attr}" if path else attr, fold_param(raw.detach(), [(s, t.detach()) for s, t in lin]))
                )
    return out


def __getattr__(name: str) -> Any:
    """Recreate ``KHAFunctional<Base>`` classes on demand (unpickling in a new process)."""
    prefix = "KHAFunctional"
    base = (
        module_class_named(name[len(prefix) :], KHAFunctional)
        if name.startswith(prefix) and len(name) > len(prefix)
        else None
    )
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return functional_class_for(base)
