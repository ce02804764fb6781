"""Key names of KHA tensors in checkpoints: canonical names, without PEFT's wrapping."""

from __future__ import annotations

import re

__all__ = ["canonical_name", "is_kha_key"]

_PEFT_PREFIX = re.compile(r"^base_model\.model\.")


def canonical_name(name: str) -> str:
    """A parameter name without PEFT's wrapping: no ``base_model.model.`` prefix, no ``base_layer``.

    Example::

        canonical_name("base_model.model.model.layers.0.self_attn.v_proj.base_layer.kha.v.up")
        # -> "model.layers.0.self_attn.v_proj.kha.v.up"
    """
    return _PEFT_PREFIX.sub("", name).replace(".base_layer.", ".")


def is_kha_key(name: str) -> bool:
    """True for the key of a KHA tensor (every one has a ``kha`` component: ``...v_proj.kha.v.up``)."""
    return ".kha." in f".{name}"
