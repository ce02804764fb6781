"""kha_compile.backend.rules.fuse_mlp_value: the hand-written MLP-value formula becomes one fused op."""

from __future__ import annotations

import operator

import pytest
import torch
from backend_cases import RTOL_GRAD, RTOL_OUT, loss_of, rel
from torch import nn

import kha_compile as kc


class HandMLP(nn.Module):
    """KHA-MLP on values written out by hand, in one of several equivalent spellings."""

    def __init__(self, d: int = 16, form: str = "paper"):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up, self.gate, self.down = (nn.Parameter(torch.randn(d, d, generator=g) / d**0.5) for _ in range(3))
        self.form = form

    def forward(self, v):
        up, gate, down = self.up, self.gate, self.down
        if self.form == "paper":
            return 2 * ((v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "matmul_swapped":
            return torch.matmul(torch.sigmoid(torch.matmul(v, gate)) * torch.matmul(v, up), down) * 2
        if self.form == "reference":
            return (2.0 * (v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "scale_after":
            return 2.0 * (((v @ up) * (v @ gate).sigmoid()) @ down)
        if self.form == "no_factor_2":
            return ((v @ up) * torch.sigmoid(v @ gate)) @ down
        if self.form == "gate_reads_other":  # the gate reads another tensor than the up-projection
            return 2 * ((v @ up) * torch.sigmoid(torch.roll(v, 1, 0) @ gate)) @ down
        if self.form == "shared_intermediate":
            a = v @ up
            return 2 * (a * torch.sigmoid(v @ gate)) @ down + a
        raise ValueError(self.form)


@pytest.mark.parametrize("form", ["paper", "matmul_swapped", "reference", "scale_after"])
def test_decomposed_mlp_value_rewritten(form):
    mod, v = HandMLP(form=form), torch.randn(2, 5, 3, 16)
    seen = []

    def record(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
        return gm.forward

    be = kc.backend(compiler=record)
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 1 and be.stats.mlp_value_ops == 1
    # the fused op is the only computation left (no matmul, sigmoid or scaling in any spelling)
    assert [t for t in seen[0] if t not in (operator.getitem,)] == [torch.ops.kha.mlp_value.default]
    assert rel(got, ref) < RTOL_OUT


def test_a_gate_that_reads_another_tensor_is_not_fused():
    """``2 * ((x @ W_up) * sigmoid(y @ W_gate)) @ W_down`` with y != x is not KHA-MLP: left as it is."""
    mod, v = HandMLP(form="gate_reads_other"), torch.randn(4, 16)
    be = kc.backend(compiler="eager")
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 0 and be.stats.mlp_value_ops == 0
    assert rel(got, ref) < RTOL_OUT


@pytest.mark.parametrize("form, reason", [("no_factor_2", "not 2"), ("shared_intermediate", "also used by")])
def test_decomposed_near_misses_declined_with_reason(form, reason):
    mod, v = HandMLP(form=form), torch.randn(4, 16)
    be = kc.backend(compiler="eager")
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 0
    assert [r for rule, _, r in be.stats.declined if rule == "fuse_mlp_value" and reason in r]
    assert rel(got, ref) < RTOL_OUT


@pytest.mark.inductor
def test_decomposed_mlp_value_inductor_trains():
    mod, v = HandMLP(), torch.randn(2, 5, 16)
    ref = mod(v)
    loss_of(ref).backward()
    ref_grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad()
    got = torch.compile(mod, backend="kha")(v)
    loss_of(got).backward()
    assert kc.backend.last_stats().rewrites["fuse_mlp_value"] == 1
    assert rel(got.detach(), ref.detach()) < RTOL_OUT
    for p, g in zip(mod.parameters(), ref_grads):
        assert ((p.grad - g).norm() / g.norm()).item() < RTOL_GRAD


def test_fuse_switched_off_leaves_the_formula():
    mod, v = HandMLP(), torch.randn(4, 16)
    be = kc.backend(compiler="eager", fuse_mlp=False)
    with torch.no_grad():
        got, ref = torch.compile(mod, backend=be)(v), mod(v)
    assert be.stats.rewrites["fuse_mlp_value"] == 0 and be.stats.mlp_value_ops == 0
    assert rel(got, ref) < RTOL_OUT
