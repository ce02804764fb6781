"""Rule einsum_softmax: einops-style attention (einsum scores and values), both configs, ONNX parity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import kha_compile as kc
from form_checks import check_form
from helpers import perturb

D, H, T = 32, 4, 6


class EinsumAttention(nn.Module):
    def __init__(self, n_kv=H):
        super().__init__()
        self.hd, self.kv = D // H, n_kv
        self.to_q = nn.Linear(D, D, bias=False)
        self.to_kv = nn.Linear(D, 2 * n_kv * self.hd, bias=False)
        self.to_out = nn.Linear(D, D)

    def forward(self, x):
        B, L, _ = x.shape
        q = self.to_q(x).view(B, L, H, self.hd).transpose(1, 2)  # (B, H, L, Dh)
        k, v = self.to_kv(x).view(B, L, 2, self.kv, self.hd).permute(2, 0, 3, 1, 4)  # (B, Hkv, L, Dh)
        k = k.repeat_interleave(H // self.kv, 1)
        v = v.repeat_interleave(H // self.kv, 1)
        s = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.hd**-0.5  # (B, H, L, L)
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), -1e9)
        o = torch.einsum("b h i j, b h j d -> b h i d", s.softmax(-1), v)  # (B, H, L, Dh)
        return x + self.to_out(o.transpose(1, 2).reshape(B, L, D))


class Two(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.blocks = nn.Sequential(EinsumAttention(**kw), EinsumAttention(**kw))

    def forward(self, x):
        return self.blocks(x)


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("n_kv", [4, 2])
def test_einsum_attention(v, n_kv):
    model = check_form(lambda: Two(n_kv=n_kv), (torch.randn(2, T, D),), v, anchor="einsum_softmax")
    report = kc.inspect(model, example_args=(torch.randn(2, T, D),))
    assert {(s.num_heads, s.num_kv_heads, s.head_dim) for s in report.matched} == {(H, n_kv, D // H)}


def test_einsum_attention_onnx_parity(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model = Two(n_kv=2).eval()
    x = torch.randn(2, T, D)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    perturb(model)
    path = kc.export_onnx(model, tmp_path / "einsum.onnx", example_args=(x,), dynamic=False)
    (got,) = ort.InferenceSession(str(path)).run(
        None, {ort.InferenceSession(str(path)).get_inputs()[0].name: x.numpy()}
    )
    with torch.no_grad():
        want = model(x).numpy()
    assert np.abs(got - want).max() < 1e-4
