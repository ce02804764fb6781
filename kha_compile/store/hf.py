"""KHA in transformers' own checkpoints: the ``kha_compile`` entry of the model config, and reading
the KHA tensors back from the weight files ``save_pretrained`` (and the Trainer) write.

``kc.apply`` records the KHA config as ``model.config.kha_compile`` (``kc.fold`` and ``kc.remove``
update or drop it), so ``model.save_pretrained(d)`` writes it into ``d/config.json`` next to the
KHA tensors in ``model.safetensors`` (or its shards). ``kc.load_pretrained(model, d)`` then
re-applies KHA and loads those tensors. ``AutoModel.from_pretrained(d)`` alone builds the model
without KHA and lists the ``.kha.`` tensors among its unexpected keys.
"""

from __future__ import annotations

import json
import logging
import pathlib

import torch
from safetensors import safe_open
from torch import nn

from ..core.errors import CheckpointError, KHAError
from ..core.optional import loaded
from ..model.carrier import kha_modules
from ..model.config import KHAConfig, config_of
from .names import canonical_name, is_kha_key

__all__ = ["CONFIG_KEY", "is_hf_dir", "read_hf", "record_config"]

log = logging.getLogger(__name__)

CONFIG_KEY = "kha_compile"
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


def _hf_config(model: nn.Module) -> object | None:
    """The model's transformers config (``PretrainedConfig``), or None: any other ``config`` attribute
    (a model's own config class) is left alone."""
    transformers = loaded("transformers")  # a transformers config exists only if transformers was imported
    cfg = getattr(model, "config", None)
    return cfg if transformers is not None and isinstance(cfg, transformers.PretrainedConfig) else None


def record_config(model: nn.Module) -> None:
    """Set ``model.config.kha_compile`` to the model's KHA config, or drop it when no KHA is left.

    Run by ``kc.apply``, ``kc.fold`` and ``kc.remove``.

    Example::

        record_config(model)
        model.config.kha_compile        # {"version": 1, "q": None, "k": None, "v": "mlp"}
    """
    cfg = _hf_config(model)
    if cfg is None:
        return
    if kha_modules(model):
        setattr(cfg, CONFIG_KEY, config_of(model))
    elif hasattr(cfg, CONFIG_KEY):
        delattr(cfg, CONFIG_KEY)


def is_hf_dir(directory: pathlib.Path) -> bool:
    """A directory written by a transformers model's ``save_pretrained`` (config.json + safetensors).

    Example::

        is_hf_dir(pathlib.Path("out/checkpoint-500"))      # True for a Trainer checkpoint
    """
    return (directory / "config.json").is_file() and ((directory / _SINGLE).is_file() or (directory / _INDEX).is_file())


def read_hf(directory: pathlib.Path) -> tuple[KHAConfig, dict[str, torch.Tensor]]:
    """The KHA config (``config.json``'s ``kha_compile`` entry) and KHA tensors of a transformers directory.

    Only the ``.kha.`` tensors are read (through the shard index when sharded); names are canonical.

    Example::

        cfg, tensors = read_hf(pathlib.Path("out/checkpoint-500"))
    """
    try:
        data = json.loads((directory / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{str(directory / 'config.json')!r} is not valid JSON: {exc}") from exc
    entry = data.get(CONFIG_KEY)
    if not isinstance(entry, dict):
        raise CheckpointError(
            f"{str(directory)!r} is a transformers checkpoint without a {CONFIG_KEY!r} entry in config.json, so it "
            "records no KHA; it was saved from a model without KHA (or after kc.fold). Load it with "
            "from_pretrained alone, or pass a directory written by kc.save_pretrained."
        )
    try:
        cfg = KHAConfig.from_dict(entry)
    except (KHAError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"the {CONFIG_KEY!r} entry of {str(directory / 'config.json')!r} is not a valid KHA config: {exc}"
        ) from exc
    if (directory / _INDEX).is_file():
        weight_map = json.loads((directory / _INDEX).read_text()).get("weight_map", {})
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            if is_kha_key(key):
                files.setdefault(fname, []).append(key)
    else:
        files = {_SINGLE: []}
    tensors: dict[str, torch.Tensor] = {}
    for fname, keys in files.items():
        try:
            with safe_open(str(directory / fname), framework="pt") as f:
                for key in keys or [k for k in f.keys() if is_kha_key(k)]:  # noqa: SIM118 (safe_open is not a dict)
                    tensors[canonical_name(key)] = f.get_tensor(key)
        except Exception as exc:  # safetensors raises its own error types for truncated files
            raise CheckpointError(
                f"{str(directory / fname)!r} cannot be read (truncated or not safetensors): {exc}"
            ) from exc
    if not tensors:
        raise CheckpointError(
            f"{str(directory)!r} records KHA in config.json but its weight files hold no "
            "'.kha.' tensors; the checkpoint is incomplete."
        )
    log.info("read %d KHA tensors from the transformers checkpoint %s", len(tensors), directory)
    return cfg, tensors
