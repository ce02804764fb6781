"""kha_compile.exporters.tensorrt: the plugin's shape/type rules, the profile and precision plan,
the plugin wiring (against a stand-in tensorrt.plugin), the errors without TensorRT, and, on a
machine with TensorRT and an NVIDIA GPU, the engine itself."""

import importlib.util
import inspect
import sys
import types

import pytest
import torch

from kha_compile.core.errors import BackendUnavailableError, ExportError, OpInputError
from kha_compile.exporters import tensorrt as trt_export
from kha_compile.exporters import tensorrt_plugin as trt_plugin
from kha_compile.exporters.onnx import PLUGIN_ID, TensorInfo
from kha_compile.exporters.tensorrt import (
    BuildPlan,
    build_plan,
    export_tensorrt,
    mlp_value_output_dtype,
    mlp_value_output_shape,
    profile_shapes,
    register_mlp_value_plugin,
    run_engine,
)

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None and torch.cuda.is_available()
NEEDS_TRT = pytest.mark.skipif(
    not HAVE_TRT,
    reason="needs TensorRT (pip install tensorrt, >= 10.7) and an NVIDIA GPU; "
    "benchmarks/gpu_check.py runs the same check on such a machine",
)


# ---- the plugin's shape and type rules ------------------------------------------------------


@pytest.mark.parametrize(
    "shapes, out",
    [
        ([(2, 4, 16, 8), (8, 8), (8, 8), (8, 8)], (2, 4, 16, 8)),
        ([(None, 4, None, 64), (64, 64), (64, 64), (64, 64)], (None, 4, None, 64)),
        ([(5, 8), (8, None), (None, 8), (8, 8)], (5, 8)),  # unknown weight dims are fine
        ([(3, None), (8, 8), (8, 8), (8, 8)], (3, None)),  # unknown d: weights decide later
    ],
)
def test_output_shape_is_that_of_v(shapes, out):
    assert mlp_value_output_shape(shapes) == out


@pytest.mark.parametrize(
    "shapes, match",
    [
        ([(2, 8), (8, 4), (8, 8), (8, 8)], "w_up has shape"),
        ([(2, 8), (8, 8), (8, 8), (4, 4)], "w_down has shape"),
        ([(2, 8), (8, 8), (8, 8, 1), (8, 8)], "w_gate must be a"),
        ([(), (8, 8), (8, 8), (8, 8)], "scalar"),
        ([(2, 8), (8, 8), (8, 8)], "4 inputs"),
    ],
)
def test_output_shape_rejects_bad_inputs(shapes, match):
    with pytest.raises(OpInputError, match=match):
        mlp_value_output_shape(shapes)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_output_dtype_is_the_shared_input_type(dtype):
    assert mlp_value_output_dtype([dtype] * 4) == dtype


@pytest.mark.parametrize(
    "dtypes, match",
    [
        (["float16", "float32", "float16", "float16"], "one type"),
        (["int32"] * 4, "supports"),
        (["float32"] * 3, "4 inputs"),
    ],
)
def test_output_dtype_rejects_bad_inputs(dtypes, match):
    with pytest.raises(OpInputError, match=match):
        mlp_value_output_dtype(dtypes)


# ---- optimization profile ----------------------------------------------------------------------

INPUTS = [
    TensorInfo("input_ids", "int64", ("batch", "seq")),
    TensorInfo("attention_mask", "int64", ("attention_mask_batch", "seq")),
    TensorInfo("scale", "float32", (4,)),
]


def _check_profile_invariants(inputs, shapes):
    """What a TensorRT profile must satisfy, whatever the ranges: one entry per input, rank kept,
    fixed dims pinned, min <= opt <= max, and one range per dim name across inputs."""
    assert set(shapes) == {i.name for i in inputs}
    by_name: dict = {}
    for info in inputs:
        lo, opt, hi = shapes[info.name]
        assert len(lo) == len(opt) == len(hi) == len(info.dims)
        for axis, dim in enumerate(info.dims):
            assert 1 <= lo[axis] <= opt[axis] <= hi[axis]
            if isinstance(dim, int):
                assert lo[axis] == opt[axis] == hi[axis] == dim
            else:
                key = dim.split("_")[-1]  # "attention_mask_batch" is a batch dim
                by_name.setdefault(key, set()).add((lo[axis], opt[axis], hi[axis]))
    assert all(len(r) == 1 for r in by_name.values()), by_name  # inputs agree on a shared dim
    return {k: r.pop() for k, r in by_name.items()}


def test_profile_takes_the_given_range_for_each_named_dim():
    given = {"batch": (2, 3, 5), "seq": (7, 11, 13)}
    ranges = _check_profile_invariants(INPUTS, profile_shapes(INPUTS, dim_ranges=given))
    assert ranges == given
    # a dim without a given range takes a default range, the same for every input that has it
    ranges = _check_profile_invariants(INPUTS, profile_shapes(INPUTS, dim_ranges={"seq": (7, 11, 13)}))
    assert ranges["seq"] == (7, 11, 13) and ranges["batch"] != ranges["seq"]


def test_profile_entry_wins_over_dim_ranges():
    entry = ((1, 1), (4, 32), (16, 512))
    free = profile_shapes(INPUTS, dim_ranges={"seq": (7, 11, 13)})
    shapes = profile_shapes(INPUTS, profile={"input_ids": entry}, dim_ranges={"seq": (7, 11, 13)})
    assert shapes["input_ids"] == entry
    assert {k: v for k, v in shapes.items() if k != "input_ids"} == {
        k: v for k, v in free.items() if k != "input_ids"
    }  # the other inputs are untouched


# the inputs of a with-past file (export_onnx(past=True)), as onnx_summary reads them
PAST_INPUTS = [
    TensorInfo("input_ids", "int64", ("batch", "sequence")),
    TensorInfo("attention_mask", "int64", ("batch", "total_sequence")),
    TensorInfo("position_ids", "int64", ("batch", "sequence")),
    TensorInfo("past_key_values.0.key", "float32", ("batch", 2, "past_sequence", 16)),
    TensorInfo("past_key_values.0.value", "float32", ("batch", 2, "past_sequence", 16)),
]


def test_profile_of_a_with_past_file_has_the_past_axis_from_zero():
    shapes = profile_shapes(PAST_INPUTS)
    assert shapes["past_key_values.0.key"] == ((1, 2, 0, 16), (1, 2, 128, 16), (8, 2, 1024, 16))
    assert shapes["attention_mask"] == ((1, 1), (1, 256), (8, 2048))  # sequence + past_sequence
    given = {"sequence": (1, 1, 512), "past_sequence": (0, 511, 4095)}
    assert profile_shapes(PAST_INPUTS, dim_ranges=given)["attention_mask"] == ((1, 1), (1, 512), (8, 4607))
    named = profile_shapes(PAST_INPUTS, dim_ranges={**given, "total_sequence": (1, 64, 128)})
    assert named["attention_mask"] == ((1, 1), (1, 64), (8, 128))  # a range given for it wins


def test_profile_shapes_run_the_exported_model(attention_onnx):
    """Behaviour: the model runs in onnxruntime at the min, opt and max shapes of its profile."""
    import numpy as np
    import onnxruntime as ort

    model, path, _ = attention_onnx
    inputs = trt_export.onnx_summary(path).inputs
    shapes = profile_shapes(inputs, dim_ranges={"batch": (1, 2, 3), "seq": (1, 6, 9)})
    _check_profile_invariants(inputs, shapes)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for k in range(3):  # min, opt, max
        feed = {name: np.random.default_rng(k).standard_normal(s[k]).astype(np.float32) for name, s in shapes.items()}
        (got,) = session.run(None, feed)
        with torch.no_grad():
            want = model(torch.from_numpy(feed["x"]))
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "inputs, kwargs, match",
    [
        ([TensorInfo("x", "float32", ("tokens", 8))], {}, "has no range"),
        ([TensorInfo("x", "float32", (None, 8))], {}, "has no range"),
        (INPUTS, {"profile": {"nope": ((1,), (1,), (1,))}}, "does not have"),
        (INPUTS, {"profile": {"input_ids": ((4, 1), (2, 8), (8, 8))}}, "min <= opt <= max"),
        (INPUTS, {"profile": {"scale": ((3,), (4,), (4,))}}, "fixed at 4"),
        (INPUTS, {"profile": {"input_ids": ((1,), (1,), (1,))}}, "must each have 2 dims"),
    ],
)
def test_profile_errors(inputs, kwargs, match):
    with pytest.raises(ExportError, match=match):
        profile_shapes(inputs, **kwargs)


def test_min_opt_max_dicts_merge_into_one_profile():
    merged = trt_export._merge_profile(None, {"x": (1, 2)}, {"x": (2, 4)}, {"x": (4, 8)})
    assert merged == {"x": ((1, 2), (2, 4), (4, 8))}
    with pytest.raises(ExportError, match="all of min_shapes"):
        trt_export._merge_profile(None, {"x": (1, 2)}, None, {"x": (4, 8)})


# ---- precision plan ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "precision, onnx_dtype, weak, plan",
    [
        ("fp32", "float32", True, BuildPlan(True, None, False)),
        ("fp16", "float16", False, BuildPlan(True, None, True)),
        ("bf16", "bfloat16", False, BuildPlan(True, None, True)),
        ("fp16", "float32", True, BuildPlan(False, "FP16", True)),
        ("bf16", "float32", True, BuildPlan(False, "BF16", True)),
        ("fp16", None, False, BuildPlan(True, None, True)),
    ],
)
def test_build_plan(precision, onnx_dtype, weak, plan):
    assert build_plan(precision, onnx_dtype, weak) == plan


@pytest.mark.parametrize(
    "precision, onnx_dtype, weak, match",
    [
        ("fp8", "float32", True, "one of fp32, fp16, bf16"),
        ("fp16", "float32", False, "strongly typed networks only"),
        ("fp32", "float16", True, "does not fit"),
        ("fp16", "bfloat16", True, "precision='bf16'"),
    ],
)
def test_build_plan_errors(precision, onnx_dtype, weak, match):
    with pytest.raises(ExportError, match=match):
        build_plan(precision, onnx_dtype, weak)


# ---- without TensorRT / without a GPU --------------------------------------------------------


@pytest.fixture
def onnx_file(tmp_path):
    """A tiny hand-built ONNX file (no torch export needed for the error paths)."""
    import onnx

    h = onnx.helper
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 8])],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", "seq", 8])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 20)]), str(path))
    return path


def test_onnx_float_dtype(onnx_file):
    assert trt_export.onnx_float_dtype(onnx_file) == "float32"


def test_no_tensorrt_is_backend_unavailable_with_install_advice(monkeypatch, onnx_file, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(BackendUnavailableError, match="`tensorrt` Python package") as info:
        export_tensorrt(onnx_file, tmp_path / "m.engine")
    msg = str(info.value)
    assert "`tensorrt` Python package" in msg
    assert "pip install tensorrt" in msg and "tensorrt-cu12" in msg and "pypi.nvidia.com" in msg
    assert "NVIDIA GPU" in msg
    assert not (tmp_path / "m.engine").exists()


def test_no_gpu_is_backend_unavailable_naming_the_gpu(monkeypatch, onnx_file, tmp_path):
    fake = types.ModuleType("tensorrt")
    fake.__version__ = "10.9.0"
    fake.plugin = types.ModuleType("tensorrt.plugin")
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", fake.plugin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match=r"torch\.cuda\.is_available\(\) is False") as info:
        export_tensorrt(onnx_file, tmp_path / "m.engine")
    msg = str(info.value)
    assert "torch.cuda.is_available() is False" in msg
    assert "`tensorrt` Python package" not in msg  # tensorrt is there


@pytest.mark.parametrize(
    "call",
    [
        lambda: run_engine("m.engine", {}),
        lambda: register_mlp_value_plugin(),
    ],
)
def test_run_and_register_need_tensorrt(monkeypatch, call):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setattr(trt_plugin, "_PLUGIN_REGISTERED", False)
    with pytest.raises(BackendUnavailableError, match="pip install tensorrt"):
        call()


def test_missing_onnx_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.onnx"
    with pytest.raises(ExportError, match="does not exist") as info:
        export_tensorrt(missing, tmp_path / "m.engine")
    assert str(missing) in str(info.value)


def test_bad_engine_directory_names_the_path(onnx_file, tmp_path):
    target = tmp_path / "no" / "m.engine"
    with pytest.raises(ExportError, match="TensorRT engine") as info:
        export_tensorrt(onnx_file, target)
    assert str(target) in str(info.value)


def test_profile_errors_come_before_the_backend_check(onnx_file, tmp_path):
    with pytest.raises(ExportError, match="min <= opt <= max"):
        export_tensorrt(
            onnx_file,
            tmp_path / "m.engine",
            min_shapes={"x": (2, 1, 8)},
            opt_shapes={"x": (1, 1, 8)},
            max_shapes={"x": (4, 4, 8)},
        )


# ---- the plugin wiring, against a stand-in tensorrt.plugin -----------------------------------


class _Expr:
    """Stand-in for tensorrt.plugin.ShapeExpr: a constant, or a build-time unknown (None)."""

    def __init__(self, value):
        self.value, self.is_fake = value, False

    @property
    def is_constant(self):
        return self.value is not None

    def constant_value(self):
        return self.value


class _Desc:
    """Stand-in for tensorrt.plugin.TensorDesc."""

    def __init__(self, shape, dtype="F"):
        self.shape_expr, self.dtype = [_Expr(d) for d in shape], dtype

    def like(self):
        return ("like", self)


@pytest.fixture
def fake_plugin_api(monkeypatch):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.9.0"
    trt.DataType = types.SimpleNamespace(FLOAT="F", HALF="H", BF16="B")
    plugin = types.ModuleType("tensorrt.plugin")
    plugin.TensorDesc = _Desc
    plugin.AutoTuneCombination = lambda *args: args
    registered = {}

    def decorator(kind):
        def factory(plugin_id):
            def wrap(fn):
                registered[kind, plugin_id] = fn
                return fn

            return wrap

        return factory

    for kind in ("register", "autotune", "impl"):
        setattr(plugin, kind, decorator(kind))
    trt.plugin = plugin
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", plugin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trt_plugin, "_PLUGIN_REGISTERED", False)
    return registered


def test_plugin_registers_descriptor_autotune_and_impl(fake_plugin_api):
    register_mlp_value_plugin()
    assert (
        set(fake_plugin_api) == {("register", PLUGIN_ID), ("autotune", PLUGIN_ID), ("impl", PLUGIN_ID)}
        and PLUGIN_ID == "kha::MLPValue"
    )
    desc = fake_plugin_api["register", PLUGIN_ID]
    # tensorrt.plugin.register reads real classes from the annotations
    params = inspect.signature(desc).parameters
    assert list(params) == ["v", "w_up", "w_gate", "w_down"]
    assert all(p.annotation is _Desc for p in params.values())
    assert inspect.signature(desc).return_annotation is _Desc
    v = _Desc((2, 4, None, 8))
    assert desc(v, _Desc((8, 8)), _Desc((8, 8)), _Desc((8, 8))) == ("like", v)
    with pytest.raises(OpInputError, match="w_gate has shape"):
        desc(v, _Desc((8, 8)), _Desc((4, 4)), _Desc((8, 8)))
    with pytest.raises(OpInputError, match="one type"):
        desc(v, _Desc((8, 8), "H"), _Desc((8, 8)), _Desc((8, 8)))
    (combo,) = fake_plugin_api["autotune", PLUGIN_ID](v, None, None, None, None)
    assert combo == (", ".join(["FP32|FP16|BF16"] * 5), "LINEAR")
    impl = fake_plugin_api["impl", PLUGIN_ID]
    assert list(inspect.signature(impl).parameters) == ["v", "w_up", "w_gate", "w_down", "outputs", "stream"]


def test_plugin_registers_once(fake_plugin_api):
    register_mlp_value_plugin()
    fake_plugin_api.clear()
    register_mlp_value_plugin()
    assert fake_plugin_api == {}


# ---- the engine (TensorRT + NVIDIA GPU only) -----------------------------------------------------


class _TwoLayers(torch.nn.Module):
    """Two attention layers whose value heads go through kha::mlp_value (non-identity weights)."""

    def __init__(self, d=32, n_head=4):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.n_head, self.dh = n_head, d // n_head
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d) for _ in range(2))
        self.w = torch.nn.Parameter(torch.randn(2, 3, self.dh, self.dh, generator=gen) / self.dh**0.5)

    def forward(self, x):
        B, L, D = x.shape
        for i, qkv in enumerate(self.qkv):
            q, k, v = (
                t.view(B, L, self.n_head, self.dh).transpose(1, 2)  # (B, H, L, Dh)
                for t in qkv(x).split(D, dim=-1)
            )
            v = torch.ops.kha.mlp_value(v, self.w[i, 0], self.w[i, 1], self.w[i, 2])
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v)  # (B, H, L, Dh)
            x = x + y.transpose(1, 2).reshape(B, L, D)  # (B, L, D)
        return x


@pytest.fixture(scope="module")
def attention_onnx(tmp_path_factory):
    import kha_compile  # noqa: F401  (registers torch.ops.kha.mlp_value)
    from kha_compile.exporters.onnx import export_onnx

    model = _TwoLayers().eval()
    path = export_onnx(model, tmp_path_factory.mktemp("trt") / "two.onnx", example_args=(torch.randn(2, 5, 32),))
    return model, path, 32


@pytest.mark.gpu
@NEEDS_TRT
@pytest.mark.parametrize("shape", [(2, 5), (3, 17)])
def test_fp32_engine_matches_torch(attention_onnx, tmp_path, shape):
    model, onnx_path, d = attention_onnx
    engine = export_tensorrt(
        onnx_path, tmp_path / "fp32.engine", precision="fp32", dim_ranges={"batch": (1, 2, 4), "sequence": (1, 8, 32)}
    )
    x = torch.randn(*shape, d)
    (y,) = run_engine(engine, {"x": x}).values()
    with torch.no_grad():
        want = model(x)
    assert float((y - want).abs().max() / want.abs().max()) < 1e-3


@pytest.mark.gpu
@NEEDS_TRT
def test_engine_uses_the_plugin(attention_onnx, tmp_path, caplog):
    caplog.set_level("INFO", logger="kha_compile.exporters.tensorrt")
    export_tensorrt(
        attention_onnx[1],
        tmp_path / "fp16.engine",
        precision="fp16",
        dim_ranges={"batch": (1, 2, 4), "sequence": (1, 8, 32)},
    )
    assert any("2 of 2 MLPValue nodes as kha::MLPValue plugins" in r.getMessage() for r in caplog.records)
