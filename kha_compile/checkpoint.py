"""KHA checkpoints: save the KHA weights and config, read and validate them, load them into a model."""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

import torch
from torch import nn

from .api import apply, remove
from .config import CONFIG_VERSION, KHAConfig
from .errors import CheckpointError, KHAError, NoKHATransformsError
from .modules import transforms_of
from .parallel.fsdp import gather_for_save, rank0_wrote, telling_other_ranks
from .passes.handlers.adapter import canonical_name
from .passes.insert import kha_modules

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "checkpoint_misfit",
    "config_of",
    "kha_state",
    "load_pretrained",
    "read_checkpoint",
    "save_pretrained",
]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "kha_model.safetensors"
CONFIG_NAME = "kha_config.json"


def config_of(model: nn.Module) -> dict[str, Any]:
    """The KHAConfig that reproduces the model's transforms (MLA sites carry v='linear' under v='mlp').

    ``strategy`` is the modules' common ``kha_strategy`` (``"auto"`` when they differ).
    """
    roles: dict[str, str] = {}
    strategies: set[str] = set()
    for _, module in kha_modules(model):
        strategies.add(getattr(module, "kha_strategy", "auto"))
        for role, t in transforms_of(module).items():
            if roles.get(role) != "mlp":
                roles[role] = str(t.kind)
    strategy = strategies.pop() if len(strategies) == 1 else "auto"  # set per module: not one config value
    return {
        "version": CONFIG_VERSION,
        "q": roles.get("q"),
        "k": roles.get("k"),
        "v": roles.get("v"),
        "strategy": strategy,
    }


def kha_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The KHA tensors of ``model`` under canonical names (no PEFT ``base_model.model.`` / ``base_layer``)."""
    return {canonical_name(k): v for k, v in model.state_dict().items() if ".kha." in f".{k}"}


def save_pretrained(model: nn.Module, directory) -> pathlib.Path:
    """Save only the KHA weights (safetensors) and config (JSON with a version) to ``directory``.

    Example::

        kc.save_pretrained(model, "kha_ckpt")      # kha_model.safetensors + kha_config.json

    On a sharded model (FSDP2, tensor parallel) every rank calls it: the KHA tensors are gathered,
    global rank 0 writes a complete checkpoint, the other ranks write nothing, and all return together.
    """
    from safetensors.torch import save_file

    state = kha_state(model)
    if not state:
        raise NoKHATransformsError(
            f"{type(model).__name__} carries no KHA transforms to save; call kc.apply(model) first."
        )
    tensors, write, sharded = gather_for_save(state)  # FSDP2/TP: a collective; only rank 0 writes
    directory = pathlib.Path(directory)
    if not write:
        rank0_wrote()  # raises CheckpointError if rank 0 could not write
        return directory
    with telling_other_ranks(sharded):  # sharded: rank 0 tells every rank whether the write succeeded
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {str(directory)!r}: {exc}") from exc
        meta = {"format": "kha_compile", "version": str(CONFIG_VERSION)}
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata=meta)
        config = config_of(model)
        config["tensors"] = {k: list(v.shape) for k, v in tensors.items()}
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    log.info("saved %d KHA tensors to %s", len(tensors), directory)
    return directory


def read_checkpoint(directory) -> tuple[KHAConfig, dict[str, torch.Tensor]]:
    """Read and validate a KHA checkpoint fully, before anything touches a model."""
    from safetensors.torch import load_file

    directory = pathlib.Path(directory)
    cfg_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    from .hf_checkpoint import is_hf_dir, read_hf

    if not cfg_path.is_file() and is_hf_dir(directory):  # written by the model's own save_pretrained / Trainer
        return read_hf(directory)
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


def load_pretrained(
    model: nn.Module, directory, example_args: Any = (), example_kwargs: dict | None = None
) -> nn.Module:
    """Re-apply KHA to a fresh ``model`` as saved in ``directory`` and load its weights.

    Validates names and shapes; on any mismatch the model is left exactly as it was.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)
        kc.load_pretrained(model, "kha_ckpt")
    """
    cfg, tensors = read_checkpoint(directory)
    apply(model, cfg, example_args, example_kwargs)
    try:
        state = kha_state(model)
        misfit = checkpoint_misfit(
            {k: tuple(v.shape) for k, v in state.items()}, {k: tuple(v.shape) for k, v in tensors.items()}
        )
        if misfit:
            raise CheckpointError(
                f"the KHA checkpoint in {str(directory)!r} does not fit {type(model).__name__}: "
                f"{misfit}. The model was left unchanged."
            )
        with torch.no_grad():
            params = {canonical_name(n): p for n, p in model.named_parameters()}
            for k, v in tensors.items():
                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
    except BaseException:
        remove(model)
        raise
    log.info("loaded %d KHA tensors from %s", len(tensors), directory)
    return model
