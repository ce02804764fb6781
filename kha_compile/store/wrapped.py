"""A real quantization config object that also records KHA: what ``model.config.quantization_config`` holds
when a quantized base (bitsandbytes, torchao, ...) carries KHA.

transformers, PEFT and the Trainer read the model's quantization config as the real method's (a
``BitsAndBytesConfig``: ``load_in_4bit``, its compute dtype, ...), so the object stays one of that class:
:func:`wrap_config` gives it a subclass of the same name whose ``to_dict`` writes kha_compile's entry with
the real one inside it (:func:`kha_compile.store.hf.compose_quantization`). ``save_pretrained`` then writes
that into ``config.json``, and ``from_pretrained(dir)`` runs kha_compile's quantizer around the real one.

Example::

    cfg = wrap_config(BitsAndBytesConfig(load_in_4bit=True), {"version": 3, "v": "mlp"})
    isinstance(cfg, BitsAndBytesConfig), cfg.to_dict()["quant_method"]      # (True, "kha_compile")
"""

from __future__ import annotations

import copy
from typing import Any

from .quantization import compose_quantization

__all__ = ["ENTRY_ATTR", "unwrap_config", "wrap_config", "wrapped_entry"]

ENTRY_ATTR = "_kha_entry"  # the KHA entry on a wrapped config object
_CLASSES: dict[type, type] = {}


def _to_dict(self: Any) -> dict:
    real = super(type(self), self).to_dict()
    real.pop(ENTRY_ATTR, None)
    return compose_quantization(getattr(self, ENTRY_ATTR), real)


def wrap_config(real: Any, entry: dict) -> Any:
    """A copy of the quantization config object ``real`` that records KHA ``entry`` when written (module docs).

    A config wrapped already gets the new entry.

    Example::

        model.config.quantization_config = wrap_config(model.config.quantization_config, entry)
    """
    if wrapped_entry(real) is not None:
        out = copy.copy(real)
    else:
        cls = type(real)
        sub = _CLASSES.get(cls)
        if sub is None:
            sub = _CLASSES[cls] = type(cls.__name__, (cls,), {"to_dict": _to_dict, "__module__": cls.__module__})
        out = copy.copy(real)
        out.__class__ = sub
    setattr(out, ENTRY_ATTR, dict(entry))
    return out


def wrapped_entry(config: Any) -> dict | None:
    """The KHA entry a wrapped config records, or None for any other object."""
    return config.__dict__.get(ENTRY_ATTR) if type(config) in _CLASSES.values() else None


def unwrap_config(config: Any) -> Any:
    """The real config object behind a wrapped one (``config`` itself when it is not wrapped)."""
    if wrapped_entry(config) is None:
        return config
    out = copy.copy(config)
    out.__class__ = type(config).__mro__[1]
    del out.__dict__[ENTRY_ATTR]
    return out
