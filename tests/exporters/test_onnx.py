"""kha_compile.exporters.onnx: custom MLPValue nodes, their function body, onnxruntime parity,
dynamic axes, and the errors of a failed export."""

import os
import sys
import types

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from torch import nn

import kha_compile  # noqa: F401  (registers torch.ops.kha.mlp_value)
from kha_compile.core.errors import ExportError
from kha_compile.exporters.onnx import (
    MLP_VALUE_DOMAIN,
    MLP_VALUE_OP,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    dynamic_axes_for,
    export_onnx,
    mlp_value_function,
    onnx_summary,
)
from kha_compile.ops.mlp_value import mlp_value_reference

D, N_HEAD, N_LAYER = 32, 4, 2
DH = D // N_HEAD


def _random_square(gen: torch.Generator, n: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(n, n, generator=gen) / n**0.5)


class Block(nn.Module):
    """Self-attention whose value heads go through kha::mlp_value (non-identity weights)."""

    def __init__(self, seed: int, mlp_value: bool = True):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.mlp_value = mlp_value
        if mlp_value:
            self.kha = nn.ParameterDict({k: _random_square(gen, DH) for k in ("up", "gate", "down")})

    def forward(self, x):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, L, N_HEAD, DH).transpose(1, 2) for t in (q, k, v))  # (B, H, L, Dh)
        if self.mlp_value:
            v = torch.ops.kha.mlp_value(v, self.kha["up"], self.kha["gate"], self.kha["down"])
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, Dh)
        return x + self.out(y.transpose(1, 2).reshape(B, L, D))  # (B, L, D)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(seed=i) for i in range(N_LAYER))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _rel_err(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = Stack()
    path = export_onnx(model, tmp_path_factory.mktemp("onnx") / "stack.onnx", example_args=(torch.randn(2, 5, D),))
    return model, path


def test_returns_the_path_and_writes_one_file(exported):
    _, path = exported
    assert path.is_file() and path.suffix == ".onnx"
    assert sorted(p.name for p in path.parent.iterdir()) == ["stack.onnx"]  # no external data


def test_one_custom_node_per_op_call(exported):
    summary = onnx_summary(exported[1])
    assert summary.num_custom_nodes == N_LAYER
    assert summary.op_counts[f"{MLP_VALUE_DOMAIN}::{MLP_VALUE_OP}"] == N_LAYER
    # the decomposition lives in the function, not in the main graph
    assert "Sigmoid" not in summary.op_counts
    assert summary.op_counts["Softmax"] == N_LAYER
    assert 20 <= summary.num_nodes <= 120


def test_custom_node_domain_attributes_and_inputs(exported):
    model = onnx.load(str(exported[1]))
    nodes = [n for n in model.graph.node if n.op_type == MLP_VALUE_OP]
    assert len(nodes) == N_LAYER
    initializers = {i.name: i for i in model.graph.initializer}
    for node in nodes:
        assert node.domain == MLP_VALUE_DOMAIN == "kha"
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"plugin_namespace": PLUGIN_NAMESPACE.encode(), "plugin_version": PLUGIN_VERSION.encode()}
        assert len(node.input) == 4 and len(node.output) == 1
        for w in node.input[1:]:  # the weights are (Dh, Dh)
            assert list(initializers[w].dims) == [DH, DH]
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets[MLP_VALUE_DOMAIN] == 1


def test_model_local_function_holds_the_decomposition(exported):
    """The function the file carries, inlined by onnx's own inliner into a one-node model and run by
    onnxruntime on random inputs, computes torch.ops.kha.mlp_value."""
    model = onnx.load(str(exported[1]))
    assert [(f.domain, f.name) for f in model.functions] == [(MLP_VALUE_DOMAIN, MLP_VALUE_OP)]
    fn = model.functions[0]
    assert list(fn.input) == ["v", "w_up", "w_gate", "w_down"] and list(fn.output) == ["y"]
    model_opset = next(o.version for o in model.opset_import if o.domain == "")
    assert [(o.domain, o.version) for o in fn.opset_import] == [("", model_opset)]
    # checked against the function alone: the schema used during export is gone again
    assert not onnx.defs.has(MLP_VALUE_OP, MLP_VALUE_DOMAIN)
    onnx.checker.check_model(model, full_check=True)

    h = onnx.helper
    f32 = onnx.TensorProto.FLOAT
    node = h.make_node(
        MLP_VALUE_OP,
        list(fn.input),
        ["y"],
        domain=MLP_VALUE_DOMAIN,
        plugin_namespace=PLUGIN_NAMESPACE,
        plugin_version=PLUGIN_VERSION,
    )
    shapes = {"v": [2, N_HEAD, 7, DH], "w_up": [DH, DH], "w_gate": [DH, DH], "w_down": [DH, DH]}
    graph = h.make_graph(
        [node],
        "alone",
        [h.make_tensor_value_info(n, f32, s) for n, s in shapes.items()],
        [h.make_tensor_value_info("y", f32, shapes["v"])],
    )
    alone = h.make_model(graph, opset_imports=list(model.opset_import), functions=[fn])
    inlined = onnx.inliner.inline_local_functions(alone)
    assert all(n.domain != MLP_VALUE_DOMAIN for n in inlined.graph.node) and not inlined.functions
    onnx.checker.check_model(inlined, full_check=True)
    gen = torch.Generator().manual_seed(7)
    feed = {n: torch.randn(*s, generator=gen) for n, s in shapes.items()}
    (y,) = ort.InferenceSession(inlined.SerializeToString()).run(None, {n: t.numpy() for n, t in feed.items()})
    want = torch.ops.kha.mlp_value(*(t.double() for t in feed.values()))
    assert _rel_err(y.astype(np.float64), want) < 1e-5
    # and the function really uses every weight: zeroing one changes the result
    for name in ("w_up", "w_gate", "w_down"):
        changed = {n: (t * 0 if n == name else t).numpy() for n, t in feed.items()}
        (y0,) = ort.InferenceSession(inlined.SerializeToString()).run(None, changed)
        assert not np.allclose(y0, y)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_function_body_computes_the_op(dtype):
    """A one-node model, run by onnxruntime through the function, equals the torch reference."""
    h = onnx.helper
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    node = h.make_node(
        MLP_VALUE_OP,
        ["v", "u", "g", "w"],
        ["y"],
        domain=MLP_VALUE_DOMAIN,
        plugin_namespace=PLUGIN_NAMESPACE,
        plugin_version=PLUGIN_VERSION,
    )
    graph = h.make_graph(
        [node],
        "one",
        [
            h.make_tensor_value_info(n, elem, s)
            for n, s in (("v", ["b", 3, DH]), ("u", [DH, DH]), ("g", [DH, DH]), ("w", [DH, DH]))
        ],
        [h.make_tensor_value_info("y", elem, ["b", 3, DH])],
    )
    model = h.make_model(
        graph, opset_imports=[h.make_opsetid("", 20), h.make_opsetid("kha", 1)], functions=[mlp_value_function(20)]
    )
    onnx.checker.check_model(model, full_check=True)
    gen = torch.Generator().manual_seed(1)
    v, u, g, w = (torch.randn(*s, generator=gen) for s in ((2, 3, DH), (DH, DH), (DH, DH), (DH, DH)))
    sess = ort.InferenceSession(model.SerializeToString())
    feed = {n: t.numpy().astype(dtype) for n, t in zip("vugw", (v, u, g, w))}
    (y,) = sess.run(None, feed)
    assert y.dtype == dtype
    ref = mlp_value_reference(*(torch.from_numpy(feed[n]).double() for n in "vugw"))
    assert _rel_err(y.astype(np.float64), ref) < (1e-5 if dtype == np.float32 else 5e-3)


@pytest.mark.parametrize("shape", [(2, 5), (3, 9), (1, 1)], ids=["example", "other", "single"])
def test_onnxruntime_matches_torch(exported, shape):
    model, path = exported
    x = torch.randn(*shape, D, generator=torch.Generator().manual_seed(sum(shape)))
    (y,) = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})
    with torch.no_grad():
        want = model(x)
    assert y.shape == tuple(want.shape)
    assert _rel_err(y, want) < 1e-4


def test_batch_and_sequence_are_dynamic_and_named(exported):
    summary = onnx_summary(exported[1])
    assert [str(i) for i in summary.inputs] == [f"x: float32[batch, sequence, {D}]"]
    assert summary.inputs[0].dynamic_axes == {0: "batch", 1: "sequence"}
    assert [str(o) for o in summary.outputs] == [f"output: float32[batch, sequence, {D}]"]


class FixedLength(nn.Module):
    """A learned position table of 4 rows: the sequence length can only be 4."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 4, D))

    def forward(self, x):
        return x + self.pos  # (B, 4, D)


def test_caller_model_is_not_modified(monkeypatch, tmp_path):
    """fold runs on a deep copy with strict=False; the caller's module and mode stay as they were."""
    seen = {}

    def fake_fold(model, strict=True):
        seen["model"], seen["strict"] = model, strict
        with torch.no_grad():
            model.kha["up"].mul_(0)  # a fold that edits weights: must not leak out
        return "folded"

    monkeypatch.setattr("kha_compile.exporters.onnx.fold_pass", fake_fold)
    model = Block(seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    export_onnx(model, tmp_path / "m.onnx", example_args=(torch.randn(2, 4, D),))
    assert seen["strict"] is False and seen["model"] is not model
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_static_export_without_fold(tmp_path):
    model = Block(seed=0).train()
    path = export_onnx(model, tmp_path / "static.onnx", example_args=(torch.randn(2, 4, D),), dynamic=False, fold=False)
    assert model.training  # eval() during export only
    summary = onnx_summary(path)
    assert summary.inputs[0].dims == (2, 4, D) and summary.inputs[0].dynamic_axes == {}
    assert summary.num_custom_nodes == 1


def test_a_pinned_axis_comes_out_fixed_and_a_model_without_kha_is_not_folded(monkeypatch, tmp_path, caplog):
    folds = []
    monkeypatch.setitem(
        sys.modules,
        "kha_compile.passes.fold",
        types.SimpleNamespace(fold=lambda model, strict=True: folds.append(model)),
    )
    caplog.set_level("WARNING", logger="kha_compile.exporters.onnx")
    path = export_onnx(FixedLength(), tmp_path / "fixed.onnx", example_args=(torch.randn(1, 4, D),))
    assert folds == []  # no KHA: no copy, no fold
    assert onnx_summary(path).inputs[0].dims == ("batch", 4, D)  # a batch of 1 stays dynamic
    (record,) = [r for r in caplog.records if "fixed size" in r.getMessage()]
    assert "'x' axis 1 (sequence)" in record.getMessage()


def test_plain_model_has_no_custom_nodes_or_functions(tmp_path):
    model = Block(seed=0, mlp_value=False).eval()
    path = export_onnx(model, tmp_path / "plain.onnx", example_args=(torch.randn(2, 4, D),))
    summary = onnx_summary(path)
    assert summary.num_custom_nodes == 0 and summary.functions == ()
    assert all(o.domain != MLP_VALUE_DOMAIN for o in onnx.load(str(path)).opset_import)
    x = torch.randn(3, 6, D)
    (y,) = ort.InferenceSession(str(path)).run(None, {"x": x.numpy()})
    with torch.no_grad():
        assert _rel_err(y, model(x)) < 1e-4


class PatchEmbed(nn.Module):
    """Image input: pixel_values (B, C, H, W) -> patches through kha::mlp_value -> (B, N, Dh)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.proj = nn.Linear(3 * 4 * 4, DH)
        self.up, self.gate, self.down = (_random_square(gen, DH) for _ in range(3))

    def forward(self, pixel_values):
        B, C, H, W = pixel_values.shape
        p = pixel_values.unfold(2, 4, 4).unfold(3, 4, 4)  # (B, C, H/4, W/4, 4, 4)
        p = p.permute(0, 2, 3, 1, 4, 5).reshape(B, (H // 4) * (W // 4), C * 16)  # (B, N, C*16)
        return torch.ops.kha.mlp_value(self.proj(p), self.up, self.gate, self.down)


def test_image_input_has_only_a_dynamic_batch(tmp_path):
    model = PatchEmbed().eval()
    path = export_onnx(model, tmp_path / "img.onnx", example_kwargs={"pixel_values": torch.randn(2, 3, 8, 8)})
    summary = onnx_summary(path)
    assert summary.inputs[0].name == "pixel_values"
    assert summary.inputs[0].dims == ("batch", 3, 8, 8)
    x = torch.randn(5, 3, 8, 8)
    (y,) = ort.InferenceSession(str(path)).run(None, {"pixel_values": x.numpy()})
    with torch.no_grad():
        assert _rel_err(y, model(x)) < 1e-4


@pytest.mark.parametrize(
    "name, ndim, axes",
    [
        ("x", 3, {0: "batch", 1: "sequence"}),
        ("input_ids", 2, {0: "batch", 1: "sequence"}),
        ("pixel_values", 4, {0: "batch"}),
        ("image_embeds", 3, {0: "batch"}),
        ("attention_mask", 4, {0: "batch"}),
        ("position_ids", 1, {}),
        ("scale", 0, {}),
    ],
)
def test_dynamic_axes_for(name, ndim, axes):
    assert dynamic_axes_for(name, ndim) == axes


def test_transformers_model_with_kha_and_no_example_inputs(tmp_path):
    """A tiny Llama with kc.apply(q linear, v mlp): inputs built from its config, the linear KHA
    folded on a copy, one MLPValue per layer, dynamic input_ids/attention_mask, ORT parity."""
    transformers = pytest.importorskip("transformers")
    import kha_compile as kc

    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"))
    with torch.no_grad():  # off the identity init, so parity means something
        for name, p in model.named_parameters():
            if "kha" in name:
                p.add_(0.2 * torch.randn_like(p))
    kha_before = [n for n, _ in model.named_parameters() if "kha" in n]

    path = export_onnx(model, tmp_path / "llama.onnx")
    assert [n for n, _ in model.named_parameters() if "kha" in n] == kha_before  # not folded
    summary = onnx_summary(path)
    assert summary.num_custom_nodes == cfg.num_hidden_layers
    dims = {i.name: i.dims for i in summary.inputs}
    assert dims == {"input_ids": ("batch", "sequence"), "attention_mask": ("batch", "sequence")}
    assert [str(o) for o in summary.outputs] == ["logits: float32[batch, sequence, 64]"]
    ids = torch.randint(0, 64, (3, 5))
    mask = torch.ones(3, 5, dtype=torch.long)
    (y,) = ort.InferenceSession(str(path)).run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert _rel_err(y, want) < 1e-4


def test_missing_directory_is_an_export_error_naming_the_path(tmp_path):
    target = tmp_path / "no" / "such" / "dir" / "m.onnx"
    with pytest.raises(ExportError, match="does not exist") as info:
        export_onnx(Block(seed=0), target, example_args=(torch.randn(2, 4, D),))
    assert str(target) in str(info.value)
    assert not (tmp_path / "no").exists()


def test_directory_as_path_is_an_export_error(tmp_path):
    with pytest.raises(ExportError, match="is a directory") as info:
        export_onnx(Block(seed=0), tmp_path, example_args=(torch.randn(2, 4, D),))
    assert str(tmp_path) in str(info.value)


def test_unwritable_directory_is_an_export_error(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # root may write anywhere, so os.access says yes: let it answer as it would for a user
        real_access = os.access
        monkeypatch.setattr(
            os,
            "access",
            lambda p, mode, *a, **k: (
                False
                if os.path.realpath(p) == os.path.realpath(locked) and mode & os.W_OK
                else real_access(p, mode, *a, **k)
            ),
        )
    try:
        with pytest.raises(ExportError, match="not writable") as info:
            export_onnx(Block(seed=0), locked / "m.onnx", example_args=(torch.randn(2, 4, D),))
        assert str(locked / "m.onnx") in str(info.value)
    finally:
        locked.chmod(0o700)


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on data: torch.export cannot trace it
            return x * 2
        return x


def test_untraceable_model_keeps_the_exporters_reason(tmp_path):
    with pytest.raises(ExportError, match="step 'export'") as info:
        export_onnx(DataDependent(), tmp_path / "m.onnx", example_args=(torch.randn(2, 3),))
    msg = str(info.value)
    assert "step 'export'" in msg and "DataDependent" in msg
    assert "data-dependent" in msg.lower()
    assert info.value.__cause__ is not None
    assert not (tmp_path / "m.onnx").exists()


class NoOnnxOp(nn.Module):
    def forward(self, x):
        return torch.linalg.eig(x)[0].real  # traces, but has no ONNX translation


def test_untranslatable_op_is_a_translation_error(tmp_path):
    with pytest.raises(ExportError, match="step 'translation'") as info:
        export_onnx(NoOnnxOp(), tmp_path / "m.onnx", example_args=(torch.randn(3, 3),), dynamic=False)
    msg = str(info.value)
    assert "step 'translation'" in msg and "linalg_eig" in msg


def test_inputs_that_do_not_fit_forward(tmp_path):
    with pytest.raises(ExportError, match="do not fit"):
        export_onnx(Block(seed=0), tmp_path / "m.onnx", example_args=(torch.randn(2, 4, D), 1, 2))
