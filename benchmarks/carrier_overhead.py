"""Per-call overhead of KHA made by the pass, against the same KHA written by hand, on shapes where it shows.

One attention block (q/k/v projections of 64 features, 4 q / 2 kv heads of 16, SDPA) with KHA made
by ``kc.apply`` (``pass``) and with the same transforms written by hand in forward hooks on its q/k/v
projections (``hand``), on calls of 8 and of 128 tokens (linear KHA runs token-side and weight-side),
forward under no_grad and forward + backward. At these sizes the arithmetic is a few microseconds,
so the difference is what the pass adds per call (Python, dispatch, extra tensors). Timed in turns;
the figures are the 10th percentile of many calls (the least disturbed by other work), and the
difference pass - hand in microseconds per attention call.

    python benchmarks/carrier_overhead.py [--calls 2000] [--json PATH]

Run it against another checkout of the library to compare versions:
``PYTHONPATH=/path/to/other/checkout python benchmarks/carrier_overhead.py``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from _common import write_json
from torch import nn

import kha_compile as kc

CONFIGS = {"linear": kc.KHAConfig(q="linear", k="linear", v="linear"), "mlp": kc.KHAConfig(v="mlp")}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(64, 64, bias=False)
        self.k = nn.Linear(64, 32, bias=False)
        self.v = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q(x).view(B, L, 4, 16).transpose(1, 2)  # (B, H, L, Dh)
        k = self.k(x).view(B, L, 2, 16).transpose(1, 2)  # (B, Hkv, L, Dh)
        v = self.v(x).view(B, L, 2, 16).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def hand_written(model: Attention, made: nn.Module, kind: str) -> nn.Module:
    """``model`` with the pass-made model's KHA weights applied by forward hooks (docs/method.md)."""
    hand = copy.deepcopy(model)
    for role in ("q", "k", "v") if kind == "linear" else ("v",):
        t = made.get_submodule(f"{role}.kha.{role}")
        if kind == "linear":
            w = nn.Parameter(t.weight.detach().clone())
            fn = lambda h, w=w: h @ w  # noqa: E731
            params = [w]
        else:
            up, gate, down = (nn.Parameter(getattr(t, n).detach().clone()) for n in ("up", "gate", "down"))
            fn = lambda h, u=up, g=gate, d=down: (2 * (h @ u) * torch.sigmoid(h @ g)) @ d  # noqa: E731
            params = [up, gate, down]
        for i, p in enumerate(params):
            hand.register_parameter(f"{role}_kha_{i}", p)
        hand.get_submodule(role).register_forward_hook(
            lambda m, i, y, fn=fn: fn(y.unflatten(-1, (-1, 16))).flatten(-2)  # (..., H, Dh) per head
        )
    return hand


def time_calls(fns: dict[str, object], calls: int) -> dict[str, float]:
    """10th-percentile microseconds per call of each function, called in turns."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(calls // 10):  # warm-up
        for f in fns.values():
            f()  # type: ignore[operator]
    for _ in range(calls):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()  # type: ignore[operator]
            times[k].append(time.perf_counter() - t0)
    return {k: sorted(v)[len(v) // 10] * 1e6 for k, v in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = Attention()
    record: dict = {"calls": args.calls, "cells": {}}
    print(f"kha_compile from {kc.__file__}; 1 thread; 10th percentile of {args.calls} calls")
    print(
        f"  {'KHA':7s} {'tokens':>6s} {'mode':8s} {'plain us':>9s} {'hand us':>9s} {'pass us':>9s} {'pass - hand':>12s}"
    )
    for kind, cfg in CONFIGS.items():
        made = copy.deepcopy(base)
        kc.apply(made, cfg, example_args=(torch.randn(1, 8, 64),))
        with torch.no_grad():
            for n, p in made.named_parameters():
                if ".kha." in f".{n}":
                    p.add_(0.05 * torch.randn_like(p))
        hand = hand_written(base, made, kind)
        for tokens in (8, 128):
            x = torch.randn(1, tokens, 64)
            with torch.no_grad():
                assert torch.allclose(made(x), hand(x), atol=1e-5), "pass and hand differ"
            for mode in ("no_grad", "fwd+bwd"):

                def call(m: nn.Module, mode: str = mode, x: torch.Tensor = x) -> object:
                    def run() -> None:
                        if mode == "no_grad":
                            with torch.no_grad():
                                m(x)
                        else:
                            m(x).sum().backward()

                    return run

                us = time_calls({"plain": call(base), "hand": call(hand), "pass": call(made)}, args.calls)
                record["cells"][f"{kind}/{tokens}/{mode}"] = us
                print(
                    f"  {kind:7s} {tokens:6d} {mode:8s} {us['plain']:9.1f} {us['hand']:9.1f} {us['pass']:9.1f} "
                    f"{us['pass'] - us['hand']:+12.1f}",
                    flush=True,
                )
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
