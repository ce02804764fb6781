"""KHA in transformers' own checkpoints: the ``config.json`` entries that record it, and reading the KHA
tensors back from the weight files ``save_pretrained`` (and the Trainer) write.

``kc.apply`` records the KHA config as ``model.config.kha_compile`` (``kc.fold`` and ``kc.remove``
update or drop it), with the model's architecture and KHA sites (:mod:`.identity`), and sets the
model's ``quantization_config`` to the same entry under ``"quant_method": "kha_compile"``
(:func:`quantization_entry`)::

    "kha_compile": {"version": 3, "q": "linear", "k": null, "v": "mlp", "strategy": "auto",
                    "architecture": "LlamaForCausalLM", "model_type": "llama", "sites": {...}},
    "quantization_config": {"quant_method": "kha_compile", "version": 3, "q": "linear", ...}

The first record gives the model its own copy of the config object, so another model built from the same
object stays vanilla in its ``config.json``. ``model.save_pretrained(d)`` writes both into ``d/config.json``, next to the KHA tensors in
``model.safetensors`` (or its shards). Importing kha_compile registers ``"kha_compile"`` as a
quantization method with transformers (:mod:`kha_compile.integrations.hf_quantizer`), so
``AutoModelForCausalLM.from_pretrained(d)`` applies KHA before the weights load and loads its
tensors; ``kc.load_pretrained(model, d)`` does the same for a model built some other way. Without
kha_compile, transformers warns "Unknown quantization type, got kha_compile" and loads the model
without its KHA; tools that refuse unknown quantization methods (serving engines, lm-evaluation-harness)
refuse the directory instead of running it without its transforms. vLLM with kha_compile's plugin
serves it with its KHA (:mod:`kha_compile.serving.vllm`). A real quantization config is never
replaced: ``quantization_config`` becomes kha_compile's entry with the real one kept under ``"wraps"``
(:func:`compose_quantization`), so loaders that dispatch on it run kha_compile's method, which runs the
real one inside it (transformers: :mod:`kha_compile.integrations.hf_quantizer`; vLLM: the plugin).
``kc.fold`` of a foldable model drops both entries, so its save is a vanilla checkpoint.

Directories written before the short name carry a sentence as ``quant_method`` (:data:`LEGACY_HINTS`,
"kha_compile (not a quantization method): ..."); they still load, by both routes. A
sentence-transformers directory (``st.save(d)``) holds its transformers model in the Transformer
module's folder (:func:`hf_model_dir`). :func:`record_in_dir` writes the same entries into a
transformers directory that ``kc.save_pretrained`` saves KHA into.
"""

from __future__ import annotations

import copy
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
from .identity import identity_of
from .names import canonical_name, is_kha_key
from .quantization import (
    CONFIG_KEY,
    QUANT_METHOD,
    WRAPS_KEY,
    compose_quantization,
    is_kha_quantization,
    quantization_entry,
    wrapped_quantization,
)
from .wrapped import unwrap_config, wrap_config, wrapped_entry

__all__ = [
    "CONFIG_KEY",
    "HINT_KEY",
    "LEGACY_HINTS",
    "QUANT_METHOD",
    "WRAPS_KEY",
    "compose_quantization",
    "hf_model_dir",
    "is_hf_dir",
    "is_kha_quantization",
    "kha_entry",
    "kha_shapes_in",
    "quantization_entry",
    "read_hf",
    "record_config",
    "record_in_dir",
    "records_kha",
    "stored_kha_keys",
    "wrapped_quantization",
]

log = logging.getLogger(__name__)

HINT_KEY = "quantization_config"  # the config.json entry transformers (and vLLM) dispatch loading on
_OLD_HINT = (
    "kha_compile (not a quantization method): this checkpoint holds trained KHA (knocking-heads attention) "
    "transforms that transformers alone does not load, so the loaded model computes something other than "
    "the trained one. Load them with `import kha_compile as kc; kc.load_pretrained(model, directory)`, "
    "directory being the one just loaded. "
)
_OLD_END = "Do not delete this entry; to ship a vanilla model, kc.fold(model) before save_pretrained"
# the quant_method sentences earlier versions wrote (they still load: the quantizer is registered under them too)
LEGACY_HINTS = (
    _OLD_HINT + _OLD_END,
    _OLD_HINT + "To serve it with vLLM, install kha_compile's vLLM plugin next to vLLM (pip install "
    "'kha-compile[vllm]'). " + _OLD_END,
)
_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_ST_MODULES = "modules.json"


def _hf_config(model: nn.Module) -> object | None:
    """The model's transformers config (``PretrainedConfig``), or None: any other ``config`` attribute
    (a model's own config class) is left alone."""
    transformers = loaded("transformers")  # a transformers config exists only if transformers was imported
    cfg = getattr(model, "config", None)
    return cfg if transformers is not None and isinstance(cfg, transformers.PretrainedConfig) else None


def _own_config(model: nn.Module, cfg: object) -> object:
    """Give ``model`` a copy of its transformers config before KHA is first recorded in it, so that other
    models built from the same config object (``LlamaForCausalLM(cfg)`` twice) do not claim KHA they lack.
    Every module of ``model`` that holds ``cfg`` itself (the inner ``LlamaModel``) gets the copy."""
    own = copy.deepcopy(cfg)
    for m in model.modules():
        if m.__dict__.get("config") is cfg:
            setattr(m, "config", own)  # noqa: B010 (a module attribute mypy types as Tensor | Module)
    return own


def kha_entry(data: object) -> dict | None:
    """The KHA entry a transformers ``config.json`` (as a dict) records, or None when it records none.

    The ``kha_compile`` entry, else the fields of kha_compile's ``quantization_config`` (when it
    carries a config ``version``: earlier versions wrote only a sentence there).

    Example::

        kha_entry(json.loads(pathlib.Path("out/config.json").read_text()))["v"]       # "mlp"
    """
    if not isinstance(data, dict):
        return None
    entry = data.get(CONFIG_KEY)
    if isinstance(entry, dict):
        return entry
    quant = data.get(HINT_KEY)
    if isinstance(quant, dict) and is_kha_quantization(quant) and "version" in quant:
        return {k: v for k, v in quant.items() if k not in ("quant_method", WRAPS_KEY)}
    return None


def record_config(model: nn.Module) -> None:
    """Record the model's KHA in its transformers config (module docs), or drop the entries when no KHA is left.

    Run by ``kc.apply``, ``kc.fold`` and ``kc.remove``.

    Example::

        record_config(model)
        model.config.kha_compile        # {"version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto", ...}
        model.config.quantization_config["quant_method"]    # "kha_compile"
    """
    cfg = _hf_config(model)
    if cfg is None:
        return
    hint = getattr(cfg, HINT_KEY, None)
    if kha_modules(model):
        if not hasattr(cfg, CONFIG_KEY):
            cfg = _own_config(model, cfg)
        entry = dict(config_of(model), **identity_of(model))
        setattr(cfg, CONFIG_KEY, entry)
        if hint is None or isinstance(hint, dict) or is_kha_quantization(hint):  # a real dict is kept inside
            setattr(cfg, HINT_KEY, compose_quantization(entry, hint))
        else:  # the real config object stays one (PEFT and the Trainer read it), and writes both
            setattr(cfg, HINT_KEY, wrap_config(hint, entry))
        return
    if hasattr(cfg, CONFIG_KEY):
        delattr(cfg, CONFIG_KEY)
    if wrapped_entry(hint) is not None:
        setattr(cfg, HINT_KEY, unwrap_config(hint))
    elif is_kha_quantization(hint):
        inner = wrapped_quantization(hint)
        if inner is None:
            delattr(cfg, HINT_KEY)
        else:  # the base is still quantized: its own config is left
            setattr(cfg, HINT_KEY, inner)


def record_in_dir(directory: pathlib.Path, entry: dict) -> bool:
    """Record KHA in the transformers ``config.json`` of ``directory``, as ``model.save_pretrained`` would.

    Sets its ``kha_compile`` entry to ``entry`` and its ``quantization_config`` to
    :func:`quantization_entry` of it (a real quantization config is kept inside it:
    :func:`compose_quantization`), so loaders that read config.json (transformers' ``from_pretrained``,
    vLLM and its plugin) know that the directory holds KHA. Returns False, changing nothing, when ``directory`` holds no transformers config.json.

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
    want = compose_quantization(entry, hint)
    if data.get(CONFIG_KEY) == entry and hint == want:
        return True  # written by model.save_pretrained of this model: nothing to add
    data[CONFIG_KEY] = dict(entry)
    data[HINT_KEY] = want
    if WRAPS_KEY in want:
        log.info("%s: KHA recorded around its quantization method %r", path, want[WRAPS_KEY]["quant_method"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    log.info("recorded KHA in %s", path)
    return True


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
    """True when the transformers config in ``directory`` (see :func:`hf_model_dir`) records KHA (:func:`kha_entry`).

    Example::

        records_kha(pathlib.Path("out"))      # True after model.save_pretrained("out") of a KHA model
    """
    try:
        data = json.loads((hf_model_dir(directory) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if isinstance(data, dict) and CONFIG_KEY in data:
        return True  # a malformed entry: read_hf says what is wrong
    return kha_entry(data) is not None


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


def kha_shapes_in(files: list[str]) -> dict[str, tuple[int, ...]]:
    """The ``.kha.`` tensors of weight files (safetensors: headers only; ``.bin``: on the meta device), with shapes.

    Example::

        kha_shapes_in(["out/model.safetensors"])    # {"model.layers.0.self_attn.v_proj.kha.v.up": (16, 16), ...}
    """
    out: dict[str, tuple[int, ...]] = {}
    for name in files:
        try:
            if name.endswith(".safetensors"):
                with safe_open(name, framework="pt") as f:
                    for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if is_kha_key(key):
                            out[key] = tuple(f.get_slice(key).get_shape())
            else:
                state = torch.load(name, map_location="meta", weights_only=True)
                out.update({k: tuple(v.shape) for k, v in state.items() if is_kha_key(k)})
        except Exception as exc:  # safetensors and torch raise their own error types for truncated files
            raise CheckpointError(f"{name!r} cannot be read (truncated, or not a weight file): {exc}") from exc
    return out


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
    entry = kha_entry(data)
    if entry is None:
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
