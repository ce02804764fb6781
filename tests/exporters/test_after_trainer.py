"""Export right after ``Trainer(bf16=True).train()`` in the same process (kha_compile/model/wrappers.py).

accelerate leaves the model's ``forward`` wrapped in bf16 autocast after training. Every export,
``kc.fold`` and ``kc.save_pretrained`` see through that wrapper: each produces what the same model
saved and reloaded produces (``model.save_pretrained`` + ``kc.save_pretrained``, read back into a
fresh model with ``kc.load_pretrained``: no wrapper, fp32), and leaves the caller's model as it
was: the same ``state_dict``, module classes, KHA modules and wrapper, and a further training
step still moves every KHA weight. The model is a tiny Llama with linear KHA on q and MLP-value
KHA on v, trained two steps by the real Trainer on the CPU in bf16.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params
from kha_compile.core.errors import BackendUnavailableError
from kha_compile.exporters import generate_aoti, generate_onnx
from kha_compile.model.wrappers import forward_wrapper

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import Trainer, TrainingArguments

CFG = kc.KHAConfig(q="linear", v="mlp")
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
PROMPT = IDS[:1, :5]
NEW = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A KHA model right after Trainer(bf16=True, use_cpu=True).train(): its forward still autocasts."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    kc.apply(model, CFG)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(
        str(tmp_path_factory.mktemp("trainer")), bf16=True, use_cpu=True, max_steps=2, per_device_train_batch_size=4,
        learning_rate=5e-2, save_strategy="no", report_to=[], seed=0,
    )  # fmt: skip
    Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids]).train()
    assert forward_wrapper(model) is not None, "accelerate no longer wraps forward: this test tests nothing"
    with torch.no_grad():
        assert model(input_ids=IDS).logits.dtype == torch.float32  # the wrapper casts its bf16 outputs back
    return model


def _reloaded(model, d):
    """The same model saved and reloaded: transformers' weights, kha_compile's KHA checkpoint, a fresh model."""
    model.save_pretrained(d / "model")
    kc.save_pretrained(model, d / "kha")
    fresh = transformers.LlamaForCausalLM.from_pretrained(d / "model")
    kc.load_pretrained(fresh, d / "kha")
    return fresh.eval()


def _snapshot(model):
    return (
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {n: type(m) for n, m in model.named_modules()},
        model.__dict__.get("forward"),
        model.config.to_dict(),
        model.training,
    )


def _left_as_it_was(model, before):
    state, classes, wrapper, config, training = _snapshot(model)
    assert state.keys() == before[0].keys() and all(torch.equal(state[k], before[0][k]) for k in state)
    assert classes == before[1] and config == before[3] and training == before[4]
    assert wrapper is before[2] and forward_wrapper(model) is not None  # accelerate's wrapper is back
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # and it still trains KHA
    kha = {n: p.detach().clone() for n, p in kha_params(model).items()}
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    opt.step()
    opt.zero_grad()
    assert all(not torch.equal(p, kha[n]) for n, p in kha_params(model).items())


def _reference(model, tmp_path):
    ref = _reloaded(model, tmp_path)
    with torch.no_grad():
        logits = ref(input_ids=IDS).logits
        own = type(model).forward(model, input_ids=IDS).logits  # the model's own fp32 forward, under the wrapper
        tokens = ref.generate(PROMPT, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    torch.testing.assert_close(own, logits, rtol=0, atol=1e-6)
    return logits, tokens


def _no_bf16(path):
    import onnx

    m = onnx.load(str(path))
    bf16 = onnx.TensorProto.BFLOAT16
    assert not [i.name for i in m.graph.initializer if i.data_type == bf16]
    assert not [n.name for n in m.graph.node if n.op_type == "Cast" and any(a.i == bf16 for a in n.attribute)]


@pytest.mark.slow  # a torch.onnx export: 5-15 s on two busy cores
def test_export_onnx_and_the_tensorrt_onnx_step(trained, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    logits, _ = _reference(trained, tmp_path)
    before = _snapshot(trained)
    path = kc.export_onnx(trained, tmp_path / "m.onnx")
    _no_bf16(path)
    got = ort.InferenceSession(str(path)).run(
        ["logits"], {"input_ids": IDS.numpy(), "attention_mask": torch.ones_like(IDS).numpy()}
    )[0]
    torch.testing.assert_close(torch.from_numpy(got), logits, rtol=1e-4, atol=1e-5)
    # TensorRT is not installable here: the step before it ran
    with pytest.raises(BackendUnavailableError, match="tensorrt"):
        kc.export_tensorrt(path, tmp_path / "m.engine")
    assert not (tmp_path / "m.engine").exists()
    _left_as_it_was(trained, before)


@pytest.mark.slow  # a with-past torch.onnx export: 5-15 s on two busy cores
def test_export_onnx_with_past(trained, tmp_path):
    pytest.importorskip("onnxruntime")
    _, tokens = _reference(trained, tmp_path)
    before = _snapshot(trained)
    path = kc.export_onnx(trained, tmp_path / "genai", past=True)
    _no_bf16(path)
    assert torch.equal(generate_onnx(path, PROMPT, NEW), tokens)
    _left_as_it_was(trained, before)


@pytest.mark.slow  # an AOTInductor compile: 10-30 s on two busy cores
def test_export_aoti(trained, tmp_path):
    logits, _ = _reference(trained, tmp_path)
    before = _snapshot(trained)
    path = kc.export_aoti(trained, tmp_path / "m.pt2")  # its own check compares the package with the model
    got = torch._inductor.aoti_load_package(str(path))(IDS, torch.ones_like(IDS))
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, logits, rtol=1e-4, atol=1e-5)
    _left_as_it_was(trained, before)


@pytest.mark.slow  # an AOTInductor compile: 10-30 s on two busy cores
def test_export_aoti_generation(trained, tmp_path):
    _, tokens = _reference(trained, tmp_path)
    before = _snapshot(trained)
    path = kc.export_aoti(trained, tmp_path / "g.pt2", generation=True, max_cache_len=16)
    assert torch.equal(generate_aoti(path, PROMPT, NEW), tokens)
    _left_as_it_was(trained, before)


def test_save_pretrained_and_fold(trained, tmp_path):
    logits, _ = _reference(trained, tmp_path)  # kc.save_pretrained of the wrapped model, read back
    folded = _reloaded(trained, tmp_path / "again")
    kc.fold(folded, strict=False)
    wrapper = trained.__dict__["forward"]
    kc.fold(trained, strict=False)  # the linear q folds in place, MLP-value stays
    assert trained.__dict__["forward"] is wrapper
    with torch.no_grad():
        want = folded(input_ids=IDS).logits
        got = type(trained).forward(trained, input_ids=IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(want, logits, rtol=1e-5, atol=1e-5)  # folding changed nothing computed
