"""kha_compile.viz: the KHA matrices per site and their labels."""
from __future__ import annotations

import torch

import kha_compile as kc
from kha_compile import _tiny
from kha_compile.viz import kha_matrices, short_labels


def test_kha_matrices_and_labels():
    model = kc.apply(_tiny.make("tiny-gpt2"), kc.KHAConfig(q="linear", v="mlp"))
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
    assert short_labels(["encoder.layer.0.attention.self", "encoder.layer.11.attention.self"]) == ["layer 0", "layer 11"]


def test_plot_without_kha_is_refused(tmp_path):
    import pytest

    from kha_compile.errors import NoKHATransformsError
    from kha_compile.viz import plot_kha

    pytest.importorskip("matplotlib")
    with pytest.raises(NoKHATransformsError, match="carries no KHA transforms"):
        plot_kha(_tiny.make("tiny-gpt2"), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
