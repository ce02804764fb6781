"""Rule flex_attention: hand-written flex models (score_mod, block_mask argument, GQA), transformers
models with attn_implementation="flex_attention", and random score mods against a per-head reference.

CPU note: flex_attention has no backward on CPU ("FlexAttention does not support backward on CPU"),
so on this platform the models run forward only, under no_grad; training a flex model needs a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

import kha_compile as kc
from form_checks import check_form
from helpers import kha_params, perturb
from kha_compile.core.errors import ExportError
from machine import require_deterministic

D, T = 32, 8


def alibi_like(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.05 * (q_idx - kv_idx).abs()


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class FlexBlock(nn.Module):
    """One pre-norm block whose attention calls flex_attention, with an optional BlockMask argument."""

    def __init__(self, d=D, n_head=4, n_kv=2, score_mod=alibi_like):
        super().__init__()
        self.h, self.kv, self.hd, self.score_mod = n_head, n_kv, d // n_head, score_mod
        self.norm = nn.LayerNorm(d)
        self.q_proj = nn.Linear(d, n_head * self.hd)
        self.k_proj = nn.Linear(d, n_kv * self.hd)
        self.v_proj = nn.Linear(d, n_kv * self.hd)
        self.o_proj = nn.Linear(n_head * self.hd, d)

    def forward(self, x, block_mask=None):
        B, L, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(B, L, self.h, self.hd).transpose(1, 2)  # (B, H, L, Dh)
        k = self.k_proj(h).view(B, L, self.kv, self.hd).transpose(1, 2)  # (B, Hkv, L, Dh)
        v = self.v_proj(h).view(B, L, self.kv, self.hd).transpose(1, 2)
        o = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask, enable_gqa=self.kv != self.h)
        return x + self.o_proj(o.transpose(1, 2).reshape(B, L, -1))  # (B, L, D)


class TwoFlexBlocks(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.blocks = nn.ModuleList([FlexBlock(**kw), FlexBlock(**kw)])

    def forward(self, x, block_mask=None):
        for block in self.blocks:
            x = block(x, block_mask)
        return x


def _mask() -> BlockMask:
    return create_block_mask(causal, None, None, T, T, device="cpu")


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_flex_with_score_mod_and_gqa(v):
    x = torch.randn(2, T, D)
    check_form(TwoFlexBlocks, (x,), v, anchor="flex_attention", grad=False)


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_flex_with_a_block_mask_argument_is_bound_as_a_constant(v):
    x = torch.randn(2, T, D)
    check_form(lambda: TwoFlexBlocks(n_kv=4), (x, _mask()), v, anchor="flex_attention", grad=False)


def test_flex_kinds_and_head_counts():
    model = TwoFlexBlocks(n_head=4, n_kv=1)
    report = kc.inspect(model, example_args=(torch.randn(1, T, D),))
    assert [(s.kind, s.num_heads, s.num_kv_heads, s.head_dim) for s in report.matched] == [("mqa", 4, 1, 8)] * 2


def test_flex_backward_on_cpu_is_refused_by_torch_but_apply_still_traces():
    model = TwoFlexBlocks()
    x = torch.randn(1, T, D)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(x)  # grad on: torch refuses, so KHA's trace must not need grad
    kc.apply(model, example_args=(x,))
    assert len(kc.inspect(model, example_args=(x,)).matched) == 2


def test_flex_onnx_export_fails_with_the_step_named(tmp_path):
    model = TwoFlexBlocks()
    x = torch.randn(1, T, D)
    kc.apply(model, example_args=(x,))
    with pytest.raises(ExportError, match="export"):
        kc.export_onnx(model, tmp_path / "flex.onnx", example_args=(x,))


# -- transformers ---------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _hf(kind: str) -> nn.Module:
    """A tiny transformers model with attn_implementation="flex_attention"; skips the test where that
    path itself (transformers compiles flex_attention) is not deterministic on this machine."""
    require_deterministic(
        ("transformers-flex", kind), lambda: _plain_forward(kind), f"a transformers {kind} with flex_attention"
    )
    return _build_hf(kind)


def _plain_forward(kind: str):
    model = _build_hf(kind)
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    return lambda: model(input_ids=ids)[0]


def _build_hf(kind: str) -> nn.Module:
    torch.manual_seed(0)
    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 64,
    }
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=2, **common)
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="flex_attention").eval()
    cfg = transformers.BertConfig(**common)
    return transformers.BertModel._from_config(cfg, attn_implementation="flex_attention").eval()


@pytest.mark.parametrize("kind,anchor_kind", [("llama", "gqa"), ("bert", "mha")])
def test_transformers_flex_linear_apply_identity_forward_and_fold(kind, anchor_kind):
    model = _hf(kind)
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids)[0]
    kc.apply(model, kc.KHAConfig(v="linear"))  # inputs built from the config, trace under no_grad
    report = kc.inspect(model)
    assert len(report.matched) == 2 and not report.skipped, str(report)
    assert {s.anchor for s in report.matched} == {"flex_attention"}
    assert {s.kind for s in report.matched} == {anchor_kind}
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids)[0], ref)
    perturb(model)
    with torch.no_grad():
        moved = model(input_ids=ids)[0]
    assert (moved - ref).abs().max() > 1e-3
    # Training one step needs flex_attention's backward, which torch has only on GPU:
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        model(input_ids=ids)[0].sum()
    kc.fold(model)
    assert not kha_params(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids)[0], moved, rtol=1e-4, atol=1e-4)


def test_transformers_flex_mlp_value_is_identity_at_init():
    model = _hf("llama")
    ids = torch.randint(0, 128, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    kc.apply(model, kc.KHAConfig(v="mlp"))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


# -- random score mods against an independent per-head reference ----------------------------
MODS = {
    "none": (None, lambda s, b, h, q, k: s),
    "bias": (lambda s, b, h, q, k: s + 0.1 * (q - k), lambda s, b, h, q, k: s + 0.1 * (q - k)),
    "head_slope": (
        lambda s, b, h, q, k: s - (h + 1) * 0.1 * (q - k).abs(),
        lambda s, b, h, q, k: s - (h + 1) * 0.1 * (q - k).abs(),
    ),
    "softcap": (lambda s, b, h, q, k: 2.0 * torch.tanh(s / 2.0), lambda s, b, h, q, k: 2.0 * torch.tanh(s / 2.0)),
    "causal": (
        lambda s, b, h, q, k: torch.where(q >= k, s, -float("inf")),
        lambda s, b, h, q, k: torch.where(q >= k, s, torch.full_like(s, -float("inf"))),
    ),
}


def _reference(model: FlexBlock, x: torch.Tensor, mod) -> torch.Tensor:
    """Per head, by hand: KHA transforms applied to each head's q, k, v, then softmax attention."""
    B, L, _ = x.shape
    h = model.norm(x)
    q = model.q_proj(h).view(B, L, model.h, model.hd)  # (B, L, H, Dh), KHA included by the module
    k = model.k_proj(h).view(B, L, model.kv, model.hd)
    v = model.v_proj(h).view(B, L, model.kv, model.hd)
    outs = []
    idx = torch.arange(L)
    for head in range(model.h):
        g = head // (model.h // model.kv)
        s = torch.einsum("bld,bmd->blm", q[:, :, head], k[:, :, g]) / math.sqrt(model.hd)  # (B, L, L)
        s = mod(s, None, torch.tensor(head), idx[:, None], idx[None, :])
        outs.append(torch.softmax(s, -1) @ v[:, :, g])  # (B, L, Dh)
    return x + model.o_proj(torch.stack(outs, 2).reshape(B, L, -1))


@st.composite
def flex_cases(draw):
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_head = n_kv * draw(st.sampled_from([2] if n_kv == 1 else [1, 2]))  # several query heads
    hd = draw(st.sampled_from([4, 8]))
    mod = draw(st.sampled_from(sorted(MODS)))
    v = draw(st.sampled_from(["linear", "mlp"]))
    return n_head, n_kv, hd, mod, v, draw(st.integers(0, 2**16))


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flex_cases())
def test_flex_random_score_mods_match_a_per_head_reference(case):
    n_head, n_kv, hd, mod_name, v, seed = case
    torch.manual_seed(seed)
    flex_mod, ref_mod = MODS[mod_name]
    d = n_head * hd
    model = FlexBlock(d, n_head, n_kv, score_mod=flex_mod).eval()
    x = torch.randn(1, 6, d)
    kc.apply(model, kc.KHAConfig(v=v), example_args=(x,))  # strict: raises unless the site matched
    assert "v_proj" in {n.rpartition(".kha.")[0] for n in kha_params(model)}
    perturb(model, seed=seed)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _reference(model, x, ref_mod), rtol=1e-4, atol=1e-4)
