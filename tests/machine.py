"""Checks of the machine a test runs on: is a reference path deterministic here?

CI runs on whichever machine a session gets, and CPUs differ (AVX-512 or AVX2 only). Some upstream
paths give different results on two identical calls on some of them (transformers' compiled
flex_attention on an AVX2-only CPU: logits up to 0.35 apart, NaN in most forwards). A test whose
reference is such a path measures that first and skips with the measured reason; it never asserts
against noise. ``ATEN_CPU_CAPABILITY=avx2`` makes an AVX-512 machine take the AVX2 kernels, which is
how the skip is exercised on a machine where the path works.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import pytest
import torch


def _cpu() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return f"torch {torch.__version__}, CPU capability {capability}"


def nondeterminism(run: Callable[[], torch.Tensor], runs: int = 4) -> str:
    """'' when ``run()`` gives the same finite tensor on every call; else what differed, measured."""
    with torch.no_grad():
        outs = [run().detach().float() for _ in range(runs)]
    nan = sum(bool(torch.isnan(o).any()) for o in outs)
    gaps = [torch.where(o.isfinite() & outs[0].isfinite(), o - outs[0], 0.0).abs().max() for o in outs]
    spread = float(max(gaps))
    if nan or spread > 0:
        return (
            f"{runs} identical no_grad forwards gave NaN in {nan} of them and finite values up to {spread:.3g} "
            f"apart on this machine ({_cpu()})"
        )
    return ""


_MEASURED: dict[Hashable, str] = {}


def require_deterministic(key: Hashable, build: Callable[[], Callable[[], torch.Tensor]], what: str) -> None:
    """Skip the calling test when the reference ``build()`` returns is not deterministic here.

    ``key`` names the probe (measured once per process); ``what`` says what was probed.

    Example::

        require_deterministic(("flex", "llama"), lambda: partial(plain_model, ids), "transformers flex Llama")
    """
    if key not in _MEASURED:
        _MEASURED[key] = nondeterminism(build())
    reason = _MEASURED[key]
    if reason:
        pytest.skip(f"reference not deterministic: {what} without kha_compile: {reason}")


def _inductor_probe() -> Callable[[], torch.Tensor]:
    """A plain two-layer MLP compiled by Inductor, against eager: the first output that differs."""
    from torch import nn

    gen = torch.Generator().manual_seed(0)
    mod = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(3, 16, generator=gen)
    compiled = torch.compile(mod, backend="inductor", dynamic=False)
    return lambda: compiled(x) - mod(x)


def require_inductor() -> None:
    """Skip the calling test when Inductor's CPU code is wrong on this machine without kha_compile.

    Measured once per process on a plain MLP (|compiled - eager| must stay below 1e-5).
    """
    key = "inductor"
    if key not in _MEASURED:
        torch._dynamo.reset()
        with torch.no_grad():
            gap = float(_inductor_probe()().abs().max())
        torch._dynamo.reset()
        _MEASURED[key] = (
            ""
            if gap < 1e-5
            else f"a plain Linear-GELU-Linear compiled by Inductor is {gap:.3g} off eager on this machine ({_cpu()})"
        )
    if _MEASURED[key]:
        pytest.skip(f"reference not trustworthy: {_MEASURED[key]}")
