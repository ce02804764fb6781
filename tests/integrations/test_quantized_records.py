"""How a directory records KHA on a quantized base: kha_compile's ``quantization_config`` with the real
method's config kept whole under ``"wraps"`` (what transformers and vLLM dispatch on), in config.json
and in memory. The reference is the real config as the quantization tool wrote it."""

from __future__ import annotations

import json

import pytest

import kha_compile as kc
from helpers import perturb
from kha_compile.serving.vllm import read_served
from kha_compile.store.hf import CONFIG_KEY, WRAPS_KEY
from kha_compile.store.wrapped import unwrap_config, wrap_config, wrapped_entry

transformers = pytest.importorskip("transformers")

COMPRESSED = {  # the shape of what compressed-tensors' ModelCompressor.update_config writes
    "quant_method": "compressed-tensors",
    "format": "int-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "channel"}}},
    "ignore": ["lm_head"],
}


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def test_kc_save_pretrained_into_a_quantized_directory_wraps_its_method(tmp_path):
    base = _llama()
    base.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(data, quantization_config=COMPRESSED)))
    model = kc.apply(base, kc.KHAConfig(v="mlp"))
    perturb(model)
    for _ in range(2):  # saved twice: the real config is kept once, never nested
        kc.save_pretrained(model, tmp_path)
        quant = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
        assert quant["quant_method"] == "kha_compile" and quant["v"] == "mlp"
        assert quant[WRAPS_KEY] == COMPRESSED
    served = read_served(tmp_path)  # what the vLLM plugin reads: the KHA, the wrapped config left to vLLM
    assert served.config == kc.KHAConfig(v="mlp") and len(served.attentions) == 1
    entry = json.loads((tmp_path / "config.json").read_text())[CONFIG_KEY]
    assert WRAPS_KEY not in entry


def test_a_real_config_object_stays_its_class_and_writes_both():
    model = _llama()
    real = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model.config.quantization_config = real
    kc.apply(model, kc.KHAConfig(v="mlp"))
    held = model.config.quantization_config
    assert isinstance(held, transformers.BitsAndBytesConfig) and held.load_in_4bit  # what PEFT and the Trainer read
    written = model.config.to_dict()["quantization_config"]
    assert written["quant_method"] == "kha_compile" and written["v"] == "mlp"
    assert written[WRAPS_KEY] == real.to_dict() and "_kha_entry" not in written[WRAPS_KEY]
    kc.fold(model, strict=False)  # MLP-value does not fold: the KHA stays, and so does the record
    assert wrapped_entry(model.config.quantization_config) is not None
    kc.remove(model)
    back = model.config.quantization_config
    assert type(back) is transformers.BitsAndBytesConfig and back.to_dict() == real.to_dict()


def test_wrapping_twice_updates_the_entry_and_unwrap_gives_the_real_class():
    real = transformers.BitsAndBytesConfig(load_in_8bit=True)
    once = wrap_config(real, {"version": 3, "v": "mlp"})
    twice = wrap_config(once, {"version": 3, "v": "linear"})
    assert type(twice) is type(once) and twice.to_dict()["v"] == "linear"
    assert type(unwrap_config(twice)) is transformers.BitsAndBytesConfig
    assert unwrap_config(real) is real and wrapped_entry(real) is None
