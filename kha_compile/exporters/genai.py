"""``genai_config.json``: what onnxruntime-genai reads beside a with-past ONNX file to generate from it.

onnxruntime-genai (``onnxruntime_genai.Model(directory)``) reads ``directory/genai_config.json``: the
decoder's file name, its input and output names (``past_key_values.%d.key`` ... ``present.%d.value``),
the cache layout (``num_hidden_layers``, ``num_key_value_heads``, ``head_size``), ``hidden_size``,
``num_attention_heads``, ``vocab_size``, ``context_length``, the special token ids and the default
search options (greedy). The model ``type`` is ``"decoder"``, the generic decoder-only type: the file
is a plain graph, so nothing type-specific applies. No tokenizer is needed to generate from token ids
(``Generator.append_tokens``); for text in and out, save the tokenizer into the same directory
(``tokenizer.save_pretrained(directory)``).

Example::

    config = genai_config(model, cache_layout(model), "model.onnx")
    config["model"]["decoder"]["num_key_value_heads"]        # 2
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import Any

from torch import nn

from ..core.errors import ExportError
from .kv_cache import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, CacheLayout, model_config

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "GENAI_CONFIG",
    "GENAI_MODEL_TYPE",
    "genai_config",
    "token_ids",
    "write_genai_config",
]

log = logging.getLogger(__name__)

GENAI_CONFIG = "genai_config.json"
GENAI_MODEL_TYPE = "decoder"  # onnxruntime-genai's generic decoder-only model
DEFAULT_CONTEXT_LENGTH = 4096  # when the config names no max_position_embeddings


def token_ids(model: nn.Module) -> dict[str, Any]:
    """``{"bos": int | None, "eos": [int, ...], "pad": int}`` from the generation config, else the model config.

    ``pad`` falls back to the first eos id, and to -1 (no token) when the model names neither.

    Example::

        token_ids(model)       # {'bos': 1, 'eos': [2], 'pad': 2}
    """
    sources = [getattr(model, "generation_config", None), model_config(model)]

    def first(field: str) -> Any:
        return next((v for s in sources if s is not None and (v := getattr(s, field, None)) is not None), None)

    eos = first("eos_token_id")
    eos_list = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])]
    pad = first("pad_token_id")
    bos = first("bos_token_id")
    return {
        "bos": None if bos is None else int(bos),
        "eos": eos_list,
        "pad": int(pad) if pad is not None else (eos_list[0] if eos_list else -1),
    }


def genai_config(model: nn.Module, layout: CacheLayout, filename: str) -> dict[str, Any]:
    """The ``genai_config.json`` content for a with-past ONNX file ``filename`` of ``model``.

    Example::

        genai_config(model, layout, "model.onnx")["model"]["decoder"]["inputs"]["past_key_names"]
        # 'past_key_values.%d.key'
    """
    config = model_config(model)
    name = type(model).__name__

    def field(key: str) -> int:
        value = getattr(config, key, None)
        if not isinstance(value, int) or value <= 0:
            raise ExportError(
                f"genai_config.json needs {key} from {name}'s config, which has {value!r}; set config.{key}."
            )
        return value

    context = getattr(config, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        log.warning("%s names no max_position_embeddings: genai context_length %d", name, DEFAULT_CONTEXT_LENGTH)
        context = DEFAULT_CONTEXT_LENGTH
    ids = token_ids(model)
    if not ids["eos"]:
        raise ExportError(
            f"{name} names no eos_token_id (in its generation_config or config), and onnxruntime-genai needs one: it "
            "stops a sequence there. Set model.generation_config.eos_token_id (your tokenizer's end-of-sequence id) "
            "before the export."
        )
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask"}
    if layout.position_ids:
        inputs["position_ids"] = "position_ids"
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": filename,
        "head_size": layout.head_size,
        "hidden_size": field("hidden_size"),
        "inputs": {**inputs, "past_key_names": PAST_KEY, "past_value_names": PAST_VALUE},
        "outputs": {"logits": "logits", "present_key_names": PRESENT_KEY, "present_value_names": PRESENT_VALUE},
        "num_attention_heads": field("num_attention_heads"),
        "num_hidden_layers": layout.num_layers,
        "num_key_value_heads": layout.num_kv_heads,
    }
    model_section: dict[str, Any] = {
        "context_length": context,
        "decoder": decoder,
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "type": GENAI_MODEL_TYPE,
        "vocab_size": field("vocab_size"),
    }
    if ids["bos"] is not None:
        model_section["bos_token_id"] = ids["bos"]
    search = {
        "do_sample": False,  # greedy, like transformers' generate by default
        "early_stopping": True,
        "length_penalty": 1.0,
        "max_length": context,
        "min_length": 0,
        "no_repeat_ngram_size": 0,
        "num_beams": 1,
        "num_return_sequences": 1,
        "past_present_share_buffer": False,  # present = concat(past, new): a new buffer each step
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_k": 1,
        "top_p": 1.0,
    }
    return {"model": model_section, "search": search}


def write_genai_config(directory: pathlib.Path, config: dict[str, Any]) -> pathlib.Path:
    """Write ``config`` to ``directory/genai_config.json``; ExportError (step 'save') if it cannot."""
    path = directory / GENAI_CONFIG
    try:
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise ExportError(f"ONNX export, step 'save': could not write {str(path)!r}: {e}") from e
    return path
