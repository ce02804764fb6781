"""Example inputs for tracing: the user's, or small ones built from a transformers config.

The graph pass needs one call of the model to trace. For a transformers ``PreTrainedModel`` (and a
``sentence_transformers.SentenceTransformer``) the shapes of a valid call follow from the config, so
the user need not give any; for every other module they are required.

Neither transformers nor sentence-transformers is imported here: a model can only be an instance
of their classes if the user already imported them, so their presence in ``sys.modules`` decides.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from ..core.errors import MissingExampleInputsError
from .hf_inputs import accepts, hf_example_kwargs, text_inputs

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

    - a transformers ``PreTrainedModel`` gets its main input built from the config
      (:mod:`~kha_compile.analysis.hf_inputs`): ``input_ids`` (``batch_size`` x ``seq_len`` random
      ids below ``vocab_size``, (batch, 2 choices, seq) for a multiple-choice head, a batch of one
      for a sequence classifier without ``pad_token_id``) with an ``attention_mask`` of ones;
      ``pixel_values`` (B, C, image_size, image_size) for vision models; ``input_features`` for
      Whisper and Speech2Text; raw audio ``input_values`` for wav2vec2-like models. Plus
      ``decoder_input_ids`` for encoder-decoder models and ``use_cache=False`` where the forward
      takes it (a ``DynamicCache`` output is not a pytree type ``torch.export`` knows);
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
    gen = torch.Generator("cpu").manual_seed(_SEED)

    st_auto_model = sentence_transformer_model(model)
    if st_auto_model is not None:
        features = text_inputs(st_auto_model, (batch_size,), seq_len, device, gen)
        if accepts(st_auto_model, "token_type_ids"):
            features["token_type_ids"] = torch.zeros(batch_size, seq_len, dtype=torch.long, device="cpu").to(device)
        return (features,), {}

    if _is_hf_pretrained(model):
        kwargs = hf_example_kwargs(model, batch_size, seq_len, device, dtype, gen)
        if accepts(model, "use_cache"):
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


def _attn_implementation(model: nn.Module) -> str:
    """The transformers attention implementation of ``model`` ("sdpa", "flex_attention", ...), or ""."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "") or "")


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
