"""AOTInductor package latency: folded linear KHA / baseline and MLP-value KHA / baseline, with package sizes.

A transformers Llama (hidden 512, 8 q / 4 kv heads of 64, 2 layers, vocab 4096, random weights) exported
three times with ``kc.export_aoti``: no KHA (baseline), linear q, k, v KHA (folded into the weights: the
same graph as the baseline) and MLP-value KHA on v (lowered to aten ops inside the package). KHA weights
are moved off identity first. The three packages are loaded in this process and timed in turns on the
same inputs, batch 1 and 8 at sequence 128. Goals: folded / baseline = 1.00 within noise, MLP-value /
baseline <= 1.05 (its FLOP share, docs/method.md, "Cost").

The device is CUDA when torch sees a GPU (the packages are then CUDA packages; Inductor writes Triton
kernels for the decomposed MLP-value), else CPU. ``--device`` chooses.

    python benchmarks/aoti_latency.py [--repeats 20] [--device cpu|cuda] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import tempfile
import time

import torch
from _common import add_threads_arg, apply_threads, deploy_line, deploy_ratios, finish, interleaved_times

import kha_compile as kc

SHAPE = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
VOCAB, SEQ, BATCHES = 4096, 128, (1, 8)
VARIANTS = {
    "baseline": None,
    "folded-linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "mlp-value": kc.KHAConfig(v="mlp"),
}


def models(device: str) -> dict[str, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, head_dim=64, vocab_size=VOCAB)
    base = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    out = {}
    for name, kcfg in VARIANTS.items():
        m = copy.deepcopy(base)
        if kcfg is not None:
            kc.apply(m, kcfg)
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():  # trained-like KHA weights
                for n, p in m.named_parameters():
                    if ".kha." in n:
                        p.add_(0.02 * torch.randn(p.shape, generator=gen))
        out[name] = m.to(device)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    device = args.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    record: dict = {"device": device, "shape": SHAPE, "vocab": VOCAB, "seq": SEQ}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runners, sizes, compile_s, eager = {}, {}, {}, {}
        for name, model in models(device).items():
            start = time.perf_counter()
            path = kc.export_aoti(model, pathlib.Path(tmp) / f"{name}.pt2")  # checked against eager inside
            compile_s[name] = time.perf_counter() - start
            sizes[name] = path.stat().st_size
            runners[name] = torch._inductor.aoti_load_package(str(path))
            eager[name] = model
        print(
            f"Llama hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, vocab {VOCAB}, on {device} "
            f"({torch.get_num_threads()} threads). Packages: "
            + ", ".join(f"{v} {sizes[v] / 2**20:.1f} MiB ({compile_s[v]:.0f} s to build)" for v in runners)
        )
        record.update({"sizes": sizes, "build_s": compile_s})
        for batch in BATCHES:
            ids = torch.randint(0, VOCAB, (batch, SEQ), device=device)
            mask = torch.ones_like(ids)
            with torch.no_grad():
                want = eager["mlp-value"](input_ids=ids, attention_mask=mask, use_cache=False).logits
            worst = float((runners["mlp-value"](ids, mask)[0] - want).abs().max())

            fns = {v: (lambda r=r, ids=ids, mask=mask: (r(ids, mask), sync())) for v, r in runners.items()}
            med = {v: statistics.median(t) for v, t in interleaved_times(fns, args.repeats).items()}
            rec = {**deploy_ratios(med), "mlp_package_vs_eager": worst}
            print(
                deploy_line(f"batch {batch}, seq {SEQ}", rec) + f" | mlp-value package vs eager max |diff| {worst:.2g}"
            )
            record[f"b{batch}"] = rec
    return finish(record, load_before, args.json)


if __name__ == "__main__":
    main()
