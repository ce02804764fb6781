"""The KHA checkpoint format: ``kha_model.safetensors`` (the KHA tensors) and ``kha_config.json``.

:func:`write_checkpoint` writes a directory, :func:`read_checkpoint` reads and validates one fully
(or a transformers directory that records KHA, :mod:`.hf`) before anything touches a model, and
:func:`checkpoint_misfit` says what does not fit between a model and a checkpoint.
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..core.errors import CheckpointError, KHAError
from ..model.config import CONFIG_VERSION, KHAConfig
from .hf import hf_model_dir, is_hf_dir, read_hf
from .names import canonical_name, is_kha_key

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "checkpoint_misfit", "kha_state", "read_checkpoint", "write_checkpoint"]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "kha_model.safetensors"
CONFIG_NAME = "kha_config.json"


def kha_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The KHA tensors of ``model`` under canonical names (no PEFT ``base_model.model.`` / ``base_layer``)."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if is_kha_key(k)}


def write_checkpoint(directory: pathlib.Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write ``tensors`` (safetensors, with format metadata) and ``config`` (JSON, with the tensor shapes)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {str(directory)!r}: {exc}") from exc
    meta = {"format": "kha_compile", "version": str(CONFIG_VERSION)}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata=meta)
    config = dict(config, tensors={k: list(v.shape) for k, v in tensors.items()})
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))


def read_checkpoint(directory) -> tuple[KHAConfig, dict[str, torch.Tensor]]:
    """Read and validate a KHA checkpoint fully, before anything touches a model.

    ``directory`` is one written by ``kc.save_pretrained``, or a transformers (``model.save_pretrained``,
    a Trainer checkpoint) or sentence-transformers (``st.save``) directory whose config records KHA.

    Example::

        cfg, tensors = read_checkpoint("kha_ckpt")
    """
    directory = pathlib.Path(directory)
    cfg_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    hf_dir = hf_model_dir(directory)  # a sentence-transformers directory: its Transformer module's folder
    if not cfg_path.is_file() and is_hf_dir(hf_dir):  # written by the model's own save_pretrained / Trainer / st.save
        return read_hf(hf_dir)
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise CheckpointError(
                f"{str(p)!r} does not exist; a KHA checkpoint directory holds "
                f"{CONFIG_NAME} and {WEIGHTS_NAME} written by kc.save_pretrained."
            )
    try:
        data = json.loads(cfg_path.read_text())
        cfg = KHAConfig.from_dict(data)
    except (json.JSONDecodeError, KHAError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{str(cfg_path)!r} is not a valid KHA config: {exc}") from exc
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for truncated files
        raise CheckpointError(f"{str(weights_path)!r} cannot be read (truncated or not safetensors): {exc}") from exc
    expected = data.get("tensors")
    if isinstance(expected, dict):
        got = {k: list(v.shape) for k, v in tensors.items()}
        if got != expected:
            raise CheckpointError(
                f"{str(weights_path)!r} does not hold the tensors {str(cfg_path)!r} lists; "
                "the checkpoint is incomplete or its files come from different saves."
            )
    return cfg, tensors


def checkpoint_misfit(expected: dict[str, tuple], got: dict[str, tuple]) -> str:
    """What does not fit between the KHA tensors a model expects and a checkpoint's ('' if all fit)."""

    def some(names: list[str]) -> str:
        return f"{names[:5]}{' ...' if len(names) > 5 else ''}"

    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if tuple(expected[k]) != tuple(got[k]))
    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {some(missing)}")
    if unexpected:
        parts.append(f"not in this model: {some(unexpected)}")
    if wrong:
        parts.append(
            "shape mismatch: " + ", ".join(f"{k} {tuple(got[k])} vs model {tuple(expected[k])}" for k in wrong[:5])
        )
    return "; ".join(parts)
