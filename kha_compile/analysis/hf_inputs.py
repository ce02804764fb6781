"""Example inputs of a transformers ``PreTrainedModel``, built from its config, for every task head.

The model's main input (``main_input_name``) decides the tensors: token ids, images, log-mel
features (Whisper, Speech2Text) or raw audio (wav2vec2 and its kin); the task head decides their
shape and batch: a multiple-choice head takes (batch, choices, sequence), and a sequence
classifier without a ``pad_token_id`` (decoders such as Llama find the last token by it) takes a
batch of one. Encoder-decoder models get ``decoder_input_ids``. What cannot be built from the
config raises :class:`~kha_compile.core.errors.MissingExampleInputsError` naming the inputs to pass.

Only called for an instance of ``transformers.PreTrainedModel``, so transformers is imported.

Example::

    kwargs = hf_example_kwargs(bert_mc, batch_size=2, seq_len=8, device=cpu, dtype=torch.float32, gen=gen)
    kwargs["input_ids"].shape          # (2, 2, 8): batch, choices, sequence
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..core.errors import MissingExampleInputsError

__all__ = ["NUM_CHOICES", "accepts", "hf_example_kwargs", "task_head", "text_inputs"]

log = logging.getLogger(__name__)

NUM_CHOICES = 2  # choices per example of a multiple-choice head
_AUDIO_FRAMES = 32  # frames after a raw-audio model's feature encoder (enough for its time masks)
_HEADS = ("MULTIPLE_CHOICE", "SEQUENCE_CLASSIFICATION")  # the heads whose inputs differ from the base model's


def _names(values: Iterable[Any]) -> set[str]:
    out: set[str] = set()
    for v in values:
        out.update(v if isinstance(v, (list, tuple)) else (v,))
    return out


def task_head(model: nn.Module) -> str | None:
    """The transformers Auto mapping whose example inputs differ that ``model``'s class (or a base) is in.

    Example::

        task_head(BertForMultipleChoice(cfg))        # "MULTIPLE_CHOICE"
        task_head(LlamaForCausalLM(cfg))             # None
    """
    from transformers.models.auto import modeling_auto

    classes = {c.__name__ for c in type(model).__mro__}
    for head in _HEADS:
        if classes & _names(getattr(modeling_auto, f"MODEL_FOR_{head}_MAPPING_NAMES", {}).values()):
            return head
    return None


def hf_example_kwargs(
    model: nn.Module, batch_size: int, seq_len: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> dict[str, Any]:
    """Keyword inputs for one call of a transformers model (see the module doc)."""
    config: Any = model.config
    head = task_head(model)
    if head == "SEQUENCE_CLASSIFICATION" and getattr(config, "pad_token_id", None) is None:
        batch_size = 1  # without a pad token the head can only pool a batch of one
    main = getattr(model, "main_input_name", "input_ids")
    if main == "inputs" and accepts(model, "input_ids") and _has_vocab(config):
        main = "input_ids"  # a generic main input (Perceiver's masked LM) that also takes token ids
    if main == "input_ids":
        lead = (batch_size, NUM_CHOICES) if head == "MULTIPLE_CHOICE" else (batch_size,)
        kwargs = text_inputs(model, lead, seq_len, device, gen)
    elif main == "pixel_values":
        kwargs = {"pixel_values": _pixel_values(config, batch_size, device, dtype, gen)}
    elif main == "input_features":
        kwargs = {"input_features": _features(model, batch_size, seq_len, device, dtype, gen)}
    elif main == "input_values":
        kwargs = {"input_values": _audio(model, batch_size, device, dtype, gen)}
    else:
        raise MissingExampleInputsError(
            f"{type(model).__name__} takes {main!r} as its main input, for which kha_compile cannot build example "
            "inputs from the config (it builds 'input_ids', 'pixel_values', 'input_features' and 'input_values'). "
            f"Pass example inputs, e.g. kc.apply(model, cfg, example_kwargs={{{main!r}: x}})."
        )
    if main != "input_ids" and head == "MULTIPLE_CHOICE":
        raise MissingExampleInputsError(
            f"{type(model).__name__} is a multiple-choice head over {main!r}; pass example inputs of shape "
            f"(batch, choices, ...), e.g. kc.apply(model, cfg, example_kwargs={{{main!r}: x}})."
        )
    if getattr(config, "is_encoder_decoder", False) and accepts(model, "decoder_input_ids"):
        vocab = _vocab_size(config)
        kwargs["decoder_input_ids"] = torch.randint(0, vocab, (batch_size, seq_len), generator=gen, device="cpu").to(
            device
        )
    return kwargs


def text_inputs(
    model: nn.Module, lead: tuple[int, ...], seq_len: int, device: torch.device, gen: torch.Generator
) -> dict[str, Any]:
    """``input_ids`` (random ids below the vocab size) and an all-ones ``attention_mask``, shape (*lead, T)."""
    vocab = _vocab_size(model.config)
    shape = (*lead, seq_len)
    out: dict[str, Any] = {
        "input_ids": torch.randint(0, vocab, shape, generator=gen, device="cpu").to(device)
    }  # (..., T)
    if accepts(model, "attention_mask"):
        out["attention_mask"] = torch.ones(shape, dtype=torch.long, device="cpu").to(device)  # (..., T)
    return out


def _pixel_values(
    config: Any, batch_size: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    config = getattr(config, "vision_config", None) or config
    size = getattr(config, "image_size", 224)
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    return torch.randn(batch_size, channels, h, w, generator=gen, device="cpu").to(
        device=device, dtype=dtype
    )  # (B, C, H, W)


def _features(
    model: nn.Module, batch_size: int, seq_len: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """Log-mel features: (B, mel bins, frames) for Whisper-like encoders, (B, frames, features) for Speech2Text."""
    config: Any = model.config
    bins, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if bins and positions:  # two stride-2 convolutions halve the frames to the encoder's positions, which must fill
        shape: tuple[int, ...] = (batch_size, int(bins), 2 * int(positions))  # (B, mel, frames)
    elif getattr(config, "input_feat_per_channel", None):
        per = int(config.input_feat_per_channel) * int(getattr(config, "input_channels", 1) or 1)
        shape = (batch_size, 4 * seq_len, per)  # (B, frames, features): the subsampler divides frames by 4
    else:
        raise MissingExampleInputsError(
            f"{type(model).__name__} takes 'input_features', whose shape kha_compile cannot read off its config "
            "(no num_mel_bins/max_source_positions, no input_feat_per_channel). Pass example inputs, e.g. "
            "kc.apply(model, cfg, example_kwargs={'input_features': x})."
        )
    return torch.randn(shape, generator=gen, device="cpu").to(device=device, dtype=dtype)


def _audio(model: nn.Module, batch_size: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator):
    """Raw audio (B, samples), long enough for the convolutional feature encoder to give a few dozen frames."""
    config: Any = model.config
    kernels, strides = getattr(config, "conv_kernel", None), getattr(config, "conv_stride", None)
    if not kernels or not strides:
        raise MissingExampleInputsError(
            f"{type(model).__name__} takes raw audio 'input_values', but its config has no conv_kernel/conv_stride "
            "to size it by. Pass example inputs, e.g. kc.apply(model, cfg, example_kwargs={'input_values': x})."
        )
    samples = _AUDIO_FRAMES
    for k, s in reversed(list(zip(kernels, strides))):  # invert out = (in - k) // s + 1
        samples = (samples - 1) * int(s) + int(k)
    return torch.randn(batch_size, samples, generator=gen, device="cpu").to(device=device, dtype=dtype)  # (B, samples)


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


def accepts(model: nn.Module, name: str) -> bool:
    """Whether ``model.forward`` names ``name`` as a parameter (a bare ``**kwargs`` does not count)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
