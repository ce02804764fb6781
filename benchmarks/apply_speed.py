"""apply() on an 80-layer Llama with 70B shapes on the meta device, against one torch.export of it.

All run in this process on the same meta model (no weights are materialised). apply() traces one
representative per distinct block type, so it should cost a small fraction of a full export. apply
runs with its self-check (``check=True``, the default: one more trace of one block per type, and the
match of it; no forward on the meta device) and without it (``check=False``), side by side.
Goals: ratio <= 0.25 without the check, <= 0.15 with it (issue 34).

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

    times = {}
    for check in (False, True) * 3:  # in turns: the machine's load moves between runs
        kc.remove(model)
        start = time.perf_counter()
        kc.apply(model, kc.KHAConfig(v="mlp"), check=check)
        times.setdefault(check, []).append(time.perf_counter() - start)
    t_apply, t_checked = min(times[False]), min(times[True])
    n = sum(".kha." in name for name, _ in model.named_parameters())

    ratio, ratio_checked = t_apply / t_export, t_checked / t_export
    print(f"Llama {args.layers} layers, hidden 8192, 64 q / 8 kv heads, on the meta device")
    print(f"  torch.export (whole model):        {t_export:6.2f} s")
    print(f"  kc.apply (KHA-MLP), check=False:   {t_apply:6.2f} s   ({n} KHA tensors inserted)")
    print(f"  kc.apply (KHA-MLP), check=True:    {t_checked:6.2f} s   (the check: {t_checked - t_apply:+.2f} s)")
    print(f"  ratio apply / export, no check:    {ratio:6.3f}   (goal <= 0.25) {'OK' if ratio <= 0.25 else 'MISSED'}")
    ok = "OK" if ratio_checked <= 0.15 else "MISSED"
    print(f"  ratio apply / export, with check:  {ratio_checked:6.3f}   (goal <= 0.15) {ok}")
    record = {
        "layers": args.layers,
        "export_s": t_export,
        "apply_s": t_apply,
        "apply_checked_s": t_checked,
        "ratio": ratio,
        "ratio_checked": ratio_checked,
    }
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
