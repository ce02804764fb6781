"""Layout ops beyond reshapes: keys and values padded along the sequence and cut into overlapping windows
(HaloNet's halo attention), and heads cut with ``reshape_as`` another tensor (LeViT):
``F.pad`` on an axis that holds no features and ``Tensor.unfold`` are layout ops the walk follows
(``analysis/layout.py``), so each role reaches its projection; the perturbed output equals a per-head
reference written from the state dict, and linear KHA folds. A pad on the feature axis is no layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import forms_zoo as fz
import kha_compile as kc
from form_checks import check_form
from forms_zoo import DH, H, TwoBlocks, attend, kha_of, lin

BLOCK, HALO = 4, 2  # queries in blocks of 4; each attends to its block and 2 positions either side


class HaloAttention(nn.Module):
    """q in blocks; k and v zero-padded by the halo and unfolded into windows of BLOCK + 2 * HALO."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        n = s // BLOCK
        q = self.q(x).reshape(b, n, BLOCK, H, DH).transpose(2, 3)  # (B, n, H, BLOCK, Dh)

        def windows(y: Tensor) -> Tensor:
            y = F.pad(y.transpose(1, 2), (HALO, HALO))  # (B, D, S + 2 HALO): zeros outside
            y = y.unfold(2, BLOCK + 2 * HALO, BLOCK)  # (B, D, n, W)
            return y.reshape(b, H, DH, n, -1).permute(0, 3, 1, 4, 2)  # (B, n, H, W, Dh)

        o = F.scaled_dot_product_attention(q, windows(self.k(x)), windows(self.v(x)))  # (B, n, H, BLOCK, Dh)
        return x + self.o(o.transpose(2, 3).reshape(b, s, d))


class HaloNet(TwoBlocks):
    block = HaloAttention

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        s = x.shape[1]
        q, k, v = (lin(sd, f"{p}.{r}", x).unflatten(-1, (H, DH)) for r in "qkv")  # (B, S, H, Dh)
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(t[:, :, h]) for h in range(H)] for r, t in zip("qkv", (q, k, v)))
        out = []
        for i in range(s // BLOCK):  # block i: its queries, keys of positions i*BLOCK - HALO ... (zeros outside)
            lo, hi = i * BLOCK - HALO, (i + 1) * BLOCK + HALO

            def window(t: Tensor, lo: int = lo, hi: int = hi) -> Tensor:
                return F.pad(t, (0, 0, HALO, HALO))[:, lo + HALO : hi + HALO]  # (B, W, Dh)

            qs = [t[:, i * BLOCK : (i + 1) * BLOCK] for t in q]
            out.append(attend(qs, [window(t) for t in k], [window(t) for t in v]))
        return x + lin(sd, f"{p}.o", torch.cat(out, dim=1))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_padded_and_unfolded_keys_match_a_per_head_reference(v):
    x = torch.randn(fz.B, 4 * BLOCK, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(HaloNet, (x,), v, qk=True, reference=lambda m: m.reference(x))


class FeaturePad(nn.Module):
    """v padded on its head axis (Dh 8 -> 12) before attention: its head vector is not the projection's."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(fz.D, H * 12), nn.Linear(fz.D, H * 12), nn.Linear(fz.D, H * DH)

    def forward(self, x: Tensor) -> Tensor:
        q, k = (t(x).unflatten(-1, (H, 12)).transpose(1, 2) for t in (self.q, self.k))  # (B, H, S, 12)
        v = F.pad(self.v(x).unflatten(-1, (H, DH)).transpose(1, 2), (0, 4))  # (B, H, S, 12)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_pad_on_the_head_axis_is_not_followed():
    model, x = FeaturePad().eval(), torch.randn(1, 6, fz.D)
    report = kc.inspect(model, (x,))
    assert len(report.sites) == 1 and report.skipped and "v:" in report.skipped[0].reason


class ShapeOfOther(nn.Module):
    """Heads cut with ``reshape_as`` / ``view_as`` a template of shape (B, S, H, Dh) (LeViT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.new_empty(x.shape[0], x.shape[1], H, DH)  # (B, S, H, Dh): only its shape is read
        q = self.q(x).reshape_as(shape).transpose(1, 2)
        k = self.k(x).view_as(shape).transpose(1, 2)
        v = self.v(x).reshape_as(shape).transpose(1, 2)  # (B, H, S, Dh)
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class ShapeOfOtherNet(TwoBlocks):
    block = ShapeOfOther

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(h) for h in fz.split_heads(lin(sd, f"{p}.{r}", x))] for r in "qkv")
        return x + lin(sd, f"{p}.o", attend(q, k, v))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_heads_cut_with_reshape_as_match_a_per_head_reference(v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(ShapeOfOtherNet, (x,), v, qk=True, reference=lambda m: m.reference(x))
