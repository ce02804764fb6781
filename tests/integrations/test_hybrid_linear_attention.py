"""KHA on the linear-attention layers of transformers' hybrid LLMs, against a per-head reference.

Qwen3-Next (3 gated-delta-rule layers and 1 full-attention layer, two value heads per key head):
every layer a site; both configs against :class:`reference.Reference` (hooks on an untouched copy's
own projections, the interleaved ``in_proj_qkvz`` cut by hand in tests/hybrid_layouts.py) in
forwards, gradients and fused-AdamW steps; fold, save/load, and greedy ``generate`` with the cache
(the recurrent kernel, one token at a time) equal to ``generate`` without it (the chunked kernel over
the whole sequence); the vLLM plugin refuses the saved directory with its reason. Every other hybrid
type with q, k, v heads in its linear-attention layers, built from its tiny sweep config with only
linear-attention layers: no ``NoAttentionFoundError``, every layer a site, linear q, k and MLP-value v
against the reference, training and cached generation.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from hybrid_layouts import hybrid_layout
from kha_compile.core.errors import ServingError
from kha_compile.serving.vllm import check_servable, read_served
from reference import Reference, check_against_reference

transformers = pytest.importorskip("transformers")

QKV, MLP_V, MIX = dict(q="linear", k="linear", v="linear"), dict(v="mlp"), dict(q="linear", k="linear", v="mlp")
VOCAB = 96


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def _qwen3_next() -> torch.nn.Module:
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
        mlp_only_layers=[0, 1, 2, 3], max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3NextForCausalLM(cfg).eval()


def _greedy(model: torch.nn.Module, ids: torch.Tensor, cache: bool) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=cache, pad_token_id=0)


def _sites_and_reference(model: torch.nn.Module, cfg: dict, linear_layers: int, steps: int, tokens: int) -> Reference:
    """Apply ``cfg``; every layer a site (the linear ones gated delta rule & co); perturbed, the reference."""
    untouched = copy.deepcopy(model)
    ids = _ids(tokens)
    with torch.no_grad():
        before = model(ids).logits
    kc.apply(model, kc.KHAConfig(**cfg))
    report = kc.inspect(model)
    layers = model.config.num_hidden_layers
    assert len(report.matched) == layers and not report.skipped, str(report)
    linear = [s for s in report.sites if "attention without softmax" in s.note]
    assert len(linear) == linear_layers, str(report)
    mla = {**cfg, "v": "linear"} if "v" in cfg else cfg  # MLA takes linear where MLP-value is asked (the spec)
    assert all(s.transforms == (mla if s.kind == "mla" else cfg) for s in report.sites), str(report)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # identity at init
    perturb(model)
    ref = Reference(untouched, hybrid_layout)
    # the chunked delta rule sums many small terms: a gradient of 1e-4 (A_log) matches to 1e-3 of itself
    expect = None if any(s.kind == "mla" for s in report.sites) else cfg  # MLA sites carry linear v (checked above)
    check_against_reference(model, ref, [((), {"input_ids": ids})], expect, steps=steps, grad_rtol=1e-3)  # type: ignore[arg-type]
    return ref


@pytest.mark.parametrize("cfg", [QKV, MLP_V], ids=["linear_qkv", "mlp_v"])
def test_qwen3_next_every_layer_a_site_and_kha_matches_the_reference(cfg, tmp_path):
    model = _qwen3_next()
    _sites_and_reference(model, cfg, linear_layers=3, steps=2, tokens=40)  # more tokens than the 32 inputs
    sites = kc.inspect(model).sites
    assert [s.anchor for s in sites] == ["gated_delta_rule"] * 3 + ["sdpa"]
    assert all(s.q_proj == s.k_proj == s.v_proj == f"{s.name}.in_proj_qkvz" for s in sites[:3])
    assert (sites[0].num_heads, sites[0].num_kv_heads, sites[0].head_dim, sites[0].v_head_dim) == (2, 2, 16, 8)

    prompt = _ids(7, 2)
    assert torch.equal(_greedy(model, prompt, cache=True), _greedy(model, prompt, cache=False))
    with torch.no_grad():
        trained = model(prompt).logits

    model.save_pretrained(tmp_path / "hf")  # KHA recorded in config.json: vLLM's plugin reads it and refuses
    with pytest.raises(ServingError, match=r"'Qwen3NextForCausalLM'.*3 of its 4 layers are linear_attention"):
        check_servable(read_served(tmp_path / "hf"))
    kc.save_pretrained(model, tmp_path / "kha")
    fresh = _qwen3_next()
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(fresh, tmp_path / "kha")
    with torch.no_grad():
        assert torch.equal(fresh(prompt).logits, trained)

    if cfg is QKV:  # folds into in_proj_qkvz (interleaved rows) and the full attention's projections
        kc.fold(model)
        assert not kha_params(model) and type(model.model.layers[0].linear_attn.in_proj_qkvz) is torch.nn.Linear
        with torch.no_grad():
            torch.testing.assert_close(model(prompt).logits, trained, rtol=1e-4, atol=1e-4)


# every other hybrid type of transformers 5.24 whose linear-attention layers have q, k, v heads
HYBRIDS = ["qwen3_5", "qwen3_5_moe", "lara_mini", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "minimax"]


def _tiny(model_type: str) -> torch.nn.Module:
    """The type's tiny sweep model (linear-attention and full-attention layers), vocabulary cut for speed."""
    from sweep_configs import build

    model, _ = build(model_type)
    if model_type == "minimax":
        for layer in model.model.layers:  # the lightning attention's chunked form: several blocks of 8 tokens
            if hasattr(layer.self_attn, "block_size"):
                layer.self_attn.block_size = 8
    return model


@pytest.mark.parametrize("model_type", HYBRIDS, ids=[f"{t}-mlp_v" for t in HYBRIDS])  # q, k linear too
def test_hybrid_linear_attention_layers_are_sites_and_match_the_reference(model_type):
    model = _tiny(model_type)
    types = model.config.layer_types
    _sites_and_reference(model, MIX, linear_layers=types.count("linear_attention"), steps=1, tokens=20)
    prompt = _ids(5, 3)
    assert torch.equal(_greedy(model, prompt, cache=True), _greedy(model, prompt, cache=False))
