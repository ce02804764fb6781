"""Attention forms of issue 28 that share, tie or compress: one projection called for two roles,
shared-QK, tied row attention, Linformer's compression along the sequence, twelve heads as modules,
graph attention written key-first. Every site matched, identity at init, the perturbed (and folded)
output equal to an independent per-head reference (``tests/forms_zoo_shared.py``), save and reload."""

from __future__ import annotations

import re

import pytest
import torch

import forms_zoo_shared as fs
import kha_compile as kc
from form_checks import check_form, check_save_and_reload
from helpers import kha_params, perturb
from kha_compile.passes.apply import analyse, recorded_report

B, D = 2, fs.D


def _x(seed: int = 0, shape: tuple[int, ...] = (B, fs.S, D)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _edges(n: int = 30, e: int = 90) -> torch.Tensor:
    return torch.randint(0, n, (2, e), generator=torch.Generator().manual_seed(5))


# name -> (model class, inputs, sites, roles kept on the attention arguments by fold)
FORMS = {
    "one_projection_called_for_two_roles": (fs.TwoWayNet, lambda: (_x(), _x(1, (B, 24, D))), 4, ("q", "k")),
    "one_projection_called_for_two_roles_einsum": (
        fs.TwoWayEinsumNet,
        lambda: (_x(), _x(1, (B, 24, D))),
        4,
        ("q", "k"),
    ),
    "shared_qk_sdpa": (fs.SharedQKNet, lambda: (_x(),), 2, ("q", "k")),
    "shared_qk_einsum_self_masked": (fs.SharedQKManualNet, lambda: (_x(),), 2, ("q", "k")),
    "tied_row_attention": (fs.TiedRowNet, lambda: (_x(0, (B, fs.R, fs.S, D)),), 2, ()),
    "linformer_sequence_compression": (fs.LinformerNet, lambda: (_x(),), 2, ()),
    "twelve_heads_as_modules": (fs.TwelveHeadsNet, lambda: (_x(),), 1, ()),
    "graph_attention_key_first": (fs.KeyFirstGraphNet, lambda: (_x(0, (30, D)), _edges()), 2, ()),
    "graph_attention_query_first": (fs.QueryFirstGraphNet, lambda: (_x(0, (30, D)), _edges()), 2, ()),
}


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_matches_a_per_head_reference(form, v):
    cls, inputs, sites, kept = FORMS[form]
    args = inputs()
    check_form(cls, args, v, sites=sites, qk=True, kept=kept, reference=lambda m: m.reference(*args))


def _perturbed(form: str) -> tuple:
    """(class, model with linear q, k and MLP-value v KHA, perturbed, its inputs)."""
    cls, inputs, _, _ = FORMS[form]
    args = inputs()
    torch.manual_seed(0)
    model = cls()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=args)
    perturb(model)
    return cls, model, args


@pytest.mark.parametrize("form", sorted(FORMS))
def test_save_and_reload(form, tmp_path):
    cls, model, args = _perturbed(form)
    check_save_and_reload(cls, model, args, tmp_path)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_training_steps_keep_the_model_equal_to_its_reference(form):
    """Three fused AdamW steps on every parameter (projections and KHA, MLP-value on v): every KHA
    weight moves (its gradient reaches it, on the attention arguments too), and the trained model
    still equals its per-head reference read from the trained weights."""
    _, model, args = _perturbed(form)
    before = {n: p.detach().clone() for n, p in kha_params(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # updates without bumping _version
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(*args).square().mean().backward()
        opt.step()
    assert {r for n in before for r in "qkv" if f".kha.{r}." in f".{n}"} == set("qkv")
    assert all(not torch.equal(p, before[n]) for n, p in kha_params(model).items())
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-4, atol=1e-5)


def test_queries_only_go_on_the_query_arguments_not_on_the_keys_of_the_same_projection():
    """``KHAConfig(q="linear")`` on a two-way cross-attention: T^Q on the queries of both directions,
    the keys (other calls of the same ``qk``) untouched; the reference has no T^K, so a T^Q on the keys
    (or on the wrong call) fails it."""
    args = (_x(), _x(1, (B, 24, D)))
    torch.manual_seed(0)
    model = fs.TwoWayNet()
    kc.apply(model, kc.KHAConfig(q="linear"), example_args=args)
    perturb(model)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-4, atol=1e-5)
    queries = sorted(n for n in kha_params(model) if ".kha.q." in f".{n}")
    assert queries == ["blocks.0.kha.q.weight", "blocks.1.kha.q.weight"]  # on the attention calls' arguments
    assert not [n for n in kha_params(model) if ".kha.k." in f".{n}"]
    site = kc.inspect(model, example_args=args).matched[0]
    assert "q, k: blocks.0.qk is called more than once and its calls feed queries and keys" in site.note


def test_a_skipped_site_keeps_its_keys_when_a_matched_one_reads_the_same_call_as_queries():
    """``p(a)`` is the queries of a matched site and the keys of a skipped one: T^Q goes on the matched
    site's query argument, so the skipped site runs as without KHA (a T^Q after ``p`` would change it)."""
    args = (_x(), _x(1, (B, 24, D)))
    torch.manual_seed(0)
    model = fs.HalfSkippedTwoWay()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=args)
    report = recorded_report(model)
    assert [s.status for s in report.sites] == ["matched", "skipped"], str(report)
    perturb(model)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-4, atol=1e-5)
    assert "q = k: queries and keys are the same features of p" in report.matched[0].note


def test_shared_qk_without_an_attention_call_is_skipped_naming_each_blocks_own_module():
    """q = k in graph attention (a product of gathers): no attention argument to carry T^Q and T^K;
    each repeated block's reason names its own projection."""
    args = (_x(0, (30, D)), _edges())
    report, _ = analyse(fs.SharedQKGraphNet(), kc.KHAConfig(q="linear", k="linear", v="mlp"), args, None)
    reasons = {s.name: s.reason for s in report.sites}
    assert set(reasons) == {"layers.0", "layers.1"} and not report.matched, str(report)
    for i in range(2):
        assert f"q = k: queries and keys are the same features of layers.{i}.qk" in reasons[f"layers.{i}"]
        assert f"layers.{1 - i}" not in reasons[f"layers.{i}"]


def test_a_walk_stopped_by_a_per_channel_mixing_of_tokens_names_the_op_and_the_line():
    report = kc.inspect(fs.PerChannelNet(), example_args=(_x(),))
    reasons = {s.name: s.reason for s in report.sites}
    assert set(reasons) == {"blocks.0", "blocks.1"} and not report.matched, str(report)
    for i in range(2):
        assert re.search(
            rf"k: no head split found between linear \(in blocks\.{i}\.k, a Linear\).*stopped at einsum \(in "
            rf"blocks\.{i}, a PerChannelBlock\) at forms_zoo_shared\.py:\d+ \(k = torch\.einsum\(.*\)\) \[einsum\]: it mixes "
            "tokens with weights that differ per feature",
            reasons[f"blocks.{i}"],
        ), reasons[f"blocks.{i}"]


def test_linformer_compression_as_wide_as_a_head_is_walked_through_not_read_as_the_keys():
    """``E`` compresses to Dh tokens: its output's last axis has a head's width, but its features are
    tokens. The keys' projection is ``k``, behind it."""
    model = fs.LinformerNet()
    site = kc.inspect(model, example_args=(_x(),)).matched[0]
    assert (site.q_proj, site.k_proj, site.v_proj, site.num_heads) == ("blocks.0.q", "blocks.0.k", "blocks.0.v", fs.H)


def test_twelve_heads_as_modules_share_one_transform_per_role():
    model = fs.TwelveHeadsNet()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(_x(),))
    (site,) = recorded_report(model).matched
    assert (site.name, site.num_heads, site.num_kv_heads) == ("blocks.0", fs.HEADS, fs.HEADS)
    assert site.joint["q"] == [f"blocks.0.heads.{h}.q" for h in range(1, fs.HEADS)]
    heads = model.blocks[0].heads
    assert all(heads[h].q.kha["q"] is heads[0].q.kha["q"] for h in range(fs.HEADS))


@pytest.mark.parametrize("cls", [fs.KeyFirstGraphNet, fs.QueryFirstGraphNet], ids=["key_first", "query_first"])
def test_graph_attention_roles_come_from_the_projections_not_the_operand_order(cls):
    (site, _) = kc.inspect(cls(), example_args=(_x(0, (30, D)), _edges())).matched
    assert (site.q_proj, site.k_proj, site.v_proj) == ("layers.0.q", "layers.0.k", "layers.0.v")


def test_a_module_that_would_carry_the_attention_arguments_and_a_functional_projection_is_skipped():
    """q = k on the arguments of an SDPA call in a module that also calls its value weight
    functionally: one module cannot carry both handlers' KHA, so the site says so (q alone is fine)."""

    class FunctionalSharedQK(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_qk, self.w_v = (torch.nn.Parameter(torch.randn(D, D) / D**0.5) for _ in range(2))

        def forward(self, x):
            qk, v = fs.to_heads(torch.nn.functional.linear(x, self.w_qk)), fs.to_heads(x @ self.w_v.t())
            return fs.from_heads(torch.nn.functional.scaled_dot_product_attention(qk, qk, v))

    both, _ = analyse(FunctionalSharedQK(), kc.KHAConfig(q="linear", k="linear", v="linear"), (_x(),), None)
    assert "v: the model would carry KHA of two handlers (attention_inputs and functional)" in both.sites[0].reason
    queries, _ = analyse(FunctionalSharedQK(), kc.KHAConfig(q="linear", v=None), (_x(),), None)
    assert queries.sites[0].status == "matched" and "T^Q acts on the arguments" in queries.sites[0].note
