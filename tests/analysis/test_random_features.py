"""Random-feature linear attention (FAVOR+) is a site with KHA before its feature map (issue 34, forms 5 and 6).

The forms are written by hand in ``tests/forms_zoo_favor.py``: FAVOR+ with matmuls, the same with ``'...'``
einsums (the random projection expanded over batch and heads, a three-operand output einsum), and one
fused qkv projection whose heads feed FAVOR+ (half) and banded softmax attention (the other half). Each
runs both KHA configs (linear q, k, v; the default MLP-value) against a per-head reference from the state
dict, with perturbed KHA weights, more tokens than d_model, save and load, and fold (linear).
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from forms_zoo_favor import DH, FORMS, B, D, H, Net, S
from helpers import kha_params, perturb
from kha_compile.passes.apply import recorded_report

CONFIGS = {"linear_qkv": dict(q="linear", k="linear", v="linear"), "mlp_v": dict(v="mlp")}
FAVOR = ("favor_matmul", "favor_einsum")


def _x() -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(0))


def _net(form: str) -> Net:
    torch.manual_seed(0)
    return Net(FORMS[form]).eval()


@pytest.mark.parametrize("form", FAVOR)
def test_random_feature_attention_is_a_site_with_its_heads(form):
    report = kc.inspect(_net(form), example_args=(_x(),))
    assert [s.name for s in report.sites] == ["blocks.0", "blocks.1"], str(report)
    for s in report.sites:
        assert (s.status, s.anchor) == ("matched", "random_features"), str(report)
        assert (s.num_heads, s.num_kv_heads, s.head_dim) == (H, H, DH)  # the head vector, not the m random features
        assert (s.q_proj, s.k_proj, s.v_proj) == tuple(f"{s.name}.{r}" for r in "qkv")
        assert "FAVOR+" in s.note and "before the short convolution, normalisation and feature map" in s.note


def test_both_forms_of_one_projection_are_sites_sharing_its_transforms():
    """Half the heads of one qkv linear are FAVOR+, half banded softmax: two sites, each with its heads, and
    one transform per role over every head of the projection (the report says it is shared)."""
    report = kc.inspect(_net("half_favor_half_local"), example_args=(_x(),))
    got = sorted((s.name, s.anchor, s.status, s.num_heads, s.q_proj, s.k_proj, s.v_proj) for s in report.sites)
    assert got == [
        (f"blocks.{i}", anchor, "matched", H // 2, *[f"blocks.{i}.qkv"] * 3)
        for i in range(2)
        for anchor in ("manual_softmax", "random_features")
    ], str(report)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("form", list(FORMS))
def test_kha_on_random_feature_attention_matches_the_per_head_reference(form, cfg, tmp_path):
    x = _x()
    model = _net(form)
    with torch.no_grad():
        before = model(x)
    kc.apply(model, kc.KHAConfig(**CONFIGS[cfg]), example_args=(x,))
    report = kc.inspect(model, example_args=(x,))
    assert len(report.matched) == (4 if form == "half_favor_half_local" else 2) and not report.skipped, str(report)
    assert all(s.transforms == CONFIGS[cfg] for s in report.matched), str(report)  # MLP-value on every v head
    if form == "half_favor_half_local":  # the second form's site says its heads share the first one's transforms
        shared = [s.note for s in recorded_report(model).matched if s.anchor == "manual_softmax"]
        assert len(shared) == 2 and all("share one transform over all the heads" in n for n in shared), shared
    with torch.no_grad():
        assert torch.equal(model(x), before)  # identity at init
    perturb(model)
    with torch.no_grad():
        moved = model(x)
        assert (moved - before).abs().max() > 1e-3
        torch.testing.assert_close(moved, model.reference(x, expect=CONFIGS[cfg]), rtol=1e-4, atol=1e-5)

    kc.save_pretrained(model, tmp_path / "kha")
    fresh = _net(form)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(fresh, tmp_path / "kha", example_args=(x,))
    with torch.no_grad():
        assert torch.equal(fresh(x), moved)

    if cfg == "linear_qkv":  # folds into the projections: the original classes, no KHA left
        kc.fold(model)
        assert not kha_params(model)
        assert all(type(m) is torch.nn.Linear for n, m in model.named_modules() if n.endswith(("q", "k", "v", "qkv")))
        with torch.no_grad():
            folded = model(x)
        torch.testing.assert_close(folded, moved, rtol=1e-5, atol=1e-5)
