"""Quantization with compressed-tensors (the format vLLM reads), run in the vLLM environment, which ships it.

llm-compressor, the usual front end, pins transformers <= 5.17 and installs neither beside vLLM's
transformers 5.19 nor beside the tests' 5.24; compressed-tensors alone is the same format and the
same compressors: its preset scheme is attached to every ``nn.Linear`` but ``lm_head`` (and the KHA,
which holds no ``nn.Linear``), the weight scales are set from each row's range with compressed-tensors'
own ``calculate_qparams`` (what llm-compressor's min-max observer computes for a data-free scheme), and
``ModelCompressor`` writes the int8 weights and the ``quantization_config`` vLLM dispatches on.
"""

from __future__ import annotations

import json
import pathlib

import torch


def quantize(source: str, target: str, scheme: str = "W8A8") -> dict:
    """Load ``source`` (a transformers directory without KHA, or a folded one), quantize it, save it to ``target``."""
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(scheme, ["Linear"])}, ignore=["lm_head"]
    )
    apply_quantization_config(model, config)
    quantized = []
    with torch.no_grad():
        for name, module in model.named_modules():
            args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
            if args is None:
                continue
            w = module.weight
            if args.group_size:  # per group of input columns
                w = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
            quantized.append(name)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    quant = json.loads((pathlib.Path(target) / "config.json").read_text())["quantization_config"]
    return {"quantized": quantized, "quant_method": quant["quant_method"], "format": quant.get("format")}
