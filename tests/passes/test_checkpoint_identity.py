"""kc.load_pretrained checks the architecture and KHA sites a checkpoint records (kha_compile.store.identity).

A Qwen3 checkpoint and a Llama of the same sizes have KHA tensors of the same names and shapes: the
tensors alone would load without a word. The refusal names both architectures; strict=False warns
and loads; checkpoints saved before the record existed still load as before.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import kha_compile as kc
from helpers import kha_params
from kha_compile.core.errors import CheckpointError
from kha_dirs import MLP, logits, plain, trained

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A trained Qwen3 saved both ways: kc.save_pretrained ("kc") and model.save_pretrained ("hf")."""
    root = tmp_path_factory.mktemp("qwen3")
    model = trained("qwen3", MLP)
    kc.save_pretrained(model, root / "kc")
    model.save_pretrained(root / "hf")
    return model, root


@pytest.mark.parametrize("saver", ["kc", "hf"])
def test_a_checkpoint_of_another_architecture_is_refused_naming_both(qwen3, saver):
    model, root = qwen3
    llama = plain("llama")  # the same sizes: 4 query and 2 key/value heads of 16, 2 layers
    before = logits(llama)
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM \(model type 'qwen3'\).*LlamaForCausalLM"):
        kc.load_pretrained(llama, root / saver)
    assert not kha_params(llama) and torch.equal(logits(llama), before)  # left as it was
    with pytest.warns(UserWarning, match="loaded anyway: strict=False"):
        kc.load_pretrained(llama, root / saver, strict=False)
    want = {n: p for n, p in kha_params(model).items()}
    assert all(torch.equal(p, want[n]) for n, p in kha_params(llama).items()) and set(kha_params(llama)) == set(want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.load_pretrained(plain("qwen3"), root / saver)  # its own architecture: no word


def test_a_checkpoint_with_other_kha_sites_is_refused_naming_both(tmp_path):
    small = trained("llama", kc.KHAConfig(q="linear", v="linear"))  # 4 query heads of 16
    kc.save_pretrained(small, tmp_path)
    wide = plain("llama", hidden_size=128, num_attention_heads=8)  # 8 query heads of 16: same tensor shapes
    with pytest.raises(CheckpointError, match=r"sites are 2 x q:linear 4x16.*this model's are 2 x q:linear 8x16"):
        kc.load_pretrained(wide, tmp_path)
    assert not kha_params(wide)


def test_a_checkpoint_saved_before_the_record_still_loads(qwen3, tmp_path):
    model, root = qwen3
    meta = json.loads((root / "kc" / "kha_config.json").read_text())
    assert (meta["architecture"], meta["model_type"]) == ("Qwen3ForCausalLM", "qwen3")
    old = tmp_path / "old"
    old.mkdir()
    (old / "kha_model.safetensors").write_bytes((root / "kc" / "kha_model.safetensors").read_bytes())
    for key in ("architecture", "model_type", "sites"):
        del meta[key]
    (old / "kha_config.json").write_text(json.dumps(meta))
    assert torch.equal(logits(kc.load_pretrained(plain("qwen3"), old)), logits(model))
