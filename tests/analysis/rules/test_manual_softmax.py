"""Rule manual_softmax with values channels first: ``v @ softmax(q^T k)^T`` over (B, H, Dh, N) tensors,
as LeViT-conv, EfficientViT-MSRA and SHViT write it with 1x1 convolutions as projections. Every role
reaches its projection (v's head vector on axis -2 at the value product); the perturbed output equals
a per-head reference written from the state dict, and linear KHA folds.

Attention over channels (XCiT's and EdgeNeXt's cross-covariance attention, DaViT's channel blocks):
scores of (Dh, Dh) per head, summed over the tokens. KHA still acts on each token's head vectors,
before the L2 normalisation over tokens; the reference does exactly that, head by head."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import forms_zoo as fz
from form_checks import check_form
from forms_zoo import DH, H, TwoBlocks, attend, kha_of, lin

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


class CrossCovariance(nn.Module):
    """XCA as XCiT writes it: fused qkv, heads as (B, H, Dh, N), q and k L2-normalised over the tokens,
    a learned temperature per head, attention over the Dh channels."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(fz.D, 3 * fz.D), nn.Linear(fz.D, fz.D)
        self.temperature = nn.Parameter(torch.linspace(0.5, 2.0, H).reshape(H, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, DH).permute(2, 0, 3, 4, 1).unbind(0)  # (B, H, Dh, N)
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.temperature
        o = (attn.softmax(-1) @ v).permute(0, 3, 1, 2).reshape(b, n, c)  # (B, H, Dh, N) -> (B, N, C)
        return x + self.o(o)


class GroupChannels(nn.Module):
    """DaViT's channel attention: scores k^T @ v over (Dc, Dc) per group, applied to q^T."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(fz.D, 3 * fz.D), nn.Linear(fz.D, fz.D)

    def forward(self, x: Tensor) -> Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, Dh)
        attn = ((k * n**-0.5).transpose(-1, -2) @ v).softmax(-1)  # (B, H, Dh, Dh)
        o = (attn @ q.transpose(-1, -2)).transpose(-1, -2)  # (B, H, N, Dh)
        return x + self.o(o.transpose(1, 2).reshape(b, n, c))


def _channel_attend(
    q: list[Tensor], k: list[Tensor], v: list[Tensor], scale: Callable[[int, Tensor], Tensor]
) -> Tensor:
    """Attention over channels, head by head: q, k, v as (B, N, Dh); softmax over (Dh, Dh); (B, N, H*Dh)."""
    out = []
    for h, (qh, kh, vh) in enumerate(zip(q, k, v)):
        probs = scale(h, qh.transpose(1, 2) @ kh).softmax(-1)  # (B, Dh, Dh): channel i of q against j of k
        out.append(vh @ probs.transpose(1, 2))  # each token's values mixed over channels
    return torch.cat(out, -1)


class CrossCovarianceNet(TwoBlocks):
    block = CrossCovariance

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        y = lin(sd, f"{p}.qkv", x)  # (B, N, 3 * D): [q | k | v], each H heads of Dh
        q, k, v = (
            [kha_of(self, r, f"{p}.qkv")(t) for t in fz.split_heads(y[..., i * fz.D : (i + 1) * fz.D])]
            for i, r in enumerate("qkv")
        )
        unit = [F.normalize(t, dim=1) for t in q], [F.normalize(t, dim=1) for t in k]  # over the tokens
        temp = sd[f"{p}.temperature"].flatten()
        return x + lin(sd, f"{p}.o", _channel_attend(*unit, v, lambda h, s: s * temp[h]))


class GroupChannelsNet(TwoBlocks):
    block = GroupChannels

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        y, n = lin(sd, f"{p}.qkv", x), x.shape[1]
        # by position in the ops, k plays the query, v the key and q the value: the roles KHA names
        q, k, v = (
            [kha_of(self, r, f"{p}.qkv")(t) for t in fz.split_heads(y[..., i * fz.D : (i + 1) * fz.D])]
            for i, r in zip((1, 2, 0), "qkv")
        )
        return x + lin(sd, f"{p}.o", _channel_attend([t * n**-0.5 for t in q], k, v, lambda h, s: s))


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("net", [CrossCovarianceNet, GroupChannelsNet], ids=["xcit", "davit"])
def test_attention_over_channels_matches_a_per_head_reference(net, v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(net, (x,), v, qk=True, reference=lambda m: m.reference(x))
