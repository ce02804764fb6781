"""The matcher on generic attention code: random head counts, layouts and rotary, plus the skip reasons."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import kha_compile as kc
from helpers import perturb
from kha_compile.analysis.match import find_sites
from kha_compile.analysis.trace import capture


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class GenericAttention(nn.Module):
    """Attention written the many ways real code writes it (layout, GQA, rotary, manual or SDPA)."""

    def __init__(self, d, n_head, n_kv, head_dim, layout, rope, manual):
        super().__init__()
        self.n_head, self.n_kv, self.hd, self.layout, self.rope, self.manual = (
            n_head,
            n_kv,
            head_dim,
            layout,
            rope,
            manual,
        )
        q_out, kv_out = n_head * head_dim, n_kv * head_dim
        if layout == "separate":
            self.q_proj = nn.Linear(d, q_out)
            self.k_proj = nn.Linear(d, kv_out, bias=False)
            self.v_proj = nn.Linear(d, kv_out)
        elif layout == "fused":  # [Q | K | V]
            self.qkv = nn.Linear(d, q_out + 2 * kv_out)
        else:  # interleaved per head [H, 3, Dh] (n_kv == n_head)
            self.qkv = nn.Linear(d, 3 * q_out)
        self.o_proj = nn.Linear(q_out, d)
        self.ref_t = None  # tests: {role: fn} applied by hand right after the head split (the spec's place)

    def forward(self, x):
        B, T, _ = x.shape
        H, K, D = self.n_head, self.n_kv, self.hd
        if self.layout == "separate":
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
            k = k.view(B, T, K, D).transpose(1, 2)
            v = v.view(B, T, K, D).transpose(1, 2)
        elif self.layout == "fused":
            q, k, v = self.qkv(x).split([H * D, K * D, K * D], dim=-1)
            q = q.reshape(B, T, H, D).permute(0, 2, 1, 3)
            k = k.reshape(B, T, K, D).permute(0, 2, 1, 3)
            v = v.reshape(B, T, K, D).permute(0, 2, 1, 3)
        else:
            qkv = self.qkv(x).view(B, T, H, 3 * D).transpose(1, 2)  # (B, H, T, 3D)
            q, k, v = qkv.chunk(3, dim=-1)
        if self.ref_t:  # (B, H, T, D): each role's transform on every head vector, before rotary and GQA
            q, k, v = (self.ref_t[r](t) if r in self.ref_t else t for r, t in zip("qkv", (q, k, v)))
        if self.rope:
            pos = torch.arange(T, dtype=torch.float32)
            inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
            ang = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], dim=-1)  # (T, D)
            cos, sin = ang.cos(), ang.sin()
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if K != H:
            k = k.repeat_interleave(H // K, dim=1)
            v = v.repeat_interleave(H // K, dim=1)
        if self.manual:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
            mask = torch.ones(T, T, dtype=torch.bool).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = att @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, H * D))


@st.composite
def attention_cases(draw):
    layout = draw(st.sampled_from(["separate", "fused", "interleaved"]))
    n_kv = draw(st.sampled_from([1, 2, 4]))
    n_head = n_kv if layout == "interleaved" else n_kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    return dict(
        d=24,
        n_head=n_head,
        n_kv=n_kv,
        head_dim=head_dim,
        layout=layout,
        rope=draw(st.booleans()),
        manual=draw(st.booleans()),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_cases(), st.sampled_from(["mlp", "linear"]))
def test_generic_attention_is_matched_identity_at_init_and_wired(params, kind):
    torch.manual_seed(0)
    model = GenericAttention(**params).eval()
    by_hand = copy.deepcopy(model)
    x = torch.randn(2, 5, 24)
    ref = model(x)
    cfg = kc.KHAConfig(v="mlp") if kind == "mlp" else kc.KHAConfig(q="linear", k="linear", v="linear")
    kc.apply(model, cfg, example_args=(x,))
    (site,) = kc.inspect(model, example_args=(x,)).sites
    assert site.status == "matched", site.reason
    assert (site.num_heads, site.num_kv_heads, site.head_dim) == (params["n_head"], params["n_kv"], params["head_dim"])
    assert site.rope == params["rope"]
    assert torch.equal(model(x), ref)
    with torch.no_grad():
        perturb(model, scale=0.1)
    out = model(x)
    assert not torch.allclose(out, ref, atol=1e-5)

    # Wired to the right features: the same (perturbed) matrices, applied by hand per docs/method.md to
    # each role's head vectors right after the head split, give the same output. This catches a
    # transform on the wrong role (q <-> k in a fused projection), the wrong head grouping, the wrong
    # place (after rotary) and MLP weights used in the wrong order, which "output changed" cannot.
    found = {}
    for m in model.modules():
        kha = getattr(m, "kha", None)
        if isinstance(kha, nn.Module):  # the projection's `kha` child: one transform per role
            for role, t in kha.named_children():
                assert role not in found, f"two transforms for role {role}"
                found[role] = {n: p.detach() for n, p in t.named_parameters()}
    assert set(found) == set(cfg.roles())

    def spec(role):
        w = found[role]
        if cfg.roles()[role] == "linear":
            return lambda h: h @ w["weight"]
        return lambda h: 2 * ((h @ w["up"]) * torch.sigmoid(h @ w["gate"])) @ w["down"]

    by_hand.ref_t = {r: spec(r) for r in found}
    with torch.no_grad():
        torch.testing.assert_close(out.detach(), by_hand(x), rtol=1e-4, atol=1e-5)


def test_kinds_of_generic_attention():
    x = torch.randn(2, 5, 24)
    expect = {(4, 4): "mha", (4, 2): "gqa", (4, 1): "mqa"}
    for (h, kv), kind in expect.items():
        m = GenericAttention(24, h, kv, 8, "separate", False, False)
        assert kc.inspect(m, example_args=(x,)).sites[0].kind == kind


class CrossAttention(nn.Module):
    def __init__(self, d=16, h=2):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, mem):
        B, T, C = x.shape
        S = mem.shape[1]
        q = self.q(x).view(B, T, self.h, -1).transpose(1, 2)
        k = self.k(mem).view(B, S, self.h, -1).transpose(1, 2)
        v = self.v(mem).view(B, S, self.h, -1).transpose(1, 2)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))


def test_cross_attention_is_classified_cross():
    m = CrossAttention()
    site = kc.inspect(m, example_args=(torch.randn(2, 3, 16), torch.randn(2, 7, 16))).sites[0]
    assert site.kind == "cross" and site.status == "matched"


class UnprojectedAttention(nn.Module):
    """q, k, v are the input itself: there is no projection to carry a transform."""

    def forward(self, x):
        q = x.view(2, 5, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q)


def test_attention_without_projection_is_skipped_with_a_reason():
    x = torch.randn(2, 5, 16)
    sites = kc.inspect(UnprojectedAttention(), example_args=(x,)).sites
    assert len(sites) == 1 and sites[0].status == "skipped"
    assert "no projection found" in sites[0].reason
    with pytest.raises(kc.KHAError, match="skipped"):
        kc.apply(UnprojectedAttention(), example_args=(x,))


class FunctionalProjection(nn.Module):
    """The q/k/v weights are bare parameters used with F.linear in the attention module."""

    def __init__(self, bias_buffer=None):
        super().__init__()
        self.w = nn.Parameter(torch.randn(48, 16))
        if bias_buffer is not None:
            self.register_buffer("b", bias_buffer)

    def forward(self, x):
        q, k, v = F.linear(x, self.w, getattr(self, "b", None)).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v)


def test_functional_projection_is_matched_by_the_functional_handler():
    x = torch.randn(2, 5, 16)
    (site,) = kc.inspect(FunctionalProjection(), example_args=(x,)).sites
    assert site.status == "matched" and "functional weight w via linear" in site.note


def test_functional_projection_with_a_non_zero_bias_buffer_is_skipped_with_the_buffer_named():
    x = torch.randn(2, 5, 16)
    (site,) = kc.inspect(FunctionalProjection(torch.ones(48)), example_args=(x,)).sites
    assert site.status == "skipped" and "bias piece b is a non-zero buffer" in site.reason


def test_find_sites_reports_the_head_maps_of_an_interleaved_projection():
    m = GenericAttention(24, 2, 2, 4, "interleaved", False, False)
    x = torch.randn(2, 5, 24)
    (raw,) = find_sites(capture(m, (x,), {}).exported)
    idx = {r: raw.roles[r].head_map.index for r in "qkv"}
    # [H, 3, Dh] per head: head h of q starts at 12h, of k at 12h + 4, of v at 12h + 8
    assert idx["q"][1].tolist() == [12, 13, 14, 15]
    assert idx["k"][0].tolist() == [4, 5, 6, 7]
    assert idx["v"][1].tolist() == [20, 21, 22, 23]
