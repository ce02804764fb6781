"""apply() on an 80-layer Llama with 70B shapes on the meta device, against one torch.export of it.

Both run in this process on the same meta model (no weights are materialised). apply() traces one
representative per distinct block type, so it should cost a small fraction of a full export.
Goal: ratio <= 0.25.

    python benchmarks/apply_speed.py [--layers 80] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import write_json

import kha_compile as kc
from kha_compile.analysis.inputs import example_inputs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=args.layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ex_args, ex_kwargs = example_inputs(model)

    start = time.perf_counter()
    torch.export.export(model, ex_args, ex_kwargs, strict=False)
    t_export = time.perf_counter() - start

    start = time.perf_counter()
    kc.apply(model, kc.KHAConfig(v="mlp"))
    t_apply = time.perf_counter() - start
    n = sum(".kha." in name for name, _ in model.named_parameters())

    ratio = t_apply / t_export
    print(f"Llama {args.layers} layers, hidden 8192, 64 q / 8 kv heads, on the meta device")
    print(f"  torch.export (whole model): {t_export:6.2f} s")
    print(f"  kc.apply (KHA-MLP):         {t_apply:6.2f} s   ({n} KHA tensors inserted)")
    print(f"  ratio apply / export:       {ratio:6.3f}   (goal <= 0.25) {'OK' if ratio <= 0.25 else 'MISSED'}")
    record = {"layers": args.layers, "export_s": t_export, "apply_s": t_apply, "ratio": ratio}
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
