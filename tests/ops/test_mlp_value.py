"""Tests for kha_compile/ops/mlp_value.py: ``kha::mlp_value`` and ``kha::mlp_value_backward`` on CPU."""

from __future__ import annotations

import pytest
import torch

import kha_compile  # noqa: F401  (registers torch.ops.kha.*)
from kha_compile.core.errors import KHAError, OpInputError
from kha_compile.ops.mlp_value import (
    check_mlp_value_inputs,
    mlp_value_backward,
    mlp_value_backward_reference,
    mlp_value_reference,
)


def _inputs(shape, dtype=torch.float32, requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    v = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    ws = [(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5).to(dtype) for _ in range(3)]
    if requires_grad:
        v.requires_grad_()
        for w in ws:
            w.requires_grad_()
    return v, ws


def _formula(v, w_up, w_gate, w_down):
    # Written out independently of the module under test.
    return 2.0 * torch.matmul(torch.matmul(v, w_up) * torch.sigmoid(torch.matmul(v, w_gate)), w_down)


# ---------------------------------------------------------------------------------------------------
# opcheck: schema, fake tensors, autograd registration, AOT dispatch
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 16), (2, 1, 3, 32)], ids=["1x8", "2x16", "3x32"])
def test_opcheck_forward(shape):
    v, ws = _inputs(shape, requires_grad=True)
    result = torch.library.opcheck(torch.ops.kha.mlp_value.default, (v, *ws))
    assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_backward():
    v, ws = _inputs((2, 3, 16))
    grad = torch.randn(v.shape)
    result = torch.library.opcheck(torch.ops.kha.mlp_value_backward.default, (grad, v, *ws))
    assert set(result.values()) == {"SUCCESS"}, result


# ---------------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 8), (2, 3, 5)])
def test_forward_matches_formula(shape):
    v, ws = _inputs(shape, dtype=torch.float64)
    y = torch.ops.kha.mlp_value(v, *ws)
    assert y.shape == v.shape and y.dtype == v.dtype
    torch.testing.assert_close(y, _formula(v, *ws), rtol=1e-12, atol=1e-12)
    assert y.abs().max() > 0.1  # not trivially zero


def test_gradcheck_float64():
    v, ws = _inputs((2, 3, 4), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(torch.ops.kha.mlp_value, (v, *ws))


def test_gradgradcheck_float64():
    # Double backward goes through the differentiable composite (create_graph=True).
    v, ws = _inputs((3, 4), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(torch.ops.kha.mlp_value, (v, *ws))


@pytest.mark.parametrize("shape", [(6, 8), (2, 3, 16)])
def test_four_grads_equal_autograd_of_reference(shape):
    v, ws = _inputs(shape, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(v.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad(torch.ops.kha.mlp_value(v, *ws), (v, *ws), grad)
    want = torch.autograd.grad(mlp_value_reference(v, *ws), (v, *ws), grad)
    for name, g, w in zip(("v", "w_up", "w_gate", "w_down"), got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"grad of {name}")
        assert w.abs().max() > 1e-3, name  # each gradient carries signal
    # ... and the backward op on its own gives the same four tensors.
    direct = torch.ops.kha.mlp_value_backward(grad, v.detach(), *[w.detach() for w in ws])
    for g, w in zip(direct, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_backward_uses_the_backward_op(monkeypatch):
    # Plain .backward() dispatches kha::mlp_value_backward (the CUDA Triton path hangs off it).
    calls = []
    orig = torch.ops.kha.mlp_value_backward

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].shape)
            return orig(*args)

    monkeypatch.setattr(torch.ops.kha, "mlp_value_backward", Spy())
    v, ws = _inputs((4, 8), requires_grad=True)
    torch.ops.kha.mlp_value(v, *ws).sum().backward()
    assert calls == [torch.Size([4, 8])]
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_reference_backward_helper_matches_autograd():
    v, ws = _inputs((5, 8), dtype=torch.float64, requires_grad=True)
    grad = torch.randn(v.shape, dtype=torch.float64)
    want = torch.autograd.grad(mlp_value_reference(v, *ws), (v, *ws), grad)
    got = mlp_value_backward_reference(grad, v.detach(), *[w.detach() for w in ws])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_identity_init_returns_v_exactly(dtype):
    d = 16
    v = torch.randn(2, 5, d).to(dtype)
    eye, zero = torch.eye(d, dtype=dtype), torch.zeros(d, d, dtype=dtype)
    y = torch.ops.kha.mlp_value(v, eye, zero, eye)
    assert torch.equal(y, v)


def test_empty_batch():
    v, ws = _inputs((0, 8))
    assert torch.ops.kha.mlp_value(v, *ws).shape == (0, 8)


# ---------------------------------------------------------------------------------------------------
# Errors name the shapes
# ---------------------------------------------------------------------------------------------------
def test_wrong_weight_shape_names_shapes():
    v, ws = _inputs((2, 3, 8))
    with pytest.raises(OpInputError, match=r"w_gate has shape \(8, 4\)") as info:
        torch.ops.kha.mlp_value(v, ws[0], torch.zeros(8, 4), ws[2])
    msg = str(info.value)
    assert "w_gate" in msg and "(8, 4)" in msg and "(2, 3, 8)" in msg and "(8, 8)" in msg
    assert isinstance(info.value, KHAError)


def test_wrong_dtype_names_dtypes():
    v, ws = _inputs((4, 8))
    with pytest.raises(OpInputError, match=r"w_down is torch.float64 but v is torch.float32"):
        torch.ops.kha.mlp_value(v, ws[0], ws[1], ws[2].double())


def test_scalar_v_rejected():
    with pytest.raises(OpInputError, match="scalar"):
        check_mlp_value_inputs(torch.tensor(1.0), *[torch.zeros(1, 1)] * 3)


def test_fake_tensor_errors_too():
    # The checks also run under FakeTensorMode, so torch.compile/export trace-time errors are the same.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        v = torch.empty(2, 8)
        with pytest.raises(OpInputError, match=r"\(8, 7\)"):
            torch.ops.kha.mlp_value(v, torch.empty(8, 8), torch.empty(8, 8), torch.empty(8, 7))


def test_backward_op_grad_shape_error():
    v, ws = _inputs((4, 8))
    with pytest.raises(OpInputError, match=r"grad has shape \(4, 7\).*v has shape \(4, 8\)"):
        mlp_value_backward(torch.zeros(4, 7), v, *ws)


# ---------------------------------------------------------------------------------------------------
# torch.compile and torch.export keep the op
# ---------------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_aot_eager():
    torch._dynamo.reset()

    def f(v, w_up, w_gate, w_down):
        return torch.ops.kha.mlp_value(v * 1.5, w_up, w_gate, w_down).relu()

    v, ws = _inputs((2, 3, 8), requires_grad=True)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(v, *ws)
    torch.testing.assert_close(y, f(v, *ws))
    grads = torch.autograd.grad(y.sum(), (v, *ws))
    want = torch.autograd.grad(f(v, *ws).sum(), (v, *ws))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w)


def test_torch_export_keeps_one_node():
    class M(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.up = torch.nn.Parameter(torch.eye(d))
            self.gate = torch.nn.Parameter(torch.zeros(d, d))
            self.down = torch.nn.Parameter(torch.eye(d))

        def forward(self, v):
            return torch.ops.kha.mlp_value(v, self.up, self.gate, self.down)

    ep = torch.export.export(M(8), (torch.randn(2, 3, 8),))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.kha.mlp_value.default) == 1
    assert not any("sigmoid" in str(t) or "mm" in str(t) for t in targets), targets
    v = torch.randn(2, 3, 8)
    torch.testing.assert_close(ep.module()(v), v)
