"""kha_compile.exporters.onnx naming and metadata: outputs named after the model's own fields,
``batch`` / ``sequence`` axes shared by inputs and outputs, input/output name overrides, and the
``kha_compile.`` metadata_props (read back with read_kha_metadata)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import perturb
from kha_compile.core.errors import ExportError, ExportNamesError
from kha_compile.exporters.onnx import METADATA_KEYS, onnx_summary, read_kha_metadata
from kha_compile.model.config import CONFIG_VERSION

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def ort_outputs(path, feeds: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """onnxruntime's outputs by name, fed by input name."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {k: v.numpy() for k, v in feeds.items()})))


def rel_err(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


def axes(path) -> dict[str, tuple]:
    summary = onnx_summary(path)
    return {t.name: t.dims for t in (*summary.inputs, *summary.outputs)}


def token_feeds(batch: int, seq: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 100 + seq)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, -2:] = 0  # some padding, so the mask matters
    return {
        "input_ids": torch.randint(0, zoo.VOCAB, (batch, seq), generator=gen),
        "attention_mask": mask,
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Tiny Llama with q linear + v mlp KHA (perturbed), exported with the default fold."""
    case = zoo.make("llama")
    kc.apply(case.model, kc.KHAConfig(q="linear", v="mlp"))
    perturb(case.model)
    path = kc.export_onnx(case.model, tmp_path_factory.mktemp("names") / "llama.onnx", *case.example)
    return case, path


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """Tiny BERT without KHA."""
    case = zoo.make("bert")
    path = kc.export_onnx(case.model, tmp_path_factory.mktemp("names") / "bert.onnx", *case.example)
    return case, path


# ---- causal LM --------------------------------------------------------------------------------


def test_causal_lm_output_is_logits_and_axes_are_shared(llama):
    _, path = llama
    assert axes(path) == {
        "input_ids": ("batch", "sequence"),
        "attention_mask": ("batch", "sequence"),
        "logits": ("batch", "sequence", zoo.VOCAB),
    }  # no past_key_values


@pytest.mark.parametrize("batch,seq", [(2, 8), (3, 5)])
def test_causal_lm_runs_in_onnxruntime_by_name(llama, batch, seq):
    case, path = llama
    feeds = token_feeds(batch, seq)
    with torch.no_grad():
        want = case.model(**feeds, use_cache=False).logits
    got = ort_outputs(path, feeds)
    assert list(got) == ["logits"]
    assert rel_err(got["logits"], want) < 1e-4


def test_metadata_records_config_sites_and_version(llama):
    case, path = llama
    model = onnx.load(str(path), load_external_data=False)
    props = {p.key: p.value for p in model.metadata_props}
    assert set(METADATA_KEYS) <= set(props)
    for key in ("kha_compile.config", "kha_compile.sites", "kha_compile.folded"):
        json.loads(props[key])  # each one parses alone
    meta = read_kha_metadata(path)
    assert meta == read_kha_metadata(model)  # path or loaded model
    assert meta["version"] == kc.__version__
    assert meta["kha"] == "applied" and meta["folded"] is True
    assert meta["config"] == {"version": CONFIG_VERSION, "q": "linear", "k": None, "v": "mlp", "strategy": "auto"}
    report = kc.inspect(case.model, *case.example)
    assert [s["name"] for s in meta["sites"]] == [s.name for s in report.matched]
    assert len(meta["sites"]) == case.num_sites
    for recorded, site in zip(meta["sites"], report.matched):
        assert recorded == {
            "name": site.name,
            "kind": site.kind,
            "num_heads": site.num_heads,
            "num_kv_heads": site.num_kv_heads,
            "head_dim": site.head_dim,
            "v_head_dim": site.v_head_dim,
            "transforms": site.transforms,
        }
        assert recorded["transforms"] == {"q": "linear", "v": "mlp"}
        assert (recorded["kind"], recorded["num_heads"], recorded["num_kv_heads"]) == (
            "gqa",
            4,
            2,
        )


# ---- encoder ----------------------------------------------------------------------------------


def test_encoder_outputs_are_last_hidden_state_and_pooler_output(bert):
    _, path = bert
    assert axes(path) == {
        "input_ids": ("batch", "sequence"),
        "attention_mask": ("batch", "sequence"),
        "last_hidden_state": ("batch", "sequence", zoo.HIDDEN),
        "pooler_output": ("batch", zoo.HIDDEN),
    }


def test_encoder_runs_in_onnxruntime_by_name(bert):
    case, path = bert
    feeds = token_feeds(3, 6)
    with torch.no_grad():
        want = case.model(**feeds)
    got = ort_outputs(path, feeds)
    assert list(got) == ["last_hidden_state", "pooler_output"]
    for name in got:
        assert rel_err(got[name], want[name]) < 1e-4


def test_model_without_kha_says_so(bert):
    assert read_kha_metadata(bert[1]) == {
        "version": kc.__version__,
        "kha": "none",
        "config": None,
        "sites": [],
        "folded": False,
    }


def test_a_file_from_elsewhere_has_no_kha_metadata(bert, tmp_path):
    model = onnx.load(str(bert[1]))
    del model.metadata_props[:]
    assert read_kha_metadata(model) == {}
    model.metadata_props.add(key="kha_compile.sites", value="[{not json")
    with pytest.raises(ExportError, match=r"kha_compile.sites.*not valid JSON"):
        read_kha_metadata(model)


# ---- plain modules ----------------------------------------------------------------------------


class Plain(nn.Module):
    """One tensor in, one tensor out."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Pair(nn.Module):
    """Two inputs, a tuple of two outputs (one of them the second input, passed through)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.lin(x) + y, y


def two_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two distinct example tensors (one tensor passed twice is exported as one input)."""
    return torch.randn(2, 3, 8), torch.randn(2, 3, 8)


class Named(nn.Module):
    """Returns a dict: its keys name the outputs."""

    def forward(self, x):
        return {"scores": x.softmax(-1), "total": x.sum(-1)}


def test_plain_tensor_output_is_named_output(tmp_path):
    model = Plain().eval()
    path = kc.export_onnx(model, tmp_path / "plain.onnx", example_args=(torch.randn(2, 3, 8),))
    assert axes(path) == {
        "x": ("batch", "sequence", 8),
        "output": ("batch", "sequence", 8),
    }
    x = torch.randn(4, 7, 8)
    with torch.no_grad():
        assert rel_err(ort_outputs(path, {"x": x})["output"], model(x)) < 1e-5


def test_tuple_outputs_are_numbered_and_names_can_be_overridden(tmp_path):
    model = Pair().eval()
    example = (torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    path = kc.export_onnx(model, tmp_path / "default.onnx", example_args=example)
    assert [t.name for t in onnx_summary(path).outputs] == ["output_0", "output_1"]

    path = kc.export_onnx(
        model,
        tmp_path / "named.onnx",
        example_args=example,
        input_names=["features", "residual"],
        output_names=["mixed", "skip"],
    )
    assert axes(path) == {name: ("batch", "sequence", 8) for name in ("features", "residual", "mixed", "skip")}
    x, y = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    got = ort_outputs(path, {"features": x, "residual": y})
    with torch.no_grad():
        want = model(x, y)
    assert list(got) == ["mixed", "skip"]
    assert rel_err(got["mixed"], want[0]) < 1e-5
    np.testing.assert_array_equal(got["skip"], y.numpy())


def test_swapped_input_names(tmp_path):
    model = Pair().eval()
    path = kc.export_onnx(model, tmp_path / "swap.onnx", example_args=two_inputs(), input_names=["y", "x"])
    x, y = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    got = ort_outputs(path, {"y": x, "x": y})  # graph input "y" is forward's x
    with torch.no_grad():
        assert rel_err(got["output_0"], model(x, y)[0]) < 1e-5


def test_dict_output_keys_name_the_outputs(tmp_path):
    path = kc.export_onnx(Named(), tmp_path / "dict.onnx", example_args=(torch.randn(2, 3, 8),))
    assert axes(path) == {
        "x": ("batch", "sequence", 8),
        "scores": ("batch", "sequence", 8),
        "total": ("batch", "sequence"),
    }


@pytest.mark.parametrize(
    "kw,names,match",
    [
        (
            "output_names",
            ["a", "b", "c"],
            (
                r"output_names has 3 name\(s\) but the exported Pair has "
                r"2 output\(s\): output_0, output_1"
            ),
        ),
        (
            "input_names",
            ["only"],
            (
                r"input_names has 1 name\(s\) but the exported Pair has 2 "
                r"input\(s\): x, y"
            ),
        ),
        ("output_names", ["same", "same"], r"repeats 'same'"),
        ("output_names", "mixed", r"must be a list of non-empty strings"),
        (
            "output_names",
            ["lin.bias", "b"],
            r"'lin.bias' is already taken by a graph weight",
        ),
    ],
)
def test_wrong_names_are_an_export_names_error(tmp_path, kw, names, match):
    target = tmp_path / "bad.onnx"
    with pytest.raises(ExportNamesError, match=match):
        kc.export_onnx(Pair(), target, example_args=two_inputs(), **{kw: names})
    assert not target.exists()


def test_names_error_on_a_transformers_model_lists_its_fields(tmp_path):
    case = zoo.make("bert")
    with pytest.raises(ExportNamesError, match="has 2 output\\(s\\): last_hidden_state, pooler_output"):
        kc.export_onnx(case.model, tmp_path / "b.onnx", *case.example, output_names=["hidden"])
