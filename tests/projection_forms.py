"""Attention blocks whose projections are not ``nn.Linear`` calls: functional weights and N-d weights.

Each form is an attention module; :func:`two_blocks` stacks two pre-norm blocks of one form.
:func:`check_form` runs the checks every form must pass (both configs): every site matched,
identity at init, perturbed KHA moves the output, gradients reach KHA, exact fold with the
original classes and keys (linear), save/load round trip, ONNX + onnxruntime parity.

Example::

    model, x = two_blocks("beit")
    check_form("beit", kc.KHAConfig(v="mlp"), tmp_path)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
from helpers import kha_params, perturb

D, H, DH = 32, 4, 8
E = H * DH
LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
MLP = kc.KHAConfig(v="mlp")


def _sdpa(q, k, v):  # (B, H, S, Dh) each
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _manual(q, k, v):
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return att.softmax(dim=-1) @ v


class BeitAttention(nn.Module):
    """BEiT/ViT style: ``F.linear(x, self.qkv.weight, cat(q_bias, zeros, v_bias))``."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * E, bias=False)
        self.q_bias = nn.Parameter(torch.randn(E) * 0.1)
        self.v_bias = nn.Parameter(torch.randn(E) * 0.1)
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        bias = torch.cat((self.q_bias, torch.zeros_like(self.v_bias, requires_grad=False), self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).reshape(B, S, 3, H, DH).permute(2, 0, 3, 1, 4)  # (3, B, H, S, Dh)
        q, k, v = qkv.unbind(0)
        return self.proj(_sdpa(q, k, v).transpose(1, 2).reshape(B, S, E))


class MatmulAttention(nn.Module):
    """A bare fused weight: ``x @ w_qkv.t() + b_qkv``, split into q, k, v; manual softmax."""

    def __init__(self):
        super().__init__()
        self.w_qkv = nn.Parameter(torch.randn(3 * E, D) / math.sqrt(D))
        self.b_qkv = nn.Parameter(torch.randn(3 * E) * 0.1)
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (x @ self.w_qkv.t() + self.b_qkv).split(E, dim=-1)
        q, k, v = (t.view(B, S, H, DH).transpose(1, 2) for t in (q, k, v))  # (B, H, S, Dh)
        return self.proj(_manual(q, k, v).transpose(1, 2).reshape(B, S, E))


class SeparateFunctional(nn.Module):
    """Separate ``nn.Linear`` modules whose weights are used with ``F.linear`` (never called)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, E), nn.Linear(D, E), nn.Linear(D, E)
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (F.linear(x, m.weight, m.bias).view(B, S, H, DH).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.proj(_sdpa(q, k, v).transpose(1, 2).reshape(B, S, E))


class EinsumDHK(nn.Module):
    """``(d_model, heads, head_dim)`` weights: ``einsum("bsd,dhk->bshk")``, a (heads, head_dim) bias on v."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(D, H, DH) / math.sqrt(D)) for _ in range(3))
        self.bv = nn.Parameter(torch.randn(H, DH) * 0.1)
        self.wo = nn.Parameter(torch.randn(H, DH, D) / math.sqrt(E))

    def forward(self, x):
        q = torch.einsum("bsd,dhk->bshk", x, self.wq).transpose(1, 2)  # (B, H, S, Dh)
        k = torch.einsum("bsd,dhk->bshk", x, self.wk).transpose(1, 2)
        v = (torch.einsum("bsd,dhk->bshk", x, self.wv) + self.bv).transpose(1, 2)
        return torch.einsum("bhsk,hkd->bsd", _sdpa(q, k, v), self.wo)


class EinsumHDK(nn.Module):
    """``(heads, d_model, head_dim)`` weights straight to (B, H, S, Dh); manual softmax."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(H, D, DH) / math.sqrt(D)) for _ in range(3))
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (torch.einsum("bsd,hdk->bhsk", x, w) for w in (self.wq, self.wk, self.wv))
        return self.proj(_manual(q, k, v).transpose(1, 2).reshape(B, S, E))


class EinsumFused(nn.Module):
    """One ``(3, d_model, heads, head_dim)`` weight for q, k and v."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, D, H, DH) / math.sqrt(D))
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = torch.einsum("bsd,tdhk->tbhsk", x, self.w).unbind(0)  # (B, H, S, Dh) each
        return self.proj(_sdpa(q, k, v).transpose(1, 2).reshape(B, S, E))


class Tensordot(nn.Module):
    """``tensordot(x, w, dims=([2], [0]))`` with a ``(d_model, heads, head_dim)`` weight."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(D, H, DH) / math.sqrt(D)) for _ in range(3))
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (torch.tensordot(x, w, dims=([2], [0])).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.proj(_sdpa(q, k, v).transpose(1, 2).reshape(B, S, E))


class DenseGeneral(nn.Module):
    """A module whose own forward is an N-d projection (Flax's DenseGeneral): (B, S, d) -> (B, S, H, Dh)."""

    def __init__(self):
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(D, H, DH) / math.sqrt(D))
        self.bias = nn.Parameter(torch.randn(H, DH) * 0.1)

    def forward(self, x):
        return torch.einsum("bsd,dhk->bshk", x, self.kernel) + self.bias


class DenseGeneralAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = DenseGeneral(), DenseGeneral(), DenseGeneral()
        self.proj = nn.Linear(E, D)

    def forward(self, x):
        B, S, _ = x.shape
        q, k, v = (m(x).transpose(1, 2) for m in (self.query, self.key, self.value))
        return self.proj(_sdpa(q, k, v).transpose(1, 2).reshape(B, S, E))


FORMS = {
    "beit": BeitAttention,
    "matmul": MatmulAttention,
    "separate": SeparateFunctional,
    "einsum_dhk": EinsumDHK,
    "einsum_hdk": EinsumHDK,
    "einsum_fused": EinsumFused,
    "tensordot": Tensordot,
    "dense_general": DenseGeneralAttention,
}


class Block(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = FORMS[form]()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TwoBlocks(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.blocks = nn.ModuleList(Block(form) for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def two_blocks(form: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    return TwoBlocks(form).eval(), torch.randn(2, 6, D)


def check_form(form: str, cfg: kc.KHAConfig, tmp_path) -> None:
    """Every check a projection form must pass under ``cfg``."""
    model, x = two_blocks(form)
    keys = list(model.state_dict())
    classes = [type(m) for m in model.modules()]
    with torch.no_grad():
        ref = model(x)
    kc.apply(model, cfg, example_args=(x,))
    report = kc.inspect(model, example_args=(x,))
    assert [s.status for s in report.sites] == ["matched", "matched"], [s.reason for s in report.sites]
    assert all((s.num_heads, s.num_kv_heads, s.head_dim) == (H, H, DH) for s in report.sites)
    assert all(s.transforms == cfg.roles() for s in report.sites), [s.transforms for s in report.sites]
    assert all("parametrizes" in s.note and "intercepts" in s.note for s in report.sites)
    names = list(kha_params(model))
    assert len(names) == 2 * 3 and all(".kha." in f".{n}" for n in names)
    assert all(type(m).__module__.startswith("kha_compile") for m in model.modules() if type(m) not in classes)
    with torch.no_grad():
        assert torch.equal(model(x), ref)  # identity at init, exactly
    perturb(model)
    out = model(x)
    assert not torch.allclose(out, ref, atol=1e-4)
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if ".kha." in f".{n}"}
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values()), grads.keys()
    model.zero_grad()
    out = out.detach()

    kc.save_pretrained(model, tmp_path / "ckpt")
    fresh, _ = two_blocks(form)
    kc.load_pretrained(fresh, tmp_path / "ckpt", example_args=(x,))
    with torch.no_grad():
        assert torch.equal(fresh(x), out)

    onnx_path = kc.export_onnx(model, tmp_path / f"{form}.onnx", example_args=(x,))
    import onnxruntime as ort

    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert np.abs(got - out.numpy()).max() < 1e-4

    if cfg.v == "mlp":
        with pytest.raises(kc.KHAError, match="MLP-value"):
            kc.fold(model)
        kc.fold(model, strict=False)
        with torch.no_grad():
            assert torch.equal(model(x), out)
        kc.remove(model)
    else:
        kc.fold(model)
        with torch.no_grad():
            assert torch.equal(model(x), out)  # fold writes the very tensors the forward used
    assert list(model.state_dict()) == keys
    assert [type(m) for m in model.modules()] == classes
    assert not any("_kha" in k for m in model.modules() for k in vars(m))
