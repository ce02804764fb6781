"""kha_compile.exporters.genai: the genai_config.json fields, from the model's config and cache layout.

That onnxruntime-genai reads the file and generates what transformers generates is tested on real
exports in tests/exporters/test_onnx_past.py; here each field is checked against the config the model
was built with, and the token-id fallbacks one by one.
"""

from __future__ import annotations

import json

import pytest

import zoo
from kha_compile.core.errors import ExportError
from kha_compile.exporters.genai import GENAI_CONFIG, genai_config, token_ids, write_genai_config
from kha_compile.exporters.kv_cache import cache_layout

pytest.importorskip("transformers")


def test_fields_come_from_the_config_and_the_layout():
    model = zoo.make("llama").model
    cfg = model.config
    config = genai_config(model, cache_layout(model), "model.onnx")
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert decoder["head_size"] == cfg.hidden_size // cfg.num_attention_heads
    assert (decoder["hidden_size"], decoder["num_attention_heads"]) == (cfg.hidden_size, cfg.num_attention_heads)
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"]) == (cfg.num_hidden_layers, 2)
    assert decoder["inputs"] == {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "position_ids": "position_ids",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    assert decoder["outputs"] == {
        "logits": "logits",
        "present_key_names": "present.%d.key",
        "present_value_names": "present.%d.value",
    }
    m = config["model"]
    assert (m["type"], m["vocab_size"], m["context_length"]) == ("decoder", cfg.vocab_size, cfg.max_position_embeddings)
    assert (m["bos_token_id"], m["eos_token_id"], m["pad_token_id"]) == (1, [2], 2)  # no pad: the eos
    assert config["search"]["do_sample"] is False and config["search"]["max_length"] == cfg.max_position_embeddings


def test_token_ids_prefer_the_generation_config():
    model = zoo.make("llama").model
    model.generation_config.eos_token_id = [7, 9]
    model.generation_config.pad_token_id = 3
    assert token_ids(model) == {"bos": 1, "eos": [7, 9], "pad": 3}
    model.generation_config.pad_token_id = None
    model.config.pad_token_id = 5
    assert token_ids(model)["pad"] == 5


def test_a_model_without_eos_is_refused_with_what_to_set():
    model = zoo.make("qwen3").model  # the tiny Qwen3 config names no special tokens
    assert token_ids(model) == {"bos": None, "eos": [], "pad": -1}
    with pytest.raises(ExportError, match=r"names no eos_token_id .*Set model\.generation_config\.eos_token_id"):
        genai_config(model, cache_layout(model), "model.onnx")
    model.generation_config.eos_token_id = 127
    assert "bos_token_id" not in genai_config(model, cache_layout(model), "model.onnx")["model"]


def test_written_file_is_the_config(tmp_path):
    model = zoo.make("gpt2").model
    config = genai_config(model, cache_layout(model), "m.onnx")
    path = write_genai_config(tmp_path, config)
    assert path == tmp_path / GENAI_CONFIG and json.loads(path.read_text()) == config
    assert config["model"]["context_length"] == model.config.n_positions  # GPT-2's name for it
