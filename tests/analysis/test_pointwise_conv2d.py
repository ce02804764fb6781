"""1x1 ``Conv2d`` projections over (B, C, H, W) feature maps (BoTNet, CoAtNet/MaxViT, MobileNetV5's
multi-query attention, ...): the walk reads the channel axis as the features of a pointwise linear
(``analysis/params.py``), KHA goes on the conv's output heads, identity at init is exact (the
transformed output keeps the conv's memory layout, ``model/parametrized.py``), the perturbed output
equals a per-head reference computed from the state dict, and linear KHA folds into the conv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import forms_zoo as fz
import kha_compile as kc
from form_checks import check_form
from forms_zoo import DH, H, TwoBlocks, attend, kha_of

C, SIDE = fz.D, 7  # 49 positions: more tokens than channels


class Conv2dAttention(nn.Module):
    """qkv and out as 1x1 convs; heads cut from the channel axis, [Q | K | V] blocks of (H, Dh)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Conv2d(C, 3 * C, 1), nn.Conv2d(C, C, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, H, DH, h * w).unbind(1)  # each (B, H, Dh, HW)
        o = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.o(o.transpose(-1, -2).reshape(b, c, h, w))  # (B, C, H, W)


class Conv2dNet(TwoBlocks):
    block = Conv2dAttention

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (B, HW, C)
        y = F.linear(tokens, sd[f"{p}.qkv.weight"][..., 0, 0], sd[f"{p}.qkv.bias"])  # (B, HW, 3C)
        y = y.unflatten(-1, (3, H, DH))  # channel = role * C + head * Dh + j
        q, k, v = ([kha_of(self, r, f"{p}.qkv")(y[..., i, n, :]) for n in range(H)] for i, r in enumerate("qkv"))
        o = F.linear(attend(q, k, v), sd[f"{p}.o.weight"][..., 0, 0], sd[f"{p}.o.bias"])  # (B, HW, C)
        return x + o.transpose(1, 2).reshape(b, c, h, w)


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_pointwise_conv2d_projections_match_a_per_head_reference(v):
    x = torch.randn(fz.B, C, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    model = check_form(Conv2dNet, (x,), v, qk=True, reference=lambda m: m.reference(x))
    assert type(model.blocks[0].qkv) is nn.Conv2d or v == "mlp"  # linear KHA folds back into the conv


class StridedConv2dAttention(Conv2dAttention):
    """A 1x1 conv with stride 2 is no pointwise linear of the input positions: not a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Conv2d(C, 3 * C, 1, stride=2)

    def forward(self, x: Tensor) -> Tensor:
        b = x.shape[0]
        y = self.qkv(x)
        q, k, v = y.reshape(b, 3, H, DH, -1).unbind(1)  # (B, H, Dh, HW/4)
        o = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return o.transpose(-1, -2).reshape(y.shape[0], C, *y.shape[2:])


def test_a_strided_conv_is_not_read_as_a_projection():
    model, x = StridedConv2dAttention().eval(), torch.randn(1, C, 8, 8)
    report = kc.inspect(model, (x,))
    assert len(report.sites) == 1 and report.skipped and "no projection found" in report.skipped[0].reason
