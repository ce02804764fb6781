"""Key names of KHA tensors in checkpoints: canonical names, without PEFT's wrapping."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["align_names", "canonical_name", "is_kha_key"]

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


def align_names(expected: Iterable[str], got: Iterable[str]) -> dict[str, str] | None:
    """Map the checkpoint's names ``got`` onto the model's names ``expected``, or None when they do not correspond.

    The names correspond when they are equal, or when one set is the other under one module prefix:
    a ``SentenceTransformer`` names its transformer's tensors ``0.model.<name>`` (or ``0.auto_model.``),
    while ``st.save`` (the transformer's own ``save_pretrained``) writes ``<name>``; and the other
    way round, a checkpoint saved from the wrapper loads into the bare transformers model.

    Example::

        align_names({"0.model.encoder.layer.0.attention.self.value.kha.v.up"},
                    {"encoder.layer.0.attention.self.value.kha.v.up"})
        # -> {"encoder.layer.0.attention.self.value.kha.v.up": "0.model.encoder.layer.0.attention.self.value.kha.v.up"}
    """
    want, have = set(expected), set(got)
    if want == have:
        return {k: k for k in have}
    if not want or len(want) != len(have):
        return None
    for short, long in ((have, want), (want, have)):  # model = prefix + checkpoint, then checkpoint = prefix + model
        probe = min(short)
        for name in long:
            if not name.endswith("." + probe):
                continue
            prefix = name[: len(name) - len(probe)]
            if {prefix + k for k in short} == long:
                if short is have:
                    return {k: prefix + k for k in have}
                return {k: k[len(prefix) :] for k in have}
    return None
