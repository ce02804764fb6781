"""MLP-value gradients in fp16 and bf16 through the composite formula plain eager runs (kha_compile/ops/mlp_value.py).

KHA's MLP-value module in plain eager mode on the CPU is autograd of the formula (``mlp_value_auto``),
under ``torch.autocast`` (fp32 master weights) and as a half model (``.to(dtype)``). Its four
gradients must equal a float64 reference rounded to the dtype: the formula of docs/method.md written
out here, differentiated in float64 on the same inputs rounded to the dtype (what autocast feeds
it). The bound is measured from the reference itself: ``BOUND`` unit roundoffs of the dtype times the
largest reference gradient. Identity init and perturbed (trained-like) weights, 512 tokens.

A formula with the same forward whose backward accumulates the sums over tokens in the low dtype
(no fp32 accumulation) must fail the same check: the test shows it does.
"""

from __future__ import annotations

import pytest
import torch

from kha_compile.model.transforms.mlp import KHAMLPValue

D, TOKENS = 16, 512
BOUND = 4  # unit roundoffs times max |reference gradient|; measured: the formula stays under 2
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _case(init: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, TOKENS // 2, D, generator=g)  # (B, T, Dh)
    if init == "identity":
        ws = [torch.eye(D), torch.zeros(D, D), torch.eye(D)]
    else:
        ws = [torch.eye(D) + 0.3 * torch.randn(D, D, generator=g) for _ in range(3)]
    grad_out = torch.randn(v.shape, generator=g)
    return v, ws, grad_out


def _formula(v, up, gate, down):
    """docs/method.md's MLP-value, written out (no kha_compile)."""
    return (2 * (v @ up) * torch.sigmoid(v @ gate)) @ down


def _reference(dtype, v, ws, grad_out):
    """float64 gradients of the formula on the inputs rounded to ``dtype``."""
    leaves = [t.to(dtype).double().requires_grad_() for t in (v, *ws)]
    return torch.autograd.grad(_formula(*leaves), leaves, grad_out.to(dtype).double())


def _kha(dtype, mode, v, ws, grad_out):
    """Gradients of (v, up, gate, down) through KHA's MLP-value module in plain eager mode."""
    module = KHAMLPValue(D)
    with torch.no_grad():
        for p, w in zip((module.up, module.gate, module.down), ws):
            p.copy_(w)
    if mode == "half":
        module.to(dtype)
        v = v.to(dtype)
    v = v.clone().requires_grad_()
    leaves = [v, module.up, module.gate, module.down]
    with torch.autocast("cpu", dtype=dtype, enabled=mode == "autocast"):
        out = module(v)
    assert out.dtype == dtype
    return torch.autograd.grad(out, leaves, grad_out.to(dtype))


class _LowAccumulation(torch.autograd.Function):
    """The same forward; a backward that sums over tokens in the low dtype, one token at a time."""

    @staticmethod
    def forward(ctx, v, up, gate, down):
        ctx.save_for_backward(v, up, gate, down)
        return _formula(v, up, gate, down)

    @staticmethod
    def backward(ctx, grad_out):
        v, up, gate, down = ctx.saved_tensors
        a, s = v @ up, torch.sigmoid(v @ gate)
        h = 2 * a * s
        gh = grad_out @ down.T
        ga, gb = gh * 2 * s, gh * 2 * a * s * (1 - s)

        def over_tokens(x, y):  # x^T y, rounded to the dtype after each token
            x, y = x.reshape(-1, D), y.reshape(-1, D)
            acc = torch.zeros(D, D, dtype=x.dtype)
            for i in range(x.shape[0]):
                acc = acc + x[i, :, None] * y[i, None, :]
            return acc

        return ga @ up.T + gb @ gate.T, over_tokens(v, ga), over_tokens(v, gb), over_tokens(h, grad_out)


def _errors(dtype, got, ref):
    """Per gradient: max |got - reference rounded to dtype|, in units of the bound's scale."""
    u = torch.finfo(dtype).eps / 2
    return [float((g.double() - r.to(dtype).double()).abs().max() / (u * r.abs().max())) for g, r in zip(got, ref)]


@pytest.mark.parametrize("init", ["identity", "perturbed"])
@pytest.mark.parametrize("mode", ["autocast", "half"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gradients_equal_the_float64_reference_rounded_to_the_dtype(dtype, mode, init):
    v, ws, grad_out = _case(init)
    ref = _reference(dtype, v, ws, grad_out)
    got = _kha(dtype, mode, v, ws, grad_out)
    assert [g.dtype for g in got] == [torch.float32 if mode == "autocast" else dtype] * 4
    errors = _errors(dtype, got, ref)
    assert max(errors) <= BOUND, f"gradients of v, up, gate, down off by {errors} unit roundoffs x max|ref|"
    assert all(float(r.abs().max()) > 0 for r in ref)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_backward_without_fp32_accumulation_fails_the_same_bound(dtype):
    v, ws, grad_out = _case("perturbed")
    ref = _reference(dtype, v, ws, grad_out)
    leaves = [t.to(dtype).requires_grad_() for t in (v, *ws)]
    out = _LowAccumulation.apply(*leaves)
    assert torch.equal(out, _formula(*(t.detach() for t in leaves)))  # the same forward
    errors = _errors(dtype, torch.autograd.grad(out, leaves, grad_out.to(dtype)), ref)
    assert max(errors) > 2 * BOUND, f"the degraded backward passed: {errors}"
