"""Tools that load a KHA directory by path: pipeline, Trainer(resume_from_checkpoint=...), PEFT on a base
loaded by path, and tied input/output embeddings (kha_compile.integrations.hf_quantizer).

The reference is always the trained (perturbed) model kept in memory, or a run of the real Trainer
that never left memory; each check fails when from_pretrained loads the directory without its KHA.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, small_trainer
from kha_compile.core.errors import CheckpointError
from kha_dirs import MLP, logits, plain, save, tokenizer, trained

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

PROMPT = "the cat sat on the red mat and the dog ran under the big tree"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = trained("qwen3", MLP)
    return model, save(model, tmp_path_factory.mktemp("tools") / "qwen3")


def test_pipeline_text_generation_by_path(saved):
    model, d = saved
    pipe = transformers.pipeline("text-generation", model=str(d), device="cpu")
    assert set(kha_params(pipe.model)) == set(kha_params(model))
    ids = tokenizer()(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=3)[0].tolist()
    got = pipe(PROMPT, max_new_tokens=12, do_sample=False, return_tensors=True, pad_token_id=3)
    assert got[0]["generated_token_ids"] == want
    assert torch.equal(logits(pipe.model), logits(model))


def _trainer(model, out, max_steps: int):
    return small_trainer(model, out, max_steps, vocab=128, seq=40)


def test_trainer_resumes_from_a_checkpoint_loaded_by_path(tmp_path):
    full = trained("llama", MLP).train()
    _trainer(full, tmp_path / "full", 4).train()  # never leaves memory; writes checkpoint-2 on the way
    ckpt = tmp_path / "full" / "checkpoint-2"
    resumed = AutoModelForCausalLM.from_pretrained(ckpt)  # the Trainer's checkpoint, by path: KHA at step 2
    _trainer(resumed, tmp_path / "resumed", 4).train(resume_from_checkpoint=str(ckpt))
    want, got = kha_params(full), kha_params(resumed)
    assert set(got) == set(want)
    for n in want:  # KHA kept training from where the checkpoint stood
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(resumed.eval()), logits(full.eval()), atol=1e-5, rtol=0)
    last = AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "checkpoint-4")
    torch.testing.assert_close(logits(last), logits(full), atol=1e-5, rtol=0)


def test_peft_adapter_on_a_base_loaded_by_path(saved, tmp_path):
    model, d = saved
    tuned = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at zero: move it so the adapter matters
        for n, p in tuned.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    tuned.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d), tmp_path / "adapter")
    assert torch.equal(logits(reloaded.eval()), logits(tuned.eval()))


def test_tied_embeddings_save_reload_and_from_pretrained(tmp_path):
    model = trained("qwen3", MLP, tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    d = save(model, tmp_path / "tied")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and set(kha_params(model)) <= keys  # the tied duplicate is dropped
    loaded, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))
    kc.save_pretrained(model, tmp_path / "kha")
    for source in (tmp_path / "kha", d):  # kc's own files, and the model's directory
        again = kc.load_pretrained(plain("qwen3", tie_word_embeddings=True), source)
        assert torch.equal(logits(again), logits(model))
    # every weight gone (transformers' own test of missing tied weights does this): refused, naming the KHA tensors
    save_file({"tensor": torch.tensor([1, 2])}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=r"missing from the checkpoint: \['model\.layers\.0\.self_attn\.q_proj\.kha"
    ):
        AutoModelForCausalLM.from_pretrained(d)
