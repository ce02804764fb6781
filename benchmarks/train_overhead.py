"""Training-step time with KHA / without, on Llama-like models (CPU, eager), with FLOP ratios.

Two shapes:

- ``small-batch``: 4 layers, hidden 1024, 8 q / 4 kv heads (head dim 128), seq 512, batch 2
  (1024 tokens per step = d_model: strategy auto runs linear KHA token-side here);
- ``realistic``: 4 layers, hidden 512, 4 q / 2 kv heads (head dim 128), seq 1024, batch 4
  (4096 tokens per step = 8 x d_model: auto runs linear KHA weight-side).

Variants, timed in turns in one process (medians): no KHA; KHA-Linear on q, k, v with
``strategy="weight"`` (folded on the fly) and ``strategy="token"`` (transform of the projection
output); KHA-MLP on v (always token-side). Next to each time ratio: the FLOP ratio of the same
step counted by ``FlopCounterMode`` on the meta device. Goal: linear KHA <= 1.01x time at the
realistic shape. The load average is printed: the machine is shared.

    python benchmarks/train_overhead.py [--repeats 10] [--shapes small-batch,realistic] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics

import torch
from _common import add_threads_arg, apply_threads, interleaved_times, llama, llama_config, step_flop_ratios, write_json

import kha_compile as kc

SHAPES = {  # name: (hidden, intermediate, layers, q heads, kv heads, seq, batch)
    "small-batch": (1024, 2816, 4, 8, 4, 512, 2),
    "realistic": (512, 1376, 4, 4, 2, 1024, 4),
}
VARIANTS = {
    "linear-weight": kc.KHAConfig(q="linear", k="linear", v="linear", strategy="weight"),
    "linear-token": kc.KHAConfig(q="linear", k="linear", v="linear", strategy="token"),
    "mlp": kc.KHAConfig(v="mlp"),
}
LINEAR_GOAL = 1.01


def build(shape: str, device: str = "cpu"):
    hidden, inter, layers, hq, hkv, _, _ = SHAPES[shape]
    cfg = llama_config(hidden, inter, layers, hq, hkv, vocab=8192)
    model = llama(cfg, device)
    variants = {"baseline": model}
    for name, kcfg in VARIANTS.items():
        m = copy.deepcopy(model)
        kc.apply(m, kcfg)
        variants[name] = m
    return variants, cfg


def step_fn(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()

    return step


def flop_ratios(shape: str) -> dict[str, float]:
    """FLOPs of one training step of each variant over the baseline, counted on the meta device."""
    hidden, inter, layers, hq, hkv, seq, batch = SHAPES[shape]
    cfg = llama_config(hidden, inter, layers, hq, hkv, vocab=8192)
    return step_flop_ratios(cfg, {"baseline": None, **VARIANTS}, batch, seq)


def run_shape(shape: str, repeats: int) -> dict:
    hidden, _, layers, hq, hkv, seq, batch = SHAPES[shape]
    flops = flop_ratios(shape)
    variants, cfg = build(shape)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    load_before = os.getloadavg()[0]
    times = interleaved_times({k: step_fn(m, ids) for k, m in variants.items()}, repeats)
    load_after = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    tokens = batch * seq
    print(
        f"[{shape}] Llama hidden {hidden}, {layers} layers, {hq} q / {hkv} kv heads of 128, seq {seq} x batch {batch} "
        f"= {tokens} tokens/step ({tokens / hidden:.0f} x d_model); {torch.get_num_threads()} threads; {repeats} steps "
        f"each, in turns; load average {load_before:.2f} -> {load_after:.2f}"
    )
    print(
        f"  {'variant':14s} {'median ms':>10s} {'min ms':>9s} {'time ratio':>11s} {'min ratio':>10s} {'FLOP ratio':>11s}"
    )
    record: dict = {"tokens": tokens, "hidden": hidden, "layers": layers, "load_avg": [load_before, load_after]}
    for name, m_s in med.items():
        r_med, r_min = m_s / med["baseline"], low[name] / low["baseline"]
        note = ""
        if name.startswith("linear") and shape == "realistic":
            note = f"  (goal <= {LINEAR_GOAL}) {'OK' if r_med <= LINEAR_GOAL else 'MISSED'}"
        print(
            f"  {name:14s} {m_s * 1e3:10.1f} {low[name] * 1e3:9.1f} {r_med:11.4f} {r_min:10.4f} "
            f"{flops[name]:11.4f}{note}"
        )
        record[name] = {
            "median_s": m_s,
            "min_s": low[name],
            "time_ratio": r_med,
            "min_ratio": r_min,
            "flop_ratio": flops[name],
        }
    return record


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    record = {shape: run_shape(shape, args.repeats) for shape in args.shapes.split(",")}
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
