"""kha_compile/ops/mlp_value_path.py: which path the op's CUDA implementation takes (kernels, compiled, formula).

The CUDA implementations are called on CPU tensors here (their dispatch does not depend on the
device); torch.compile is replaced by a recording stand-in that runs the formula it was given, so
what is checked is which path ran, and the result against an fp64 autograd reference.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kha_compile.core.errors import KHAConfigError
from kha_compile.ops import mlp_value_path as paths

op = importlib.import_module("kha_compile.ops.mlp_value")  # the package re-exports the op under this name


def _inputs(M=24, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(2, M // 2, d, generator=g)  # (B, L, d): the op takes leading dims
    ws = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(3)]
    return v, ws, torch.randn(v.shape, generator=g)


def _reference(v, ws, grad):
    leaves = [t.double().requires_grad_() for t in (v, *ws)]
    y = 2.0 * ((leaves[0] @ leaves[1]) * torch.sigmoid(leaves[0] @ leaves[2])) @ leaves[3]
    return y.detach(), torch.autograd.grad(y, leaves, grad.double())


@pytest.fixture
def calls(monkeypatch):
    """Which formulas went through torch.compile (stand-in: runs the formula eagerly)."""
    seen: list[str] = []

    def fake_compile(fn):
        def run(*args):
            seen.append(fn.__name__)
            return fn(*args)

        return run

    monkeypatch.setattr(op, "compiled_formula", fake_compile)
    monkeypatch.setattr(op, "_COMPILE_BROKEN", set())
    monkeypatch.delenv(paths.ENV, raising=False)
    return seen


def _no_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton kernels ran")

    monkeypatch.setattr(op.kernels, "mlp_value_triton_forward", refuse)
    monkeypatch.setattr(op.kernels, "mlp_value_triton_backward", refuse)


def test_env_compiled_runs_the_compiled_formula_both_ways(monkeypatch, calls):
    monkeypatch.setenv(paths.ENV, "compiled")
    _no_kernels(monkeypatch)
    v, ws, grad = _inputs()
    want_y, want_g = _reference(v, ws, grad)
    y = op._mlp_value_cuda(v, *ws)
    grads = op._mlp_value_backward_cuda(grad, v, *ws)
    assert calls == ["mlp_value_reference", "mlp_value_backward_reference"]
    torch.testing.assert_close(y.double(), want_y, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_g):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_recorded_choice_per_gpu_direction_and_size(monkeypatch, calls):
    _no_kernels(monkeypatch)
    monkeypatch.setattr(paths, "_device_name", lambda index: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    v, ws, grad = _inputs(d=16)
    monkeypatch.setitem(paths.RECORDED, paths.recorded_key("backward", "NVIDIA H200", 16, torch.float32), "compiled")
    monkeypatch.setitem(paths.RECORDED, paths.recorded_key("forward", "NVIDIA H100 80GB HBM3", 16, torch.float32), "x")
    assert paths.mlp_value_path("forward", v) == "kernel"  # recorded for another GPU only
    assert paths.mlp_value_path("backward", v) == "compiled"
    assert paths.mlp_value_path("backward", v.bfloat16()) == "kernel"  # another dtype
    assert paths.mlp_value_path("backward", torch.randn(3, 64)) == "kernel"  # another head size
    op._mlp_value_backward_cuda(grad, v, *ws)
    assert calls == ["mlp_value_backward_reference"]


def test_env_formula_and_kernel(monkeypatch, calls):
    v, ws, grad = _inputs()
    want_y, _ = _reference(v, ws, grad)
    monkeypatch.setenv(paths.ENV, "formula")
    _no_kernels(monkeypatch)
    torch.testing.assert_close(op._mlp_value_cuda(v, *ws).double(), want_y, rtol=1e-5, atol=1e-5)
    assert calls == []
    monkeypatch.setenv(paths.ENV, "Kernel ")
    assert paths.mlp_value_path("forward", v) == "kernel"


def test_env_with_another_value_is_refused(monkeypatch):
    monkeypatch.setenv(paths.ENV, "fastest")
    with pytest.raises(KHAConfigError, match=r"KHA_MLP_VALUE_PATH='fastest'.*kernel, compiled, formula or auto"):
        paths.mlp_value_path("forward", torch.randn(2, 16))


def test_a_compile_failure_warns_once_and_runs_the_eager_formula(monkeypatch, caplog):
    monkeypatch.setenv(paths.ENV, "compiled")
    monkeypatch.setattr(op, "_COMPILE_BROKEN", set())
    tries = []

    def broken(fn):
        def run(*args):
            tries.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no compiler here")

        return run

    monkeypatch.setattr(op, "compiled_formula", broken)
    v, ws, grad = _inputs()
    want_y, _ = _reference(v, ws, grad)
    with caplog.at_level("WARNING", logger="kha_compile.ops.mlp_value"):
        y1 = op._mlp_value_cuda(v, *ws)
        y2 = op._mlp_value_cuda(v, *ws)
    assert tries == [1] and torch.equal(y1, y2)
    torch.testing.assert_close(y1.double(), want_y, rtol=1e-5, atol=1e-5)
    assert "no compiler here" in caplog.text and "eager formula" in caplog.text
