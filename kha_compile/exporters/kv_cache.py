"""The KV cache of a decoder language model, as the exports that generate see it.

:func:`cache_layout` runs the model once on two tokens with ``use_cache=True`` and reads the cache it
returns: one plain, growing ``(batch, kv_heads, positions, head_size)`` key and value tensor per layer,
the same head count and head size in every layer, is what the exports express (ONNX with
``past_key_values.N.key/value`` inputs and ``present.N.key/value`` outputs, AOTInductor with a static
cache). Anything else is refused before a file is written, with what it is:

- no cache at all (an encoder, a module without a ``cache`` / ``past_key_values`` argument):
  :class:`~kha_compile.core.errors.NoKVCacheError`;
- an encoder-decoder (a cross-attention cache over the encoder's output), sliding-window layers (they
  keep only the last N positions), keys and values of different head sizes (multi-head latent
  attention), head counts that differ between layers, a cache type without per-layer tensors:
  :class:`~kha_compile.core.errors.CacheLayoutError`.

Example::

    layout = cache_layout(model)                # a transformers LlamaForCausalLM
    layout.num_layers, layout.num_kv_heads, layout.head_size, layout.cache_arg   # 2, 2, 16, 'cache'
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

import torch
from torch import nn

from ..core.errors import CacheLayoutError, ExportError, NoKVCacheError
from .common import root_reason

__all__ = [
    "PAST_KEY",
    "PAST_VALUE",
    "PRESENT_KEY",
    "PRESENT_VALUE",
    "CacheLayout",
    "cache_layout",
    "cache_tensors",
    "model_config",
    "output_cache",
]

log = logging.getLogger(__name__)

# the names of the ONNX file's cache inputs and outputs (%d: the layer), as onnxruntime-genai's
# genai_config.json names them by default
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
_CACHE_ARGS = ("cache", "past_key_values")  # the forward's name for it: transformers >= 5.2x, and before
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """One KV cache layout for every layer: ``(batch, num_kv_heads, positions, head_size)`` keys and values."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    cache_arg: str  # the forward's argument (and output field) that holds the cache
    position_ids: bool  # the forward takes position_ids

    def past_names(self) -> list[str]:
        """``past_key_values.0.key, past_key_values.0.value, ...``: the ONNX file's cache inputs, in order."""
        return [name % i for i in range(self.num_layers) for name in (PAST_KEY, PAST_VALUE)]

    def present_names(self) -> list[str]:
        """``present.0.key, present.0.value, ...``: the ONNX file's cache outputs, in order."""
        return [name % i for i in range(self.num_layers) for name in (PRESENT_KEY, PRESENT_VALUE)]

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def model_config(model: nn.Module) -> Any:
    """The text config of a transformers model (``config.get_text_config()`` where it has one), or None."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def output_cache(out: Any) -> Any:
    """The cache a transformers model returned: ``out.cache`` (transformers >= 5.2x) or ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values)]`` per layer of a transformers cache (``cache.layers``)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_layout(model: nn.Module) -> CacheLayout:
    """The KV cache layout of ``model``, read from one forward of two tokens; errors say what does not fit.

    Raises :class:`~kha_compile.core.errors.NoKVCacheError` for a model without a KV cache and
    :class:`~kha_compile.core.errors.CacheLayoutError` for a cache the exports cannot express (see the
    module's docstring); the model is not changed.

    Example::

        cache_layout(tiny_llama)    # CacheLayout(num_layers=2, num_kv_heads=2, head_size=16, ...)
    """
    name = type(model).__name__
    if not isinstance(model, nn.Module):
        raise ExportError(f"an export with a KV cache takes an nn.Module; got {name}.")
    params = inspect.signature(model.forward).parameters
    cache_arg = next((a for a in _CACHE_ARGS if a in params), None)
    config = model_config(model)
    if cache_arg is None or config is None:
        raise NoKVCacheError(
            f"{name} keeps no KV cache that an export can drive: its forward takes no `cache` / `past_key_values` "
            f"argument{'' if config is not None else ' and it has no transformers config'}. Exports with a KV cache "
            f"(export_onnx(past=True), export_aoti(generation=True)) take a transformers decoder language model "
            f"(a ...ForCausalLM); export {name} without them."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise CacheLayoutError(
            f"{name} is an encoder-decoder: its decoder caches the encoder's keys and values for cross attention "
            "besides its own, and the export writes one decoder-only file with self-attention caches. Export the "
            "encoder and decoder yourself, or use a decoder-only model."
        )
    out = _probe(model, cache_arg, "position_ids" in params)
    cache = output_cache(out)
    if cache is None:
        raise NoKVCacheError(
            f"{name} returned no KV cache from a forward with use_cache=True: it keeps none (an encoder such as "
            f"BertModel attends to the whole input at once). Export it without past=True / generation=True."
        )
    if getattr(out, "logits", None) is None:
        raise ExportError(
            f"{name} returns no logits: generation from an exported file needs the language-model head. Export "
            f"the ...ForCausalLM model that holds {name}."
        )
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise CacheLayoutError(
            f"{name}'s cache is a {type(cache).__name__} without per-layer tensors (cache.layers): the export reads "
            "transformers' layered caches (transformers >= 4.56)."
        )
    shapes = [_layer_shape(i, layer) for i, layer in enumerate(layers)]
    h, dk, _, dtype = shapes[0]
    for i, (hi, dki, dvi, _) in enumerate(shapes):
        if dki != dvi:
            raise CacheLayoutError(
                f"{name} caches keys of head size {dki} and values of head size {dvi} (layer {i}; as in multi-head "
                "latent attention): onnxruntime-genai's decoder and the export's cache take one head size for both."
            )
        if (hi, dki) != (h, dk):
            raise CacheLayoutError(
                f"{name}'s cache layers differ: layer 0 holds {h} heads of size {dk}, layer {i} {hi} of size {dki}; "
                "the export writes one layout for every layer."
            )
    if dtype not in _DTYPES:
        raise CacheLayoutError(f"{name} caches {dtype} keys and values; the export takes float32, float16 or bfloat16.")
    layout = CacheLayout(len(shapes), h, dk, dtype, cache_arg, "position_ids" in params)
    log.info("KV cache of %s: %s", name, layout)
    return layout


def _probe(model: nn.Module, cache_arg: str, position_ids: bool) -> Any:
    """One forward of two tokens with ``use_cache=True`` (eval mode, no grad; the model's mode is restored)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta":
        raise ExportError(
            f"{type(model).__name__} is on the meta device: the export reads the KV cache from one real forward; "
            "load its weights first."
        )
    vocab = int(getattr(model_config(model), "vocab_size", 2) or 2)
    ids = torch.tensor([[1 % vocab, 2 % vocab]], device=device)
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True}
    if position_ids:
        kwargs["position_ids"] = torch.arange(2, device=device)[None]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**kwargs)
    except Exception as e:
        raise ExportError(
            f"a forward of {type(model).__name__} with use_cache=True on 2 tokens failed, so its KV cache cannot be "
            f"read: {root_reason(e)}"
        ) from e
    finally:
        model.train(was_training)


def _layer_shape(i: int, layer: Any) -> tuple[int, int, int, torch.dtype]:
    """(kv heads, key head size, value head size, dtype) of a plain growing cache layer; CacheLayoutError otherwise."""
    kind = type(layer).__name__
    if getattr(layer, "is_sliding", False):
        window = getattr(layer, "sliding_window", None)
        raise CacheLayoutError(
            f"layer {i} of the KV cache is a {kind}: sliding-window attention keeps only the last "
            f"{window or 'N'} positions, and the export's cache holds every position. Export a model "
            "without sliding-window layers (or with sliding_window=None in its config)."
        )
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise CacheLayoutError(
            f"layer {i} of the KV cache ({kind}) holds no key and value tensors after a forward (a layer that "
            "shares another layer's cache, or a quantized cache); the export writes one cache per layer."
        )
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[2] != 2 or values.shape[:3] != keys.shape[:3]:
        raise CacheLayoutError(
            f"layer {i} of the KV cache ({kind}) holds keys {tuple(keys.shape)} and values {tuple(values.shape)} "
            "after 2 tokens; the export expresses (batch, kv_heads, positions, head_size) with the 2 positions "
            "on axis 2."
        )
    return int(keys.shape[1]), int(keys.shape[3]), int(values.shape[3]), keys.dtype
