"""kc.apply on quantized bases: bitsandbytes 4-bit (nf4, fp4) and 8-bit, torchao weight-only int8 and int4.

The analysis traces each quantized linear as the plain linear it stands for (analysis/quantized.py), so
the q, k, v projections are found; the transforms go in after them, in the compute dtype, trainable,
while the quantized weights stay frozen and quantized; identity holds exactly at init. The KHA model
is checked against two references, with perturbed (trained-like) KHA weights: the per-head reference
(tests/reference.py) on the float model whose weights are the base's dequantized ones, and the same on
the unquantized model, within the quantization's own error.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.core.quantized import is_quantized_linear
from quantized_bases import KINDS, dequantize_weight, dequantized, load_float, load_quantized, max_err, save_tiny_llama
from reference import Reference

CFG = kc.KHAConfig(q="linear", k="linear", v="mlp")
# more tokens than d_model (64): "auto" would run linear KHA weight-side on a plain weight
IDS = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def logits(model, **kw):
    return model(IDS, **kw).logits


def reference_logits(untouched, kha_model) -> torch.Tensor:
    """The per-head reference on ``untouched`` (a float model) with ``kha_model``'s KHA tensors."""
    state = dict(untouched.state_dict())
    state.update({k: v.float() for k, v in kha_model.state_dict().items() if ".kha." in k})
    ref = Reference(untouched).load(state, expect={"q": "linear", "k": "linear", "v": "mlp"})
    with torch.no_grad():
        return ref(input_ids=IDS).logits


@pytest.mark.parametrize("kind", KINDS)
def test_apply_on_quantized_base_matches_reference(llama_dir, kind):
    model = load_quantized(llama_dir, kind)
    deq = dequantized(model, llama_dir)  # read before any forward (bitsandbytes repacks 4-bit for CPU inference)
    plain = load_float(llama_dir)
    with torch.no_grad():
        before = logits(model)
        quant_err = max_err(before, logits(plain))  # the quantization's own error
        kernel_err = max_err(before, logits(deq))  # the quantized kernels against their own weights in float
    kc.apply(model, CFG)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert is_quantized_linear(q_proj), "the base weight must stay quantized"
    with torch.no_grad():
        assert torch.equal(logits(model), before), "identity at init must be exact"
    params = kha_params(model)
    assert len(params) == 2 * (2 + 3)  # 2 layers x (T^Q, T^K, the MLP's up, gate, down)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params.values())
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.endswith("q_proj.weight"))
    perturb(model)
    with torch.no_grad():
        got = logits(model)
    ref_deq = reference_logits(deq, model)
    ref_plain = reference_logits(plain, model)
    effect = max_err(ref_plain, logits(plain).detach())  # what the perturbed KHA changes: far above the errors
    err_deq, err_plain = max_err(got, ref_deq), max_err(got, ref_plain)
    print(
        f"{kind}: quantization error {quant_err:.2e}, kernel {kernel_err:.2e}; with KHA: {err_deq:.2e} against the "
        f"dequantized model, {err_plain:.2e} against the unquantized one; KHA changes the logits by {effect:.2e}"
    )
    assert effect > 10 * max(err_deq, 1e-6), (kind, effect, err_deq)
    # against the float model holding the dequantized weights: within the kernels' own rounding (bitsandbytes'
    # CPU 4-bit kernel computes in bfloat16; LLM.int8 quantizes the activations too)
    assert err_deq <= 3 * kernel_err + 1e-5, (kind, err_deq, kernel_err)
    # against the unquantized model with the same KHA: within the quantization's own error
    assert err_plain <= 3 * quant_err + 1e-5, (kind, err_plain, quant_err)


@pytest.mark.parametrize("kind", KINDS)
def test_kha_trains_on_frozen_quantized_base(llama_dir, kind):
    model = load_quantized(llama_dir, kind)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"))
    perturb(model)
    model.train()  # bitsandbytes' CPU inference repacking (eval, no grad) has no backward
    q_projs = [layer.self_attn.q_proj for layer in model.model.layers]
    before = [dequantize_weight(m) for m in q_projs]
    logits(model).float().pow(2).mean().backward()
    params = kha_params(model)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params.values()), "every KHA weight trains"
    for m, w in zip(q_projs, before):
        assert m.weight.grad is None and torch.equal(dequantize_weight(m), w), "the quantized weights stay frozen"


@pytest.mark.parametrize("kind", ["torchao-int8", "torchao-int4"])
def test_apply_in_either_order_with_torchao(llama_dir, kind):
    """quantize_ then kc.apply gives the model kc.apply then quantize_ gives: the same quantized weights (torchao
    quantizes each weight on its own) and the same float transforms, so the same logits; both within the
    quantization's error of the unquantized model with that KHA."""
    from torchao.quantization import quantize_

    from quantized_bases import torchao_config

    first = load_float(llama_dir)
    kc.apply(first, CFG)
    perturb(first)
    float_kha = logits(first).detach()
    quantize_(first, torchao_config(kind))  # apply, then quantize
    second = load_quantized(llama_dir, kind)  # quantize, then apply
    kc.apply(second, CFG)
    second.load_state_dict({k: v for k, v in first.state_dict().items() if ".kha." in k}, strict=False)
    with torch.no_grad():
        a, b = logits(first), logits(second)
    quant_err = max_err(a, float_kha)
    assert 0 < quant_err < 0.5 * max_err(float_kha, logits(load_float(llama_dir)).detach())
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bnb-int8", "bnb-nf4", "torchao-int8"])
def test_transforms_take_the_compute_dtype_of_a_bfloat16_model(llama_dir, kind):
    """bitsandbytes' 8-bit weight tells no compute dtype (int8 rows, float32 scales): the transforms take the
    model's, so a bfloat16 model runs; identity stays exact."""
    model = load_quantized(llama_dir, kind, dtype=torch.bfloat16)
    with torch.no_grad():
        before = logits(model)
    kc.apply(model, CFG)
    assert {p.dtype for p in kha_params(model).values()} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(logits(model), before)
