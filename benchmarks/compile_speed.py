"""Speed of a Llama with KHA-MLP compiled with backend="kha", against the same model without KHA on Inductor.

Both models are built from one seeded config; the KHA one gets ``kc.apply(model, KHAConfig(v="mlp"))``.
Inference (``no_grad`` forward) and a training step (forward with the LM loss, backward, SGD step)
are timed in one run, the two models alternating step by step so that a busy machine slows both
alike; each figure is the median of ``--steps`` steps after ``--warmup`` (the first compiles). The
minimum and the CPU-time (``process_time``) ratios are printed beside it: on a shared machine the
wall-clock median moves by several percent from run to run.

Example::

    python benchmarks/compile_speed.py                 # hidden 1024, 4 layers, 8/4 heads of 128, seq 512, batch 2
    python benchmarks/compile_speed.py --small --steps 5 --json speed.json
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _common import write_json

import kha_compile as kc

FULL = dict(hidden=1024, layers=4, heads=8, kv_heads=4, head_dim=128, inter=2816, vocab=8192, seq=512, batch=2)
SMALL = dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, inter=704, vocab=1024, seq=128, batch=2)


def build(shape: dict, kha: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["inter"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=shape["seq"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    if kha:
        kc.apply(model, kc.KHAConfig(v="mlp"))
        with torch.no_grad():  # off the identity init, as after training
            for name, p in model.named_parameters():
                if ".kha." in name:
                    p.add_(0.05 * torch.randn_like(p))
    return model


def interleaved(fns: dict, repeats: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Wall and CPU seconds of each call, the functions taking turns and alternating who goes first."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {k: {"wall": [], "cpu": []} for k in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            w, c = time.perf_counter(), time.process_time()
            fns[name]()
            times[name]["cpu"].append(time.process_time() - c)
            times[name]["wall"].append(time.perf_counter() - w)
    return times


def kha_op_share(step) -> float:
    """Fraction of one profiled step's CPU time spent in kha:: ops (their matmuls included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    kha = sum(e.cpu_time_total for e in events if e.key.startswith("kha::"))
    return kha / total if total else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small model for a quick run")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per phase and model (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    ap.add_argument("--phases", default="inference,train", help="comma list of inference, train")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also profile one step of the KHA model per phase: the share of time in kha:: ops, "
        "a figure that contention on a shared machine moves much less than wall time",
    )
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = SMALL if args.small else FULL
    phases = [p for p in args.phases.split(",") if p]

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g)
    kwargs = dict(input_ids=ids, use_cache=False)

    models = {"inductor": build(shape, kha=False), "kha": build(shape, kha=True)}
    compiled = {
        "inductor": torch.compile(models["inductor"], backend="inductor"),
        "kha": torch.compile(models["kha"], backend="kha"),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in models.items()}

    def infer(key):
        with torch.no_grad():
            compiled[key](**kwargs)

    def train(key):
        opts[key].zero_grad(set_to_none=True)
        loss = compiled[key](**kwargs, labels=ids).loss
        loss.backward()
        opts[key].step()

    steps = {"inference": infer, "train": train}
    results: dict = {"shape": shape, "steps": args.steps, "warmup": args.warmup, "phases": {}}
    for phase in phases:
        for m in models.values():
            m.train(phase == "train")
        first_call_s = {}
        for key in models:  # the first call compiles
            t0 = time.perf_counter()
            steps[phase](key)
            first_call_s[key] = time.perf_counter() - t0
        times = interleaved(
            {k: (lambda k=k, phase=phase: steps[phase](k)) for k in models}, args.steps, warmup=max(args.warmup - 1, 0)
        )
        med = {k: statistics.median(v["wall"]) for k, v in times.items()}
        low = {k: min(v["wall"]) for k, v in times.items()}
        cpu = {k: statistics.median(v["cpu"]) for k, v in times.items()}
        results["phases"][phase] = {
            "median_ms": {k: 1e3 * v for k, v in med.items()},
            "ratio": med["kha"] / med["inductor"],
            "min_ms": {k: 1e3 * v for k, v in low.items()},
            "ratio_min": low["kha"] / low["inductor"],
            "cpu_median_ms": {k: 1e3 * v for k, v in cpu.items()},
            "ratio_cpu": cpu["kha"] / cpu["inductor"],
            "first_call_s": first_call_s,
            "wall_ms": {k: [round(1e3 * t, 1) for t in v["wall"]] for k, v in times.items()},
        }
        if args.profile:
            results["phases"][phase]["kha_op_share"] = kha_op_share(lambda phase=phase: steps[phase]("kha"))
    stats = kc.backend.last_stats()
    results["kha_backend"] = {
        "rewrites": stats.rewrites,
        "mlp_value_ops": stats.mlp_value_ops,
        "graphs": len(stats.graphs),
    }

    print(
        f"Llama {shape} | torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.steps} steps after {args.warmup} warmup (min and CPU-time ratios beside it)"
    )
    print(
        f"{'phase':<10} {'inductor, no KHA ms':>20} {'kha, KHA-MLP ms':>16} {'ratio':>6} {'min':>6} {'cpu':>6} "
        f"{'first call s':>14}"
    )
    for phase, r in results["phases"].items():
        m, c = r["median_ms"], r["first_call_s"]
        print(
            f"{phase:<10} {m['inductor']:>20.1f} {m['kha']:>16.1f} {r['ratio']:>6.3f} {r['ratio_min']:>6.3f} "
            f"{r['ratio_cpu']:>6.3f} {c['inductor']:>6.1f} /{c['kha']:>6.1f}"
        )
        if "kha_op_share" in r:
            print(f"{'':<10} profiled: {100 * r['kha_op_share']:.2f}% of a KHA {phase} step is in kha:: ops")
    print(f"kha backend: {stats}")
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
