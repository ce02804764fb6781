"""Example inputs for tracing: the user's, or small ones built from a transformers config.

The graph pass needs one call of the model to trace. For a transformers ``PreTrainedModel`` (and a
``sentence_transformers.SentenceTransformer``) the shapes of a valid call follow from the config, so
the user need not give any; for every other module they are required.

Neither transformers nor sentence-transformers is imported here: a model can only be an instance
of their classes if the user already imported them, so their presence in ``sys.modules`` decides.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import torch
from torch import nn

from ..core.errors import MissingExampleInputsError

__all__ = ["example_inputs", "sentence_transformer_model"]

log = logging.getLogger(__name__)

_SEED = 0  # fixed, so two calls build the same inputs


def example_inputs(
    model: nn.Module,
    example_args: Any = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 8,
) -> tuple[tuple, dict]:
    """Return ``(args, kwargs)`` for one call of ``model``: the user's, or ones built from its config.

    User inputs win: if ``example_args`` or ``example_kwargs`` is given, they come back as they are
    (args as a tuple, a lone tensor wrapped in one; kwargs as a shallow copy). Otherwise:

    - a transformers ``PreTrainedModel`` gets ``input_ids`` (``batch_size`` x ``seq_len`` random ids
      below ``vocab_size``), ``attention_mask`` of ones and ``use_cache=False`` where its forward
      takes them (a ``DynamicCache`` output is not a pytree type ``torch.export`` knows), and
      ``decoder_input_ids`` for encoder-decoder models; a vision model (``main_input_name ==
      "pixel_values"``, e.g. ViT) gets ``pixel_values`` of shape (B, C, image_size, image_size);
    - a ``SentenceTransformer`` gets one positional features dict (``input_ids``,
      ``attention_mask``, and ``token_type_ids`` where its transformer takes them);
    - anything else raises :class:`~kha_compile.core.errors.MissingExampleInputsError`.

    Tensors are built on the device of the model's first parameter, the meta device included
    (``torch.export`` in non-strict mode then traces with no real compute), and are the same on
    every call.

    Example::

        >>> args, kwargs = example_inputs(hf_llama)                  # built from the config
        >>> sorted(kwargs)
        ['attention_mask', 'input_ids', 'use_cache']
        >>> args, kwargs = example_inputs(my_module, example_args=(x,))   # the user's, unchanged
    """
    if isinstance(example_args, torch.Tensor):
        example_args = (example_args,)
    if example_args or example_kwargs:
        return tuple(example_args), dict(example_kwargs or {})

    device, dtype = _device_and_dtype(model)
    gen = torch.Generator().manual_seed(_SEED)

    st_auto_model = sentence_transformer_model(model)
    if st_auto_model is not None:
        features = _text_inputs(st_auto_model, batch_size, seq_len, device, gen)
        if _accepts(st_auto_model, "token_type_ids"):
            features["token_type_ids"] = torch.zeros(batch_size, seq_len, dtype=torch.long).to(device)
        return (features,), {}

    if _is_hf_pretrained(model):
        main = getattr(model, "main_input_name", "input_ids")
        if main == "inputs" and _accepts(model, "input_ids") and _has_vocab(model.config):
            main = "input_ids"  # a generic main input (Perceiver's masked LM) that also takes token ids
        if main == "input_ids":
            kwargs = _text_inputs(model, batch_size, seq_len, device, gen)
            if getattr(model.config, "is_encoder_decoder", False) and _accepts(model, "decoder_input_ids"):
                vocab = _vocab_size(model.config)
                kwargs["decoder_input_ids"] = torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device)
        elif main == "pixel_values":
            kwargs = {"pixel_values": _pixel_values(model.config, batch_size, device, dtype, gen)}
        else:
            raise MissingExampleInputsError(
                f"{type(model).__name__} takes {main!r} as its main input, for which kha_compile "
                f"cannot build example inputs from the config (it builds 'input_ids' and "
                f"'pixel_values'). Pass example inputs, e.g. "
                f"kc.apply(model, cfg, example_kwargs={{{main!r}: x}})."
            )
        if _accepts(model, "use_cache"):
            kwargs["use_cache"] = False
        if _attn_implementation(model) == "flex_attention":
            # An all-ones mask adds nothing, and transformers' flex mask builder checks it with a
            # data-dependent guard (``fast_all(attention_mask)``) that torch.export cannot trace.
            kwargs.pop("attention_mask", None)
        log.debug(
            "built example inputs for %s: %s",
            type(model).__name__,
            {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        )
        return (), kwargs

    raise MissingExampleInputsError(
        f"{type(model).__name__} is not a transformers PreTrainedModel, so kha_compile cannot build "
        f"example inputs for it: pass example inputs that make one valid call, e.g. "
        f"kc.apply(model, cfg, example_args=(x,)) or example_kwargs={{'input_ids': ids}}."
    )


def _is_hf_pretrained(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:  # a broken or partial install: treat as not a transformers model
        return False
    return isinstance(model, PreTrainedModel)


def sentence_transformer_model(model: nn.Module) -> nn.Module | None:
    """The transformers model inside a SentenceTransformer, or None if ``model`` is not one."""
    if "sentence_transformers" not in sys.modules:
        return None
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return None
    if not isinstance(model, SentenceTransformer):
        return None
    for module in model.children():
        for attr in ("auto_model", "model"):
            inner = getattr(module, attr, None)
            if isinstance(inner, nn.Module) and _is_hf_pretrained(inner):
                return inner
    raise MissingExampleInputsError(
        "this SentenceTransformer has no transformers model among its modules, so kha_compile "
        "cannot build example inputs for it: pass a features dict, e.g. "
        "kc.apply(model, cfg, example_args=({'input_ids': ids, 'attention_mask': mask},))."
    )


def _text_inputs(
    model: nn.Module, batch_size: int, seq_len: int, device: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    vocab = _vocab_size(model.config)
    out: dict[str, Any] = {
        "input_ids": torch.randint(0, vocab, (batch_size, seq_len), generator=gen).to(device)
    }  # (B, T)
    if _accepts(model, "attention_mask"):
        out["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long).to(device)  # (B, T)
    return out


def _pixel_values(
    config: Any, batch_size: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    config = getattr(config, "vision_config", None) or config
    size = getattr(config, "image_size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    return torch.randn(batch_size, channels, h, w, generator=gen).to(device=device, dtype=dtype)  # (B, C, H, W)


def _has_vocab(config: Any) -> bool:
    try:
        return _vocab_size(config) > 0
    except MissingExampleInputsError:
        return False


def _vocab_size(config: Any) -> int:
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(config, "get_text_config"):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not vocab:
        raise MissingExampleInputsError(
            f"{type(config).__name__} has no vocab_size, so kha_compile cannot build input_ids: "
            f"pass example inputs, e.g. kc.apply(model, cfg, example_kwargs={{'input_ids': ids}})."
        )
    return int(vocab)


def _attn_implementation(model: nn.Module) -> str:
    """The transformers attention implementation of ``model`` ("sdpa", "flex_attention", ...), or ""."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "") or "")


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` names ``name`` as a parameter (a bare ``**kwargs`` does not count)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    device, dtype = torch.device("cpu"), torch.get_default_dtype()
    for p in model.parameters():
        device = p.device
        break
    for p in model.parameters():
        if p.is_floating_point():
            dtype = p.dtype
            break
    return device, dtype
