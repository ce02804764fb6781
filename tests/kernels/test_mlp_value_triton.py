"""Tests for kha_compile/kernels/mlp_value.py: the fused Triton kernels, run on CPU under TRITON_INTERPRET=1.

The kernels are built on first use, per mode, so setting TRITON_INTERPRET=1 in a fixture (before the
first launch in this module) is enough; the variable is restored afterwards.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest
import torch

import kha_compile  # noqa: F401  (registers torch.ops.kha.*)
import kha_compile.kernels.mlp_value as km
from kha_compile.core.errors import BackendUnavailableError, KHAError, OpInputError
from kha_compile.kernels import mlp_value_triton, mlp_value_triton_backward, triton_available
from kha_compile.kernels.availability import interpreter_defect

HAS_TRITON = importlib.util.find_spec("triton") is not None
if HAS_TRITON:
    # Imported before TRITON_INTERPRET=1 is set, as happens in a full test run (torch.compile and
    # others import triton): the kernels must not depend on triton's own @jit helpers then.
    import triton  # noqa: F401
DEFECT = interpreter_defect()  # this triton's interpreter cannot run the kernels (with this numpy)
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or DEFECT is not None, reason=DEFECT or "triton is not importable (pip install triton)"
)


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(M, d, dtype, seed=0):
    """bf16/fp16/fp32 inputs, and the same values in fp64 for the reference."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(M, d, generator=g).to(dtype)
    ws = [(torch.randn(d, d, generator=g) / d**0.5).to(dtype) for _ in range(3)]
    grad = torch.randn(M, d, generator=g).to(dtype)
    return v, ws, grad


def _reference(v, ws, grad):
    """Output and the four gradients in fp64, by autograd of the written-out formula."""
    v64 = v.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in ws]
    y = 2.0 * ((v64 @ w64[0]) * torch.sigmoid(v64 @ w64[1])) @ w64[2]
    grads = torch.autograd.grad(y, (v64, *w64), grad.double())
    return y.detach(), grads


def _rel_err(got, want):
    """max |got - want| / max |want| (want is fp64)."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# Tolerances, relative to the largest reference value (fp64, from the same rounded inputs). fp32: exact
# up to summation order (measured <= 8e-7). bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3)
# and rounds h, grad_a, grad_g and the output once each: measured <= 6.6e-3 here, eager bf16 torch
# <= 1.2e-2. fp16 (11 bits): measured <= 7e-4, eager <= 1.3e-3.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
SIZES = [(1, 16), (17, 16), (64, 16), (1, 64), (17, 64), (64, 64), (1, 128), (17, 128), (64, 128)]


# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,d", SIZES, ids=[f"M{m}-d{d}" for m, d in SIZES])
def test_forward_matches_formula(M, d, dtype):
    v, ws, grad = _inputs(M, d, dtype)
    y = mlp_value_triton(v, *ws)
    want, _ = _reference(v, ws, grad)
    assert y.shape == (M, d) and y.dtype == dtype
    assert want.abs().max() > 0.5  # a real signal to compare
    assert _rel_err(y, want) < TOL[dtype]


@needs_triton
def test_forward_bf16_no_worse_than_eager_bf16():
    v, ws, grad = _inputs(64, 64, torch.bfloat16, seed=3)
    want, _ = _reference(v, ws, grad)
    eager = 2.0 * ((v @ ws[0]) * torch.sigmoid(v @ ws[1])) @ ws[2]  # bf16 throughout
    assert _rel_err(mlp_value_triton(v, *ws), want) <= 1.25 * _rel_err(eager, want) + 1e-3


@needs_triton
@pytest.mark.parametrize("d", [8, 24, 100], ids=["d8-pad16", "d24-pad32", "d100-pad128"])
def test_forward_padded_d(d):
    v, ws, grad = _inputs(19, d, torch.float32)
    want, _ = _reference(v, ws, grad)
    assert _rel_err(mlp_value_triton(v, *ws), want) < TOL[torch.float32]


@needs_triton
def test_forward_fp16():
    v, ws, grad = _inputs(33, 32, torch.float16)
    want, _ = _reference(v, ws, grad)
    assert _rel_err(mlp_value_triton(v, *ws), want) < TOL[torch.float16]


@needs_triton
def test_forward_row_strided_input():
    # v is a column slice of a wider buffer (row stride 3d), as a head slice of a fused projection is.
    wide, ws, grad = _inputs(20, 96, torch.float32)
    v = wide[:, 32:64]
    assert v.stride() == (96, 1)
    ws = [w[:32, :32].contiguous() for w in ws]
    want, _ = _reference(v, ws, grad[:, :32])
    assert _rel_err(mlp_value_triton(v, *ws), want) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_identity_init_exact(dtype):
    d = 32
    v = torch.randn(40, d).to(dtype)
    eye, zero = torch.eye(d, dtype=dtype), torch.zeros(d, d, dtype=dtype)
    assert torch.equal(mlp_value_triton(v, eye, zero, eye), v)


@needs_triton
def test_block_m_tiles_walked_per_program():
    # M = 200 rows at BLOCK_M = 16 is 13 tiles over 4 programs: each program walks several tiles.
    v, ws, grad = _inputs(200, 16, torch.float32)
    want, _ = _reference(v, ws, grad)
    y = km.mlp_value_triton_forward(v, *ws, block_m=16)
    assert _rel_err(y, want) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,d", SIZES, ids=[f"M{m}-d{d}" for m, d in SIZES])
def test_backward_matches_formula(M, d, dtype):
    v, ws, grad = _inputs(M, d, dtype)
    got = mlp_value_triton_backward(grad, v, *ws)
    _, want = _reference(v, ws, grad)
    for name, g, w in zip(("v", "w_up", "w_gate", "w_down"), got, want):
        assert g.shape == w.shape and g.dtype == dtype, name
        assert w.abs().max() > 1e-2, name
        assert _rel_err(g, w) < TOL[dtype], name


@needs_triton
@pytest.mark.parametrize(
    "d,block_n,dtype,rows",
    [
        (64, 32, torch.float32, 45),
        (64, 16, torch.float32, 45),
        (128, 128, torch.float32, 45),
        (24, 16, torch.float32, 45),
        (128, None, torch.float16, 33),
    ],
    ids=["d64-split32", "d64-split16", "d128-fused", "d24-split", "d128-fp16-default"],
)
def test_backward_fused_and_split_paths(d, block_n, dtype, rows):
    v, ws, grad = _inputs(rows, d, dtype, seed=1)
    kwargs = {} if block_n is None else {"block_n": block_n}
    got = mlp_value_triton_backward(grad, v, *ws, **kwargs)
    _, want = _reference(v, ws, grad)
    for g, w in zip(got, want):
        assert _rel_err(g, w) < TOL[dtype]


@needs_triton
def test_autograd_through_mlp_value_triton():
    v, ws, grad = _inputs(17, 16, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (v, *ws)]
    y = mlp_value_triton(*leaves)
    assert y.grad_fn is not None
    y.backward(grad)
    _, want = _reference(v, ws, grad)
    for t, w in zip(leaves, want):
        assert _rel_err(t.grad, w) < TOL[torch.float32]


@needs_triton
def test_empty_rows():
    v, ws, grad = _inputs(0, 16, torch.float32)
    assert mlp_value_triton(v, *ws).shape == (0, 16)
    gv, gu, gg, gd = mlp_value_triton_backward(grad, v, *ws)
    assert gv.shape == (0, 16)
    assert all(torch.equal(w, torch.zeros(16, 16)) for w in (gu, gg, gd))


# ---------------------------------------------------------------------------------------------------
# The op's CUDA implementation (kha_compile/ops/mlp_value.py) drives the kernels through a reshape
# ---------------------------------------------------------------------------------------------------
@needs_triton
def test_op_cuda_impl_reshapes_leading_dims():
    from kha_compile.ops.mlp_value import _mlp_value_backward_cuda, _mlp_value_cuda

    v, ws, grad = _inputs(2 * 3 * 5, 16, torch.float32)
    v3, g3 = v.reshape(2, 3, 5, 16), grad.reshape(2, 3, 5, 16)
    want_y, want_g = _reference(v, ws, grad)
    y = _mlp_value_cuda(v3, *ws)
    assert y.shape == (2, 3, 5, 16)
    assert _rel_err(y.reshape(-1, 16), want_y) < TOL[torch.float32]
    gv, gu, gg, gd = _mlp_value_backward_cuda(g3, v3, *ws)
    assert gv.shape == v3.shape
    for g, w in zip((gv.reshape(-1, 16), gu, gg, gd), want_g):
        assert _rel_err(g, w) < TOL[torch.float32]


@needs_triton
@pytest.mark.parametrize("M", [0, 40])
def test_backward_outputs_share_no_storage(M):
    """The backward op's four outputs are tensors of their own: a custom op may not return aliases
    (torch refuses them on CUDA: "may not alias any inputs to this custom operator or other returns")."""
    v, ws, grad = _inputs(M, 16, torch.float32)
    outs = mlp_value_triton_backward(grad, v, *ws)
    ptrs = [t.untyped_storage().data_ptr() for t in outs if t.numel()]
    inputs = {t.untyped_storage().data_ptr() for t in (grad, v, *ws) if t.numel()}
    assert len(set(ptrs)) == len(ptrs) and not set(ptrs) & inputs


@needs_triton
def test_op_cuda_impl_falls_back_where_kernel_does_not_apply():
    from kha_compile.ops.mlp_value import _mlp_value_cuda

    v = torch.randn(3, 4, dtype=torch.float64)  # float64: not a kernel dtype -> the composite
    ws = [torch.randn(4, 4, dtype=torch.float64) for _ in range(3)]
    want = 2.0 * ((v @ ws[0]) * torch.sigmoid(v @ ws[1])) @ ws[2]
    torch.testing.assert_close(_mlp_value_cuda(v, *ws), want)


@needs_triton
def test_op_cuda_impl_falls_back_once_when_triton_cannot_build(monkeypatch, caplog):
    from triton.runtime.errors import OutOfResources

    op = importlib.import_module("kha_compile.ops.mlp_value")  # (the package re-exports the op by that name)
    monkeypatch.setattr(op, "_TRITON_BROKEN", set())
    calls = []

    def no_smem(*args, **kwargs):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(km, "mlp_value_triton_forward", no_smem)
    v, ws, grad = _inputs(6, 16, torch.float32)
    want, _ = _reference(v, ws, grad)
    with caplog.at_level("WARNING", logger="kha_compile.ops.mlp_value"):
        y1 = op._mlp_value_cuda(v, *ws)
        y2 = op._mlp_value_cuda(v, *ws)
    assert _rel_err(y1, want) < TOL[torch.float32] and torch.equal(y1, y2)
    assert calls == [1]  # tried once, then remembered
    assert "could not be built" in caplog.text and "OutOfResources" in caplog.text

    def other_bug(*args, **kwargs):
        raise RuntimeError("not a build error")

    monkeypatch.setattr(km, "mlp_value_triton_backward", other_bug)
    with pytest.raises(RuntimeError, match="not a build error"):
        op._mlp_value_backward_cuda(grad, v, *ws)


# ---------------------------------------------------------------------------------------------------
# The GPU launch path: autotuned wrappers (run here in the interpreter with a stub benchmark)
# ---------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("M,d", [(20, 128), (20, 32)], ids=["d128-split", "d32-fused"])
def test_autotuned_launch_path(monkeypatch, M, d):
    benched = []

    def stub_bench(fn, quantiles=None, **kwargs):
        fn()
        benched.append(1)
        return [float(len(benched))] * 3  # the first config "wins"

    tuned = km._build_kernels(True, autotune=True, do_bench=stub_bench)
    monkeypatch.setattr(km, "_kernels", lambda interpret: tuned)
    v, ws, grad = _inputs(M, d, torch.bfloat16)
    y = km.mlp_value_triton_forward(v, *ws)
    got = km.mlp_value_triton_backward(grad, v, *ws)
    want_y, want_g = _reference(v, ws, grad)
    assert _rel_err(y, want_y) < TOL[torch.bfloat16]
    for g, w in zip(got, want_g):
        assert _rel_err(g, w) < TOL[torch.bfloat16]
    kinds = ["fwd", "dv", "dw"] if d > 64 else ["fwd", "fused"]
    for kind in kinds:  # each launch went through its own tuner, which benchmarked every config
        cls = km.config_class(kind, km.padded_d(d), torch.bfloat16)
        assert tuned.tuner(kind, cls).best_config is not None, kind
    assert len(benched) == sum(len(km.CONFIGS[(k, km.config_class(k, km.padded_d(d), torch.bfloat16))]) for k in kinds)


@needs_triton
def test_interpreter_beside_a_gpu_keeps_every_config(monkeypatch):
    """CPU tensors under the interpreter on a machine with an sm_90 GPU: the launches still autotune over
    every config. The GPU's architecture applies to CUDA tensors only (this failed on the lent H200)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    benched = []

    def stub_bench(fn, quantiles=None, **kwargs):
        fn()
        benched.append(1)
        return [float(len(benched))] * 3

    tuned = km._build_kernels(True, autotune=True, do_bench=stub_bench)
    monkeypatch.setattr(km, "_kernels", lambda interpret: tuned)
    v, ws, grad = _inputs(20, 32, torch.bfloat16)
    got = km.mlp_value_triton_backward(grad, v, *ws)
    _, want = _reference(v, ws, grad)
    assert all(_rel_err(g, w) < TOL[torch.bfloat16] for g, w in zip(got, want))
    every = km.CONFIGS[("fused", "16bit")]
    assert km.configs_for("fused", "16bit", 32, 90) != every  # sm_90 itself leaves some out at D = 32
    assert len(benched) == len(every)


# ---------------------------------------------------------------------------------------------------
# Errors and availability
# ---------------------------------------------------------------------------------------------------
def test_rejects_3d_v_naming_shape():
    v = torch.randn(2, 3, 16)
    ws = [torch.randn(16, 16)] * 3
    with pytest.raises(OpInputError, match=r"\(2, 3, 16\)"):
        mlp_value_triton(v, *ws)


def test_rejects_large_d_and_float64():
    with pytest.raises(OpInputError, match=r"d = 256.*<= 128"):
        mlp_value_triton(torch.randn(4, 256), *[torch.randn(256, 256)] * 3)
    with pytest.raises(OpInputError, match=r"float64"):
        mlp_value_triton(torch.randn(4, 8, dtype=torch.float64), *[torch.randn(8, 8, dtype=torch.float64)] * 3)


def test_rejects_weight_shape_and_dtype():
    v = torch.randn(4, 16)
    with pytest.raises(OpInputError, match=r"w_gate has shape \(16, 8\).*\(4, 16\)"):
        mlp_value_triton(v, torch.randn(16, 16), torch.randn(16, 8), torch.randn(16, 16))
    with pytest.raises(OpInputError, match=r"w_down is torch.bfloat16 but v is torch.float32"):
        mlp_value_triton(v, torch.randn(16, 16), torch.randn(16, 16), torch.randn(16, 16).bfloat16())
    with pytest.raises(OpInputError, match=r"grad_out has shape \(3, 16\)"):
        mlp_value_triton_backward(torch.randn(3, 16), v, *[torch.randn(16, 16)] * 3)


@needs_triton
def test_bad_block_sizes_rejected():
    v = torch.randn(4, 16)
    ws = [torch.randn(16, 16)] * 3
    with pytest.raises(OpInputError, match="power of two >= 16"):
        km.mlp_value_triton_forward(v, *ws, block_m=8)


def test_without_triton_raises_backend_unavailable(monkeypatch):
    monkeypatch.setattr("kha_compile.kernels.availability.import_triton", lambda: None)
    assert not triton_available()
    with pytest.raises(BackendUnavailableError, match="pip install triton") as info:
        mlp_value_triton(torch.randn(4, 16), *[torch.randn(16, 16)] * 3)
    msg = str(info.value)
    assert "pip install triton" in msg and "NVIDIA GPU" in msg and "TRITON_INTERPRET=1" in msg
    assert isinstance(info.value, KHAError)


@needs_triton
def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        mlp_value_triton(torch.randn(4, 16), *[torch.randn(16, 16)] * 3)


def test_package_imports_without_triton():
    # A fresh interpreter where `import triton` fails: kha_compile and its kernels module still import.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kha_compile, kha_compile.kernels as k\n"
        "assert not k.triton_available()\n"
        "import torch\n"
        "try:\n"
        "    k.mlp_value_triton(torch.randn(2, 16), *[torch.eye(16)] * 3)\n"
        "except kha_compile.KHAError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("BackendUnavailableError") and "pip install triton" in out.stdout
