"""N-d projections: parameters of rank 3 and more applied with einsum / tensordot."""
from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from kha_compile.passes.match import find_sites
from kha_compile.passes.trace import capture

from projection_forms import LINEAR, MLP, check_form, two_blocks


@pytest.mark.parametrize("cfg", [LINEAR, MLP], ids=["linear", "mlp"])
@pytest.mark.parametrize("form", ["einsum_dhk", "einsum_hdk", "einsum_fused", "tensordot", "dense_general"])
def test_nd_form(form, cfg, tmp_path):
    check_form(form, cfg, tmp_path)


def test_head_map_comes_from_the_parameter_axes():
    model, x = two_blocks("einsum_fused")
    raw = find_sites(capture(model, (x,), {}).exported)[0]
    for i, r in enumerate("qkv"):
        proj = raw.roles[r].projection
        assert proj.pieces[0].axes == (0, 2, 3)  # (roles, d_model, heads, head_dim): all but d_model
        # head h of role i: flat positions i*H*Dh + h*Dh + j over (roles, heads, head_dim)
        assert raw.roles[r].head_map.index[1].tolist() == [i * 32 + 8 + j for j in range(8)]


def test_dense_general_bias_is_a_piece_of_the_projection():
    model, x = two_blocks("dense_general")
    site = kc.inspect(model, example_args=(x,)).sites[0]
    assert "N-d weight blocks.0.attn.value.kernel via einsum" in site.note
    assert "parametrizes blocks.0.attn.value.kernel, blocks.0.attn.value.bias" in site.note
