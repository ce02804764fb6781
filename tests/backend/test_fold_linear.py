"""kha_compile.backend.rules.fold_linear: KHA-Linear folded into the projection (graph run eagerly).

Expected outputs come from the per-head reference (tests/reference.py), not from the eager KHA model.
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import RTOL_OUT, kha_case, reference, rel, run

import kha_compile as kc
from kha_compile.model.carrier import make_transform


@pytest.mark.parametrize("name", ["llama", "gpt2", "gpt_neox"])  # separate, fused Conv1D, interleaved [H, 3, Dh]
@pytest.mark.parametrize(
    "cfg",
    [kc.KHAConfig(q="linear", k="linear", v="linear"), kc.KHAConfig(q="linear", v="mlp")],
    ids=["qkv_linear", "q_linear_v_mlp"],
)
def test_fold_layouts(name, cfg):
    case = kha_case(name, cfg)
    ref = reference(case)
    be = kc.backend(compiler="eager")
    got = run(torch.compile(case.model, backend=be), case)
    assert rel(got, ref) < RTOL_OUT
    n_linear = sum(kind == "linear" for kind in cfg.roles().values())
    assert be.stats.rewrites["fold_linear"] == n_linear * case.num_sites
    assert be.stats.mlp_value_ops == (case.num_sites if cfg.v == "mlp" else 0)
    assert not be.stats.declined


def test_fold_declined_while_training():
    case = kha_case("llama", kc.KHAConfig(q="linear", k="linear", v="linear"))
    be = kc.backend(compiler="eager")
    ref = reference(case)
    got = run(torch.compile(case.model, backend=be), case, grad=True)
    assert rel(got.detach(), ref.detach()) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == 0
    assert be.stats.declined and all("gradients are on" in why for _, _, why in be.stats.declined)


def test_fold_follows_in_place_updates():
    """A folded weight is recomputed when a source parameter changes (e.g. an optimizer step)."""
    case = kha_case("llama", kc.KHAConfig(v="linear"))
    be = kc.backend(compiler="eager")
    compiled = torch.compile(case.model, backend=be)
    run(compiled, case)
    with torch.no_grad():
        case.model.get_parameter("model.layers.0.self_attn.v_proj.kha.v.weight").mul_(-1.5)
    got, ref = run(compiled, case), reference(case)
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == case.num_sites and len(be.stats.graphs) == 1


def test_fold_switched_off_keeps_the_matmuls():
    case = kha_case("llama", kc.KHAConfig(v="linear"))
    ref = reference(case)
    be = kc.backend(compiler="eager", fold=False)
    got = run(torch.compile(case.model, backend=be), case)
    assert rel(got, ref) < RTOL_OUT
    assert be.stats.rewrites["fold_linear"] == 0
    assert [d.reason for d in be.stats.declined] == ["folding is switched off (fold=False)"] * case.num_sites


class ReadTwice(torch.nn.Module):
    """A KHA-Linear transform on the heads of a projection whose output is also added back raw."""

    def __init__(self, d: int = 16, heads: int = 2):
        super().__init__()
        self.lin, self.heads = torch.nn.Linear(d, d), heads
        self.t = make_transform("linear", d // heads)
        with torch.no_grad():
            self.t.weight.add_(0.2 * torch.randn(d // heads, d // heads, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        y = self.lin(x)
        return self.t(y.unflatten(-1, (self.heads, -1))).flatten(-2) + y  # ``+ y`` reads the raw features


def test_fold_declined_when_another_op_reads_the_projection_features():
    mod, x = ReadTwice().eval(), torch.randn(3, 5, 16)
    be = kc.backend(compiler="eager")
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(x), mod(x)
    assert be.stats.rewrites["fold_linear"] == 0
    assert any("also reads the transformed features" in why for _, _, why in be.stats.declined)
    assert rel(got, ref) < RTOL_OUT
