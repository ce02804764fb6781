"""Shared helpers of the benchmark scripts: timing side by side and the JSON record."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import platform
import statistics
import time
from collections.abc import Callable

import torch

import kha_compile as kc


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 2,
    inner: int = 1,
    sync: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, the functions run in turns (a, b, a, b, ...) so drift hits all alike.

    Each sample times ``inner`` calls back to back and divides; ``sync`` (e.g. ``torch.cuda.synchronize``)
    runs before the clock stops, so work a call queued on a GPU counts, and launches overlap as in a model.
    """
    sync = sync or (lambda: None)
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    sync()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / inner)
    return times


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each function, timed with :func:`interleaved_times`."""
    return {k: statistics.median(v) for k, v in interleaved_times(fns, repeats, warmup).items()}


def deploy_ratios(times: dict[str, float]) -> dict[str, float]:
    """Median times of the ``baseline``, ``folded-linear`` and ``mlp-value`` deployments as the record
    the deployment benchmarks write: baseline ms and both ratios to it."""
    base = times["baseline"]
    return {
        "baseline_ms": base * 1e3,
        "folded_ratio": times["folded-linear"] / base,
        "mlp_ratio": times["mlp-value"] / base,
    }


def deploy_line(head: str, rec: dict[str, float]) -> str:
    """One printed row of :func:`deploy_ratios`, with the goals (folded 1.00, MLP-value <= 1.05)."""
    ok = "OK" if rec["mlp_ratio"] <= 1.05 else "MISSED"
    return (
        f"  {head}: baseline {rec['baseline_ms']:7.2f} ms | folded/baseline {rec['folded_ratio']:5.3f} (goal 1.00) "
        f"| mlp-value/baseline {rec['mlp_ratio']:5.3f} (goal <= 1.05) {ok}"
    )


def with_kha(base: torch.nn.Module, cfg, scale: float, seed: int = 1) -> torch.nn.Module:
    """A copy of ``base`` with KHA ``cfg`` applied and every KHA weight moved off identity (trained-like)."""
    model = copy.deepcopy(base)
    kc.apply(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".kha." in n:
                p.add_(scale * torch.randn(p.shape, generator=gen).to(p.device))
    return model


def llama_config(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int, head_dim: int = 128):
    """A transformers ``LlamaConfig`` of this shape (GQA: ``kv_heads`` < ``heads``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )


def llama(cfg, device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """A ``LlamaForCausalLM`` of ``cfg`` with random weights, made on ``device`` (sdpa attention, train mode)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()


def step_flop_ratios(cfg, variants: dict, batch: int, seq: int) -> dict[str, float]:
    """FLOPs of one training step (forward + backward) of each variant over the first, counted on the meta device.

    ``variants`` maps a name to a ``KHAConfig`` (None: no KHA); the first is the baseline.
    """
    from torch.utils.flop_counter import FlopCounterMode

    base = llama(cfg, "meta")
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    mask = torch.zeros(batch, 1, seq, seq, device="meta")  # explicit 4-D mask: no .item() on meta
    counts = {}
    for name, kcfg in variants.items():
        model = base if kcfg is None else kc.apply(copy.deepcopy(base), kcfg)
        with FlopCounterMode(display=False) as fc:
            model(input_ids=ids, attention_mask=mask, use_cache=False).logits.sum().backward()
        counts[name] = fc.get_total_flops()
    first = next(iter(counts.values()))
    return {k: v / first for k, v in counts.items()}


def add_threads_arg(ap) -> None:
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); "
        "use 1 on a shared machine, where spinning OpenMP threads distort the timings",
    )


def apply_threads(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def machine() -> dict[str, object]:
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
    }


def write_json(path: str | None, record: dict) -> None:
    if path:
        record = {"machine": machine(), **record}
        pathlib.Path(path).write_text(json.dumps(record, indent=2))


def finish(record: dict, load_before: float, path: str | None) -> dict:
    """Print and record the load average before and after the run, then write the JSON record; returns it."""
    record["load_avg"] = [load_before, os.getloadavg()[0]]
    print(f"load average {record['load_avg'][0]:.2f} -> {record['load_avg'][1]:.2f}")
    write_json(path, record)
    return record
