"""kha_compile.viz: the KHA matrices per site and their labels."""

from __future__ import annotations

import torch

import kha_compile as kc
from kha_compile.cli import tiny
from kha_compile.viz import kha_matrices, short_labels


def test_kha_matrices_and_labels():
    model = kc.apply(tiny.make("tiny-gpt2"), kc.KHAConfig(q="linear", v="mlp"))
    with torch.no_grad():  # set by hand, so the test sees the live tensors, not the identity init
        model.transformer.h[1].attn.c_attn.kha.q.weight.mul_(3.0)
        model.transformer.h[0].attn.c_attn.kha.v.gate.fill_(0.5)
    sites = kha_matrices(model)
    assert [s for s, _ in sites] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert sorted(sites[0][1]) == ["T^Q", "V down", "V gate", "V up"]
    assert torch.equal(sites[0][1]["T^Q"], torch.eye(16))
    assert torch.equal(sites[1][1]["T^Q"], 3.0 * torch.eye(16))
    assert torch.equal(sites[0][1]["V gate"], torch.full((16, 16), 0.5))
    assert torch.equal(sites[1][1]["V gate"], torch.zeros(16, 16))
    assert short_labels([s for s, _ in sites]) == ["h 0", "h 1"]
    assert short_labels(["encoder.layer.0.attention.self", "encoder.layer.11.attention.self"]) == [
        "layer 0",
        "layer 11",
    ]


def test_plot_without_kha_is_refused(tmp_path):
    import pytest

    from kha_compile.core.errors import NoKHATransformsError
    from kha_compile.viz import plot_kha

    pytest.importorskip("matplotlib")
    with pytest.raises(NoKHATransformsError, match="carries no KHA transforms"):
        plot_kha(tiny.make("tiny-gpt2"), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def _hand_set_model():
    """tiny-gpt2 with linear T^Q, T^V: layer 0 near identity, layer 1 far from it (set by hand)."""
    model = kc.apply(tiny.make("tiny-gpt2"), kc.KHAConfig(q="linear", v="linear"))
    d = 16
    near = torch.eye(d) + 0.01 * torch.ones(d, d)  # diagonal 1.01, off-diagonal 0.01
    far = torch.ones(d, d)  # every entry 1
    far[0, 1] = 3.0
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.kha.q.weight.copy_(near)
        model.transformer.h[0].attn.c_attn.kha.v.weight.copy_(torch.eye(d))
        model.transformer.h[1].attn.c_attn.kha.q.weight.copy_(far)
        model.transformer.h[1].attn.c_attn.kha.v.weight.copy_(2.0 * torch.eye(d))
    return model


def test_diagonal_summary_matches_a_computation_by_hand():
    from kha_compile.viz import diagonal_summary

    model = _hand_set_model()
    rows = {(r.layer, r.role): r for r in diagonal_summary(model)}
    assert sorted(rows) == [("h 0", "T^Q"), ("h 0", "T^V"), ("h 1", "T^Q"), ("h 1", "T^V")]
    # near: 16 diagonal entries 1.01, 240 off-diagonal entries 0.01
    diag, off = 16 * 1.01**2, 240 * 0.01**2
    r = rows[("h 0", "T^Q")]
    assert abs(r.diagonal - diag / (diag + off)) < 1e-7 and abs(r.off_diagonal - off / (diag + off)) < 1e-7
    assert abs(r.diagonal - 0.998532) < 1e-6  # near the identity
    assert abs(r.distance_from_identity - (0.01 * 16) / 4) < 1e-7  # ||0.01 * ones||_F / sqrt(16)
    # far: 16 diagonal ones; off-diagonal 239 ones and one 3
    diag, off = 16.0, 239.0 + 9.0
    r = rows[("h 1", "T^Q")]
    assert abs(r.diagonal - diag / (diag + off)) < 1e-7 and abs(r.off_diagonal - off / (diag + off)) < 1e-7
    assert r.diagonal < 0.07  # far from it
    assert rows[("h 0", "T^V")].diagonal == 1.0 and rows[("h 0", "T^V")].distance_from_identity == 0.0
    assert rows[("h 1", "T^V")].diagonal == 1.0 and abs(rows[("h 1", "T^V")].distance_from_identity - 1.0) < 1e-12


def test_diagonal_summary_of_mlp_value_uses_up_times_down():
    from kha_compile.viz import diagonal_mass, diagonal_summary, effective_matrices

    model = kc.apply(tiny.make("tiny-gpt2"), kc.KHAConfig(v="mlp"))
    gen = torch.Generator().manual_seed(0)
    up, down = torch.randn(16, 16, generator=gen), torch.randn(16, 16, generator=gen)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.kha.v.up.copy_(up)
        model.transformer.h[1].attn.c_attn.kha.v.down.copy_(down)
        model.transformer.h[1].attn.c_attn.kha.v.gate.fill_(5.0)  # the gate does not enter the measure
    eff = dict(effective_matrices(model))["transformer.h.1.attn"]["V mlp"]
    assert torch.allclose(eff, (up @ down).double(), atol=1e-5)
    rows = diagonal_summary(model)
    assert [(r.layer, r.role) for r in rows] == [("h 0", "V mlp"), ("h 1", "V mlp")]
    assert rows[0].diagonal == 1.0 and rows[0].distance_from_identity == 0.0  # up = down = I at init
    p = up.double() @ down.double()
    assert abs(rows[1].diagonal - float(p.diagonal().square().sum() / p.square().sum())) < 1e-9
    assert abs(rows[1].diagonal - diagonal_mass(p)) < 1e-12


def test_diagonal_mass_examples():
    import math

    from kha_compile.viz import diagonal_mass

    assert diagonal_mass(torch.eye(4)) == 1.0
    assert diagonal_mass(torch.ones(4, 4)) == 0.25
    assert diagonal_mass(torch.diag(torch.tensor([1.0, -2.0, 3.0]))) == 1.0
    assert math.isnan(diagonal_mass(torch.zeros(3, 3)))


def test_pictures_are_written(tmp_path):
    import json

    import pytest

    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from kha_compile.viz import (
        LOSS_CURVES_FILE,
        diagonal_summary,
        load_loss_curves,
        plot_diagonal,
        plot_kha,
        plot_loss_curves,
    )

    model = _hand_set_model()
    m = plot_kha(model, tmp_path / "m.png", with_delta=True)
    d = plot_diagonal(diagonal_summary(model), tmp_path / "d.png")
    runs = [
        {"name": "a", "train": [[1, 2.0], [2, 1.5]], "val": [[0, 2.1], [2, 1.7]]},
        {"name": "b", "train": [[1, 2.0], [2, 1.4]], "val": [[0, 2.1], [2, 1.6]]},
    ]
    (tmp_path / LOSS_CURVES_FILE).write_text(json.dumps({"runs": runs}))
    (tmp_path / "ckpt").mkdir()
    assert load_loss_curves(tmp_path / "ckpt") == runs  # found in the checkpoint's parent
    assert load_loss_curves(tmp_path / "ckpt" / "nothing") is None
    lo = plot_loss_curves(runs, tmp_path / "l.png")
    m_img, d_img, l_img = imread(str(m)), imread(str(d)), imread(str(lo))
    # 2 rows x 4 panels (T^Q, T^Q - I, T^V, T^V - I); the panels are not blank
    assert m_img.shape[1] > 4 * 150 and m_img.shape[0] > 2 * 150 and m_img.std() > 0.05
    assert d_img.shape[1] > 800 and d_img.std() > 0.02 and l_img.shape[1] > 800 and l_img.std() > 0.02
