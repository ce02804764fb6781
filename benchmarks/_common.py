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


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds of each call, the functions run in turns (a, b, a, b, ...) so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
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
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


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
