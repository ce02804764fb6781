"""kc.apply on a pre-quantized compressed-tensors checkpoint (pack-quantized int4 weights, groups of 32), the format
llm-compressor writes and vLLM serves, loaded by transformers' own compressed-tensors quantizer on CPU.

The checkpoint is written with compressed-tensors alone (no llm-compressor: the weight-only scales are the min-max
ones its memoryless observer computes). transformers keeps the weights packed until the first forward, which
decompresses them; compressed-tensors then runs each linear through a forward of its own that fake-quantizes the
weight, which the analysis traces as the plain linear it is (kha_compile/analysis/quantized.py). The reference: the
per-head reference (tests/reference.py) on the float model holding the decompressed weights.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import perturb
from kha_compile.core.errors import UnsupportedModelError
from quantized_bases import load_float, max_err, save_tiny_llama
from reference import Reference

IDS = torch.randint(0, 128, (2, 80), generator=torch.Generator().manual_seed(0))
CFG = kc.KHAConfig(q="linear", k="linear", v="mlp")


def write_w4a16(src: str, out: str) -> None:
    """``src`` quantized to int4 weights (symmetric, groups of 32, lm_head left out), saved pack-quantized to ``out``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = load_float(src)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "quantization_scheme", None) is None:
                continue
            w = m.weight.reshape(m.weight.shape[0], -1, 32)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
            m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


@pytest.fixture(scope="module")
def w4a16_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed (the quant extra)")
    src = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
    out = str(tmp_path_factory.mktemp("tiny_llama_w4a16"))
    write_w4a16(src, out)
    return src, out


def test_apply_on_compressed_tensors_checkpoint(w4a16_dir):
    from transformers import AutoModelForCausalLM

    src, out = w4a16_dir
    model = AutoModelForCausalLM.from_pretrained(out)
    assert "weight_packed" in dict(model.model.layers[0].self_attn.q_proj.named_parameters())
    with pytest.raises(UnsupportedModelError, match=r"packed weights.*Run one forward"):
        kc.apply(model, CFG)  # still packed: a clear refusal, the model unchanged
    with torch.no_grad():
        before = model(IDS).logits  # the first forward decompresses the packed weights
        quant_err = max_err(before, load_float(src)(IDS).logits)
    assert quant_err > 1e-3  # int4 weights: really quantized
    deq = load_float(src)
    with torch.no_grad():
        for name, m in model.named_modules():
            if getattr(m, "quantization_scheme", None) is not None:
                deq.get_submodule(name).weight.copy_(m.weight)
        assert max_err(deq(IDS).logits, before) < 1e-5  # the decompressed weights are the quantized values
    kc.apply(model, CFG)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, before), "identity at init must be exact"
    perturb(model)
    with torch.no_grad():
        got = model(IDS).logits
    state = dict(deq.state_dict())
    state.update({k: v for k, v in model.state_dict().items() if ".kha." in k})
    ref = Reference(deq).load(state, expect={"q": "linear", "k": "linear", "v": "mlp"})
    with torch.no_grad():
        want = ref(input_ids=IDS).logits
    assert max_err(want, before) > 0.1  # the perturbed KHA changes the logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
