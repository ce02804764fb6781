"""kha_compile.store.hf.record_in_dir: kc.save_pretrained into a transformers directory records KHA in its config.json."""

from __future__ import annotations

import json
import logging

import pytest

import kha_compile as kc
from kha_compile.cli import tiny
from kha_compile.store.hf import quantization_entry, record_in_dir

pytest.importorskip("transformers")


def _base_dir(tmp_path, **config):
    model = tiny.make("tiny-llama")
    for key, value in config.items():
        setattr(model.config, key, value)
    model.save_pretrained(tmp_path / "d")  # the model's own files, before kc.apply
    return model, tmp_path / "d"


def test_save_pretrained_into_the_models_directory_records_kha_as_model_save_pretrained_would(tmp_path):
    model, d = _base_dir(tmp_path)
    kc.apply(model, kc.KHAConfig(v="mlp"))
    kc.save_pretrained(model, d)
    data = json.loads((d / "config.json").read_text())
    assert data["kha_compile"] == model.config.kha_compile
    assert data["quantization_config"] == quantization_entry(model.config.kha_compile)
    model.save_pretrained(tmp_path / "hf")  # what transformers itself writes for the KHA model
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf["kha_compile"], hf["quantization_config"]) == (data["kha_compile"], data["quantization_config"])


def test_a_directory_already_recording_the_same_kha_is_not_rewritten(tmp_path):
    model, d = _base_dir(tmp_path)
    kc.apply(model, kc.KHAConfig(v="mlp"))
    model.save_pretrained(d)
    before = (d / "config.json").read_text()
    assert record_in_dir(d, model.config.kha_compile)
    assert (d / "config.json").read_text() == before


def test_a_real_quantization_config_is_kept_inside_kha_compiles(tmp_path, caplog):
    """A directory quantized for real keeps that config whole, inside kha_compile's (``wraps``): loaders
    dispatch on kha_compile's method, which runs the real one inside it (docs/guides/quantized.md)."""
    real = {"quant_method": "bitsandbytes_4bit", "load_in_4bit": True}
    _, d = _base_dir(tmp_path, quantization_config=real)
    with caplog.at_level(logging.INFO, logger="kha_compile"):
        assert record_in_dir(d, {"version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto"})
    data = json.loads((d / "config.json").read_text())
    assert data["quantization_config"]["quant_method"] == "kha_compile" and data["kha_compile"]["v"] == "mlp"
    assert data["quantization_config"]["wraps"] == real
    assert "around its quantization method 'bitsandbytes_4bit'" in caplog.text
    assert record_in_dir(d, {"version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto"})
    again = json.loads((d / "config.json").read_text())["quantization_config"]
    assert again["wraps"] == real  # recorded twice: never nested


def test_no_transformers_config_no_change(tmp_path):
    assert not record_in_dir(tmp_path, {"v": "mlp"})
    (tmp_path / "config.json").write_text(json.dumps({"not": "a transformers config"}))
    assert not record_in_dir(tmp_path, {"v": "mlp"})
    assert json.loads((tmp_path / "config.json").read_text()) == {"not": "a transformers config"}
    model = tiny.make("tiny-llama")  # and kc.save_pretrained into an empty directory writes only its own files
    kc.apply(model, kc.KHAConfig(v="mlp"))
    kc.save_pretrained(model, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["kha_config.json", "kha_model.safetensors"]


def test_a_config_shared_with_another_model_records_kha_only_in_the_model_that_has_it(tmp_path):
    """kc.apply gives the model its own copy of a config object that another model was built from too:
    the other model's save_pretrained writes a vanilla config.json, which loads without KHA."""
    import transformers

    cfg = tiny.make("tiny-llama").config
    cfg = type(cfg)(**{k: v for k, v in cfg.to_dict().items() if k not in ("kha_compile", "quantization_config")})
    with_kha, plain = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    kc.apply(with_kha, kc.KHAConfig(v="mlp"))
    assert with_kha.config.kha_compile["v"] == "mlp" and with_kha.model.config is with_kha.config
    assert not hasattr(cfg, "kha_compile") and getattr(cfg, "quantization_config", None) is None
    plain.save_pretrained(tmp_path / "plain")
    data = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "kha_compile" not in data and "quantization_config" not in data
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert not any(".kha." in n for n, _ in loaded.named_parameters())
