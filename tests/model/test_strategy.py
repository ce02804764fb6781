"""kha_compile/strategy.py: weight-side (fold on the fly) and token-side linear KHA agree; cache; fast paths.

Each model of the zoo runs with its KHA weights moved off the identity, once with every KHA
module on ``kha_strategy = "weight"`` and once on ``"token"``; outputs and every gradient must
agree. A spy on ``swapped_params`` proves which path ran.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import kha_compile as kc
import kha_compile.model.carrier as kmod
import kha_compile.model.mha as kmha
import zoo
from helpers import META_BATCH, META_SEQ, main_output, meta_llama, perturb, training_step_flops
from kha_compile.core.errors import KHAConfigError

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")


def _kha_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if kmod.carries_kha(m)]


def _set_strategy(model: nn.Module, strategy: str) -> None:
    mods = _kha_modules(model)
    assert mods
    for m in mods:
        m.kha_strategy = strategy


@pytest.fixture
def swaps(monkeypatch):
    """Counts the weight-side calls: each folds the transforms into the weight (``kha_fold(detach=False)``)
    for one forward, or swaps the folded weight in (nn.MultiheadAttention)."""
    calls = []
    real_fold, real_swap = kmod.KHAProjection.kha_fold, kmha.swapped_params

    def fold_spy(self, roles, *, detach=True):
        if not detach:
            calls.append(type(self).__name__)
        return real_fold(self, roles, detach=detach)

    def swap_spy(module, params):
        calls.append(type(module).__name__)
        return real_swap(module, params)

    monkeypatch.setattr(kmod.KHAProjection, "kha_fold", fold_spy)
    monkeypatch.setattr(kmha, "swapped_params", swap_spy)
    return calls


def _run_and_grads(case: zoo.ZooCase, model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = main_output(model(*case.args, **case.kwargs))
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


# (zoo name, config): separate (llama), fused Conv1D [Q|K|V] (gpt2), fused Linear (phi, falcon, nanogpt),
# interleaved (gpt_neox), MLA (deepseek_v3), nn.MultiheadAttention (torch_encoder)
CASES = [
    ("llama", LINEAR),
    ("gpt2", LINEAR),
    ("phi", LINEAR),
    ("falcon", LINEAR),
    ("nanogpt", LINEAR),
    ("gpt_neox", LINEAR),
    ("deepseek_v3", LINEAR),
    ("torch_encoder", LINEAR),
    ("gpt2", kc.KHAConfig(q="linear", k="linear", v="mlp")),  # mixed on one fused Conv1D
    ("torch_encoder", kc.KHAConfig(q="linear", v="mlp")),
]


def _as_fp32(case: zoo.ZooCase) -> zoo.ZooCase:
    def f(x):
        return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    return dataclasses.replace(
        case, args=tuple(f(a) for a in case.args), kwargs={k: f(v) for k, v in case.kwargs.items()}
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,cfg", CASES, ids=[f"{n}-{c.v}" for n, c in CASES])
def test_weight_side_equals_token_side(name, cfg, dtype, swaps):
    """fp32: within 1e-5 of the largest value. bf16: as close to an fp32 run of the same weights as token-side is."""
    case = zoo.make(name, dtype=dtype)
    kc.apply(case.model, cfg, example_args=case.args, example_kwargs=case.kwargs)
    swaps.clear()  # apply's self-check ran the model once; count the runs below only
    perturb(case.model)
    weight, token = case.model, copy.deepcopy(case.model)
    _set_strategy(weight, "weight")
    _set_strategy(token, "token")
    out_w, grads_w = _run_and_grads(case, weight)
    assert len(swaps) == len(_kha_modules(weight))  # every KHA module ran weight-side once
    out_t, grads_t = _run_and_grads(case, token)
    assert len(swaps) == len(_kha_modules(weight))  # ... and token-side never swaps
    assert grads_w.keys() == grads_t.keys()
    assert any(".kha." in n for n in grads_w)  # T gets its gradient through the fold
    pairs = [("output", out_w, out_t), *((n, grads_w[n], grads_t[n]) for n in grads_w)]
    if dtype == torch.float32:
        for n, a, b in pairs:
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), n
        return
    ref_model = copy.deepcopy(token).float()
    out_r, grads_r = _run_and_grads(_as_fp32(case), ref_model)
    refs = {"output": out_r, **grads_r}
    eps = torch.finfo(torch.bfloat16).eps  # 2^-7
    for n, a, b in pairs:  # weight-side error at most twice token-side's, plus half an eps
        assert _rel(a, refs[n]) <= 2 * _rel(b, refs[n]) + eps / 2, n


def test_auto_picks_weight_side_above_in_features_only(swaps):
    lin = nn.Linear(16, 32)
    proj = kmod.attach(lin, (kmod.HeadSlot("v", 0, 2, 16, 16),), {"v": "linear"}, 32)
    proj._kha_handler = "linear"
    x_few, x_many = torch.randn(2, 8, 16), torch.randn(2, 9, 16)  # 16 tokens = in_features; 18 > 16
    proj(x_few)
    assert swaps == []
    proj(x_many)
    assert swaps == ["KHALinear"]
    with torch.no_grad():  # the same rule without gradients: nothing is cached between calls
        proj(x_few)
        assert len(swaps) == 1
        proj(x_many)
    assert len(swaps) == 2


def _linear_model(strategy: str = "weight") -> tuple[nn.Module, torch.Tensor]:
    case = zoo.make("llama")
    kc.apply(
        case.model,
        kc.KHAConfig(q="linear", k="linear", v="linear", strategy=strategy),
        example_args=case.args,
        example_kwargs=case.kwargs,
    )
    perturb(case.model)
    return case.model, case.kwargs["input_ids"]


def _token_reference(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    ref = copy.deepcopy(model)
    _set_strategy(ref, "token")
    with torch.no_grad():
        return ref(input_ids=ids).logits


def test_no_grad_forward_folds_for_every_call_so_a_fused_optimizer_step_is_seen(swaps, monkeypatch):
    model, ids = _linear_model()
    folds = []
    real = kmod.KHAProjection.kha_fold
    monkeypatch.setattr(
        kmod.KHAProjection, "kha_fold", lambda self, roles, **kw: folds.append(self) or real(self, roles, **kw)
    )
    n = len(_kha_modules(model))
    with torch.no_grad():
        first = model(input_ids=ids).logits
        assert len(folds) == n
        assert torch.equal(model(input_ids=ids).logits, first)
        assert len(folds) == 2 * n  # folded again: nothing is cached
    assert torch.allclose(first, _token_reference(model, ids), rtol=1e-5, atol=1e-5)

    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)  # steps without bumping _version
    model(input_ids=ids).logits.square().mean().backward()
    opt.step()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert not torch.allclose(after, first)
    assert torch.allclose(after, _token_reference(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("edit", ["weight", "bias_free_T"])
def test_no_grad_cache_invalidated_by_in_place_edits(edit):
    model, ids = _linear_model()
    proj = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        model(input_ids=ids)
        if edit == "weight":
            proj.weight.add_(0.25)
        else:
            proj.kha["q"].weight.copy_(torch.randn_like(proj.kha["q"].weight))
        out = model(input_ids=ids).logits
    assert torch.allclose(out, _token_reference(model, ids), rtol=1e-5, atol=1e-5)


def test_cache_follows_a_replaced_parameter():
    model, ids = _linear_model()
    proj = model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        model(input_ids=ids)
        proj.weight = nn.Parameter(proj.weight * 2)
        out = model(input_ids=ids).logits
    assert torch.allclose(out, _token_reference(model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
def test_identity_exact_under_no_grad_transformer_encoder(batch_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=batch_first)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(8, 2, 64) if not batch_first else torch.randn(2, 8, 64)
    with torch.no_grad():
        ref = enc(x)
    model = copy.deepcopy(enc)
    kc.apply(model, LINEAR, example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    # the encoder layer's fast path is still allowed: no hook on the attention
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("batch_first", [True, False])
def test_identity_exact_under_no_grad_multihead_attention(batch_first):
    torch.manual_seed(0)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(64, 4, batch_first=batch_first)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    model = Wrap().eval()
    x = torch.randn(8, 2, 64) if not batch_first else torch.randn(2, 8, 64)
    with torch.no_grad():
        ref = model(x)
    kc.apply(model, LINEAR, example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_trained_transformer_encoder_fast_path_uses_the_folded_weight():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 8, 64)
    kc.apply(model, LINEAR, example_args=(x,))
    perturb(model)
    ref = model(x).detach()  # grad on: the regular path, token-side transforms
    with torch.no_grad():
        fast = model(x)  # the fused fast path, with the folded in-projection
    assert torch.allclose(fast, ref, rtol=1e-4, atol=1e-5)
    kc.fold(model)  # the folded vanilla model agrees too
    with torch.no_grad():
        assert torch.allclose(model(x), fast, rtol=1e-5, atol=1e-6)


def test_the_fast_path_runs_on_the_folded_in_projection_and_reads_outside_give_the_parameter(monkeypatch):
    torch.manual_seed(0)
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1, enable_nested_tensor=False
    ).eval()
    x = torch.randn(2, 8, 64)
    kc.apply(model, LINEAR, example_args=(x,))
    perturb(model)
    attn = model.layers[0].self_attn
    weights = []
    real = torch._transformer_encoder_layer_fwd

    def spy(src, embed_dim, num_heads, in_proj_weight, *rest):
        weights.append(in_proj_weight)
        return real(src, embed_dim, num_heads, in_proj_weight, *rest)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", spy)
    with torch.no_grad():
        assert attn.in_proj_weight is attn._parameters["in_proj_weight"]
        fast = model(x)  # fast path, on the in-projection folded for this call
        assert attn.in_proj_weight is attn._parameters["in_proj_weight"]
        assert attn.in_proj_bias is attn._parameters["in_proj_bias"]
    assert len(weights) == 1 and weights[0] is not attn._parameters["in_proj_weight"]
    ref = copy.deepcopy(model)
    _set_strategy(ref, "token")
    with torch.no_grad():
        torch.testing.assert_close(fast, ref(x), rtol=1e-4, atol=1e-5)


def test_mlp_value_and_token_strategy_keep_the_fast_path_off():
    model = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1, enable_nested_tensor=False
    ).eval()
    x = torch.randn(2, 8, 64)
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"), example_args=(x,))
    attn = model.layers[0].self_attn
    assert attn._forward_hooks  # MLP-value cannot fold: the encoder layer must call the attention
    lin = copy.deepcopy(
        nn.TransformerEncoder(nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1, enable_nested_tensor=False)
    )
    kc.apply(lin, LINEAR, example_args=(x,))
    a2 = lin.layers[0].self_attn
    assert not a2._forward_hooks
    a2.kha_strategy = "token"
    assert a2._forward_hooks
    a2.kha_strategy = "auto"
    assert not a2._forward_hooks


def test_strategy_config_validated_and_versioned():
    with pytest.raises(KHAConfigError, match="'auto', 'weight', 'token'"):
        kc.KHAConfig(v="linear", strategy="fast")
    cfg = kc.KHAConfig(v="linear", strategy="token")
    assert cfg.to_dict()["version"] == 3 and kc.KHAConfig.from_dict(cfg.to_dict()) == cfg
    v2 = {"version": 2, "q": None, "k": None, "v": "linear", "strategy": "token"}  # before recorded plans
    assert kc.KHAConfig.from_dict(v2) == cfg
    with pytest.raises(KHAConfigError, match="version 4 is not supported"):
        kc.KHAConfig.from_dict({**v2, "version": 4})
    old = {"version": 1, "q": None, "k": None, "v": "linear"}  # a checkpoint written before strategies
    assert kc.KHAConfig.from_dict(old) == kc.KHAConfig(v="linear", strategy="auto")
    model, _ = _linear_model("token")
    assert {m.kha_strategy for m in _kha_modules(model)} == {"token"}
    with pytest.raises(KHAConfigError, match="kha_strategy"):
        mod = _kha_modules(model)[0]
        mod.kha_strategy = "sometimes"
        mod(torch.randn(1, 2, 64))


def test_save_load_keeps_strategy(tmp_path):
    model, ids = _linear_model("weight")
    kc.save_pretrained(model, tmp_path)
    fresh = zoo.make("llama")
    kc.load_pretrained(fresh.model, tmp_path, example_kwargs=fresh.kwargs)
    assert {m.kha_strategy for m in _kha_modules(fresh.model)} == {"weight"}
    with torch.no_grad():
        assert torch.allclose(fresh.model(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)


def test_llama_training_step_flops_at_8192_tokens_linear_auto():
    """Issue 9's shape on the meta device: linear KHA on q, k, v with strategy auto costs <= 1.005x."""
    B, L = META_BATCH, META_SEQ
    step = training_step_flops
    base_model, kha_model = meta_llama(), meta_llama()
    kc.apply(kha_model, LINEAR)
    token_model = copy.deepcopy(kha_model)
    _set_strategy(token_model, "token")
    base, auto, token = step(base_model), step(kha_model), step(token_model)
    # weight-side by hand: per projection a fold of d_out x d_in by dh (forward 2 dh d_out d_in FLOPs),
    # backward twice that (grad of W and of T); q: 1024 rows, k and v 512 each
    H, dh, n = 1024, 128, 2
    assert auto - base == n * 3 * 2 * dh * H * (1024 + 512 + 512)
    assert auto / base <= 1.005
    # token-side: 3 products of (T, d_out) x (dh, dh) per projection
    assert token - base == n * 3 * 2 * (B * L) * dh * (1024 + 512 + 512)
    assert token / base > 1.005
