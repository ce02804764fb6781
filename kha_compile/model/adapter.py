"""KHA on adapter-wrapped projections (PEFT's ``LoraLayer`` with a ``base_layer``), inside the model.

KHA transforms the whole output of a projection, adapters included: ``T(Wx + BAx)``. So the
transforms sit on the outermost module that computes that output, the adapter wrapper, which gets
a ``KHAAdapter<Base>`` class (:class:`KHAAdapterProjection`). On PEFT's unload (``merge_and_unload``
/ ``unload``) the wrapper hands its transforms (the same parameter objects) to the base layer,
which then computes the merged (or adapter-free) projection. Planning, the PEFT model hook and
folding live in :mod:`kha_compile.handlers.adapter`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from ..core.mixins import module_class_named
from ..core.optional import loaded
from .carrier import KHAProjection, KHATransforms, attach, carrier_state, detach, kha_class_for, make_transforms
from .rows import weight_out_axis
from .slots import HeadSlot, layout_plan

__all__ = [
    "ADAPTER_HANDLER",
    "KHAAdapterProjection",
    "attach_adapter",
    "is_adapter_wrapper",
    "move_kha",
    "tuner_layer_cls",
    "unwrap_model",
]

ADAPTER_HANDLER = "adapter"  # the projection handler that owns adapter wrappers


def tuner_layer_cls() -> type | None:
    """PEFT's ``BaseTunerLayer``, or None (a model can only hold PEFT layers if peft was imported)."""
    if loaded("peft") is None:
        return None
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - a broken peft install
        return None
    return BaseTunerLayer


def is_adapter_wrapper(module: nn.Module) -> bool:
    """True for an adapter wrapper (PEFT tuner layer with a ``base_layer``).

    Example::

        is_adapter_wrapper(peft_model.base_model.model.model.layers[0].self_attn.q_proj)   # True (lora.Linear)
    """
    cls = tuner_layer_cls()
    return cls is not None and isinstance(module, cls) and isinstance(getattr(module, "base_layer", None), nn.Module)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers (or plain) model inside a ``PeftModel``; ``model`` itself otherwise.

    Example::

        base = unwrap_model(get_peft_model(llama, LoraConfig(...)))   # the LlamaForCausalLM
    """
    if tuner_layer_cls() is None:
        return model
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


class KHAAdapterProjection(KHAProjection):
    """Mixin for an adapter wrapper carrying KHA: ``T(base(x) + adapters(x))``.

    On PEFT's unload (``merge_and_unload`` / ``unload``) the transforms move to the base layer,
    which then computes the merged (or adapter-free) projection.
    """

    _kha_prefix: ClassVar[str] = "KHAAdapter"

    def unload_and_optionally_merge_module(self: Any, merge: bool, safe_merge: bool, adapter_names: Any) -> nn.Module:
        if merge:
            self.merge(safe_merge=safe_merge, adapter_names=adapter_names)
        base = self.get_base_layer()
        move_kha(self, base)
        return base


def _ref_param(module: Any) -> Tensor | None:
    base = module.get_base_layer() if is_adapter_wrapper(module) else module
    return next(iter(base.parameters(recurse=False)), None)


def attach_adapter(
    module: nn.Module, slots: tuple[HeadSlot, ...], kinds: dict[str, str], out_features: int
) -> nn.Module:
    """Give an adapter wrapper KHA transforms in place (dtype and device of its base weight).

    Example::

        attach_adapter(lora_q_proj, (HeadSlot("q", 0, 4, 16, 16),), {"q": "linear"}, 64)
    """
    transforms, active = make_transforms(slots, kinds, _ref_param(module))
    layout_plan(active, out_features)
    return _install(module, transforms, slots, out_features, None)


def _install(
    module: nn.Module, transforms: KHATransforms, slots: tuple[HeadSlot, ...], out: int, axis: int | None
) -> nn.Module:
    wrapper = is_adapter_wrapper(module)
    return attach(
        module,
        slots,
        {},
        out,
        handler=ADAPTER_HANDLER if wrapper else None,
        weight_axis=None if wrapper else axis,  # a wrapper has no weight of its own: token-side
        mixin=KHAAdapterProjection if wrapper else KHAProjection,
        transforms=transforms,
    )


def move_kha(src: KHAProjection, dst: nn.Module) -> None:
    """Move the KHA transforms (same parameter objects) from ``src`` to ``dst``."""
    transforms, slots, out, axis = carrier_state(src)
    if axis is None and not is_adapter_wrapper(dst):
        axis = weight_out_axis(dst, out)
    detach(src)
    _install(dst, transforms, slots, out, axis)


def __getattr__(name: str) -> type:
    """Recreate ``KHAAdapter<Base>`` classes on demand (unpickling in a new process)."""
    prefix = KHAAdapterProjection._kha_prefix
    base = module_class_named(name[len(prefix) :], KHAProjection) if name.startswith(prefix) else None
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return kha_class_for(base, KHAAdapterProjection)
