"""kha_compile.exporters.generate: the greedy loop against transformers' ``generate``, and what the loops refuse.

The loops over real exported files are tested with those files (test_onnx_past.py, test_aoti_generation.py);
here :func:`greedy` runs over the eager model without a cache (each step a forward over the whole
sequence), an independent path from ``generate``'s own cached one.
"""

from __future__ import annotations

import sys

import pytest
import torch

import kha_compile as kc
import zoo
from helpers import perturb
from kha_compile.core.errors import BackendUnavailableError, ExportError
from kha_compile.exporters.generate import generate_onnx, generate_tensorrt, greedy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    model = zoo.make("llama").model
    kc.apply(model, kc.KHAConfig(v="mlp"))
    perturb(model)
    return model


def _no_cache_step(model):
    """A step that recomputes the whole sequence: it keeps the tokens itself, as a caller without a cache would."""
    seen: list[torch.Tensor] = []

    def step(ids: torch.Tensor, start: int) -> torch.Tensor:
        assert start == sum(t.shape[1] for t in seen), "greedy must pass the position of the new tokens"
        seen.append(ids)
        with torch.no_grad():
            return model(input_ids=torch.cat(seen, 1), use_cache=False).logits[:, start:]

    return step


def _hf(model, prompt, new, **kwargs):
    with torch.no_grad():
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False, **kwargs
        )


def test_greedy_is_transformers_greedy(model):
    prompt = torch.tensor([[5, 17, 33, 9, 100], [1, 2, 3, 4, 5]])
    want = _hf(model, prompt, 8, eos_token_id=None, pad_token_id=0)
    assert greedy(_no_cache_step(model), prompt, 8).tolist() == want.tolist()


def test_a_finished_sequence_gets_pad_tokens_and_all_finished_stop(model):
    prompt = torch.tensor([[5, 17, 33, 9, 100], [1, 2, 3, 4, 5]])
    free = _hf(model, prompt, 8, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, 7])  # the third new token of the first row: it stops there
    assert eos not in free[0, 5:7].tolist()
    want = _hf(model, prompt, 8, eos_token_id=eos, pad_token_id=99)
    got = greedy(_no_cache_step(model), prompt, 8, eos_token_id=eos, pad_token_id=99)
    assert got.tolist() == want.tolist() and 99 in got[0].tolist()
    single = greedy(_no_cache_step(model), prompt[:1], 8, eos_token_id=[eos])
    assert single.tolist() == free[:1, :8].tolist()  # stops right after the eos


def test_greedy_refuses_bad_shapes():
    with pytest.raises(ExportError, match=r"input_ids of shape \(batch, prompt length >= 1\)"):
        greedy(lambda ids, start: ids, torch.tensor([1, 2, 3]), 2)


def test_onnx_loop_refuses_a_file_without_a_cache(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, ["batch", "sequence"])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), str(tmp_path / "m.onnx"))
    with pytest.raises(ExportError, match=r"not written by export_onnx\(past=True\)"):
        generate_onnx(tmp_path / "m.onnx", torch.tensor([[1, 2]]), 2)


def test_tensorrt_loop_needs_tensorrt(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailableError, match="pip install tensorrt"):
        generate_tensorrt(tmp_path / "llm.engine", torch.tensor([[1, 2]]), 2)
