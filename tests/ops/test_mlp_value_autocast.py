"""``kha::mlp_value`` under autocast (kha_compile/ops/mlp_value.py): it follows autocast the way matmul does.

Inside ``torch.autocast`` (bf16 or fp16, whichever the region asks for) the op's floating inputs are
cast to the autocast dtype and it runs in that dtype; gradients of fp32 master weights come back in
fp32. Checked in eager, under torch.compile (Inductor and the ``"kha"`` backend), under
torch.export, against the formula written out here on inputs cast by hand (eager) or against the
eager op (the other execution paths). Outside autocast nothing is cast: mixed dtypes are refused
with both dtypes and the fix in the message. The Triton path runs on CUDA (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from kha_compile.core.errors import OpInputError
from kha_compile.ops.mlp_value import autocast_device_types

AMP = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


def _inputs(shape=(3, 40, 16), device="cpu", seed=0):
    """fp32 v and trained-like fp32 weights (leaves that require grad)."""
    g = torch.Generator().manual_seed(seed)
    d = shape[-1]
    v = torch.randn(shape, generator=g)
    ws = [torch.eye(d) + 0.2 * torch.randn(d, d, generator=g) for _ in range(3)]
    return [t.to(device).requires_grad_() for t in (v, *ws)]


def _formula(v, up, gate, down):
    """docs/method.md's MLP-value, written out with plain torch ops (no kha_compile)."""
    return (2 * (v @ up) * torch.sigmoid(v @ gate)) @ down


def _grads(out, leaves, seed=1):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad((out.float() * w).sum(), leaves)


def test_cpu_and_cuda_have_autocast_rules():
    assert {"cpu", "cuda"} <= set(autocast_device_types())


@pytest.mark.parametrize("dtype", AMP, ids=IDS)
def test_eager_autocast_casts_inputs_like_matmul(dtype):
    leaves = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        y = torch.ops.kha.mlp_value(*leaves)
        mm = leaves[0] @ leaves[1]  # what autocast does to a matmul of the same tensors
    assert y.dtype == mm.dtype == dtype
    want = _formula(*(t.detach().to(dtype) for t in leaves))  # cast by hand, outside autocast
    assert torch.equal(y, want)


@pytest.mark.parametrize("dtype", AMP, ids=IDS)
def test_autocast_gradients_reach_fp32_masters_in_fp32(dtype):
    """Gradients come back in fp32 and are as accurate as autograd of the formula in the same precision."""
    leaves = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        got = _grads(torch.ops.kha.mlp_value(*leaves), leaves)
        low = _grads(_formula(*(t.to(dtype) for t in leaves)), leaves)  # autograd in the low precision
    exact = _grads(_formula(*(t.double() for t in leaves)), leaves)  # fp64 reference
    for name, g, lo, ex in zip(("v", "up", "gate", "down"), got, low, exact):
        assert g.dtype == torch.float32, f"grad of {name} is {g.dtype}"
        err, err_low = float((g.double() - ex).abs().max()), float((lo.double() - ex).abs().max())
        assert err <= 4 * err_low + 1e-6, f"grad of {name}: {err:.3g} off fp64, autograd in {dtype} {err_low:.3g}"
        assert float(ex.abs().max()) > 10 * err  # a signal well above the rounding


def test_autocast_dtype_is_read_at_call_time():
    """One process, both precisions: the op follows the region it runs in, not a dtype fixed at import."""
    leaves = _inputs()
    with torch.autocast("cpu", dtype=torch.float16):
        a = torch.ops.kha.mlp_value(*leaves)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b = torch.ops.kha.mlp_value(*leaves)
        with torch.autocast("cpu", enabled=False):
            c = torch.ops.kha.mlp_value(*leaves)
    assert (a.dtype, b.dtype, c.dtype) == (torch.float16, torch.bfloat16, torch.float32)


def test_identity_init_stays_exact_under_autocast():
    d = 16
    v = torch.randn(2, 30, d)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.ops.kha.mlp_value(v, torch.eye(d), torch.zeros(d, d), torch.eye(d))
    assert torch.equal(y, v.to(torch.bfloat16))


class _HandMLP(torch.nn.Module):
    """MLP-value written out in a module's forward (the ``"kha"`` backend fuses it into the op)."""

    def __init__(self, up, gate, down):
        super().__init__()
        self.up, self.gate, self.down = (torch.nn.Parameter(t.detach().clone()) for t in (up, gate, down))

    def forward(self, v):
        return (2 * (v @ self.up) * torch.sigmoid(v @ self.gate)) @ self.down


class _OpMLP(_HandMLP):
    def forward(self, v):
        return torch.ops.kha.mlp_value(v, self.up, self.gate, self.down)


@pytest.mark.inductor
@pytest.mark.parametrize("backend", ["kha", "inductor"])
@pytest.mark.parametrize("module", [_OpMLP, _HandMLP], ids=["op", "written-out"])
def test_compiled_under_autocast_matches_eager(backend, module):
    torch._dynamo.reset()
    kc.backend.reset()
    v, *ws = _inputs()
    eager, mod = _OpMLP(*ws), module(*ws)
    compiled = torch.compile(mod, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(v), eager(v)
    assert got.dtype == want.dtype == torch.bfloat16
    scale = float(want.detach().float().abs().max())
    assert float((got.float() - want.float()).abs().max()) <= 2 * torch.finfo(torch.bfloat16).eps * scale
    got.float().sum().backward()
    want.float().sum().backward()
    for name in ("up", "gate", "down"):
        g, w = getattr(mod, name).grad, getattr(eager, name).grad
        assert g.dtype == torch.float32
        assert float((g - w).abs().max()) <= 8 * torch.finfo(torch.bfloat16).eps * float(w.abs().max())
    if backend == "kha" and module is _HandMLP:
        rewrites = kc.backend.last_stats().rewrites
        assert rewrites.get("fuse_mlp_value", 0) >= 1, rewrites  # the written-out formula became the op
    torch._dynamo.reset()


def test_torch_export_under_autocast_keeps_the_cast():
    class M(_OpMLP):
        def forward(self, v):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return super().forward(v)

    v, *ws = _inputs()
    m = M(*ws)
    ep = torch.export.export(m, (v.detach(),))
    got = ep.module()(v.detach())
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, m(v.detach()))


# ---------------------------------------------------------------------------------------------------
# Outside autocast nothing is cast
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("v_dtype", "w_dtype"), [(torch.float32, torch.float16), (torch.bfloat16, torch.float32)], ids=["fp16-w", "bf16-v"]
)
def test_mixed_dtypes_outside_autocast_are_refused_with_the_fix(v_dtype, w_dtype):
    v = torch.randn(2, 5, 8, dtype=v_dtype)
    ws = [torch.eye(8, dtype=w_dtype) for _ in range(3)]
    pattern = rf"w_up is {w_dtype} but v is {v_dtype}.*model\.to\(dtype\).*torch\.autocast"
    with pytest.raises(OpInputError, match=pattern):
        torch.ops.kha.mlp_value(v, *ws)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False), pytest.raises(OpInputError, match=pattern):
        torch.ops.kha.mlp_value(v, *ws)


def test_float64_is_never_cast_by_autocast():
    v = torch.randn(2, 5, 8, dtype=torch.float64)
    ws = [torch.eye(8, dtype=torch.float64) for _ in range(3)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.ops.kha.mlp_value(v, *ws).dtype == torch.float64


# ---------------------------------------------------------------------------------------------------
# CUDA: autocast in front of the Triton kernels
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA autocast and the Triton kernels)")
@pytest.mark.parametrize("dtype", AMP, ids=IDS)
def test_cuda_autocast_runs_the_triton_kernels(dtype, monkeypatch):
    from kha_compile.kernels import mlp_value as km

    calls = []
    fwd, bwd = km.mlp_value_triton_forward, km.mlp_value_triton_backward
    monkeypatch.setattr(km, "mlp_value_triton_forward", lambda *a: calls.append(a[0].dtype) or fwd(*a))
    monkeypatch.setattr(km, "mlp_value_triton_backward", lambda *a: calls.append(a[0].dtype) or bwd(*a))
    leaves = _inputs((4, 256, 64), device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = torch.ops.kha.mlp_value(*leaves)
        got = _grads(y, leaves)
    assert y.dtype == dtype and calls == [dtype, dtype], calls  # forward and backward ran the kernels
    exact = _grads(_formula(*(t.double() for t in leaves)), leaves)
    want = _formula(*(t.detach().double() for t in leaves))
    tol = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}[dtype]  # as tests/kernels: relative to the largest value
    assert float((y.double() - want).abs().max() / want.abs().max()) < tol
    for g, ex in zip(got, exact):
        assert g.dtype == torch.float32
        assert float((g.double() - ex).abs().max() / ex.abs().max()) < 4 * tol
