"""Training-step time with KHA / without, on a Llama-like model (CPU, eager).

4 layers, hidden 1024, 8 q heads / 4 kv heads (head dim 128), seq 512, batch 2; KHA-Linear on
q, k, v and KHA-MLP on v. The models run in turns in one process; the figures are medians.
Goal: ratio <= 1.03 (the paper's FLOP share is about 1% at this size).

    python benchmarks/train_overhead.py [--repeats 10] [--small] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch

import kha_compile as kc

from _common import add_threads_arg, apply_threads, interleaved_times, write_json


def build(small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    if small:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024)
    else:
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                          num_key_value_heads=4, vocab_size=8192)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train(), cfg


def step_fn(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="a small model, for a quick check")
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    base, cfg = build(args.small)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    variants = {"baseline": base}
    for name, kcfg in {"linear": kc.KHAConfig(q="linear", k="linear", v="linear"), "mlp": kc.KHAConfig(v="mlp")}.items():
        m = copy.deepcopy(base)
        kc.apply(m, kcfg)
        variants[name] = m
    times = interleaved_times({k: step_fn(m, ids) for k, m in variants.items()}, args.repeats)
    med = {k: statistics.median(v) for k, v in times.items()}
    low = {k: min(v) for k, v in times.items()}
    print(f"Llama hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} q / "
          f"{cfg.num_key_value_heads} kv heads, seq {args.seq}, batch {args.batch}, {torch.get_num_threads()} threads; "
          f"{args.repeats} steps each, in turns")
    print(f"  baseline train step:   median {med['baseline'] * 1e3:8.1f} ms   min {low['baseline'] * 1e3:8.1f} ms")
    record = {"baseline_s": med["baseline"], "baseline_min_s": low["baseline"]}
    for name in ("linear", "mlp"):
        r_med, r_min = med[name] / med["baseline"], low[name] / low["baseline"]
        record.update({f"{name}_s": med[name], f"{name}_ratio": r_med, f"{name}_min_ratio": r_min})
        print(f"  KHA-{name:6s} train step: median {med[name] * 1e3:8.1f} ms   min {low[name] * 1e3:8.1f} ms   "
              f"ratio median {r_med:5.3f}  min {r_min:5.3f}  (goal <= 1.03) {'OK' if r_med <= 1.03 else 'MISSED'}")
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
