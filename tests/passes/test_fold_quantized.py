"""kc.fold on quantized bases: the linear KHA folds into the dequantized weight, which is stored again in its own
format (bitsandbytes 4-bit nf4/fp4 and 8-bit, torchao weight-only int8 and int4); any other format is refused
with a FoldError that says to fold before quantizing, and the model is left as it was.

The references: the unquantized model with the same (perturbed) KHA, folded in float; and the quantization's own
error (the quantized KHA model against the unquantized one). Requantizing the folded weight rounds it once more,
so the folded quantized model stays within about twice the quantization's own error of both.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.core.errors import FoldError
from kha_compile.model.carrier import KHAProjection
from quantized_bases import KINDS, load_float, load_quantized, max_err, save_tiny_llama, skip_without, torchao_config

LINEAR = kc.KHAConfig(q="linear", k="linear", v="linear")
IDS = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def logits(model):
    with torch.no_grad():
        return model(IDS).logits


def with_same_kha(float_model, kha_model):
    """``float_model`` with ``kha_model``'s KHA tensors (the unquantized twin)."""
    kc.apply(float_model, LINEAR)
    float_model.load_state_dict({k: v.float() for k, v in kha_model.state_dict().items() if ".kha." in k}, strict=False)
    return float_model


@pytest.mark.parametrize("kind", KINDS)
def test_fold_requantizes_in_the_same_format(llama_dir, kind, caplog):
    model = load_quantized(llama_dir, kind)
    q_proj = model.model.layers[0].self_attn.q_proj
    base_class, weight_class = type(q_proj), type(q_proj.weight)
    untouched = logits(model)
    kc.apply(model, LINEAR)
    perturb(model, scale=0.3)
    twin = with_same_kha(load_float(llama_dir), model)
    kha_q, kha_f = logits(model), logits(twin)
    quant_err = max_err(kha_q, kha_f)  # the quantization's own error, with KHA
    with caplog.at_level(logging.INFO, logger="kha_compile.passes.fold"):
        kc.fold(model)
    kc.fold(twin)
    assert not kha_params(model) and not any(isinstance(m, KHAProjection) for m in model.modules())
    assert type(q_proj) is base_class and type(q_proj.weight) is weight_class, "stored again in its own format"
    assert not q_proj.weight.requires_grad
    assert sum("requantized as" in r.getMessage() for r in caplog.records) == 6, "each requantization is logged"
    folded_q, folded_f = logits(model), logits(twin)
    fold_err = max_err(folded_q, kha_q)  # what folding into the quantized weight changed
    dropped = max_err(untouched, kha_q)  # a fold that lost the transforms would be this far off
    print(
        f"{kind}: quantization error {quant_err:.2e}; fold on the quantized base changes the logits by {fold_err:.2e}; "
        f"folded quantized vs folded float {max_err(folded_q, folded_f):.2e}; float fold {max_err(folded_f, kha_f):.2e}"
    )
    assert max_err(folded_f, kha_f) < 1e-4
    assert fold_err <= 2 * quant_err + 1e-5, (kind, fold_err, quant_err)
    assert max_err(folded_q, folded_f) <= 2 * quant_err + 1e-5, (kind, max_err(folded_q, folded_f), quant_err)
    assert dropped > 3 * max(fold_err, quant_err), (kind, dropped, fold_err, quant_err)


def test_fold_refuses_a_format_it_cannot_requantize(llama_dir):
    skip_without("torchao-int8")
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    model = load_float(llama_dir)
    quantize_(model, Float8WeightOnlyConfig())  # runs on CPU; kha_compile does not requantize float8
    kc.apply(model, LINEAR)
    perturb(model)
    before = logits(model)
    with pytest.raises(FoldError, match=r"Float8Tensor.*Fold before quantizing.*Nothing was changed"):
        kc.fold(model)
    assert len(kha_params(model)) == 6 and torch.equal(logits(model), before), "a refused fold changes nothing"


@pytest.mark.parametrize("kind", ["torchao-int8", "torchao-int4"])
def test_apply_then_quantize_then_fold(llama_dir, kind):
    """The other order: KHA on the float model, then torchao's quantize_ (the KHA transforms are no nn.Linear:
    they stay float), then fold; within the quantization's error of the same model unquantized."""
    skip_without(kind)
    from torchao.quantization import quantize_

    model = load_float(llama_dir)
    kc.apply(model, LINEAR)
    perturb(model, scale=0.3)
    float_kha = logits(model)
    quantize_(model, torchao_config(kind))
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in kha_params(model).values())
    kha_q = logits(model)
    quant_err = max_err(kha_q, float_kha)
    assert quant_err > 0
    kc.fold(model)
    assert not kha_params(model)
    assert max_err(logits(model), kha_q) <= 2 * quant_err + 1e-5
    assert max_err(logits(model), float_kha) <= 3 * quant_err + 1e-5
