"""kha_compile.backend.compiler: the backend object, Inductor end to end, models without KHA.

Inductor compiles are slow on CPU (tens of seconds for a tiny 2-layer model), so the rewrite logic
is tested with ``compiler="eager"`` in the rule tests and Inductor runs in a few end-to-end tests
here; those on more than one model are marked slow.
"""

from __future__ import annotations

import logging

import pytest
import torch
from backend_cases import RTOL_GRAD, RTOL_OUT, kha_case, loss_of, rel, run
from torch import nn

import kha_compile as kc
from kha_compile.backend import KHABackend
from kha_compile.core.errors import BackendOptionError, KHAError


def test_backend_module_is_callable():
    be = kc.backend(fold=False)
    assert isinstance(be, KHABackend) and be.options["fold"] is False
    assert kc.backend.last_stats().rewrites == {"deploy": 0, "fuse_mlp_value": 0, "fold_linear": 0}
    with pytest.raises(BackendOptionError, match="compiler="):
        kc.backend(compiler="tvm")
    with pytest.raises(BackendOptionError, match="from_pretrained"):
        kc.backend(model=nn.Linear(2, 2))
    with pytest.raises(KHAError, match="fuse_mlp must be True or False"):
        kc.backend(fuse_mlp="yes")


# --- Inductor end to end --------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["llama", pytest.param("qwen3", marks=pytest.mark.slow), pytest.param("bert", marks=pytest.mark.slow)]
)
@pytest.mark.inductor
def test_mlp_value_inductor_matches_eager_forward_and_grads(name):
    """One compile with gradients on: outputs and one backward step's KHA gradients match eager."""
    case = kha_case(name, kc.KHAConfig(v="mlp"))
    model = case.model
    ref = run(model, case, grad=True)
    loss_of(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".kha." in n}
    model.zero_grad()

    compiled = torch.compile(model, backend="kha")
    got = run(compiled, case, grad=True)
    loss_of(got).backward()

    assert rel(got.detach(), ref.detach()) < RTOL_OUT
    for n, g in ref_grads.items():
        p = model.get_parameter(n)
        assert ((p.grad - g).norm() / g.norm()).item() < RTOL_GRAD, n
    stats = kc.backend.last_stats()
    assert stats.mlp_value_ops == case.num_sites
    assert stats.rewrites["fold_linear"] == 0 and stats.has_kha


@pytest.mark.inductor
def test_linear_qkv_folded_under_no_grad_inductor():
    case = kha_case("llama", kc.KHAConfig(q="linear", k="linear", v="linear"))
    ref = run(case.model, case)
    be = kc.backend()
    got = run(torch.compile(case.model, backend=be), case)
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == 3 * case.num_sites
    assert be.stats.mlp_value_ops == 0


# --- no KHA ---------------------------------------------------------------------------------


@pytest.mark.inductor
def test_model_without_kha_compiles_unchanged_and_logs_once(caplog):
    mod = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    compiled = torch.compile(mod, backend="kha", dynamic=False)
    with caplog.at_level(logging.INFO, logger="kha_compile.backend"), torch.no_grad():
        for n in (3, 5):  # a second shape recompiles: still one log line
            x = torch.randn(n, 16)
            assert rel(compiled(x), mod(x)) < RTOL_OUT
    stats = kc.backend.last_stats()
    assert len(stats.graphs) == 2 and not stats.has_kha
    assert stats.rewrites == {"deploy": 0, "fuse_mlp_value": 0, "fold_linear": 0} and stats.mlp_value_ops == 0
    lines = [r for r in caplog.records if r.name.startswith("kha_compile.backend")]
    assert len(lines) == 1 and "no KHA" in lines[0].getMessage()
