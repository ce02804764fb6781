"""save_pretrained / read_checkpoint / load_pretrained: round trips of every role and kind, tensor by
tensor; every way a checkpoint can misfit changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

import kha_compile as kc
import zoo
from helpers import kha_params, perturb
from kha_compile.core.errors import CheckpointError, NoKHATransformsError
from kha_compile.store.format import checkpoint_misfit, read_checkpoint


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()]


def _unchanged(model, snap, ids, ref):
    state, classes = snap
    assert [type(m) for m in model.modules()] == classes
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


ROUND_TRIPS = {
    "qkv_linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "qk_linear_v_mlp": kc.KHAConfig(q="linear", k="linear", v="mlp"),
}


@pytest.mark.parametrize("name", ["llama", "gpt2"])  # separate projections; one fused [Q|K|V] Conv1D
@pytest.mark.parametrize("cfg_name", sorted(ROUND_TRIPS))
def test_round_trip_keeps_every_tensor_of_every_role_and_kind(tmp_path, name, cfg_name):
    cfg = ROUND_TRIPS[cfg_name]
    case = zoo.make(name)
    kc.apply(case.model, cfg)
    perturb(case.model)
    saved = {n: p.detach().clone() for n, p in kha_params(case.model).items()}
    roles = {n.split(".kha.")[1].split(".")[0] for n in saved}
    assert roles == {"q", "k", "v"}  # every role is in the checkpoint, each moved off identity by perturb
    kc.save_pretrained(case.model, tmp_path)
    fresh = zoo.make(name)
    kc.load_pretrained(fresh.model, tmp_path)
    loaded = kha_params(fresh.model)
    assert set(loaded) == set(saved)
    for n, t in saved.items():  # each tensor, not just the output
        assert torch.equal(loaded[n], t), f"{n} changed in the round trip"
    with torch.no_grad():
        want = case.model(*case.args, **case.kwargs).logits
        assert torch.equal(fresh.model(*fresh.args, **fresh.kwargs).logits, want)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = _llama(2)
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"))
    perturb(model)
    path = tmp_path_factory.mktemp("ckpt") / "kha"
    kc.save_pretrained(model, path)
    return path


@pytest.mark.parametrize("layers,what", [(3, "missing from the checkpoint"), (1, "not in this model")])
def test_load_into_a_deeper_or_shallower_model_names_the_misfit_and_changes_nothing(ckpt, layers, what):
    model = _llama(layers)
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids).logits
    snap = _snapshot(model)
    with pytest.raises(CheckpointError, match=f"does not fit LlamaForCausalLM: {what}.*left unchanged"):
        kc.load_pretrained(model, ckpt)
    _unchanged(model, snap, ids, ref)


def test_a_config_listing_other_tensors_than_the_file_is_refused(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "kha_model.safetensors").write_bytes((ckpt / "kha_model.safetensors").read_bytes())
    meta = json.loads((ckpt / "kha_config.json").read_text())
    meta["tensors"].popitem()
    (bad / "kha_config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not hold the tensors"):
        read_checkpoint(bad)


def test_a_config_of_another_version_is_refused(ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "kha_model.safetensors").write_bytes((ckpt / "kha_model.safetensors").read_bytes())
    meta = json.loads((ckpt / "kha_config.json").read_text())
    meta["version"] = 99
    (bad / "kha_config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="version 99 is not supported"):
        read_checkpoint(bad)


def test_misfit_lists_missing_unexpected_and_wrong_shapes():
    text = checkpoint_misfit({"a": (2, 2), "b": (2, 2)}, {"b": (3, 3), "c": (2, 2)})
    assert text == (
        "missing from the checkpoint: ['a']; not in this model: ['c']; shape mismatch: b (3, 3) vs model (2, 2)"
    )
    assert checkpoint_misfit({"a": (2, 2)}, {"a": (2, 2)}) == ""


def test_save_without_kha_says_to_apply_first(tmp_path):
    with pytest.raises(NoKHATransformsError, match=r"call kc.apply"):
        kc.save_pretrained(_llama(1), tmp_path / "x")


class _Wrapper(torch.nn.Module):
    """A model around a transformers model (as a SentenceTransformer is): its KHA names carry the prefix ``lm.``."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids).logits


def test_names_under_a_wrapper_prefix_load_both_ways(tmp_path):
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    trained = kc.apply(_llama(2), kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(trained)
    with torch.no_grad():
        want = trained(ids).logits
    kc.save_pretrained(trained, tmp_path / "bare")  # model.layers.0...
    wrapped = kc.load_pretrained(_Wrapper(_llama(2)), tmp_path / "bare", example_args=(ids,))
    with torch.no_grad():
        assert torch.equal(wrapped(ids), want)
    kc.save_pretrained(wrapped, tmp_path / "wrapped")  # lm.model.layers.0...
    assert all(
        k.startswith("lm.") for k in json.loads((tmp_path / "wrapped" / "kha_config.json").read_text())["tensors"]
    )
    bare = kc.load_pretrained(_llama(2), tmp_path / "wrapped")
    with torch.no_grad():
        assert torch.equal(bare(ids).logits, want)


def test_align_names_maps_only_a_whole_prefix():
    from kha_compile.store.names import align_names

    model = {"0.model.a.kha.q.weight", "0.model.b.kha.v.up"}
    assert align_names(model, {"a.kha.q.weight", "b.kha.v.up"}) == {
        "a.kha.q.weight": "0.model.a.kha.q.weight",
        "b.kha.v.up": "0.model.b.kha.v.up",
    }
    assert align_names({"a.kha.q.weight"}, {"x.a.kha.q.weight"}) == {"x.a.kha.q.weight": "a.kha.q.weight"}
    assert align_names(model, {"a.kha.q.weight", "c.kha.v.up"}) is None  # not one prefix for all
    assert align_names(model, {"a.kha.q.weight"}) is None  # a missing tensor is a misfit, not a rename
    assert align_names(model, {"odel.a.kha.q.weight", "odel.b.kha.v.up"}) is None  # prefixes end at a dot
