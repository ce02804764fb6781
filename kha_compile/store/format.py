"""The KHA checkpoint format: ``kha_model.safetensors`` (the KHA tensors) and ``kha_config.json``.

:func:`write_checkpoint` writes a directory, :func:`read_checkpoint` reads and validates one fully
(or a transformers directory that records KHA, :mod:`.hf`) before anything touches a model, and
:func:`checkpoint_misfit` says what does not fit between a model and a checkpoint.

Since config version 3, ``kha_config.json`` also records the insertion plan (:func:`kha_plan`, read
back by :func:`read_plan`): per KHA carrier its module path, projection handler, head slots, kind
per role and output features. Deploy mode (``kc.backend(from_pretrained=...)``) places the
transforms from it without analysing the model. Example of one entry::

    {"module": "model.layers.0.self_attn.v_proj", "handler": "linear", "out_features": 128,
     "kinds": {"v": "mlp"},
     "slots": [{"role": "v", "offset": 0, "num_heads": 8, "head_dim": 16, "head_stride": 16}]}

It also records the architecture and KHA sites of the model it was saved from (``architecture``,
``model_type``, ``sites``: :mod:`.identity`), which :func:`read_identity` reads back (from
``config.json`` for a transformers directory) so that loading refuses a model of another architecture.
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
from ..core.kinds import ROLES
from ..model.config import CONFIG_VERSION, KHAConfig
from ..model.slots import HeadSlot
from .hf import hf_model_dir, is_hf_dir, kha_entry, read_hf
from .identity import recorded_identity
from .names import canonical_name, is_kha_key
from .plan import PlannedProjection, kha_plan

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "PlannedProjection",
    "checkpoint_misfit",
    "kha_plan",
    "kha_state",
    "read_checkpoint",
    "read_identity",
    "read_plan",
    "write_checkpoint",
]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "kha_model.safetensors"
CONFIG_NAME = "kha_config.json"


def kha_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The KHA tensors of ``model`` under canonical names (no PEFT ``base_model.model.`` / ``base_layer``)."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if is_kha_key(k)}


def _planned(item: Any) -> PlannedProjection:
    if not isinstance(item, dict) or not isinstance(item.get("module"), str):
        raise TypeError(f"a plan entry must be an object with a 'module' path, got {item!r}")
    kinds = item.get("kinds")
    if not isinstance(kinds, dict) or not all(r in ROLES and isinstance(k, str) for r, k in kinds.items()):
        raise TypeError(f"{item['module']}: 'kinds' must map roles (q, k, v) to kind names, got {kinds!r}")
    slots = []
    for s in item.get("slots") or []:
        fields = ("offset", "num_heads", "head_dim", "head_stride")
        if not isinstance(s, dict) or s.get("role") not in kinds or not all(isinstance(s.get(f), int) for f in fields):
            raise TypeError(f"{item['module']}: a head slot must give a planned role and {fields}, got {s!r}")
        rows = s.get("rows")
        if rows is not None and not (isinstance(rows, list) and all(isinstance(f, int) for f in rows)):
            raise TypeError(f"{item['module']}: a head slot's 'rows' must be a list of feature numbers, got {rows!r}")
        offset, heads, dim, stride = (int(s[f]) for f in fields)
        slots.append(HeadSlot(s["role"], offset, heads, dim, stride, tuple(rows) if rows is not None else None))
    out_features = item.get("out_features")
    if out_features is not None and not isinstance(out_features, int):
        raise TypeError(f"{item['module']}: 'out_features' must be an integer, got {out_features!r}")
    handler = item.get("handler")
    return PlannedProjection(
        item["module"], handler if isinstance(handler, str) else None, tuple(slots), dict(kinds), out_features
    )


def read_plan(directory) -> list[PlannedProjection] | None:
    """The insertion plan a checkpoint records (config version 3), or None when it records none
    (versions 1 and 2, or a transformers directory).

    Raises :class:`CheckpointError` for a plan that does not parse.

    Example::

        [p.path for p in read_plan("kha_ckpt")]     # ["model.layers.0.self_attn.v_proj", ...]
    """
    cfg_path = pathlib.Path(directory) / CONFIG_NAME
    if not cfg_path.is_file():
        return None
    try:
        plan = json.loads(cfg_path.read_text()).get("plan")
        return None if plan is None else [_planned(p) for p in plan]
    except (json.JSONDecodeError, TypeError, AttributeError, KeyError) as exc:
        raise CheckpointError(
            f"{str(cfg_path)!r} records an invalid insertion plan ({exc}); re-save the checkpoint with kc.save_pretrained."
        ) from exc


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


def read_identity(directory) -> dict[str, Any]:
    """The architecture and KHA sites a checkpoint records (:mod:`.identity`); empty for older checkpoints.

    ``directory`` as for :func:`read_checkpoint`; call it after that has validated the directory.

    Example::

        read_identity("kha_ckpt")["architecture"]       # "Qwen3ForCausalLM"
    """
    directory = pathlib.Path(directory)
    path = directory / CONFIG_NAME
    if not path.is_file():
        path = hf_model_dir(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return recorded_identity(data if path.name == CONFIG_NAME else kha_entry(data))


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
