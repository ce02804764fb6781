"""Attention forms of issue 34 that read scores another way: bidirectional cross-attention (one score matrix,
a softmax over each of its axes) and keys and values pooled into interests with the scores normalised over
the queries. Every site matched with the right roles, identity at init, the perturbed (and folded) output
equal to an independent per-head reference (``tests/forms_zoo_issue34.py``) in the linear and the MLP-value
config, save and reload."""

from __future__ import annotations

import pytest
import torch

import forms_zoo_issue34 as fz
import kha_compile as kc
from form_checks import check_form, check_save_and_reload
from helpers import kha_params, perturb
from kha_compile.passes.apply import analyse, recorded_report

B, D, H, DH = 2, fz.D, 4, fz.DH


def _x(seed: int = 0, n: int = fz.S) -> torch.Tensor:
    return torch.randn(B, n, D, generator=torch.Generator().manual_seed(seed))


def _two() -> tuple[torch.Tensor, torch.Tensor]:
    return _x(), _x(1, fz.SB)


# name -> (model class, inputs, sites)
FORMS = {
    "bidirectional_one_score_einsum": (fz.BidirNet, _two, 4),
    "bidirectional_one_score_one_projection_matmul": (fz.BidirOneProjectionNet, _two, 4),
    "interests_pooled_scores_over_queries_einsum": (fz.InterestPoolNet, lambda: (_x(),), 2),
    "interests_pooled_scores_over_queries_matmul": (fz.InterestPoolMatmulNet, lambda: (_x(),), 2),
    "interests_pooled_scores_over_queries_transposed": (fz.InterestPoolTransposedNet, lambda: (_x(),), 2),
}
# the linear config (per-head T on q, k and v) and the default one (the MLP on the value heads)
CONFIGS = {"linear": kc.KHAConfig(q="linear", k="linear", v="linear"), "mlp_value": kc.KHAConfig()}


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_matches_a_per_head_reference(form, config):
    cls, inputs, sites = FORMS[form]
    args = inputs()
    v, qk = CONFIGS[config].v, CONFIGS[config].q is not None
    check_form(cls, args, v, sites=sites, qk=qk, reference=lambda m: m.reference(*args))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_save_and_reload(form, config, tmp_path):
    cls, inputs, _ = FORMS[form]
    args = inputs()
    torch.manual_seed(0)
    model = cls()
    kc.apply(model, CONFIGS[config], example_args=args)
    perturb(model)
    check_save_and_reload(cls, model, args, tmp_path)


@pytest.mark.parametrize("cls", [fz.BidirNet, fz.BidirOneProjectionNet], ids=["two_projections", "one_projection"])
def test_bidirectional_sites_name_each_directions_roles_and_one_transform_for_q_and_k(cls):
    """Each direction is a site with its own roles (b's queries are the keys of a's direction); T^Q and T^K
    are one transform after the query/key projections, held by both sides, no T^K of its own; the note
    says so."""
    model = cls()
    kc.apply(model, CONFIGS["linear"], example_args=_two())
    report = kc.inspect(model, example_args=_two())
    a, b = ("qk", "qk") if cls is fz.BidirOneProjectionNet else ("qk_a", "qk_b")
    roles = [(s.q_proj, s.k_proj, s.v_proj) for s in report.matched if s.name == "blocks.0"]
    assert roles == [
        (f"blocks.0.{a}", f"blocks.0.{b}", "blocks.0.v_b"),
        (f"blocks.0.{b}", f"blocks.0.{a}", "blocks.0.v_a"),
    ]
    for site in report.matched:
        assert site.transforms == {"q": "linear", "k": "linear", "v": "linear"}, str(report)
        assert "one score matrix read both ways" in site.note and "T^Q and T^K are one transform T" in site.note
    assert not [n for n in kha_params(model) if ".kha.k." in f".{n}"]
    blk = model.blocks[0]
    if cls is fz.BidirNet:
        assert blk.qk_b.kha["q"] is blk.qk_a.kha["q"]


@pytest.mark.parametrize("role", ["q", "k"])
def test_bidirectional_with_only_q_or_only_k_asked_puts_the_one_transform_on_both_and_says_so(role, tmp_path):
    """``KHAConfig(q="linear")`` (or ``k``): the one transform is asked, so both sides carry it, held as
    that role's; the note says the other role carries it too; save and reload keep it."""
    args = _two()
    torch.manual_seed(0)
    model = fz.BidirNet()
    kc.apply(model, kc.KHAConfig(v="mlp", **{role: "linear"}), example_args=args)
    held = sorted(n for n in kha_params(model) if ".kha.q." in f".{n}" or ".kha.k." in f".{n}")
    assert held == [f"blocks.{i}.qk_{'a' if role == 'q' else 'b'}.kha.{role}.weight" for i in range(2)]
    site = kc.inspect(model, example_args=args).matched[0]
    assert site.transforms == {"q": "linear", "k": "linear", "v": "mlp"}
    other = "keys" if role == "q" else "queries"
    assert (
        f"the KHAConfig asks {role}='linear' only; the {other} carry it too" in recorded_report(model).matched[0].note
    )
    perturb(model)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-4, atol=1e-5)
    kc.save_pretrained(model, tmp_path)
    again = fz.BidirNet()
    again.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in f".{k}"})
    kc.load_pretrained(again, tmp_path, example_args=args)
    with torch.no_grad():
        assert torch.equal(again(*args), model(*args))


@pytest.mark.parametrize(
    "cls",
    [fz.InterestPoolNet, fz.InterestPoolMatmulNet, fz.InterestPoolTransposedNet],
    ids=["einsum", "matmul", "transposed"],
)
def test_interest_pooling_is_one_attention_with_the_q_k_v_projections_as_roles(cls):
    """Queries from ``q``, keys from ``k``, values from ``v`` (the pooling mixes tokens, not features), head
    dim Dh for all three; the pooling (a softmax over the tokens, I = 3 wide) is no role and no site."""
    report = kc.inspect(cls(), example_args=(_x(),))
    assert len(report.sites) == 2 and not report.skipped, str(report)
    for i, site in enumerate(report.matched):
        got = (site.q_proj, site.k_proj, site.v_proj, site.kind, site.num_heads, site.num_kv_heads)
        assert got == (f"blocks.{i}.q", f"blocks.{i}.k", f"blocks.{i}.v", "mha", H, H), str(report)
        assert (site.head_dim, site.v_head_dim, site.joint) == (DH, DH, {}), str(report)


def test_bidirectional_with_a_side_kha_cannot_share_a_transform_with_is_skipped_naming_the_form():
    """b's side is a functional projection (a weight used with ``F.linear``): the one transform of q and k
    cannot be shared with it, so the sites are skipped with the reason, not given a T^Q on one side only."""

    class FunctionalSide(fz.BidirBlock):
        def __init__(self) -> None:
            super().__init__()
            del self.qk_b
            self.w_b = torch.nn.Parameter(torch.randn(D, D) / D**0.5)

        def sides(self, a, b):
            return fz.to_heads(self.qk_a(a)), fz.to_heads(torch.nn.functional.linear(b, self.w_b))

    class FunctionalSideNet(fz.BidirNet):
        block = FunctionalSide

    report, _ = analyse(FunctionalSideNet(), CONFIGS["linear"], _two(), None)
    assert len(report.sites) == 4 and not report.matched, str(report)
    for site in report.sites:
        assert "q, k: one score matrix read both ways needs one transform shared by blocks." in site.reason, site.reason


@pytest.mark.parametrize("cls", [fz.BidirNet, fz.BidirOneProjectionNet], ids=["two_projections", "one_projection"])
def test_training_steps_move_the_one_transform_and_keep_the_reference(cls):
    """Three fused AdamW steps: the one q/k transform (its gradient comes from both sides and both
    directions) and each T^V move, and the trained model still equals its per-head reference."""
    args = _two()
    torch.manual_seed(0)
    model = cls()
    kc.apply(model, CONFIGS["linear"], example_args=args)
    perturb(model)
    before = {n: p.detach().clone() for n, p in kha_params(model).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(*args).square().mean().backward()
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in kha_params(model).items())
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-4, atol=1e-5)
