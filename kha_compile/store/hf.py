"""KHA in transformers' own checkpoints: the ``kha_compile`` entry of the model config, and reading
the KHA tensors back from the weight files ``save_pretrained`` (and the Trainer) write.

``kc.apply`` records the KHA config as ``model.config.kha_compile`` (``kc.fold`` and ``kc.remove``
update or drop it), so ``model.save_pretrained(d)`` writes it into ``d/config.json`` next to the
KHA tensors in ``model.safetensors`` (or its shards). ``kc.load_pretrained(model, d)`` then
re-applies KHA and loads those tensors. A sentence-transformers directory (``st.save(d)``) holds
its transformers model in the Transformer module's folder (:func:`hf_model_dir`).

``AutoModel.from_pretrained(d)`` alone builds the model without KHA: it drops the ``.kha.``
tensors (its load report lists them as unexpected, "can be ignored") and computes something other
than the trained model. transformers 5.24 reads nothing from a checkpoint that could say more
(unknown ``config.json`` keys are kept silently; ``auto_map`` needs ``trust_remote_code``), except
one warning that prints a value from ``config.json``: an unknown ``quantization_config.quant_method``
("Unknown quantization type, got ...", after which it loads the model as usual, unquantized). So
:func:`record_config` also sets :data:`LOAD_HINT` as the ``quantization_config`` of a model that has
none; its ``quant_method`` is a sentence naming kha_compile and ``kc.load_pretrained``. It is
dropped with the ``kha_compile`` entry, and never replaces a real quantization config. Tools that
refuse unknown quantization methods (serving engines) then refuse such a directory instead of
serving it without its transforms; fold first (``kc.fold``) to ship a vanilla model. vLLM with
kha_compile's plugin installed reads the hint as its quantization method and serves the directory
with its KHA (:mod:`kha_compile.serving.vllm`). :func:`record_in_dir` writes the same two entries
into a transformers directory that ``kc.save_pretrained`` saves KHA into.
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

__all__ = [
    "CONFIG_KEY",
    "HINT_KEY",
    "LOAD_HINT",
    "hf_model_dir",
    "is_hf_dir",
    "read_hf",
    "record_config",
    "record_in_dir",
    "records_kha",
    "stored_kha_keys",
]

log = logging.getLogger(__name__)

CONFIG_KEY = "kha_compile"
HINT_KEY = "quantization_config"  # the one config.json entry transformers warns about with its value
LOAD_HINT = {
    "quant_method": (
        "kha_compile (not a quantization method): this checkpoint holds trained KHA (knocking-heads attention) "
        "transforms that transformers alone does not load, so the loaded model computes something other than "
        "the trained one. Load them with `import kha_compile as kc; kc.load_pretrained(model, directory)`, "
        "directory being the one just loaded. To serve it with vLLM, install kha_compile's vLLM plugin next to "
        "vLLM (pip install 'kha-compile[vllm]'). Do not delete this entry; to ship a vanilla model, "
        "kc.fold(model) before save_pretrained"
    ),
}
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_ST_MODULES = "modules.json"


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
        model.config.kha_compile        # {"version": 2, "q": None, "k": None, "v": "mlp", "strategy": "auto"}
        model.config.quantization_config["quant_method"]    # "kha_compile (not a quantization method): ..."
    """
    cfg = _hf_config(model)
    if cfg is None:
        return
    hint = getattr(cfg, HINT_KEY, None)
    if kha_modules(model):
        setattr(cfg, CONFIG_KEY, config_of(model))
        if hint is None or _is_hint(hint):  # a real quantization config stays as it is
            setattr(cfg, HINT_KEY, dict(LOAD_HINT))
        return
    if hasattr(cfg, CONFIG_KEY):
        delattr(cfg, CONFIG_KEY)
    if _is_hint(hint):
        delattr(cfg, HINT_KEY)


def record_in_dir(directory: pathlib.Path, entry: dict) -> bool:
    """Record KHA in the transformers ``config.json`` of ``directory``, as ``model.save_pretrained`` would.

    Sets its ``kha_compile`` entry to ``entry`` and its ``quantization_config`` to :data:`LOAD_HINT`
    (a real quantization config stays, with a warning), so loaders that read config.json (transformers'
    warning, vLLM and its plugin) know that the directory holds KHA. Returns False, changing nothing,
    when ``directory`` holds no transformers config.json.

    Example::

        record_in_dir(pathlib.Path("llama_dir"), {"version": 3, "q": None, "k": None, "v": "mlp"})
    """
    path = directory / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(data, dict) or "model_type" not in data:
        return False
    hint = data.get(HINT_KEY)
    if data.get(CONFIG_KEY) == entry and hint == LOAD_HINT:
        return True  # written by model.save_pretrained of this model: nothing to add
    data[CONFIG_KEY] = dict(entry)
    if hint is None or _is_hint(hint):
        data[HINT_KEY] = dict(LOAD_HINT)
    else:
        log.warning(
            "%s has a quantization config of its own (%s); its KHA is recorded, but loaders that read "
            "quantization_config will not see it",
            path,
            hint.get("quant_method") if isinstance(hint, dict) else hint,
        )
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    log.info("recorded KHA in %s", path)
    return True


def _is_hint(value: object) -> bool:
    """True for kha_compile's :data:`LOAD_HINT` (as set, or as read back from a config.json)."""
    return isinstance(value, dict) and str(value.get("quant_method", "")).startswith(CONFIG_KEY)


def hf_model_dir(directory: pathlib.Path) -> pathlib.Path:
    """The folder of the transformers model in ``directory``: its Transformer module's for a
    sentence-transformers directory (``modules.json``), else ``directory`` itself.

    Example::

        hf_model_dir(pathlib.Path("st_out"))     # st_out (st.save puts module 0 at the top), or st_out/0_Transformer
    """
    modules = directory / _ST_MODULES
    if not modules.is_file():
        return directory
    try:
        entries = json.loads(modules.read_text())
    except (OSError, json.JSONDecodeError):
        return directory
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Transformer"):
            return directory / str(entry.get("path", ""))
    return directory


def records_kha(directory: pathlib.Path) -> bool:
    """True when the transformers config in ``directory`` (see :func:`hf_model_dir`) has a ``kha_compile`` entry.

    Example::

        records_kha(pathlib.Path("out"))      # True after model.save_pretrained("out") of a KHA model
    """
    try:
        data = json.loads((hf_model_dir(directory) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and CONFIG_KEY in data  # a malformed entry: read_hf says what is wrong


def stored_kha_keys(directory: pathlib.Path) -> list[str]:
    """The names of the ``.kha.`` tensors in the weight files of ``directory`` (read from the headers only).

    Example::

        stored_kha_keys(pathlib.Path("out"))     # ["model.layers.0.self_attn.v_proj.kha.v.up", ...]
    """
    directory = hf_model_dir(directory)
    try:
        if (directory / _INDEX).is_file():
            keys = list(json.loads((directory / _INDEX).read_text()).get("weight_map", {}))
        elif (directory / _SINGLE).is_file():
            with safe_open(str(directory / _SINGLE), framework="pt") as f:
                keys = list(f.keys())
        else:
            return []
    except Exception:  # an unreadable file holds no KHA we could load; read_hf says why when asked
        return []
    return sorted(k for k in keys if is_kha_key(k))


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
