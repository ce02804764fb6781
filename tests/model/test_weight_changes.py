"""Inference state follows every weight change: after any of them a KHA model's forward equals a fresh model's.

A fresh model is a never-run copy of the applied model with ``load_state_dict`` of the changed
model's weights, so nothing it computes can be left over from before. Each change is preceded by
forwards of the changed model (no_grad and with gradients), so any state a forward leaves behind
(a folded weight, a compiled graph) exists when the weights move. The tiny Llama runs 96 tokens per
call, more than its width (64): the ``"auto"`` strategy runs weight-side, the path that would hold a
stale fold.

Changes: 3 steps of AdamW / Adam / SGD with ``fused=True`` (they update parameters without bumping
``param._version``), AdamW with ``foreach=True`` and with the plain for-loop, ``load_state_dict``,
``copy_`` and ``.data`` assignment.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import kha_compile as kc
import zoo
from helpers import perturb

CONFIGS = {
    "qkv_linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "qk_linear_v_mlp": kc.KHAConfig(q="linear", k="linear", v="mlp"),
}
TOL = 1e-6


@pytest.fixture(scope="module")
def applied() -> dict[str, tuple[nn.Module, dict]]:
    """Per config: a tiny Llama with KHA applied and perturbed, never run; and 96-token inputs."""
    out = {}
    for name, cfg in CONFIGS.items():
        case = zoo.make("llama")
        kc.apply(case.model, cfg, *case.example)
        perturb(case.model)
        out[name] = (case.model, zoo.inputs("llama", case.model, batch=4, seq=24)[1])
    return out


def _loss(model: nn.Module, kwargs: dict) -> torch.Tensor:
    logits = model(**kwargs).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    return (logits * w).mean()


def _optimizer(make: Callable[[list], torch.optim.Optimizer]) -> Callable[[nn.Module, dict], None]:
    def change(model: nn.Module, kwargs: dict) -> None:
        opt = make(list(model.parameters()))
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            _loss(model, kwargs).backward()
            opt.step()
        model.zero_grad(set_to_none=True)

    return change


def _new_values(model: nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def _load_state_dict(model: nn.Module, kwargs: dict) -> None:
    model.load_state_dict({**model.state_dict(), **_new_values(model)})


def _copy(model: nn.Module, kwargs: dict) -> None:
    new = _new_values(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(new[n])


def _data(model: nn.Module, kwargs: dict) -> None:
    new = _new_values(model)
    for n, p in model.named_parameters():
        p.data = new[n].clone()  # a new tensor behind the same Parameter: no version counter moves


CHANGES: dict[str, Callable[[nn.Module, dict], None]] = {
    "adamw_fused": _optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
    "adam_fused": _optimizer(lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True)),
    "sgd_fused": _optimizer(lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, fused=True)),
    "adamw_foreach": _optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True)),
    "adamw_for_loop": _optimizer(lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False, fused=False)),
    "load_state_dict": _load_state_dict,
    "copy_": _copy,
    "data_assignment": _data,
}

# The compiled forward (the "kha" backend, graphs run eagerly) is checked the same way: its folds are
# graph nodes over the live weights (kha_compile/backend/runtime.py), so no change can leave them stale.


@pytest.mark.parametrize("forward", ["eager", "compiled"])
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("cfg_name", sorted(CONFIGS))
def test_forward_after_a_weight_change_equals_a_fresh_model(applied, cfg_name, change, forward):
    pristine, kwargs = applied[cfg_name]
    model = copy.deepcopy(pristine)
    run = torch.compile(model, backend=kc.backend(compiler="eager")) if forward == "compiled" else model
    with torch.no_grad():
        before = run(**kwargs).logits  # leaves behind whatever a forward leaves (a fold, a graph)
    _loss(run, kwargs).backward()  # ... and with gradients
    model.zero_grad(set_to_none=True)

    CHANGES[change](model, kwargs)

    fresh = copy.deepcopy(pristine)  # never run: nothing in it predates the change
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        got = run(**kwargs).logits
        want = fresh(**kwargs).logits
    assert (want - before).abs().max() > 1e-3, "the change did not move the outputs"
    gap = float((got - want).abs().max())
    assert gap <= TOL, f"no_grad {forward} forward after {change} is {gap:.3g} off a fresh model with the same weights"
    got = run(**kwargs).logits.detach()  # with gradients too
    assert float((got - want).abs().max()) <= TOL
