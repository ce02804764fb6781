"""Tiny Llama models on quantized bases, built the way a user builds them, and their dequantized twins.

Each base kind is loaded from one tiny random Llama saved to a directory: bitsandbytes 4-bit (nf4, fp4)
and 8-bit through ``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``, torchao's
weight-only int8 and int4 through ``quantize_`` (torchao's ``Int4WeightOnlyConfig`` has no CPU packing
in 0.18: its plain format needs the mslk kernels, plain_int32 refuses the CPU; ``IntxWeightOnlyConfig``
with ``torch.int4`` is torchao's int4 weight-only that runs on CPU). :func:`dequantized` reads the
quantized weights back with the libraries' own dequantization, into the plain model: an independent
float model whose weights are exactly what the quantized base stores.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

BNB = ("bnb-nf4", "bnb-fp4", "bnb-int8")
TORCHAO = ("torchao-int8", "torchao-int4")
KINDS = BNB + TORCHAO

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def skip_without(kind: str) -> None:
    """Skip the calling test when the library behind ``kind`` cannot be imported."""
    if kind in BNB:
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (the quant extra)")
    else:
        pytest.importorskip("torchao", reason="torchao is not installed (the quant extra)")


def save_tiny_llama(path) -> str:
    """A tiny random Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def torchao_config(kind: str):
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    if kind == "torchao-int8":
        return Int8WeightOnlyConfig()
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))


def load_float(path: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def load_quantized(path: str, kind: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The model at ``path`` on the quantized base ``kind`` (one of :data:`KINDS`), in ``dtype`` (default: as saved)."""
    from transformers import AutoModelForCausalLM

    skip_without(kind)
    if kind in BNB:
        from transformers import BitsAndBytesConfig

        if kind == "bnb-int8":
            qc = BitsAndBytesConfig(load_in_8bit=True)
        else:
            qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=kind[4:], bnb_4bit_compute_dtype=dtype)
        return AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=dtype or "auto")
    from torchao.quantization import quantize_

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
    quantize_(model, torchao_config(kind))
    return model


def dequantize_weight(m: nn.Module) -> torch.Tensor:
    """A quantized linear's weight as the float matrix it stands for, by the library's own dequantization."""
    w = m.weight
    if type(w).__name__ == "Params4bit":
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(w.data, w.quant_state).float()
    if type(w).__name__ == "Int8Params":
        scb = w.SCB if w.SCB is not None else m.state.SCB  # the first forward moves it to the module's state
        return w.data.float() * scb.float()[:, None] / 127  # bitsandbytes' row-wise absmax int8
    return w.dequantize().float()  # torchao's tensor subclasses


def dequantized(quantized: nn.Module, path: str) -> nn.Module:
    """The float model from ``path`` with every quantized linear's weight replaced by its dequantization."""
    from kha_compile.core.quantized import is_quantized_linear

    model = load_float(path)
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if is_quantized_linear(m):
                model.get_submodule(name).weight.copy_(dequantize_weight(m))
    return model


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())
