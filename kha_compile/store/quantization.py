"""kha_compile's ``quantization_config``: the entry transformers and vLLM dispatch loading on, alone or around
a real quantization method's config (kept under :data:`WRAPS_KEY`).

Example::

    compose_quantization({"version": 3, "v": "mlp"}, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    # {"quant_method": "kha_compile", "version": 3, "v": "mlp", "wraps": {"quant_method": "bitsandbytes", ...}}
"""

from __future__ import annotations

__all__ = [
    "CONFIG_KEY",
    "QUANT_METHOD",
    "WRAPS_KEY",
    "compose_quantization",
    "is_kha_quantization",
    "quantization_entry",
    "wrapped_quantization",
]

CONFIG_KEY = "kha_compile"
QUANT_METHOD = "kha_compile"  # kha_compile's quantization method in transformers and vLLM
WRAPS_KEY = "wraps"  # in kha_compile's quantization_config: the real quantization method's config it runs inside


def quantization_entry(entry: dict) -> dict:
    """The ``quantization_config`` that records the KHA ``entry``: ``quant_method`` and the entry beside it.

    Example::

        quantization_entry({"version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto"})
        # {"quant_method": "kha_compile", "version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto"}
    """
    return {"quant_method": QUANT_METHOD, **{k: v for k, v in entry.items() if k not in ("quant_method", WRAPS_KEY)}}


def compose_quantization(entry: dict, real: object) -> dict:
    """kha_compile's ``quantization_config`` for KHA ``entry`` on a base quantized by ``real`` (its config dict).

    ``real`` is kept whole under :data:`WRAPS_KEY`: transformers and vLLM dispatch on ``quant_method``,
    find kha_compile's method, and it runs the real method inside it. ``real`` may itself be
    kha_compile's entry (a KHA directory saved again): its wrapped config is kept, never nested twice.

    Example::

        compose_quantization({"version": 3, "v": "mlp"}, {"quant_method": "compressed-tensors", ...})
        # {"quant_method": "kha_compile", "version": 3, "v": "mlp", "wraps": {"quant_method": "compressed-tensors", ...}}
    """
    inner = wrapped_quantization(real) if is_kha_quantization(real) else real
    out = quantization_entry(entry)
    if isinstance(inner, dict):
        out[WRAPS_KEY] = inner
    return out


def wrapped_quantization(value: object) -> dict | None:
    """The real quantization config kha_compile's ``quantization_config`` wraps (a dict), or None.

    Example::

        wrapped_quantization({"quant_method": "kha_compile", "v": "mlp", "wraps": {"quant_method": "bitsandbytes"}})
        # {"quant_method": "bitsandbytes"}
    """
    if not is_kha_quantization(value):
        return None
    inner = value.get(WRAPS_KEY) if isinstance(value, dict) else getattr(value, WRAPS_KEY, None)
    to_dict = getattr(inner, "to_dict", None)
    inner = to_dict() if callable(to_dict) else inner
    return inner if isinstance(inner, dict) and inner.get("quant_method") else None


def is_kha_quantization(value: object) -> bool:
    """True for kha_compile's ``quantization_config`` (a dict or transformers' config object; any version).

    Example::

        is_kha_quantization({"quant_method": "kha_compile", "v": "mlp"})        # True
    """
    method = value.get("quant_method") if isinstance(value, dict) else getattr(value, "quant_method", None)
    return str(getattr(method, "value", method) or "").lower().startswith(CONFIG_KEY)
