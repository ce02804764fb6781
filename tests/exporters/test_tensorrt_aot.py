"""kha_compile/exporters/tensorrt_aot.py: the AOT MLP-value plugin without TensorRT.

The compiled kernel (PTX for sm_90), its argument order, the extents and the launch grid as
functions of symbolic M are checked here; the plugin kernel runs under the Triton interpreter with
that grid and argument order against the op's formula; the aot_impl is driven through a stand-in
``tensorrt.plugin``; the ONNX marking is checked on a real export. With TensorRT and a GPU, the
engine built with the AOT implementation is compared with torch.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import pytest
import sympy
import torch

from kha_compile.core.errors import KernelCompileError, OpInputError
from kha_compile.exporters import tensorrt_aot as taot
from kha_compile.exporters import tensorrt_plugin as trt_plugin
from kha_compile.exporters.onnx import PLUGIN_ID

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable (pip install triton)")
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()


# ---- extents and grid ----------------------------------------------------------------------------


def test_extents_of_concrete_and_symbolic_shapes():
    assert taot.plugin_extents((2, 8, 128, 64)) == (2048, 64)
    assert taot.plugin_extents((5, 32)) == (5, 32)
    assert taot.plugin_extents((32,)) == (1, 32)
    B, L = sympy.symbols("B L", positive=True, integer=True)
    M, d = taot.plugin_extents((B, 4, L, 64))
    assert d == 64 and sympy.simplify(M - 4 * B * L) == 0
    with pytest.raises(OpInputError, match="scalar"):
        taot.plugin_extents(())


@pytest.mark.parametrize("M", [1, 63, 64, 65, 1000, 4096])
def test_grid_covers_every_row_once(M):
    (gx, gy, gz) = taot.launch_grid(M, 64)
    assert (gy, gz) == (1, 1)
    assert (gx - 1) * 64 < M <= gx * 64  # the last program has rows, one more would not


def test_symbolic_grid_evaluates_like_the_concrete_one():
    B, L = sympy.symbols("B L", positive=True, integer=True)
    M, _ = taot.plugin_extents((B, 8, L, 128))
    gx, _, _ = taot.launch_grid(M, 32)
    for b, n in [(1, 1), (1, 3), (2, 100), (4, 2048)]:
        assert gx.subs({B: b, L: n}) == -(-(b * 8 * n) // 32)
    # the division TensorRT is given (tensorrt.plugin.cdiv) is the one used
    seen = []
    taot.launch_grid(M, 16, cdiv=lambda a, b: seen.append((a, b)) or "expr")
    assert seen == [(M, 16)]


# ---- the compiled kernel -------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype, d", [("fp16", 64), ("bf16", 128), ("float32", 32)])
def test_plugin_kernel_is_ptx_in_tensorrts_argument_order(dtype, d):
    k = taot.plugin_kernel(dtype, d, "sm_90")
    assert k.dtype == taot.PLUGIN_DTYPES.get(dtype, dtype) and k.head_dim == d
    entry = re.search(rf"\.entry {re.escape(k.name)}\((.*?)\)", k.ptx, re.DOTALL)
    assert entry, "the PTX defines the kernel under the returned name"
    params = re.findall(r"\.param \.(\w+)", entry.group(1))
    # v, w_up, w_gate, w_down (pointers), M (i32), y (pointer); then Triton's two scratch pointers,
    # which TensorRT passes as null: fine only while the kernel needs no scratch
    assert params[:6] == ["u64", "u64", "u64", "u64", "u32", "u64"]
    assert len(params) - 6 <= 2
    assert taot.PLUGIN_ARGS == ("v", "w_up", "w_gate", "w_down", "M", "y")
    assert k.block == (32 * k.num_warps, 1, 1)
    from kha_compile.kernels.aot import SHARED_LIMITS

    assert 0 < k.shared_bytes <= SHARED_LIMITS[90]
    assert k.block_m >= 16 and k.block_m & (k.block_m - 1) == 0


@needs_triton
def test_plugin_kernel_rejects_head_sizes_above_the_kernels():
    with pytest.raises(KernelCompileError, match="d=256"):
        taot.plugin_kernel("fp16", 256, "sm_90")


@needs_triton
@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 32), (2, 4, 9, 64)])
def test_plugin_kernel_computes_mlp_value_with_that_grid(monkeypatch, shape):
    """The wrapper under the interpreter: TensorRT's argument order and grid give the op's output."""
    from kha_compile.kernels.availability import interpreter_defect

    if interpreter_defect() is not None:
        pytest.skip(interpreter_defect())
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import kha_compile.kernels.mlp_value as km
    from kha_compile.ops.mlp_value import mlp_value_reference

    g = torch.Generator().manual_seed(0)
    d = shape[-1]
    v = torch.randn(*shape, generator=g)
    ws = [torch.randn(d, d, generator=g) / d**0.5 for _ in range(3)]
    y = torch.full_like(v, float("nan"))
    M, _ = taot.plugin_extents(v.shape)
    block_m = 16
    kernel = km._build_kernels(interpret=True, autotune=False).fwd_plugin
    args = dict(zip(taot.PLUGIN_ARGS, (v, *ws, M, y)))
    kernel[taot.launch_grid(M, block_m)](
        *(args[n] for n in taot.PLUGIN_ARGS), d=d, D=km.padded_d(d), BLOCK_M=block_m, PRECISION="ieee"
    )
    torch.testing.assert_close(y, mlp_value_reference(v, *ws), rtol=1e-5, atol=1e-5)


# ---- aot_impl through a stand-in tensorrt.plugin -------------------------------------------------


class _Expr:
    """Stand-in for tensorrt.plugin.ShapeExpr, over sympy."""

    def __init__(self, e):
        self.e, self.is_fake = sympy.sympify(e), False

    is_constant = property(lambda self: self.e.is_number)

    def constant_value(self):
        return int(self.e)

    def __mul__(self, o):
        return _Expr(self.e * (o.e if isinstance(o, _Expr) else o))


class _Desc:
    def __init__(self, shape, dtype="H"):
        self.shape_expr, self.dtype, self.ndim = [_Expr(s) for s in shape], dtype, len(shape)


@pytest.fixture
def fake_trt(monkeypatch):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.0"
    trt.DataType = types.SimpleNamespace(FLOAT="F", HALF="H", BF16="B")
    plugin = types.ModuleType("tensorrt.plugin")
    registered = {}
    for kind in ("register", "autotune", "impl", "aot_impl"):
        setattr(plugin, kind, lambda pid, kind=kind: lambda fn: registered.setdefault((kind, pid), fn))
    plugin.TensorDesc = _Desc
    plugin.AutoTuneCombination = lambda *a: a
    plugin.KernelLaunchParams = type("KernelLaunchParams", (), {})
    plugin.SymInt32 = lambda e: ("SymInt32", e)
    plugin.SymIntExprs = types.SimpleNamespace(from_tuple=lambda t: ("SymIntExprs", tuple(t)))
    plugin.cdiv = lambda a, b: ("cdiv", a, b)
    trt.plugin = plugin
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trt_plugin, "_PLUGIN_REGISTERED", False)
    monkeypatch.setattr(trt_plugin, "_AOT_REGISTERED", False)
    monkeypatch.setattr(taot, "_current_arch", lambda: "sm_90")
    return registered


@needs_triton
def test_aot_impl_returns_name_ptx_launch_params_and_symbolic_m(fake_trt):
    trt_plugin.register_mlp_value_plugin()
    assert trt_plugin.aot_registered()
    assert {k for k, _ in fake_trt} == {"register", "autotune", "impl", "aot_impl"}
    aot_impl = fake_trt["aot_impl", PLUGIN_ID]
    B, L = sympy.symbols("B L", positive=True, integer=True)
    v = _Desc((B, 4, L, 64), "H")
    w = _Desc((64, 64), "H")
    name, ptx, params, extra = aot_impl(v, w, w, w, (v,), 0)
    k = taot.plugin_kernel("fp16", 64, "sm_90")
    assert name == k.name.encode() and ptx == k.ptx.encode()
    assert f".entry {k.name}(".encode() in ptx
    # grid: ceil(M / BLOCK_M) programs through tensorrt.plugin.cdiv, M = B * 4 * L
    kind, m_expr, block_m = params.grid_x
    assert kind == "cdiv" and block_m == k.block_m and sympy.simplify(m_expr.e - 4 * B * L) == 0
    assert params.block_x == k.block[0] and k.block[1:] == (1, 1) and taot.launch_grid(7, 16)[1:] == (1, 1)
    assert not hasattr(params, "grid_y") and not hasattr(params, "block_y")  # TensorRT's defaults (1)
    assert params.shared_mem == k.shared_bytes
    # the one scalar argument, M, as a SymInt32 of the same expression
    (tag, (sym,)) = extra
    assert tag == "SymIntExprs" and sym[0] == "SymInt32" and sympy.simplify(sym[1].e - 4 * B * L) == 0


@needs_triton
def test_aot_impl_needs_a_known_head_size(fake_trt):
    trt_plugin.register_mlp_value_plugin()
    d = sympy.Symbol("d")
    v = _Desc((2, 3, d), "F")
    with pytest.raises(OpInputError, match="head size"):
        fake_trt["aot_impl", PLUGIN_ID](v, v, v, v, (v,), 0)


def test_without_aot_impl_the_plugin_stays_jit(fake_trt):
    del sys.modules["tensorrt.plugin"].aot_impl
    trt_plugin.register_mlp_value_plugin()
    assert not trt_plugin.aot_registered()
    assert ("impl", PLUGIN_ID) in fake_trt and ("aot_impl", PLUGIN_ID) not in fake_trt


# ---- ONNX marking --------------------------------------------------------------------------------


def _mlp_onnx(tmp_path, d, with_model=False):
    import kha_compile  # noqa: F401
    from kha_compile.exporters.onnx import export_onnx

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, d, d))

        def forward(self, x):  # (B, H, L, d)
            return torch.ops.kha.mlp_value(x, self.w[0], self.w[1], self.w[2]) + x

    net = Net().eval()
    path = export_onnx(net, tmp_path / f"m{d}.onnx", example_args=(torch.randn(1, 2, 3, d),))
    return (net, path) if with_model else path


@pytest.mark.parametrize("d, marked", [(16, 1), (160, 0)])
def test_mark_aot_nodes(tmp_path, d, marked):
    import onnx

    model = onnx.load(str(_mlp_onnx(tmp_path, d)))
    nodes = [n for n in model.graph.node if n.op_type == "MLPValue"]
    assert len(nodes) == 1
    assert taot.mark_aot_nodes(model) == marked
    aot = [a for a in nodes[0].attribute if a.name == "aot"]
    assert [a.i for a in aot] == ([1] if marked else [])
    assert {a.name for a in nodes[0].attribute} >= {"plugin_namespace", "plugin_version"}
    taot.mark_aot_nodes(model)  # idempotent: still one attribute
    assert len([a for a in nodes[0].attribute if a.name == "aot"]) == marked


# ---- the engine (TensorRT >= 10.10 + NVIDIA GPU only) ------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_TRT, reason="needs TensorRT (>= 10.10 for aot_impl) and an NVIDIA GPU")
def test_aot_engine_matches_torch(tmp_path, caplog):
    from kha_compile.exporters.tensorrt import export_tensorrt, run_engine

    caplog.set_level("INFO", logger="kha_compile.exporters.tensorrt")

    net, onnx_path = _mlp_onnx(tmp_path, 64, with_model=True)
    engine = export_tensorrt(
        onnx_path, tmp_path / "m.engine", precision="fp32", aot=True, dim_ranges={"batch": (1, 1, 2)}
    )
    x = torch.randn(2, 2, 3, 64)  # (batch, 2, 3, 64): batch is dynamic
    (y,) = run_engine(engine, {"x": x}).values()
    with torch.no_grad():
        want = net(x)
    assert float((y - want).abs().max() / want.abs().max()) < 1e-4
    assert any("1 of 1 MLPValue nodes use the AOT plugin implementation" in r.getMessage() for r in caplog.records)
