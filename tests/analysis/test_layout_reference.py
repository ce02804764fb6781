"""Fused and interleaved QKV layouts against an independent reference.

For each model the table below says, from the model's own source, which rows (or Conv1D columns) of
its fused projection hold head h of role r. The reference applies a random T to exactly those
features by editing the original weights (docs/method.md: W[R_h] <- T^T W[R_h], b[R_h] <- b[R_h] T);
the KHA model gets the same T through its transform. A swapped role or a wrong head grouping
changes the output, so these tests fail on it — the fold tests cannot, since fold reuses the slots.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
import zoo
from helpers import run

H, DH = zoo.HEADS, zoo.HIDDEN // zoo.HEADS
ROLE = {"q": 0, "k": 1, "v": 2}


def _rows_blocks(r, h, n_heads=H):  # [Q | K | V] blocks of H heads each
    start = ROLE[r] * n_heads * DH + h * DH
    return list(range(start, start + DH))


def _rows_interleaved(r, h):  # per head [q | k | v], as GPT-NeoX and BLOOM view(B, T, H, 3*Dh)
    start = h * 3 * DH + ROLE[r] * DH
    return list(range(start, start + DH))


def _rows_falcon_mqa(r, h):  # H query heads, then one key head, then one value head
    if r == "q":
        return list(range(h * DH, (h + 1) * DH))
    start = (H + ROLE[r] - 1) * DH
    return list(range(start, start + DH))


# name: (projection module path in layer 0, weight name, bias name, output axis, rows(role, head), heads per role)
LAYOUTS = {
    "gpt2": ("transformer.h.{i}.attn.c_attn", "weight", "bias", 1, _rows_blocks, {"q": H, "k": H, "v": H}),
    "nanogpt": ("h.{i}.attn.c_attn", "weight", "bias", 0, _rows_blocks, {"q": H, "k": H, "v": H}),
    "gpt_neox": (
        "gpt_neox.layers.{i}.attention.query_key_value",
        "weight",
        "bias",
        0,
        _rows_interleaved,
        {"q": H, "k": H, "v": H},
    ),
    "falcon": (
        "transformer.h.{i}.self_attention.query_key_value",
        "weight",
        None,
        0,
        _rows_falcon_mqa,
        {"q": H, "k": 1, "v": 1},
    ),
    "torch_encoder": (
        "layers.{i}.self_attn",
        "in_proj_weight",
        "in_proj_bias",
        0,
        _rows_blocks,
        {"q": H, "k": H, "v": H},
    ),
}


def _edit(model, path, wname, bname, axis, rows_of, heads, role, t):
    mod = model.get_submodule(path)
    w = getattr(mod, wname)
    b = getattr(mod, bname) if bname else None
    with torch.no_grad():
        for h in range(heads[role]):
            idx = torch.tensor(rows_of(role, h))
            if axis == 0:
                w[idx] = t.t() @ w[idx]
            else:
                w[:, idx] = w[:, idx] @ t
            if b is not None:
                b[idx] = b[idx] @ t


@pytest.mark.parametrize("role", ["q", "k", "v"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_transform_lands_on_the_right_features(name, role):
    path, wname, bname, axis, rows_of, heads = LAYOUTS[name]
    case = zoo.make(name)
    reference = copy.deepcopy(case.model)
    kc.apply(case.model, kc.KHAConfig(q="linear", k="linear", v="linear"), *case.example)
    gen = torch.Generator().manual_seed(7)
    for i in range(zoo.LAYERS):
        t = torch.eye(DH) + 0.3 * torch.randn(DH, DH, generator=gen)
        layer_path = path.format(i=i)
        with torch.no_grad():
            case.model.get_submodule(layer_path).kha[role].weight.copy_(t)
        _edit(reference, layer_path, wname, bname, axis, rows_of, heads, role, t)
    want = run(zoo.ZooCase(**{**case.__dict__, "model": reference}))
    got = run(case)
    assert not torch.allclose(want, run(zoo.make(name)), atol=1e-4)  # the edit matters
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
