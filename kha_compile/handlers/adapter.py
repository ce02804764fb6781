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
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import FoldError, NoKHATransformsError, UnsupportedModelError
from ..model.adapter import (
    ADAPTER_HANDLER,
    KHAAdapterProjection,
    attach_adapter,
    is_adapter_wrapper,
    move_kha,
    tuner_layer_cls,
    unwrap_model,
)
from ..model.carrier import KHAProjection, detach, is_kha_projection
from ..model.rows import fold_rows, weight_out_axis
from ..model.transforms import kind_of
from . import register_handler
from .base import ModuleProjectionHandler, PlanEntry
from .plan import current_transforms

__all__ = [
    "AdapterHandler",
    "adapters_off",
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


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Switch every adapter of ``model`` off (without touching ``requires_grad``) for a trace.

    With the adapters off, a wrapper computes ``base_layer(x)`` only, so the matcher sees an
    ordinary projection; the plan then moves to the wrapper (:func:`retarget`).

    Example::

        with adapters_off(model):
            cap = capture(model, args, kwargs)
    """
    wrappers = [m for m in model.modules() if is_adapter_wrapper(m)]
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
                if not is_adapter_wrapper(model.get_submodule(parent)):
                    break
            except AttributeError:
                break
            path = parent
        return path

    for entry in plan:
        new = outer(entry.module_path)
        if new != entry.module_path and entry.handler in ("linear", "conv1d"):
            entry.module_path, entry.handler = new, "adapter"

    for site in sites:
        paths = {}
        for role in "qkv":
            value = getattr(site, f"{role}_proj", None)
            if isinstance(value, str):
                paths[role] = outer(value)
                setattr(site, f"{role}_proj", paths[role])
        if len(paths) == 3 and getattr(site, "status", "") == "matched":
            current_transforms(model, site, paths)


def fold(name: str, module: Any) -> list[tuple[nn.Module, str, Tensor]]:
    """New tensors (module, parameter name, value) that fold the wrapper's linear KHA; nothing written.

    Example::

        for mod, pname, value in fold("model.layers.0.self_attn.q_proj", wrapper):
            getattr(mod, pname).data.copy_(value)      # kc.fold commits them after checking all
    """
    slots = [s for s in module._kha_slots if s.role in module.kha and kind_of(module.kha[s.role]).foldable]
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
    mats = {s.role: kind_of(module.kha[s.role]).fold_matrix(module.kha[s.role]) for s in slots}
    for s in slots:
        w, b = fold_rows(w, b, s, mats[s.role], axis)
    out: list[tuple[nn.Module, str, Tensor]] = [(base, "weight", w)] + ([(base, "bias", b)] if b is not None else [])
    lin: Any
    for lin in lora_b.values():  # (out, r): rows are the projection's output features
        lw, lb = lin.weight, getattr(lin, "bias", None)
        for s in slots:
            lw, lb = fold_rows(lw, lb, s, mats[s.role], 0)
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
    if tuner_layer_cls() is None:
        return 0
    moved = 0
    for parent, cname, child in _carriers(model):
        if cname == "base_layer" and is_adapter_wrapper(parent) and not is_kha_projection(parent):
            assert isinstance(child, KHAProjection)  # _carriers lists KHA projections only
            move_kha(child, parent)
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

    name = ADAPTER_HANDLER
    priority = 20

    def accepts(self, model: nn.Module, m: Any) -> tuple[bool, str]:
        return False, ""

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, KHAAdapterProjection)

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        attach_adapter(module, tuple(entry.slots), entry.kinds, entry.out_features)

    def detach(self, module: nn.Module) -> None:
        detach(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        names = {id(m): n for n, m in module.named_modules()}
        return [
            (f"{names[id(owner)]}.{pname}" if names[id(owner)] else pname, value)
            for owner, pname, value in fold(type(module).__name__, module)
        ]


register_handler(AdapterHandler())
