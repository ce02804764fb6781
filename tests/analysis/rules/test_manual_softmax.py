"""Rule manual_softmax with values channels first: ``v @ softmax(q^T k)^T`` over (B, H, Dh, N) tensors,
as LeViT-conv, EfficientViT-MSRA and SHViT write it with 1x1 convolutions as projections. Every role
reaches its projection (v's head vector on axis -2 at the value product); the perturbed output equals
a per-head reference written from the state dict, and linear KHA folds."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import forms_zoo as fz
from form_checks import check_form
from forms_zoo import DH, H, TwoBlocks, attend, kha_of

SIDE = 7  # a 7 x 7 map: 49 tokens, more than the 32 channels


class ConvAttention(nn.Module):
    """q, k, v from 1x1 convolutions over (B, C, h, w), heads on channels, values kept channels first."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Conv2d(fz.D, fz.D, 1) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        q, k, v = (p(x).view(b, H, DH, h * w) for p in (self.q, self.k, self.v))  # (B, H, Dh, N)
        attn = (q.transpose(-2, -1) @ k * DH**-0.5).softmax(-1)  # (B, H, N, N)
        o = (v @ attn.transpose(-2, -1)).view(b, c, h, w)  # (B, H, Dh, N) -> (B, C, h, w)
        return x + self.o(o)


class ConvNet(TwoBlocks):
    block = ConvAttention

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (B, N, C)

        def heads(r: str) -> list[Tensor]:  # a 1x1 convolution is a linear map of each token's channels
            y = tokens @ sd[f"{p}.{r}.weight"][:, :, 0, 0].T + sd[f"{p}.{r}.bias"]
            return [kha_of(self, r, f"{p}.{r}")(t) for t in fz.split_heads(y)]

        o = attend(heads("q"), heads("k"), heads("v")).transpose(1, 2).reshape(b, c, h, w)
        return x + torch.nn.functional.conv2d(o, sd[f"{p}.o.weight"], sd[f"{p}.o.bias"])


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_values_channels_first_match_a_per_head_reference(v):
    x = torch.randn(fz.B, fz.D, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    check_form(ConvNet, (x,), v, qk=True, reference=lambda m: m.reference(x))
