"""A model trained in mixed precision or cast to bf16: checkpoints both ways, fold, ONNX and AOTInductor.

- kc.save_pretrained from a bf16 model loads into an fp32 one (KHA tensors cast up, exactly) and
  the other way round (cast down, as transformers casts a checkpoint to the model's dtype); the
  same through transformers' own save_pretrained / from_pretrained(dtype=...).
- kc.fold of a bf16 model: the folded bf16 model and the unfolded one both stay within a few bf16
  units of the fp32 reference (tests/reference.py, KHA by hooks on the untouched fp32 copy).
- ONNX: a bf16 model exports as bf16 with its kha::MLPValue nodes, and says how to get a file that
  onnxruntime's CPU provider runs (an fp32 copy), which then matches the fp32 model.
- AOTInductor: a bf16 package runs and matches the bf16 model within a few bf16 units.
- A model trained under autocast (fp32 master weights) exports and runs as before.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("transformers")

import kha_compile as kc
import zoo
from helpers import kha_params, perturb
from reference import Reference, rel_err
from regimes import KINDS, Regime, pair, train

BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7
IDS = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(4))


def _kha_model(cfg=None):
    model = zoo.make("llama").model.eval()
    untouched = copy.deepcopy(model)
    kc.apply(model, cfg or kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(model, scale=0.1)
    return model, untouched


def test_kha_checkpoint_from_bf16_loads_into_fp32_and_back(tmp_path):
    model, _ = _kha_model()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    kc.save_pretrained(bf16, tmp_path / "from_bf16")
    kc.save_pretrained(model, tmp_path / "from_fp32")

    fp32 = kc.load_pretrained(zoo.make("llama").model, tmp_path / "from_bf16")
    for name, p in kha_params(fp32).items():
        assert p.dtype == torch.float32
        assert torch.equal(p, bf16.get_parameter(name).float())  # cast up: exact
    down = kc.load_pretrained(zoo.make("llama").model.to(torch.bfloat16), tmp_path / "from_fp32")
    for name, p in kha_params(down).items():
        assert p.dtype == torch.bfloat16
        assert torch.equal(p, model.get_parameter(name).to(torch.bfloat16))  # cast down, round to nearest
    with torch.no_grad():
        assert down(input_ids=IDS).logits.dtype == torch.bfloat16  # runs: every KHA tensor is bf16 too


def test_transformers_checkpoint_of_a_bf16_model_loads_in_either_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = _kha_model()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "hf")
    for dtype in (torch.float32, torch.bfloat16):
        loaded = kc.load_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=dtype), tmp_path / "hf")
        for name, p in kha_params(loaded).items():
            assert p.dtype == dtype
            assert torch.equal(p, bf16.get_parameter(name).to(dtype))
        with torch.no_grad():  # (rotary buffers are rebuilt in fp32 on load: not bit-equal to a cast model)
            got, want = loaded(input_ids=IDS).logits, copy.deepcopy(bf16).to(dtype)(input_ids=IDS).logits
        assert got.dtype == dtype and rel_err(got, want) <= 4 * BF16_EPS


def test_fold_of_a_bf16_model_stays_within_bf16_rounding_of_the_fp32_reference():
    model, untouched = _kha_model(kc.KHAConfig(q="linear", k="linear", v="linear"))
    ref = Reference(untouched).load(model.state_dict(), {"q": "linear", "k": "linear", "v": "linear"})
    want = ref(input_ids=IDS).logits.detach()
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        unfolded = bf16(input_ids=IDS).logits
        kc.fold(bf16)
        folded = bf16(input_ids=IDS).logits
    assert not kha_params(bf16) and bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    err_unfolded, err_folded = rel_err(unfolded, want), rel_err(folded, want)
    assert err_folded <= 2 * max(err_unfolded, 4 * BF16_EPS), (err_folded, err_unfolded)


def test_onnx_export_of_a_bf16_model_is_bf16_and_says_how_to_run_it_on_cpu(tmp_path, caplog):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    model, _ = _kha_model(kc.KHAConfig(v="mlp"))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="kha_compile"):
        path = kc.export_onnx(bf16, tmp_path / "bf16.onnx")
    assert "onnxruntime's CPU provider" in caplog.text and ".float()" in caplog.text
    m = onnx.load(str(path))
    assert m.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    mlp = [n for n in m.graph.node if n.op_type == "MLPValue"]
    assert len(mlp) == 2 and {f.name for f in m.functions} >= {"MLPValue"}

    path = kc.export_onnx(copy.deepcopy(bf16).float(), tmp_path / "fp32.onnx")  # the fix the warning names
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": IDS.numpy(), "attention_mask": torch.ones_like(IDS).numpy()})[0]
    with torch.no_grad():
        want = copy.deepcopy(bf16).float()(input_ids=IDS).logits
    assert rel_err(torch.from_numpy(got), want) < 1e-5


@pytest.mark.slow
def test_aoti_package_of_a_bf16_model_runs_in_bf16(tmp_path):
    model, _ = _kha_model(kc.KHAConfig(q="linear", v="mlp"))
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    path = kc.export_aoti(bf16, tmp_path / "bf16.pt2", example_kwargs={"input_ids": IDS})
    got = torch._inductor.aoti_load_package(str(path))(IDS)
    got = got[0] if isinstance(got, (tuple, list)) else got
    with torch.no_grad():
        want = bf16(input_ids=IDS).logits
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 4 * BF16_EPS


def test_model_trained_under_autocast_exports_to_onnx(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    made, _, _ = pair("llama", KINDS["mlp"])
    train(made, Regime("bf16", amp=torch.bfloat16, steps=2))
    assert all(p.dtype == torch.float32 for p in made.parameters())  # fp32 master weights
    path = kc.export_onnx(made, tmp_path / "trained.onnx")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"input_ids": IDS.numpy(), "attention_mask": torch.ones_like(IDS).numpy()})[0]
    with torch.no_grad():
        want = made.eval()(input_ids=IDS).logits
    assert rel_err(torch.from_numpy(got), want) < 1e-5
