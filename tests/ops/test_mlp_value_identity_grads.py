"""At identity init, MLP-value passes the incoming gradient through to v bit for bit, tiny entries included.

``2 * sigmoid(0) = 1`` and ``x @ I = x`` are exact, so V~ = V and dL/dV = dL/dV~ exactly, in any dtype. A
gradient with entries from 1e-7 to 1e2 (fp16's subnormals start below 6.1e-5, its smallest step is
6e-8) must come back unchanged: a backward that halves the gradient first and doubles it later, or
that rounds through a low-precision intermediate, loses the last bits of the small entries, which a
bound relative to the largest gradient does not see. Checked for the op (``torch.ops.kha.mlp_value``:
its autograd and ``kha::mlp_value_backward``), for the op under ``create_graph`` (the differentiable
formula), and for what KHA's MLP-value module runs in plain eager mode.
"""

from __future__ import annotations

import pytest
import torch

from kha_compile.model.transforms.mlp import KHAMLPValue

D = 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _spread_gradient(dtype: torch.dtype, shape=(2, 64, D)) -> torch.Tensor:
    """Entries of magnitude 10^u, u uniform in [-7, 2], random signs, rounded to ``dtype``."""
    g = torch.Generator().manual_seed(0)
    mag = 10.0 ** (torch.rand(shape, generator=g) * 9 - 7)
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mag).to(dtype)


def _identity(dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.eye(D, dtype=dtype), torch.zeros(D, D, dtype=dtype), torch.eye(D, dtype=dtype)]


def _v(dtype: torch.dtype) -> torch.Tensor:
    return (3 * torch.randn(2, 64, D, generator=torch.Generator().manual_seed(1))).to(dtype).requires_grad_()


def _check(dtype, grad_out, grad_v):
    tiny = grad_out.abs() < torch.finfo(dtype).tiny  # subnormal entries (fp16: below 6.1e-5)
    if dtype == torch.float16:
        assert tiny.sum() > 100 and (grad_out[tiny] != 0).all()  # the case holds subnormals, none flushed
    lost = (grad_v != grad_out).sum()
    assert torch.equal(grad_v, grad_out), f"{int(lost)} of {grad_out.numel()} gradient entries changed"


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_op_passes_the_gradient_through_bit_for_bit(dtype):
    v, grad_out = _v(dtype), _spread_gradient(dtype)
    y = torch.ops.kha.mlp_value(v, *_identity(dtype))
    assert torch.equal(y, v.detach())
    (grad_v,) = torch.autograd.grad(y, v, grad_out)
    _check(dtype, grad_out, grad_v)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_backward_op_and_the_double_backward_formula_pass_it_through(dtype):
    v, grad_out = _v(dtype), _spread_gradient(dtype)
    gv, *_ = torch.ops.kha.mlp_value_backward(grad_out, v.detach(), *_identity(dtype))
    _check(dtype, grad_out, gv)
    y = torch.ops.kha.mlp_value(v, *_identity(dtype))
    (grad_v,) = torch.autograd.grad(y, v, grad_out, create_graph=True)
    _check(dtype, grad_out, grad_v.detach())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_mlp_value_module_passes_it_through(dtype):
    module = KHAMLPValue(D).to(dtype)
    v, grad_out = _v(dtype), _spread_gradient(dtype)
    y = module(v)
    assert torch.equal(y, v.detach())
    (grad_v,) = torch.autograd.grad(y, v, grad_out)
    _check(dtype, grad_out, grad_v)
