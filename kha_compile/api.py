"""The public verbs: apply, inspect, save_pretrained, load_pretrained."""
from __future__ import annotations

import json
import logging
import pathlib
import warnings
from typing import Any, Optional

import torch
from torch import nn

from .config import KHAConfig, CONFIG_VERSION
from .errors import AlreadyAppliedError, CheckpointError, KHAError, NoAttentionFoundError
from .modules import detach, detach_mha, KHAMultiheadAttention
from .passes.inputs import example_inputs as _example_inputs
from .passes.insert import build_sites, insert, kha_modules
from .passes.match import find_sites
from .passes.trace import capture
from .report import Report

__all__ = ["apply", "inspect", "save_pretrained", "load_pretrained", "remove"]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "kha_model.safetensors"
CONFIG_NAME = "kha_config.json"


def _analyse(model: nn.Module, cfg: Optional[KHAConfig], example_args, example_kwargs):
    args, kwargs = _example_inputs(model, example_args, example_kwargs)
    cap = capture(model, args, kwargs)
    raw = find_sites(cap.exported)
    sites, plan = build_sites(model, raw, cap, cfg)
    report = Report(type(model).__name__, sites, cap.seconds, sum(len(p) for p in cap.groups.values()))
    return report, plan


def _nothing_found(model: nn.Module, report: Report) -> str:
    what = (f"kha_compile found no per-head attention to transform in {type(model).__name__}. It looked for "
            "aten.scaled_dot_product_attention and softmax(q @ k^T ...) @ v (matmul, bmm, baddbmm) in the "
            "torch.export graph and walked q, k, v back to their projections.")
    if report.skipped:
        what += " Attention ops were found but skipped:\n" + "\n".join(f"  {s.name}: {s.reason}" for s in report.skipped)
    else:
        what += " The graph contains no attention op; check that the example inputs run the attention path."
    return what


def apply(model: nn.Module, cfg: Optional[KHAConfig] = None, example_args: Any = (),
          example_kwargs: Optional[dict] = None, strict: bool = True) -> nn.Module:
    """Insert KHA transforms after the q/k/v projections of every attention in ``model``, in place.

    The transforms start at identity, so the model's outputs do not change until training moves
    them. Repeated blocks are traced once. Returns ``model``.

    Example::

        import kha_compile as kc
        model = kc.apply(model, kc.KHAConfig(v="mlp"))          # transformers: inputs built from config
        model = kc.apply(block, example_args=(x,))              # any other nn.Module
        print(kc.inspect(model))
    """
    if cfg is None:
        cfg = KHAConfig()
    if not isinstance(cfg, KHAConfig):
        raise KHAError(f"cfg must be a kha_compile.KHAConfig, got {type(cfg).__name__}; e.g. KHAConfig(v='mlp').")
    existing = kha_modules(model)
    if existing:
        raise AlreadyAppliedError(
            f"{type(model).__name__} already carries KHA transforms ({len(existing)} modules, e.g. "
            f"{existing[0][0]!r}); apply() runs once per model. Use kc.fold(model) or kc.remove(model) first, "
            "or start from a fresh model.")
    report, plan = _analyse(model, cfg, example_args, example_kwargs)
    if not report.matched:
        message = _nothing_found(model, report)
        if strict:
            raise NoAttentionFoundError(message + "\nPass strict=False to return the model unchanged instead.")
        warnings.warn(message, stacklevel=2)
        log.warning(message)
        return model
    count = insert(model, plan)
    for s in report.skipped:
        log.warning("KHA skipped %s: %s", s.name, s.reason)
    log.info("KHA inserted %d transforms into %d modules at %d attention sites (%d skipped) in %.2fs",
             count, len(plan), len(report.matched), len(report.skipped), report.trace_seconds)
    return model


def inspect(model: nn.Module, example_args: Any = (), example_kwargs: Optional[dict] = None) -> Report:
    """Report every attention site of ``model`` (before or after apply) without changing it.

    Example::

        report = kc.inspect(model)
        print(report)                     # a table: kind, heads, kv heads, head dim, rope, qk-norm, kha
        report.sites[0].transforms        # {"v": "mlp"} after apply
    """
    report, _ = _analyse(model, None, example_args, example_kwargs)
    return report


def remove(model: nn.Module) -> nn.Module:
    """Take every KHA transform out of ``model`` (no folding): the original classes come back."""
    for _, module in kha_modules(model):
        if isinstance(module, KHAMultiheadAttention):
            detach_mha(module)
        else:
            detach(module)
    return model


def _config_of(model: nn.Module) -> dict[str, Any]:
    """The KHAConfig that reproduces the model's transforms (MLA sites carry v='linear' under v='mlp')."""
    roles: dict[str, str] = {}
    for _, module in kha_modules(model):
        for role, t in module.kha.items():
            if roles.get(role) != "mlp":
                roles[role] = t.kind
    return {"version": CONFIG_VERSION, "q": roles.get("q"), "k": roles.get("k"), "v": roles.get("v")}


def _kha_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".kha." in f".{k}"}


def save_pretrained(model: nn.Module, directory) -> pathlib.Path:
    """Save only the KHA weights (safetensors) and config (JSON with a version) to ``directory``.

    Example::

        kc.save_pretrained(model, "kha_ckpt")      # kha_model.safetensors + kha_config.json
    """
    from safetensors.torch import save_file

    state = _kha_state(model)
    if not state:
        raise KHAError(f"{type(model).__name__} carries no KHA transforms to save; call kc.apply(model) first.")
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create checkpoint directory {str(directory)!r}: {exc}") from exc
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    meta = {"format": "kha_compile", "version": str(CONFIG_VERSION)}
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata=meta)
    config = _config_of(model)
    config["tensors"] = {k: list(v.shape) for k, v in tensors.items()}
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    log.info("saved %d KHA tensors to %s", len(tensors), directory)
    return directory


def read_checkpoint(directory) -> tuple[KHAConfig, dict[str, torch.Tensor]]:
    """Read and validate a KHA checkpoint fully, before anything touches a model."""
    from safetensors.torch import load_file

    directory = pathlib.Path(directory)
    cfg_path, weights_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise CheckpointError(f"{str(p)!r} does not exist; a KHA checkpoint directory holds "
                                  f"{CONFIG_NAME} and {WEIGHTS_NAME} written by kc.save_pretrained.")
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
            raise CheckpointError(f"{str(weights_path)!r} does not hold the tensors {str(cfg_path)!r} lists; "
                                  "the checkpoint is incomplete or its files come from different saves.")
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
        parts.append("shape mismatch: " + ", ".join(f"{k} {tuple(got[k])} vs model {tuple(expected[k])}" for k in wrong[:5]))
    return "; ".join(parts)


def load_pretrained(model: nn.Module, directory, example_args: Any = (), example_kwargs: Optional[dict] = None
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
        state = _kha_state(model)
        misfit = checkpoint_misfit({k: tuple(v.shape) for k, v in state.items()},
                                   {k: tuple(v.shape) for k, v in tensors.items()})
        if misfit:
            raise CheckpointError(f"the KHA checkpoint in {str(directory)!r} does not fit {type(model).__name__}: "
                                  f"{misfit}. The model was left unchanged.")
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in tensors.items():
                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
    except BaseException:
        remove(model)
        raise
    log.info("loaded %d KHA tensors from %s", len(tensors), directory)
    return model
