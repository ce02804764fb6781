"""The functional handler: projection weights used through F.linear / matmul inside another module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kha_compile as kc
from helpers import perturb
from kha_compile.model.parametrized import ParamSlot, fold_param
from projection_forms import LINEAR, MLP, check_form, two_blocks
from projection_reference import FunctionalCase, gqa_heads, kha_transforms, reference


@pytest.mark.parametrize("cfg", [LINEAR, MLP], ids=["linear", "mlp"])
@pytest.mark.parametrize("form", ["beit", "matmul", "separate"])
def test_functional_form(form, cfg, tmp_path):
    check_form(form, cfg, tmp_path)


def test_beit_report_names_the_bias_pieces_and_the_intercepted_call():
    model, x = two_blocks("beit")
    site = kc.inspect(model, example_args=(x,)).sites[0]
    assert site.q_proj == site.k_proj == site.v_proj == "blocks.0.attn"  # the module calling the projection
    assert "functional weight blocks.0.attn.qkv.weight via linear" in site.note
    assert "parametrizes blocks.0.attn.qkv.weight, blocks.0.attn.q_bias, blocks.0.attn.v_bias" in site.note
    assert "intercepts the linear call in BeitAttention.forward" in site.note


def test_mixed_linear_q_and_mlp_value_on_one_fused_functional_weight():
    model, x = two_blocks("beit")
    with torch.no_grad():
        ref = model(x)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
        perturb(model, scale=0.1)
        out = model(x)
    kc.fold(model, strict=False)  # q, k fold into qkv.weight and q_bias; v stays an intercepted op
    names = [n for n, _ in model.named_parameters() if ".kha." in n]
    assert names and all(".kha.v." in n for n in names)
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_fold_param_equals_the_transform_on_the_output():
    torch.manual_seed(0)
    w = torch.randn(3, 5, 2, 4)  # (roles, d_model, heads, head_dim): output axes 0, 2, 3
    x = torch.randn(7, 5)
    t = torch.randn(4, 4)
    y = torch.einsum("nd,tdhk->nthk", x, w)  # (7, 3, 2, 4)
    idx = 2 * 8 + torch.arange(2).unsqueeze(1) * 4 + torch.arange(4)  # role 2's heads, flat over (t, h, k)
    got = torch.einsum("nd,tdhk->nthk", x, fold_param(w, [(ParamSlot("v", (0, 2, 3), idx), t)]))
    expected = y.clone()
    expected[:, 2] = y[:, 2] @ t
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(fold_param(w, [(ParamSlot("v", (0, 2, 3), idx), torch.eye(4))]), w)  # exact at identity


def test_a_code_path_without_the_traced_projection_call_is_an_error():
    model, x = two_blocks("separate")
    kc.apply(model, MLP, example_args=(x,))
    attn = model.blocks[0].attn
    attn.__dict__["_kha_calls"][0].occurrence = 5  # as if the forward took another path than the traced one
    with pytest.raises(kc.errors.TracedPathError, match="did not run in this forward"):
        model(x)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gqa_heads(),
    st.booleans(),
    st.booleans(),
    st.sampled_from(["linear", "matmul", "matmul_T"]),
    st.sampled_from(["linear", "mlp", "mixed"]),
)
def test_functional_weights_match_a_per_head_reference(heads, fused, bias, op, kind):
    n_head, n_kv, head_dim = heads
    torch.manual_seed(0)
    model = FunctionalCase(8, n_head, n_kv, head_dim, fused, bias, op)
    x = torch.randn(1, 3, 8)
    with torch.no_grad():
        ref = model(x)
    cfg = {
        "linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
        "mlp": kc.KHAConfig(v="mlp"),
        "mixed": kc.KHAConfig(k="linear", v="mlp"),
    }[kind]
    kc.apply(model, cfg, example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), ref)
        perturb(model, scale=0.2)
        out = model(x)
        expected = reference(model, x, kha_transforms(model))
    assert set(kha_transforms(model)) == set(cfg.roles())
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


class ZeroBufferBias(torch.nn.Module):
    """timm style: the key bias is a zero buffer between two parameters, ``cat(q_bias, k_bias, v_bias)``."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.q_bias, self.v_bias = torch.nn.Parameter(torch.randn(16)), torch.nn.Parameter(torch.randn(16))
        self.register_buffer("k_bias", torch.zeros(16), persistent=False)

    def forward(self, x):
        B, S, _ = x.shape
        qkv = F.linear(x, self.qkv.weight, torch.cat((self.q_bias, self.k_bias, self.v_bias)))
        q, k, v = qkv.view(B, S, 3, 2, 8).permute(2, 0, 3, 1, 4)  # (B, H, S, Dh) each
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, S, 16)


def test_a_zero_buffer_bias_piece_stays_zero_and_linear_kha_folds_exactly():
    torch.manual_seed(0)
    model, x = ZeroBufferBias(), torch.randn(2, 5, 16)
    keys = list(model.state_dict())
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(x,))
    (site,) = kc.inspect(model, example_args=(x,)).sites
    assert site.status == "matched" and "parametrizes qkv.weight, q_bias, v_bias" in site.note
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".kha." in f".{n}":
                p.add_(0.1 * torch.randn_like(p))
        out = model(x)
        kc.fold(model)
        assert torch.equal(model(x), out) and torch.equal(model.k_bias, torch.zeros(16))
    assert list(model.state_dict()) == keys and type(model) is ZeroBufferBias
