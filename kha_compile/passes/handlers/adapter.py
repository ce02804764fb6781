"""Projection handler for adapter-wrapped projections (PEFT's ``LoraLayer`` with a ``base_layer``).

KHA transforms the whole output of a projection, adapters included: ``T(Wx + BAx)``. So the
transforms sit on the outermost module that computes that output, the adapter wrapper, whichever
order the user chose:

- LoRA first, then ``kc.apply(peft_model)``: the trace runs with the adapters switched off (so q
  comes from ``base_layer`` alone), and the plan is moved from ``...q_proj.base_layer`` to the
  wrapper ``...q_proj``, which gets a ``kha_compile`` subclass of its own class.
- ``kc.apply`` first, then ``get_peft_model``: PEFT wraps the KHA projection as ``base_layer``, which
  would put LoRA's delta after the transform. :func:`sync` moves the transforms (the same
  parameter objects) out to the wrapper; a forward pre-hook on the model that ``kc.apply`` saw runs
  it before every forward, and ``kc.fold``, ``kc.save_pretrained`` and :func:`mark_trainable` run
  it too, so the wrong state is never computed with.

``merge_and_unload()`` / ``unload()`` hand the transforms back to the base layer
(``unload_and_optionally_merge_module``), so a merge keeps KHA, MLP-value included. Folding
linear KHA into a wrapper folds ``T`` into the base weight and every ``lora_B``:
``T^T (W + B A) = (T^T W) + (T^T B) A``, so merging and folding commute.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import FoldError, NoKHATransformsError, UnsupportedModelError
from ...mixins import mixin_class
from ...modules import (
    HeadSlot,
    KHAProjection,
    KHATransforms,
    detach,
    is_kha_projection,
    layout_plan,
    make_transform,
)
from . import register_handler
from .base import HANDLER_ATTR, ModuleProjectionHandler, PlanEntry

__all__ = [
    "KHAAdapterProjection",
    "accepts",
    "adapters_off",
    "attach",
    "canonical_name",
    "detach",
    "fold",
    "mark_trainable",
    "retarget",
    "sync",
    "unwatch",
    "unwrap_model",
    "watch",
]

log = logging.getLogger(__name__)

_WATCH = "_kha_adapter_watch"  # [(parent, child name, carrier)] in the watched model's __dict__


def _tuner_layer_cls() -> type | None:
    if "peft" not in sys.modules:  # a model can only hold PEFT layers if peft was imported
        return None
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - a broken peft install
        return None
    return BaseTunerLayer


def accepts(module: nn.Module) -> bool:
    """True for an adapter wrapper (PEFT tuner layer with a ``base_layer``).

    Example::

        accepts(peft_model.base_model.model.model.layers[0].self_attn.q_proj)   # True (lora.Linear)
    """
    cls = _tuner_layer_cls()
    return cls is not None and isinstance(module, cls) and isinstance(getattr(module, "base_layer", None), nn.Module)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers (or plain) model inside a ``PeftModel``; ``model`` itself otherwise.

    Example::

        base = unwrap_model(get_peft_model(llama, LoraConfig(...)))   # the LlamaForCausalLM
    """
    if _tuner_layer_cls() is None:
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Switch every adapter of ``model`` off (without touching ``requires_grad``) for a trace.

    With the adapters off, a wrapper computes ``base_layer(x)`` only, so the matcher sees an
    ordinary projection; the plan then moves to the wrapper (:func:`retarget`).

    Example::

        with adapters_off(model):
            cap = capture(model, args, kwargs)
    """
    wrappers = [m for m in model.modules() if accepts(m)]
    merged = [type(m).__name__ for m in wrappers if getattr(m, "merged", False)]
    if merged:
        raise UnsupportedModelError(
            f"{len(merged)} adapter layers are merged into their base weights; kc.apply needs them "
            "unmerged (call peft_model.unmerge_adapter()) or fully merged and unloaded "
            "(peft_model.merge_and_unload()) first."
        )
    saved = [(m, m.__dict__.get("_disable_adapters")) for m in wrappers]
    try:
        for m, _ in saved:
            m.__dict__["_disable_adapters"] = True
        yield
    finally:
        for m, old in saved:
            if old is None:
                m.__dict__.pop("_disable_adapters", None)
            else:
                m.__dict__["_disable_adapters"] = old


def retarget(model: nn.Module, plan: list, sites: list) -> None:
    """Move plan entries (and report paths) from ``<wrapper>.base_layer`` to the adapter wrapper.

    Example::

        sites, plan = build_sites(model, raw, cap, cfg)
        retarget(model, plan, sites)    # "...q_proj.base_layer" -> "...q_proj", handler "adapter"
    """

    def outer(path: str) -> str:
        while path.endswith(".base_layer"):
            parent = path[: -len(".base_layer")]
            try:
                if not accepts(model.get_submodule(parent)):
                    break
            except AttributeError:
                break
            path = parent
        return path

    for entry in plan:
        new = outer(entry.module_path)
        if new != entry.module_path and entry.handler in ("linear", "conv1d"):
            entry.module_path, entry.handler = new, "adapter"
    from ..insert import current_transforms

    for site in sites:
        paths = {}
        for role in "qkv":
            value = getattr(site, f"{role}_proj", None)
            if isinstance(value, str):
                paths[role] = outer(value)
                setattr(site, f"{role}_proj", paths[role])
        if len(paths) == 3 and getattr(site, "status", "") == "matched":
            current_transforms(model, site, paths)


class KHAAdapterProjection(KHAProjection):
    """Mixin for an adapter wrapper carrying KHA: ``T(base(x) + adapters(x))``.

    On PEFT's unload (``merge_and_unload`` / ``unload``) the transforms move to the base layer,
    which then computes the merged (or adapter-free) projection.
    """

    def unload_and_optionally_merge_module(self: Any, merge: bool, safe_merge: bool, adapter_names: Any) -> nn.Module:
        if merge:
            self.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        base = self.get_base_layer()
        _move(self, base)
        return base


def _adapter_class(base_cls: type) -> type:
    return mixin_class(
        KHAAdapterProjection, base_cls, f"KHAAdapter{base_cls.__name__}", __name__, _kha_base_class=base_cls
    )


def _ref_param(module: Any) -> Tensor | None:
    base = module.get_base_layer() if accepts(module) else module
    return next(iter(base.parameters(recurse=False)), None)


def attach(module: nn.Module, slots: tuple[HeadSlot, ...], kinds: dict[str, str], out_features: int) -> nn.Module:
    """Give an adapter wrapper KHA transforms in place (dtype and device of its base weight).

    Example::

        attach(lora_q_proj, (HeadSlot("q", 0, 4, 16, 16),), {"q": "linear"}, 64)
    """
    ref = _ref_param(module)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    transforms = KHATransforms()
    for s in slots:
        if s.role in kinds and s.role not in transforms:
            transforms[s.role] = make_transform(
                kinds[s.role], s.head_dim, dtype=dtype, device=ref.device if ref is not None else None
            )
    layout_plan(tuple(s for s in slots if s.role in transforms), out_features)
    _install(module, transforms, tuple(slots), out_features)
    return module


def _install(module: Any, transforms: KHATransforms, slots: tuple[HeadSlot, ...], out_features: int) -> None:
    wrapper = accepts(module)
    module.__class__ = _adapter_class(type(module)) if wrapper else _plain_class(module)
    if wrapper:
        module.__dict__[HANDLER_ATTR] = AdapterHandler.name
    module.kha = transforms
    module._kha_slots = slots
    module._kha_out_features = out_features
    module.__dict__.pop("_kha_cached_layout", None)


def _plain_class(module: nn.Module) -> type:
    from ...modules import kha_class_for

    return kha_class_for(type(module))


def _move(src: Any, dst: nn.Module) -> None:
    """Move the KHA transforms (same parameter objects) from ``src`` to ``dst``."""
    transforms, slots, out = src.kha, src._kha_slots, src._kha_out_features
    detach(src)
    _install(dst, transforms, slots, out)


def fold(name: str, module: Any) -> list[tuple[nn.Module, str, Tensor]]:
    """New tensors (module, parameter name, value) that fold the wrapper's linear KHA; nothing written.

    Example::

        for mod, pname, value in fold("model.layers.0.self_attn.q_proj", wrapper):
            getattr(mod, pname).data.copy_(value)      # kc.fold commits them after checking all
    """
    from ..fold import fold_rows, weight_out_axis

    slots = [s for s in module._kha_slots if s.role in module.kha and module.kha[s.role].kind == "linear"]
    if not slots:
        return []
    lora_b = getattr(module, "lora_B", None)
    variants = getattr(module, "lora_variant", None) or {}
    magnitude = getattr(module, "lora_magnitude_vector", None) or {}
    extra = [n for n in ("lora_embedding_B", "hada_w1_a", "ia3_l", "lokr_w1") if getattr(module, n, None)]
    if not isinstance(lora_b, nn.ModuleDict) or variants or len(magnitude) or extra:
        raise FoldError(
            f"cannot fold KHA into {name} ({type(module)._kha_base_class.__name__}): only plain LoRA "
            "adapters (no DoRA or other variants) fold with it. Merge the adapters first "
            "(peft_model.merge_and_unload()), then kc.fold. Nothing was changed."
        )
    base = module.get_base_layer()
    axis = weight_out_axis(base)
    if axis is None:
        raise FoldError(
            f"cannot fold into {name}.base_layer ({type(base).__name__}): only nn.Linear and "
            "transformers' Conv1D weights are folded. Nothing was changed."
        )
    w, b = base.weight, getattr(base, "bias", None)
    for s in slots:
        w, b = fold_rows(w, b, s, module.kha[s.role].weight, axis)
    out: list[tuple[nn.Module, str, Tensor]] = [(base, "weight", w)] + ([(base, "bias", b)] if b is not None else [])
    lin: Any
    for lin in lora_b.values():  # (out, r): rows are the projection's output features
        lw, lb = lin.weight, getattr(lin, "bias", None)
        for s in slots:
            lw, lb = fold_rows(lw, lb, s, module.kha[s.role].weight, 0)
        out.append((lin, "weight", lw))
        if lb is not None:
            out.append((lin, "bias", lb))
    return out


# -- keeping KHA outermost when PEFT wraps a KHA projection after kc.apply -----------------------


def _carriers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    out = []
    for parent in model.modules():
        for cname, child in parent._modules.items():
            if child is not None and is_kha_projection(child):
                out.append((parent, cname, child))
    return out


def sync(model: nn.Module) -> int:
    """Move KHA out of every ``base_layer`` to its adapter wrapper; returns how many moved.

    Example::

        kc.apply(model); peft_model = get_peft_model(model, cfg)
        sync(peft_model)        # also run by a forward pre-hook, kc.fold and kc.save_pretrained
    """
    if _tuner_layer_cls() is None:
        return 0
    moved = 0
    for parent, cname, child in _carriers(model):
        if cname == "base_layer" and accepts(parent) and not is_kha_projection(parent):
            _move(child, parent)
            moved += 1
    if moved:
        log.info("KHA moved out of %d adapter base layers to their wrappers, so it transforms base + adapter", moved)
    for m in model.modules():
        state = m.__dict__.get(_WATCH)
        if state is not None:
            state[:] = _carriers(m)
    return moved


def _check_hook(module: nn.Module, args: Any) -> None:
    state = module.__dict__.get(_WATCH)
    if state is None or torch.compiler.is_compiling():  # no module surgery inside a compiled graph
        return
    for parent, cname, child in state:
        if parent._modules.get(cname) is not child or not is_kha_projection(child):
            sync(module)
            return


def watch(model: nn.Module) -> None:
    """Register the forward pre-hook that runs :func:`sync` when a KHA projection was wrapped.

    Example::

        watch(model)        # kc.apply does this; the hook costs one identity check per KHA projection
    """
    if _WATCH in model.__dict__:
        sync(model)
        return
    model.register_forward_pre_hook(_check_hook)
    model.__dict__[_WATCH] = _carriers(model)


def unwatch(model: nn.Module) -> None:
    """Remove the pre-hook from every watched module of ``model`` that no longer carries KHA.

    Example::

        unwatch(model)      # kc.fold and kc.remove do this, so a vanilla model keeps no hook
    """
    for m in model.modules():
        state = m.__dict__.get(_WATCH)
        if state is not None and not _carriers(m):
            # by identity, not a stored handle: a deepcopy's handle may point at the original's hooks
            for key in [k for k, h in m._forward_pre_hooks.items() if h is _check_hook]:
                del m._forward_pre_hooks[key]
            del m.__dict__[_WATCH]


# -- names and trainability ----------------------------------------------------------------

_PEFT_PREFIX = re.compile(r"^base_model\.model\.")


def canonical_name(name: str) -> str:
    """A parameter name without PEFT's wrapping: no ``base_model.model.`` prefix, no ``base_layer``.

    Example::

        canonical_name("base_model.model.model.layers.0.self_attn.v_proj.base_layer.kha.v.up")
        # -> "model.layers.0.self_attn.v_proj.kha.v.up"
    """
    return _PEFT_PREFIX.sub("", name).replace(".base_layer.", ".")


def mark_trainable(model: nn.Module, trainable: bool = True) -> nn.Module:
    """Set ``requires_grad`` on every KHA parameter (``get_peft_model`` freezes them); returns ``model``.

    Also moves KHA outward where PEFT wrapped a KHA projection (:func:`sync`). Call it after
    ``get_peft_model`` when KHA was applied first; after ``kc.apply(peft_model)`` the KHA
    parameters are trainable already.

    Example::

        kc.apply(model, kc.KHAConfig(v="mlp"))
        peft_model = get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))
        kc.mark_trainable(peft_model)       # LoRA and KHA train together
    """
    sync(model)
    count = 0
    for name, p in model.named_parameters():
        if ".kha." in f".{name}":
            p.requires_grad_(trainable)
            count += 1
    if not count:
        raise NoKHATransformsError(f"{type(model).__name__} carries no KHA parameters; call kc.apply(model) first.")
    return model


class AdapterHandler(ModuleProjectionHandler):
    """Adapter wrappers (PEFT tuner layers): KHA on ``base(x) + adapters(x)``.

    Plans reach it through :func:`retarget` (the trace sees ``base_layer`` with adapters off), so
    :meth:`accepts` declines every traced projection.
    """

    name = "adapter"

    def accepts(self, model: nn.Module, m: Any) -> tuple[bool, str]:
        return False, ""

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, KHAAdapterProjection)

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        attach(module, tuple(entry.slots), entry.kinds, entry.out_features)

    def detach(self, module: nn.Module) -> None:
        detach(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        names = {id(m): n for n, m in module.named_modules()}
        return [
            (f"{names[id(owner)]}.{pname}" if names[id(owner)] else pname, value)
            for owner, pname, value in fold(type(module).__name__, module)
        ]


register_handler(AdapterHandler(), first=True)
