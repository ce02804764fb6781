"""Attention forms of issue 34 (3, 7, 8) and heads as modules with two-digit indices: every site matched
with one transform per role of the asked-for kind, identity at init, the perturbed (and folded) output equal to
an independent per-head reference (``tests/forms_zoo_compress.py``) in both configs, save and reload.

- compressed, selected and sliding-window branches over one grouped qkv: keys and values compressed
  block by block by a learned MLP get no second transform on the MLP's output (it was read as MLA);
- a single-head gated unit (q and k from one projection through a scale and an offset per role, an
  einsum that contracts nothing): the scale is no projection, so T^Q and T^K sit where q and k part and
  v gets the MLP it was asked for (it was swapped for a linear transform under an "MLA" reading).
"""

from __future__ import annotations

import pytest
import torch

import forms_zoo_compress as fc
import kha_compile as kc
from form_checks import check_form, check_save_and_reload
from helpers import kha_params, perturb
from kha_compile.passes.apply import recorded_report

B, D = 2, fc.D
S = 40  # more tokens than d_model (32)


def _x(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


# name -> (model class, sites, roles kept on the attention arguments by fold)
FORMS = {
    "compressed_selected_window_branches": (fc.CompressedSparseNet, 6, ()),
    "gated_unit_laplace_einsum_scale": (fc.GatedUnitNet, 2, ("q", "k")),
    "gated_unit_softmax_einsum_scale": (fc.SoftmaxGatedUnitNet, 2, ("q", "k")),
    "gated_unit_laplace_product_scale": (fc.ProductGatedUnitNet, 2, ("q", "k")),
    "eleven_heads_as_modules": (fc.many_heads_net(11), 2, ()),  # heads.10: the first two-digit index
}
# (v, q and k linear too): linear KHA on q, k, v; the default KHAConfig() (MLP-value on v only)
CONFIGS = {"linear": ("linear", True), "mlp_value": ("mlp", False)}


def _config(name: str) -> kc.KHAConfig:
    return kc.KHAConfig(q="linear", k="linear", v="linear") if name == "linear" else kc.KHAConfig()


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_form_matches_a_per_head_reference(form, config):
    cls, sites, kept = FORMS[form]
    v, qk = CONFIGS[config]
    args = (_x(),)
    check_form(cls, args, v, sites=sites, qk=qk, kept=kept if qk else (), reference=lambda m: m.reference(*args))


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_save_and_reload(form, config, tmp_path):
    cls = FORMS[form][0]
    args = (_x(),)
    torch.manual_seed(0)
    model = cls()
    kc.apply(model, _config(config), example_args=args)
    perturb(model)
    check_save_and_reload(cls, model, args, tmp_path)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_compressed_branch_reads_the_one_transform_per_role_after_the_projection(config):
    """Every branch's k and v come from ``wqkv``: no transform on the compression MLPs, the note says why."""
    model, args = fc.CompressedSparseNet(), (_x(),)
    cfg = _config(config)
    kc.apply(model, cfg, example_args=args)
    report = kc.inspect(model, example_args=args)
    assert {(s.kind, s.q_proj, s.k_proj, s.v_proj) for s in report.matched if s.name == "blocks.1"} == {
        ("gqa", "blocks.1.wqkv", "blocks.1.wqkv", "blocks.1.wqkv")
    }
    compressed = [s for s in report.matched if "compressed block by block" in s.note]
    assert len(compressed) == 2 and "blocks.1.compress_k, blocks.1.compress_v" in compressed[1].note
    owners = {n.partition(".kha.")[0] for n in kha_params(model)}
    assert owners == {"blocks.0.wqkv", "blocks.1.wqkv"}
    assert all(s.transforms == cfg.roles() for s in report.matched)


@pytest.mark.parametrize("cls", [fc.GatedUnitNet, fc.SoftmaxGatedUnitNet], ids=["laplace", "softmax"])
def test_gated_unit_value_gets_the_mlp_it_asked_for(cls):
    """v = silu(Linear(x)): KHAConfig(v="mlp") puts the MLP on the Linear's output, and the report says mlp."""
    model, args = cls(), (_x(),)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=args)
    report = kc.inspect(model, example_args=args)
    assert [(s.kind, s.transforms, s.v_proj) for s in report.matched] == [
        ("mha", {"v": "mlp"}, f"blocks.{i}.v") for i in range(2)
    ]
    assert sorted(kha_params(model)) == [f"blocks.{i}.v.kha.v.{p}" for i in range(2) for p in ("down", "gate", "up")]


def test_gated_unit_matches_its_reference_exactly_in_float64():
    """The gated unit was off its per-head reference by the same amount in float64: a placement, not
    rounding. With T^Q and T^K where q and k part, float64 agrees to the last bits."""
    args = (_x(dtype=torch.float64),)
    torch.manual_seed(0)
    model = fc.GatedUnitNet().double()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=args)
    perturb(model)
    with torch.no_grad():
        torch.testing.assert_close(model(*args), model.reference(*args), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [11])
def test_heads_as_modules_with_two_digit_indices_are_one_site(n):
    """``heads.10``, ``heads.11``, ...: one site per block, every head's projection sharing one T per role."""
    model, args = fc.many_heads_net(n)(), (_x(),)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"), example_args=args)
    report = kc.inspect(model, example_args=args)
    assert [(s.name, s.num_heads, s.num_kv_heads) for s in report.matched] == [(f"blocks.{i}", n, n) for i in (0, 1)]
    assert not report.skipped
    assert report.matched[1].joint["q"] == [f"blocks.1.heads.{h}.q" for h in range(1, n)]
    for blk in model.blocks:
        heads = blk.heads
        assert all(heads[h].v.kha["v"] is heads[0].v.kha["v"] for h in range(n))
        assert all(heads[h].k.kha["k"] is heads[0].k.kha["k"] for h in range(n))


def test_mla_says_when_it_puts_a_linear_value_transform_for_mlp_value(caplog):
    """Real MLA keeps linear KHA only (weight absorption): asked for MLP-value, the report's transforms say
    linear, its note says what was asked and what was put, and a warning says it too."""
    import zoo

    case = zoo.make("deepseek_v3")
    with caplog.at_level("WARNING", logger="kha_compile.handlers.plan"):
        kc.apply(case.model, kc.KHAConfig())
    assert kc.inspect(case.model).matched[0].transforms == {"v": "linear"}
    site = recorded_report(case.model).matched[0]  # what apply did, with the config it was asked for
    assert (site.kind, site.transforms) == ("mla", {"v": "linear"})
    assert "v='mlp' asked, 'linear' put" in site.note
    assert "v='mlp' asked, 'linear' put" in caplog.text
