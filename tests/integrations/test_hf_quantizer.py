"""kha_compile.integrations.hf_quantizer: transformers' from_pretrained of a KHA directory loads its KHA.

Every directory is written by ``model.save_pretrained`` of a trained (perturbed) KHA model kept in
memory, of both kinds (linear q, k, v on a tiny Llama; linear q and MLP-value v on a tiny Qwen3); the
reference is that in-memory model (and once the per-head reference of tests/reference.py over an
untouched copy), never a reload through the code under test.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, run_python
from kha_compile.core.errors import CheckpointError
from kha_compile.passes import apply as apply_module
from kha_compile.store.hf import LEGACY_HINTS
from kha_dirs import IDS, LINEAR, MLP, in_dtype, logits, plain, save, trained
from reference import Reference

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

KINDS = {"linear": ("llama", LINEAR), "mlp": ("qwen3", MLP)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """kind -> (trained model in memory, its save_pretrained directory)."""
    root = tmp_path_factory.mktemp("by_path")
    out = {}
    for kind, (name, cfg) in KINDS.items():
        model = trained(name, cfg)
        out[kind] = (model, save(model, root / kind))
    return out


@pytest.fixture
def traces(monkeypatch):
    """How many times kc.apply's analysis (trace and match) runs."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(type(args[0]).__name__)
        return real(*args, **kwargs)

    real = apply_module._analysed  # apply's and inspect's analysis (analyse calls it too)
    monkeypatch.setattr(apply_module, "_analysed", counted)
    return calls


def _not_quantized(model) -> None:
    """The quantizer took itself off: transformers sees a plain model, as after kc.apply."""
    assert getattr(model, "hf_quantizer", None) is None and model.is_quantized is False
    assert not getattr(model.config, "_is_quantized", False)
    assert model.config.quantization_config["quant_method"] == "kha_compile"  # recorded as kc.apply records it


@pytest.mark.parametrize("loader", ["AutoModelForCausalLM", "concrete", "AutoModel"])
@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_loads_the_trained_kha_once(saved, kind, loader, traces):
    model, d = saved[kind]
    cls = type(model) if loader == "concrete" else getattr(transformers, loader)
    loaded, info = cls.from_pretrained(d, output_loading_info=True)
    want_unexpected = ["lm_head.weight"] if loader == "AutoModel" else []  # the head the base model lacks
    assert (
        sorted(info["unexpected_keys"]) == want_unexpected and not info["missing_keys"] and not info["mismatched_keys"]
    )
    assert traces == [type(loaded).__name__]  # analysed once, before the weights loaded
    prefix = "" if loader != "AutoModel" else "model."
    assert {prefix + n: p.dtype for n, p in kha_params(loaded).items()} == {
        n: p.dtype for n, p in kha_params(model).items()
    }
    _not_quantized(loaded)
    if loader == "AutoModel":
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=IDS).last_hidden_state, model.model(input_ids=IDS).last_hidden_state)
        return
    assert torch.equal(logits(loaded), logits(model))
    kc.load_pretrained(loaded, d)  # already carries that KHA: no second trace, the same model
    assert traces == [type(loaded).__name__] and torch.equal(logits(loaded), logits(model))


def test_the_loaded_model_is_the_per_head_reference(saved):
    model, d = saved["mlp"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    ref = Reference(plain("qwen3")).load(loaded.state_dict(), expect={"q": "linear", "v": "mlp"})
    with torch.no_grad():
        torch.testing.assert_close(ref(input_ids=IDS).logits, logits(model), atol=2e-5, rtol=1e-5)


OPTIONS = {
    "bf16": {"dtype": torch.bfloat16},
    "torch_dtype-bf16": {"torch_dtype": torch.bfloat16},
    "device_map-cpu": {"device_map": "cpu"},
    "low_cpu_mem_usage": {"low_cpu_mem_usage": True},
}


@pytest.mark.parametrize("option", OPTIONS)
def test_from_pretrained_options(saved, option):
    model, d = saved["mlp"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d, **OPTIONS[option])
    dtype = OPTIONS[option].get("dtype", OPTIONS[option].get("torch_dtype", torch.float32))
    assert {p.dtype for p in kha_params(loaded).values()} == {dtype}
    reference = in_dtype(model, dtype)  # what the trained model computes in that dtype
    assert torch.equal(logits(loaded), logits(reference))


def test_dtype_auto_keeps_the_checkpoints_dtype(saved, tmp_path):
    model, _ = saved["linear"]
    half = in_dtype(model, torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(save(half, tmp_path / "bf16"), dtype="auto")
    assert {p.dtype for p in kha_params(loaded).values()} == {torch.bfloat16}
    assert torch.equal(logits(loaded), logits(half))


def test_sharded_loads_and_an_incomplete_one_is_refused_with_the_names(saved, tmp_path):
    model, _ = saved["mlp"]
    d = save(model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(d)), logits(model))
    dropped = "model.layers.1.self_attn.v_proj.kha.v.gate"  # taken out of its shard and of the index
    shard = d / index["weight_map"].pop(dropped)
    save_file({k: v for k, v in load_file(str(shard)).items() if k != dropped}, str(shard), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"missing from the checkpoint: \['{dropped}'\]"):
        transformers.AutoModelForCausalLM.from_pretrained(d)


def test_a_checkpoint_of_an_earlier_version_loads_by_both_routes(saved, tmp_path):
    model, d = saved["linear"]
    old = tmp_path / "old"
    shutil.copytree(d, old)
    data = json.loads((old / "config.json").read_text())  # as the long-sentence version wrote it
    data["kha_compile"] = {k: data["kha_compile"][k] for k in ("version", "q", "k", "v", "strategy")}
    data["quantization_config"] = {"quant_method": LEGACY_HINTS[1]}
    (old / "config.json").write_text(json.dumps(data))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(old)
    assert torch.equal(logits(loaded), logits(model))
    _not_quantized(loaded)
    assert torch.equal(logits(kc.load_pretrained(plain("llama"), old)), logits(model))
    loaded.save_pretrained(tmp_path / "again")  # saved again: the short name, with the config beside it
    quant = json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"]
    assert (quant["quant_method"], quant["architecture"], quant["v"]) == ("kha_compile", "LlamaForCausalLM", "linear")


def test_save_pretrained_after_loading_and_after_fold(saved, tmp_path):
    model, d = saved["linear"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(d)
    loaded.save_pretrained(tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert torch.equal(logits(again), logits(model))
    kc.fold(again)  # every transform linear: a vanilla model, whose config no longer names the quantizer
    assert not hasattr(again.config, "quantization_config") and not hasattr(again.config, "kha_compile")
    again.save_pretrained(tmp_path / "folded")
    data = json.loads((tmp_path / "folded" / "config.json").read_text())
    assert "quantization_config" not in data and "kha_compile" not in data
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "folded")
    assert not kha_params(vanilla) and torch.equal(logits(vanilla), logits(again))
    torch.testing.assert_close(logits(vanilla), logits(model), atol=1e-4, rtol=1e-4)  # folding rounds


def test_installed_after_transformers_registers_at_once(saved, monkeypatch):
    """``import kha_compile`` after transformers' quantizer registry: registered at once (the other order,
    the hook, is the next test)."""
    from transformers.quantizers import auto

    from kha_compile.integrations import hf_quantizer

    for name in ("AUTO_QUANTIZER_MAPPING", "AUTO_QUANTIZATION_CONFIG_MAPPING"):  # as before kha_compile's import
        monkeypatch.setattr(auto, name, {k: v for k, v in getattr(auto, name).items() if "kha_compile" not in k})
    hf_quantizer.install()
    model, d = saved["linear"]
    assert torch.equal(logits(transformers.AutoModelForCausalLM.from_pretrained(d)), logits(model))


def test_import_kha_compile_imports_no_transformers_and_registers_once_it_is_imported(saved):
    model, d = saved["mlp"]
    script = f"""
import sys, torch
import kha_compile
assert "transformers" not in sys.modules, "import kha_compile imported transformers"
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(d)!r})
ids = torch.load({str(d / "ids.pt")!r})
with torch.no_grad():
    assert torch.equal(model(input_ids=ids["ids"]).logits, ids["logits"])
print("LOADED")
"""
    torch.save({"ids": IDS, "logits": logits(model)}, d / "ids.pt")
    run_python(script, "LOADED")


def test_from_pretrained_into_another_architecture_is_refused_naming_both(saved):
    _, d = saved["mlp"]  # a Qwen3's, loaded as a Llama of the same sizes
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM \(model type 'qwen3'\).*LlamaForCausalLM"):
        transformers.LlamaForCausalLM.from_pretrained(d)
