"""Projection handlers: tried in order, first match wins; attach, fold and remove go through the owner."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
import zoo
from helpers import kha_params, perturb, run
from kha_compile import handlers
from kha_compile.handlers import get_handler, handler_of, projection_handlers, register_handler
from kha_compile.handlers.linear import LinearHandler
from kha_compile.model.carrier import kha_modules
from kha_compile.model.rows import weight_out_axis
from kha_compile.passes.apply import analyse


class TransposedLinear(nn.Module):
    """``y = x W + b`` with W stored (in, out), like GPT-2's Conv1D under another name."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class SquareAttention(nn.Module):
    """Separate square (in, out) projections: orientation cannot be told from the shape."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v = (TransposedLinear(d, d) for _ in range(3))
        self.o = nn.Linear(d, d)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (
            p(x).view(B, L, self.h, D // self.h).transpose(1, 2) for p in (self.q, self.k, self.v)
        )  # (B, H, L, Dh)
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, D))


def test_builtin_handlers_are_tried_mha_conv1d_then_linear():
    names = [h.name for h in projection_handlers()]
    assert names.index("mha") < names.index("conv1d") < names.index("linear")
    assert get_handler("mha").param_space and not get_handler("linear").param_space


@pytest.mark.parametrize("name,handler", [("llama", "linear"), ("gpt2", "conv1d"), ("torch_encoder", "mha")])
def test_the_plan_names_the_handler_that_owns_each_projection(name, handler):
    case = zoo.make(name)
    _, plan = analyse(case.model, kc.KHAConfig(v="linear"), *case.example)
    assert plan and {p.handler for p in plan} == {handler}


def test_weight_orientation_is_told_by_behaviour_for_square_weights():
    assert weight_out_axis(nn.Linear(8, 8)) == 0
    assert weight_out_axis(TransposedLinear(8, 8)) == 1
    assert weight_out_axis(TransposedLinear(8, 24), out_features=24) == 1


def test_a_square_transposed_projection_is_conv1d_and_folds_exactly():
    torch.manual_seed(0)
    model, x = SquareAttention().eval(), torch.randn(2, 5, 32)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(x,))
    assert {handler_of(m).name for m in (model.q, model.k, model.v)} == {"conv1d"}
    perturb(model)
    with torch.no_grad():
        trained = model(x)
    kc.fold(model)
    assert type(model.q) is TransposedLinear and not kha_params(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), trained, rtol=1e-5, atol=1e-5)


class CountingHandler(LinearHandler):
    """Owns the value projections of llama only; counts what goes through it."""

    name = "counting"

    def __init__(self):
        self.calls = {"attach": 0, "fold": 0, "detach": 0}

    def accepts(self, model, m):
        return m.projection.module_path.endswith("v_proj"), ""

    def attach(self, module, entry):
        self.calls["attach"] += 1
        super().attach(module, entry)

    def fold(self, module, roles):
        self.calls["fold"] += 1
        return super().fold(module, roles)

    def detach(self, module):
        self.calls["detach"] += 1
        super().detach(module)


@pytest.fixture
def counting():
    saved = projection_handlers()
    h = CountingHandler()
    register_handler(h, first=True)
    yield h
    handlers.HANDLERS.restore(saved)


def test_a_handler_registered_first_wins_and_fold_and_remove_go_through_it(counting):
    case = zoo.make("llama")
    _, plan = analyse(case.model, kc.KHAConfig(q="linear", v="linear"), *case.example)
    assert {p.module_path.rpartition(".")[2]: p.handler for p in plan} == {"q_proj": "linear", "v_proj": "counting"}
    kc.apply(case.model, kc.KHAConfig(q="linear", v="linear"))
    assert counting.calls["attach"] == 2  # two layers
    perturb(case.model)
    with torch.no_grad():
        trained = run(case)
    kc.fold(case.model)
    assert counting.calls == {"attach": 2, "fold": 2, "detach": 2}
    with torch.no_grad():
        torch.testing.assert_close(run(case), trained, rtol=1e-4, atol=1e-4)
    kc.apply(case.model, kc.KHAConfig(v="mlp"))
    kc.remove(case.model)
    assert counting.calls["detach"] == 4 and not kha_params(case.model)


def test_a_module_without_a_recorded_handler_is_found_by_ownership():
    """Models pickled before handlers were recorded: fold and remove still find the owner."""
    for name, expected in (("gpt2", "conv1d"), ("llama", "linear"), ("torch_encoder", "mha")):
        case = zoo.make(name)
        kc.apply(case.model, kc.KHAConfig(v="linear"), *case.example)
        for _, m in kha_modules(case.model):
            del m.__dict__["_kha_handler"]
            assert handler_of(m).name == expected
