"""transformers checkpoints of KHA models: save_pretrained -> from_pretrained (KHA loaded by kha_compile's
quantizer) -> kc.load_pretrained, Trainer resume. Loading by path with every option and tool: test_hf_quantizer.py."""

from __future__ import annotations

import json

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb, run_python_without_kha, small_trainer
from kha_compile.cli import tiny
from kha_compile.store.hf import quantization_entry

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM

CFG = kc.KHAConfig(q="linear", v="mlp")
IDS = torch.randint(0, tiny.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _trained(cfg: kc.KHAConfig = CFG):
    model = tiny.make("tiny-llama")
    kc.apply(model, cfg)
    perturb(model, scale=0.2)
    return model


def test_config_records_kha_and_fold_drops_it():
    model = tiny.make("tiny-llama")
    assert not hasattr(model.config, "kha_compile") and not hasattr(model.config, "quantization_config")
    kc.apply(model, kc.KHAConfig(q="linear", v="linear"))
    assert model.config.kha_compile == {
        "version": model.config.kha_compile["version"],
        "q": "linear",
        "k": None,
        "v": "linear",
        "strategy": "auto",
        "architecture": "LlamaForCausalLM",
        "model_type": "llama",
        "sites": {"q:linear 4x16": 2, "v:linear 2x16": 2},  # 4 query heads, 2 key/value heads, of 16
    }
    # the quantization method transformers dispatches on (kha_compile's quantizer; a warning without it)
    assert model.config.quantization_config == quantization_entry(model.config.kha_compile)
    assert model.config.quantization_config["quant_method"] == "kha_compile"
    assert model._forward_pre_hooks  # the hook that keeps KHA outside PEFT adapters (passes/handlers/adapter.py)
    kc.fold(model)
    assert not hasattr(model.config, "kha_compile") and not model._forward_pre_hooks
    assert not hasattr(model.config, "quantization_config")
    kc.apply(model, CFG)
    kc.remove(model)
    assert not hasattr(model.config, "kha_compile") and not hasattr(model.config, "quantization_config")


def test_a_real_quantization_config_is_kept_inside_kha_compiles_and_comes_back_after_fold():
    model = tiny.make("tiny-llama")
    real = {"quant_method": "bitsandbytes_4bit", "load_in_4bit": True}
    model.config.quantization_config = dict(real)
    kc.apply(model, kc.KHAConfig(v="linear"))
    quant = model.config.quantization_config  # loaders dispatch on kha_compile's, which runs the real one inside
    assert quant["quant_method"] == "kha_compile" and quant["v"] == "linear" and quant["wraps"] == real
    kc.fold(model)
    assert model.config.quantization_config == real


def test_plain_from_pretrained_warns_naming_kha_compile_and_still_loads(tmp_path):
    _trained().save_pretrained(tmp_path / "d")
    base = tiny.make("tiny-llama")  # the same weights without KHA: what a plain load must give
    torch.save({"ids": IDS, "logits": base(input_ids=IDS).logits.detach()}, tmp_path / "want.pt")
    script = f"""
import torch
model = transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / "d")!r}).eval()
want = torch.load({str(tmp_path / "want.pt")!r})
with torch.no_grad():
    assert torch.equal(model(input_ids=want["ids"]).logits, want["logits"])  # plain loading is unchanged
assert getattr(model, "hf_quantizer", None) is None
hint = [m for lvl, m in seen if lvl == "WARNING" and "Unknown quantization type, got kha_compile" in m]
print("HINT" if hint else "NO HINT: " + repr(seen))
"""
    out = run_python_without_kha(script, "HINT")
    assert "NO HINT" not in out


ROUND_TRIPS = {
    "qkv_linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "qk_linear_v_mlp": kc.KHAConfig(q="linear", k="linear", v="mlp"),
}


@pytest.mark.parametrize(
    "cfg_name,shard", [("qkv_linear", None), ("qk_linear_v_mlp", None), ("qk_linear_v_mlp", "20KB")]
)
def test_save_pretrained_from_pretrained_load_pretrained_is_exact(tmp_path, cfg_name, shard):
    cfg = ROUND_TRIPS[cfg_name]
    model = _trained(cfg)
    saved = {n: p.detach().clone() for n, p in kha_params(model).items()}
    assert {n.split(".kha.")[1].split(".")[0] for n in saved} == {"q", "k", "v"}
    want = model(input_ids=IDS).logits
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert json.loads((tmp_path / "config.json").read_text())["kha_compile"]["v"] == cfg.v
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    fresh, info = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", output_loading_info=True)
    assert not any(info.values()), info  # no unexpected .kha. keys, nothing missing: the quantizer applied KHA
    loaded = kha_params(fresh)
    assert set(loaded) == set(saved)
    for n, t in saved.items():  # each tensor of each role, not just the output
        assert torch.equal(loaded[n], t), f"{n} changed in the round trip"
    assert torch.equal(fresh.eval()(input_ids=IDS).logits, want)
    kc.load_pretrained(fresh, tmp_path)  # already carries that KHA: loads the same tensors again
    assert torch.equal(fresh(input_ids=IDS).logits, want)


def test_hf_dir_without_kha_entry_is_refused(tmp_path):
    tiny.make("tiny-llama").save_pretrained(tmp_path)
    model = tiny.make("tiny-llama")
    with pytest.raises(kc.KHAError, match="kha_compile"):
        kc.load_pretrained(model, tmp_path)
    assert not kha_params(model)


def _trainer(model, out, max_steps: int):
    return small_trainer(model, out, max_steps, vocab=tiny.VOCAB, seq=8)


def test_trainer_resume_matches_uninterrupted_run(tmp_path):
    def fresh():
        model = tiny.make("tiny-llama").train()
        kc.apply(model, CFG)
        return model

    full = fresh()
    _trainer(full, tmp_path / "full", 4).train()
    part = fresh()
    _trainer(part, tmp_path / "part", 2).train()  # stops at step 2 with checkpoint-2
    assert (tmp_path / "part" / "checkpoint-2" / "optimizer.pt").is_file()
    resumed = fresh()  # KHA applied first: the checkpoint's .kha. tensors load into it
    _trainer(resumed, tmp_path / "part", 4).train(resume_from_checkpoint=True)
    want, got = kha_params(full), kha_params(resumed)
    assert any((p - torch.eye(p.shape[0])).abs().max() > 1e-4 for n, p in want.items() if n.endswith("up"))
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=0)
    torch.testing.assert_close(
        resumed.eval()(input_ids=IDS).logits, full.eval()(input_ids=IDS).logits, atol=1e-5, rtol=0
    )
    # the Trainer's own checkpoint restores into a fresh model with kc.load_pretrained
    restored = kc.load_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "checkpoint-4"), tmp_path / "part" / "checkpoint-4"
    )
    assert torch.equal(restored.eval()(input_ids=IDS).logits, resumed(input_ids=IDS).logits)
