"""Trace and layout robustness: rotary helpers returning tuples with type_as, complex RoPE
(view_as_complex / view_as_real), None entries in a ModuleList, module inputs torch.export cannot
take (bound as constants), and every unexpected failure reported as a KHAError naming its step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
from form_checks import check_form
from kha_compile.core.errors import AnalysisError

D, H, T = 32, 4, 6
HD = D // H


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_pair(q, k, cos, sin):
    """A helper in the HF style: computes in float32 and returns (q, k) cast back with type_as."""
    qf, kf = q.float(), k.float()
    return (qf * cos + rotate_half(qf) * sin).type_as(q), (kf * cos + rotate_half(kf) * sin).to(k.dtype)


def rotary_complex(q, k, freqs_cis):
    """Llama-2 reference code: pairs of features as complex numbers, (B, T, H, Dh) in and out."""
    qc = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))  # (B, T, H, Dh/2)
    kc_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    f = freqs_cis.view(1, q.shape[1], 1, qc.shape[-1])
    return torch.view_as_real(qc * f).flatten(3).type_as(q), torch.view_as_real(kc_ * f).flatten(3).type_as(k)


class RopeAttention(nn.Module):
    def __init__(self, rope: str):
        super().__init__()
        self.rope = rope
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D)
        inv = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.outer(torch.arange(T).float(), inv)  # (T, Dh/2)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, H, HD)  # (B, T, H, Dh)
        k = self.wk(x).view(B, L, H, HD)
        v = self.wv(x).view(B, L, H, HD)
        if self.rope == "complex":
            q, k = rotary_complex(q, k, self.freqs_cis[:L])
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, T, Dh)
        else:
            ang = torch.arange(L, dtype=torch.float32)[:, None] * self.inv_freq[None]  # (T, Dh/2)
            emb = torch.cat((ang, ang), -1)  # (T, Dh)
            q, k = rotary_pair(q.transpose(1, 2), k.transpose(1, 2), emb.cos(), emb.sin())
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return x + self.wo(o.transpose(1, 2).reshape(B, L, D))


class Stack(nn.Module):
    """Two attention blocks, with None placeholders in the list (pruned or optional layers)."""

    def __init__(self, make):
        super().__init__()
        self.layers = nn.ModuleList([make(), None, make(), None])

    def forward(self, x):
        for layer in self.layers:
            if layer is not None:
                x = layer(x)
        return x


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("rope", ["type_as_tuple", "complex"])
def test_rotary_helpers_and_none_entries(rope, v):
    model = check_form(lambda: Stack(lambda: RopeAttention(rope)), (torch.randn(2, T, D),), v, anchor="sdpa")
    report = kc.inspect(model, example_args=(torch.randn(2, T, D),))
    assert all(s.rope for s in report.matched), str(report)
    assert [s.name for s in report.matched] == ["layers.0", "layers.2"]


def test_view_as_complex_is_followed_as_a_layout_op():
    from kha_compile.analysis.layout import LAYOUT_OPS, read_head_map

    idx = torch.arange(H * HD).expand(T, H * HD).reshape(1, T, H, HD // 2, 2)  # features of a (B, T, H*Dh) output
    c = LAYOUT_OPS[torch.ops.aten.view_as_complex.default](idx, None)
    back = LAYOUT_OPS[torch.ops.aten.view_as_real.default](c, None).flatten(3)  # (1, T, H, Dh)
    hm = read_head_map(back)
    assert hm is not None and hm.num_heads == H and torch.equal(hm.index, torch.arange(H * HD).view(H, HD))


@dataclasses.dataclass
class Options:
    scale: float
    tag: object


class TakesAnObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = RopeAttention("type_as_tuple")

    def forward(self, x, opts: Options, extra=None):
        return self.attn(x) * opts.scale + (0 if extra is None else extra.offset)


class Offset:
    offset = 0.5


def test_non_pytree_inputs_are_bound_as_constants_and_forward_restored():
    model = TakesAnObject()
    x = torch.randn(2, T, D)
    opts = Options(2.0, object())
    with torch.no_grad():
        ref = model(x, opts, extra=Offset())
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x, opts), example_kwargs={"extra": Offset()})
    assert "forward" not in vars(model)  # the wrapper is gone
    with torch.no_grad():
        assert torch.equal(model(x, opts, extra=Offset()), ref)


@pytest.mark.parametrize("step", ["find_sites", "build_sites"])
def test_an_unexpected_failure_is_a_kha_error_naming_the_step_and_the_model_is_untouched(monkeypatch, step):
    from kha_compile.analysis import submodules
    from kha_compile.passes import apply as api

    def boom(*a, **k):
        raise IndexError("synthetic bug")

    monkeypatch.setattr(submodules if step == "find_sites" else api, step, boom)
    model = Stack(lambda: RopeAttention("complex"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = {"find_sites": "match", "build_sites": "plan"}[step]
    with pytest.raises(AnalysisError, match=rf"in the {name} step on Stack: IndexError: synthetic bug"):
        kc.apply(model, example_args=(torch.randn(1, T, D),))
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert [type(m) for m in model.layers] == [RopeAttention, type(None), RopeAttention, type(None)]


def test_a_crash_inside_the_trace_is_a_trace_error(monkeypatch):
    class Bad(nn.Module):
        def forward(self, x):
            raise AttributeError("inside the model")

    with pytest.raises(kc.KHAError, match="AttributeError: inside the model"):
        kc.apply(Bad(), example_args=(torch.randn(1, 2),))
