"""The modules KHA inserts: the shared transforms and the projection that carries them.

A projection keeps its own object, parameters and ``state_dict`` keys. :func:`attach` turns it
into a KHA projection by switching its class to a subclass made here (``KHALinear`` for
``nn.Linear``, ``KHAConv1D`` for transformers' ``Conv1D``, ...) and adding a ``kha`` child that
holds one transform per role. :func:`detach` switches the class back, so the original module
object, class and keys return (that is how :func:`kha_compile.fold` restores a vanilla model).

A carrier holds everything it needs to run: its head slots, the orientation of its weight and
its execution strategy. It folds its own linear transforms into its weight
(:meth:`KHAProjection.kha_fold`), on the fly (weight-side execution, differentiable) and for
``kc.fold`` (detached), with the one fold primitive :func:`~kha_compile.model.rows.fold_rows`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.errors import FoldError, TensorParallelError, TracedPathError
from ..core.mixins import mixin_class, module_class_named
from ..core.optional import is_dtensor
from ..core.quantized import compute_dtype, is_quantized_weight
from .quantized import dequantized
from .rows import base_class, fold_rows, projection_output, weight_out_axis
from .sharded import UNADOPTED_TP, adopt_tensor_parallel
from .slots import HeadSlot, layout_plan, transform_slices
from .strategy import as_parameters, check_strategy, swapped_params, use_weight_side
from .transforms import get_transform, kind_of

__all__ = [
    "HANDLER_ATTR",
    "KHAProjection",
    "KHATransforms",
    "attach",
    "carries_kha",
    "detach",
    "handler_name",
    "is_borrower",
    "is_kha_projection",
    "kha_class_for",
    "kha_modules",
    "make_transform",
    "register_by_path",
    "set_handler",
    "set_strategy",
    "transforms_of",
]

HANDLER_ATTR = "_kha_handler"  # instance attribute of a module with KHA: the name of its projection handler


def register_by_path(module: nn.Module, name: str, param: nn.Parameter | None) -> bool:
    """Register a parameter named by its dotted path (``kha.q.weight``) on the child that owns it.

    torch's tensor-parallel styles (``ColwiseParallel``) re-register every parameter of the module
    they shard under its name in ``module.named_parameters()``, children included, and
    ``nn.Module.register_parameter`` refuses dotted names. Returns False for a plain name.
    """
    if "." not in name:
        return False
    owner, _, leaf = name.rpartition(".")
    module.get_submodule(owner).register_parameter(leaf, param)
    return True


class KHATransforms(nn.ModuleDict):
    """The ``kha`` child of a KHA carrier: one shared transform per role ("q", "k", "v")."""

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        if not register_by_path(self, name, param):  # torch's ColwiseParallel names its children's parameters
            super().register_parameter(name, param)


def make_transform(
    kind: str, head_dim: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> nn.Module:
    """Build the transform of registered ``kind`` ("linear" | "mlp" | ...) at identity, in the given dtype and device."""
    return get_transform(kind).create(head_dim, dtype=dtype, device=device)


def make_transforms(
    slots: Sequence[HeadSlot], kinds: dict[str, str], ref: Tensor | None
) -> tuple[KHATransforms, tuple[HeadSlot, ...]]:
    """One transform per role of ``kinds`` (dtype and device of ``ref``) and the slots they act on."""
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    device = ref.device if ref is not None else None
    return _transforms_for(slots, kinds, dtype, device)


def _transforms_for(
    slots: Sequence[HeadSlot], kinds: dict[str, str], dtype: torch.dtype | None, device: torch.device | None
) -> tuple[KHATransforms, tuple[HeadSlot, ...]]:
    transforms = KHATransforms()
    for s in slots:
        if s.role in kinds and s.role not in transforms:
            transforms[s.role] = make_transform(kinds[s.role], s.head_dim, dtype=dtype, device=device)
    return transforms, tuple(s for s in slots if s.role in transforms)


class KHAProjection(nn.Module):
    """Mixin for a projection module that applies shared KHA transforms to its head slices.

    Not instantiated directly: :func:`attach` gives an existing projection a subclass of this
    mixin and its own class, so it keeps its parameters and ``state_dict`` keys. Its state (plain
    attributes, not parameters or modules): ``_kha_slots`` (head slots of every role it carries),
    ``_kha_out_features``, ``_kha_weight_axis`` (0: ``y = x W^T``, 1: ``y = x W``, None: unknown,
    so no weight-side execution), ``kha_strategy`` and the handler's name.
    """

    _kha_base_class: ClassVar[type[nn.Module]]
    kha: KHATransforms
    _kha_slots: tuple[HeadSlot, ...]
    _kha_out_features: int
    _kha_weight_axis: int | None = None
    kha_strategy: str = "auto"  # linear KHA execution: "auto" | "weight" | "token" (kha_compile.model.strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        folded = self._kha_weight_side_roles(args, kwargs)
        if not folded:  # token-side: transform the projection output
            return self._kha_output(super().forward(*args, **kwargs), ())
        params = self.kha_fold(folded, detach=False)
        if self._kha_base_class is nn.Linear and len(args) == 1 and not kwargs:
            y = F.linear(args[0], *as_parameters(self, params))  # nn.Linear's forward, on W' and b'
        else:
            with swapped_params(self, params):
                y = super().forward(*args, **kwargs)  # weight-side: the base forward with W' = T^T W per head slot
        return self._kha_output(y, folded)

    def _kha_output(self, y: Any, skip: Sequence[str]) -> Any:
        """Transform the projection output; a module returning a tuple (a quantized linear's
        ``(y, scale)``) gets its projection element (:func:`projection_output`) transformed."""
        if isinstance(y, Tensor):
            return self.kha_transform(y, skip=skip)
        i = projection_output(y, self._kha_out_features)
        if i is None:
            raise TracedPathError(
                f"{base_class(self).__name__} returned {type(y).__name__} with no tensor of "
                f"{self._kha_out_features} features; KHA cannot find its projection output. Re-run kc.apply "
                "with example inputs that take this code path."
            )
        items = list(y)
        items[i] = self.kha_transform(items[i], skip=skip)
        return type(y)(items) if type(y) in (tuple, list) else type(y)(*items)  # a namedtuple takes fields

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """``nn.Module.register_parameter``; a dotted name (torch's ``ColwiseParallel``) goes to its owner."""
        if not register_by_path(self, name, param):
            super().register_parameter(name, param)

    def _kha_sources(self, roles: Sequence[str]) -> list[Tensor]:
        """The tensors a fold of ``roles`` reads: weight, bias, and each role's transform parameters."""
        out: list[Tensor] = [t for t in (self._parameters.get("weight"), self._parameters.get("bias")) if t is not None]
        for r in roles:
            out.extend(kind_of(self.kha[r]).params(self.kha[r]))
        return out

    def _kha_weight_side_roles(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """The foldable roles this call runs weight-side (empty: all token-side), per ``kha_strategy``."""
        w = self._parameters.get("weight")
        x = args[0] if args else next(iter(kwargs.values()), None)
        if (
            self._kha_weight_axis is None
            or self.__dict__.get("_is_hooked")  # sharded by transformers: its weight may be this rank's rows only
            or not isinstance(w, Tensor)
            or w.dim() != 2
            or is_quantized_weight(w)  # a quantized weight is never folded on the fly: token-side
            or not isinstance(x, Tensor)
            or x.dim() == 0
        ):
            return ()
        if torch.compiler.is_compiling():  # traced: token-side (use_weight_side), and no guard on a token count
            return ()
        tokens = x.numel() // max(x.shape[-1], 1)
        strategy = self.kha_strategy
        if strategy == "auto" and tokens <= x.shape[-1]:  # token-side whatever the sources (strategy.py)
            return ()
        roles = self._kha_foldable_roles()
        if not roles:
            return ()
        return roles if use_weight_side(strategy, self._kha_sources(roles), tokens, x.shape[-1]) else ()

    def _kha_foldable_roles(self) -> tuple[str, ...]:
        """The roles whose transform is of a foldable kind (remembered per set of transform modules)."""
        mods = tuple(self.kha._modules.items())
        cached = self.__dict__.get("_kha_cached_foldable")
        if cached is None or len(cached[0]) != len(mods) or any(a[1] is not b[1] for a, b in zip(cached[0], mods)):
            roles = tuple(r for r, m in mods if m is not None and kind_of(m).foldable)
            cached = self.__dict__["_kha_cached_foldable"] = (mods, roles)
        return cached[1]

    def kha_fold(self, roles: Sequence[str], *, detach: bool = True) -> list[tuple[str, Tensor]]:
        """(name, tensor) of weight and bias with the linear transforms of ``roles`` folded in.

        ``detach=False`` keeps autograd (weight-side execution: W, b and T get exact gradients);
        ``detach=True`` is what ``kc.fold`` writes. Computes only; nothing is written.
        """
        slots = [s for s in self._kha_slots if s.role in roles and s.role in self.kha]
        if not slots:
            return []
        axis = self._kha_weight_axis
        if axis is None:
            raise FoldError(
                f"cannot fold into {base_class(self).__name__}: the orientation of its weight "
                "(y = x W^T or y = x W) could not be told from its shape or a probe of its forward. "
                "Nothing was changed."
            )
        w: Tensor = self.get_parameter("weight")
        if is_quantized_weight(w):  # kc.fold only (a quantized weight runs token-side): fold in float, requantize after
            w = dequantized(self)
        b: Tensor | None = self._parameters.get("bias")
        for s in slots:
            t = self.kha[s.role]
            w, b = fold_rows(w, b, s, kind_of(t).fold_matrix(t), axis, detach=detach)
        return [("weight", w)] + ([("bias", b)] if b is not None else [])

    def _kha_layout(self, skip: Sequence[str] = ()) -> tuple[tuple[HeadSlot, ...], str, int]:
        """(active slots, plan, stride) of the roles not in ``skip``, computed once per set of roles."""
        roles = tuple(r for r in self.kha if r not in skip)
        cache = self.__dict__.get("_kha_cached_layout")
        if not isinstance(cache, dict):  # none yet (or a pickle from before strategies)
            cache = self.__dict__["_kha_cached_layout"] = {}
        cached = cache.get(roles)
        if cached is None:
            slots = tuple(s for s in self._kha_slots if s.role in roles)
            plan = layout_plan(slots, self._kha_out_features) if slots else ("none", 0)
            cached = cache[roles] = (slots, *plan)
        return cached

    def kha_transform(self, y: Tensor, skip: Sequence[str] = ()) -> Tensor:
        """Apply each role's transform (except those in ``skip``) to its head slices of ``y`` (..., out)."""
        if is_dtensor(y) and adopt_tensor_parallel(self):  # torch's parallelize_module sharded this projection
            return self.kha_transform(y, skip)  # now a TensorParallelKHA: this rank's heads
        if self.__dict__.get("_is_hooked") and y.shape[-1] != self._kha_out_features:  # transformers' local TP path
            raise TensorParallelError(
                UNADOPTED_TP.format(name=type(self).__name__, got=y.shape[-1], want=self._kha_out_features)
            )
        slots, mode, stride = self._kha_layout(skip)
        return transform_slices(y, slots, mode, stride, dict(self.kha.items()))

    def kha_extra(self) -> str:
        return ", ".join(
            f"{s.role}:{type(self.kha[s.role]).__name__}[{s.num_heads}x{s.head_dim}]"
            for s in self._kha_slots
            if s.role in self.kha
        )


def kha_class_for(base_cls: type, mixin: type = KHAProjection) -> type:
    """The KHA subclass of a projection class (created once, named ``KHA<Base>``)."""
    if issubclass(base_cls, mixin):
        return base_cls
    prefix = getattr(mixin, "_kha_prefix", "KHA")
    return mixin_class(mixin, base_cls, f"{prefix}{base_cls.__name__}", mixin.__module__, _kha_base_class=base_cls)


def is_kha_projection(module: nn.Module) -> bool:
    return isinstance(module, KHAProjection)


def carries_kha(module: nn.Module) -> bool:
    """True when ``module`` holds KHA transforms (a ``kha`` child, or transforms it shares with
    another projection of a joint attention), whichever handler attached them."""
    return isinstance(module._modules.get("kha"), KHATransforms) or is_borrower(module)


def is_borrower(module: nn.Module) -> bool:
    """True when ``module`` applies transforms registered in another projection (joint streams).

    Example::

        is_borrower(model.blocks[0].img_q)     # True: its T^Q is txt_qkv's
    """
    return isinstance(module.__dict__.get("kha"), KHATransforms)


def transforms_of(module: nn.Module) -> KHATransforms:
    """The ``kha`` transforms of a module that carries KHA (an empty set for a module that does not)."""
    kha = module._modules.get("kha")
    if not isinstance(kha, KHATransforms):
        kha = module.__dict__.get("kha")
    return kha if isinstance(kha, KHATransforms) else KHATransforms()


def kha_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module in ``model`` that currently carries KHA transforms."""
    return [(n, m) for n, m in model.named_modules() if carries_kha(m)]


def handler_name(module: nn.Module) -> str | None:
    """The name of the projection handler that attached ``module``'s KHA (None: not recorded)."""
    name = module.__dict__.get(HANDLER_ATTR)
    return name if isinstance(name, str) else None


def set_handler(module: nn.Module, name: str | None) -> None:
    """Record (or, with None, forget) which projection handler owns ``module``'s KHA."""
    if name is None:
        module.__dict__.pop(HANDLER_ATTR, None)
    else:
        module.__dict__[HANDLER_ATTR] = name


def attach(
    module: nn.Module,
    slots: tuple[HeadSlot, ...],
    kinds: dict[str, str],
    out_features: int,
    *,
    handler: str | None = None,
    strategy: str = "auto",
    weight_axis: int | str | None = "probe",
    mixin: type = KHAProjection,
    transforms: KHATransforms | None = None,
    borrowed: bool = False,
    quantized_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Turn ``module`` into a KHA projection in place; transforms match its weight's dtype and device.

    ``weight_axis``: the axis of ``module.weight`` that indexes output features ("probe": told by
    :func:`~kha_compile.model.rows.weight_out_axis`). ``transforms``: existing ones to carry (PEFT's
    unload moves them between modules) instead of new ones at identity. ``borrowed``: the transforms
    are another projection's (joint streams share one per role): held, not registered, so each
    parameter has one name; fold folds them into this projection too. ``quantized_dtype``: the
    transforms' dtype beside a quantized weight that does not tell its compute dtype (bitsandbytes
    8-bit: the model's).

    Example::

        attach(lin, (HeadSlot("v", 0, 4, 16, 16),), {"v": "mlp"}, 64, handler="linear")
    """
    if transforms is None and is_quantized_weight(module._parameters.get("weight")):
        # the transforms run in the compute dtype of a quantized linear, beside its frozen quantized weight
        weight = module._parameters["weight"]
        dtype = compute_dtype(module, quantized_dtype)
        transforms, active = _transforms_for(slots, kinds, dtype, weight.device)  # type: ignore[union-attr]
    elif transforms is None:
        ref = next(iter(module.parameters(recurse=False)), None)
        transforms, active = make_transforms(slots, kinds, ref)
    else:
        active = tuple(s for s in slots if s.role in transforms)
    layout_plan(active, out_features)  # refuse odd layouts up front
    if weight_axis == "probe":
        weight_axis = weight_out_axis(module, out_features)
    module.__class__ = kha_class_for(type(module), mixin)
    if borrowed:
        module.__dict__["kha"] = transforms  # a reference, not a child: the owner registers the parameters
    else:
        module.kha = transforms
    d = module.__dict__  # plain attributes (not parameters or modules)
    d["_kha_slots"] = tuple(slots)
    d["_kha_out_features"] = out_features
    d["_kha_weight_axis"] = weight_axis
    d.pop("_kha_cached_layout", None)
    d.pop("_kha_cached_foldable", None)
    set_handler(module, handler)
    if strategy != "auto":
        set_strategy(module, strategy)
    return module


_STATE = (
    "_kha_slots",
    "_kha_out_features",
    "_kha_cached_layout",
    "_kha_cached_foldable",
    "kha_strategy",
    "_kha_weight_axis",
)


def detach(module: nn.Module) -> nn.Module:
    """Undo :func:`attach`: the module gets back its original class; its ``kha`` child is removed."""
    if not isinstance(module, KHAProjection):
        return module
    del module.kha
    for attr in _STATE:
        module.__dict__.pop(attr, None)
    set_handler(module, None)
    module.__class__ = type(module)._kha_base_class  # type: ignore[assignment]  # back to the original class
    return module


def carrier_state(module: KHAProjection) -> tuple[KHATransforms, tuple[HeadSlot, ...], int, int | None]:
    """(transforms, slots, out features, weight axis) of a carrier: what moving its KHA needs."""
    return module.kha, module._kha_slots, module._kha_out_features, module._kha_weight_axis


def set_strategy(module: nn.Module, strategy: str) -> None:
    """Set how a KHA module runs linear KHA: "auto" | "weight" | "token" (its ``kha_strategy``).

    Example::

        set_strategy(model.model.layers[0].self_attn.q_proj, "token")
    """
    check_strategy(strategy, "kha_strategy")
    setter = getattr(type(module), "kha_set_strategy", None)
    if setter is not None:  # a carrier with its own bookkeeping (nn.MultiheadAttention's fast path)
        setter(module, strategy)
    else:
        module.__dict__["kha_strategy"] = strategy


def __getattr__(name: str) -> type:
    """Recreate ``KHA<Base>`` classes on demand, so a pickled model with KHA loads in a new process."""
    base = module_class_named(name[3:], KHAProjection) if name.startswith("KHA") and len(name) > 3 else None
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return kha_class_for(base)
