"""kha_compile.backend.runtime: a compiled no_grad forward always folds the weights as they are now.

Fused optimizers (AdamW/Adam/SGD ``fused=True``, the HF Trainer's default) and ``p.data.copy_``
update parameters without moving ``param._version``, so a fold cached on that counter would run the
weights of before training. The reference is a fresh model loaded with the same state dict and run
token-side (``strategy="token"``: the transforms on the projection outputs, no fold at all).
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import kha_case, loss_of, out_of, run

import kha_compile as kc
import zoo

CFG = kc.KHAConfig(q="linear", k="linear", v="linear")
ATOL = 1e-6

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=1e-3, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "sgd_for_loop": lambda ps: torch.optim.SGD(ps, lr=1e-3, foreach=False),
}


def _fresh_output(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """A new model with the same weights, transforms applied token-side (no fold anywhere)."""
    fresh = zoo.make("llama")
    kc.apply(fresh.model, kc.KHAConfig(q="linear", k="linear", v="linear", strategy="token"))
    fresh.model.load_state_dict(state)
    return run(fresh.model, fresh)


def _compiled_once(compiler: str = "eager"):
    """A perturbed tiny Llama, its compiled form and backend, after one compiled no_grad call."""
    case = kha_case("llama", CFG)
    be = kc.backend(compiler=compiler)
    compiled = torch.compile(case.model, backend=be)
    before = run(compiled, case)  # folded once under no_grad: what a cache would keep
    return case, compiled, be, before


def _train(case, make_optimizer, steps: int = 3) -> None:
    opt = make_optimizer(case.model.parameters())
    for _ in range(steps):
        loss_of(out_of(case.model(*case.args, **case.kwargs))).backward()
        opt.step()
        opt.zero_grad()


def _assert_current(case, compiled, be, before) -> None:
    got = run(compiled, case)
    want = _fresh_output(case.model.state_dict())
    assert (want - before).abs().max() > 1e-3  # the weights did move
    assert (got - want).abs().max().item() < ATOL
    assert be.stats.rewrites["fold_linear"] == 3 * case.num_sites  # it was folded ...
    assert len(be.stats.graphs) == 1  # ... by the graph compiled before the change (no recompile hid it)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_compiled_no_grad_after_optimizer_steps(optimizer):
    case, compiled, be, before = _compiled_once()
    _train(case, OPTIMIZERS[optimizer])
    _assert_current(case, compiled, be, before)


@pytest.mark.inductor
def test_compiled_no_grad_after_fused_adamw_inductor():
    case, compiled, be, before = _compiled_once("inductor")
    _train(case, OPTIMIZERS["adamw_fused"])
    _assert_current(case, compiled, be, before)


def _moved(model) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` moved a little (new tensors)."""
    g = torch.Generator().manual_seed(5)
    return {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def test_compiled_no_grad_after_data_copy():
    case, compiled, be, before = _compiled_once()
    for name, value in _moved(case.model).items():
        case.model.get_parameter(name).data.copy_(value)  # does not bump the parameter's version
    _assert_current(case, compiled, be, before)


def test_compiled_no_grad_after_load_state_dict():
    case, compiled, be, before = _compiled_once()
    case.model.load_state_dict(dict(case.model.state_dict(), **_moved(case.model)))
    _assert_current(case, compiled, be, before)


def test_fold_in_a_graph_shared_by_the_layers():
    """A graph break before every layer: one graph runs both layers and folds each one's own weights."""
    case = kha_case("llama", CFG)
    for layer in case.model.model.layers:
        layer.register_forward_pre_hook(lambda *_: torch._dynamo.graph_break())
    be = kc.backend(compiler="eager")
    got = run(torch.compile(case.model, backend=be), case)
    assert (got - _fresh_output(case.model.state_dict())).abs().max().item() < ATOL
    layer_graphs = [g for g in be.stats.graphs if g.count("fold_linear")]
    assert len(layer_graphs) == 1 and layer_graphs[0].count("fold_linear") == 3  # q, k, v of one layer
