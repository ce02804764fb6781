"""Helpers shared by the backend tests (imported as ``backend_cases``)."""

from __future__ import annotations

import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import perturb_biases, reference_output

RTOL_OUT, RTOL_GRAD = 1e-4, 1e-3


def out_of(o):
    for name in ("logits", "last_hidden_state"):
        if hasattr(o, name):
            return getattr(o, name)
    return o


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def perturb(model: nn.Module, seed: int = 1) -> None:
    """Move every KHA parameter off its identity init, so the transforms do something."""
    g = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".kha." in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
                changed += 1
    assert changed, "perturb: the model has no KHA parameters"


def kha_case(name: str, cfg: kc.KHAConfig) -> zoo.ZooCase:
    """Zoo model ``name`` with KHA ``cfg``, its KHA weights and biases moved off their init (as trained)."""
    case = zoo.make(name)
    kc.apply(case.model, cfg)
    perturb(case.model)
    perturb_biases(case.model)
    return case


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss with non-trivial gradients (``square().mean()`` is constant after a final LayerNorm)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    return (out * w).sum()


def reference(case: zoo.ZooCase, base: nn.Module | None = None) -> torch.Tensor:
    """The output ``case.model`` must give, from the per-head reference (tests/reference.py).

    Independent of the fold primitive and the strategy that the backend and the eager model share.
    ``base``: take the model's own weights from this model instead (a vanilla model the KHA tensors of
    ``case.model`` are deployed into).
    """
    state = case.model.state_dict()
    if base is not None:
        state = {**base.state_dict(), **{k: v for k, v in state.items() if ".kha." in f".{k}"}}
    return reference_output(case.name, case.model, case.args, case.kwargs, state=state)


def run(model, case, grad: bool = False):
    with torch.set_grad_enabled(grad):
        return out_of(model(*case.args, **case.kwargs))
