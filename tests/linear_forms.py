"""Attention without a softmax call, written by hand: linear attention, retention (parallel, recurrent), LSH.

Each model is two blocks of one form, with separate q, k, v, o linears of ``H`` heads of ``DH``. The
reference of a KHA model is :class:`reference.Reference` over an untouched copy: forward hooks on the
copy's own q, k, v projections apply docs/method.md's transforms head by head (:func:`layout`).

Example::

    model = Net(LinearAttention)
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    ref = Reference(Net(LinearAttention), layout, cfg={}).load(model.state_dict())
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reference import Fn, Proj

D, H = 32, 4
DH = D // H
B, S = 2, 40  # more tokens than d_model: the token-side strategy runs

__all__ = [
    "DH",
    "LSH",
    "B",
    "D",
    "EfficientAttention",
    "H",
    "LinearAttention",
    "LinearAttentionChannelsFirst",
    "LinearAttentionOnesColumn",
    "LinearAttentionRotary",
    "LogsumexpSoftmax",
    "Net",
    "Retention",
    "RetentionRecurrent",
    "S",
    "layout",
]


def to_heads(y: Tensor) -> Tensor:
    """(B, S, H*Dh) -> (B, H, S, Dh)."""
    return y.unflatten(-1, (H, DH)).transpose(1, 2)


def from_heads(o: Tensor) -> Tensor:
    """(B, H, S, Dh) -> (B, S, H*Dh)."""
    return o.transpose(1, 2).flatten(2)


class Block(nn.Module):
    """q, k, v, o linears and a residual; ``attend(q, k, v)`` on (B, H, S, Dh) heads is the form."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(p(x)) for p in (self.q, self.k, self.v))
        return x + self.o(from_heads(self.attend(q, k, v)))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError


class LinearAttention(Block):
    """``phi(q) (phi(k)^T v) / (phi(q) sum_j phi(k_j))`` with ``phi = elu + 1``: the key-value state first."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = k.transpose(-2, -1) @ v  # (B, H, Dh, Dh)
        norm = q @ k.sum(-2, keepdim=True).transpose(-2, -1)  # (B, H, S, 1)
        return (q @ state) / norm


class LinearAttentionChannelsFirst(Block):
    """ReLU linear attention over heads held channels first, (B, H, D, N), as Sana writes it: the state
    ``v @ k^T`` (B, H, Dv, Dk) first, then ``state @ q``; normalised by the same products of ones."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = F.relu(q).transpose(-2, -1), F.relu(k), v.transpose(-2, -1)  # (B, H, D, N) but k (B, H, N, D)
        out = (v @ k) @ q  # (B, H, Dv, N)
        norm = (torch.ones_like(v[:, :, :1]) @ k) @ q  # (B, H, 1, N)
        return (out / (norm + 1e-6)).transpose(-2, -1)


class LinearAttentionOnesColumn(Block):
    """Sana's ReLU linear attention as diffusers writes it: channels first, a row of ones padded onto the
    values (``F.pad(v, (0, 0, 0, 1), value=1.0)``) so one product pair gives the output and its normaliser
    (the padded row), which divides the rest."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = F.relu(q).transpose(-2, -1), F.relu(k), v.transpose(-2, -1)  # (B, H, D, N) but k (B, H, N, D)
        v = F.pad(v, (0, 0, 0, 1), mode="constant", value=1.0)  # (B, H, Dv + 1, N)
        out = (v @ k) @ q  # (B, H, Dv + 1, N)
        return (out[:, :, :-1] / (out[:, :, -1:] + 1e-6)).transpose(-2, -1)


class LinearAttentionRotary(Block):
    """SanaVideo's form: ReLU linear attention, channels first, RoPE on the products' q and k (its cos/sin
    tables expanded over the batch and heads), the normaliser from the unrotated q and k."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = F.relu(q), F.relu(k)  # (B, H, N, D)
        angle = torch.arange(q.shape[-2], dtype=q.dtype)[:, None] * 0.1 ** torch.arange(DH // 2, dtype=q.dtype)
        cos, sin = (f(angle).repeat_interleave(2, -1).expand(q.shape) for f in (torch.cos, torch.sin))

        def rotate(x: Tensor) -> Tensor:
            pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
            return x * cos + pairs * sin

        qr, kr = rotate(q).transpose(-2, -1), rotate(k).transpose(-2, -1)  # (B, H, D, N)
        z = 1 / (k.sum(-2, keepdim=True) @ q.transpose(-2, -1) + 1e-6)  # (B, H, 1, N)
        out = (v.transpose(-2, -1) @ kr.transpose(-2, -1)) @ qr  # (B, H, Dv, N)
        return (out * z).transpose(-2, -1)


class EfficientAttention(Block):
    """Factorised ("efficient") attention, as CoaT and lambda layers write it: softmax of q over its
    features, softmax of k over the tokens, the key-value state first: ``softmax_d(q) (softmax_n(k)^T v)``."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state = torch.einsum("bhnk,bhnv->bhkv", k.softmax(dim=2), v)
        return torch.einsum("bhnk,bhkv->bhnv", q.softmax(dim=-1), state)


def _gammas() -> Tensor:
    return 1 - 2.0 ** (-5 - torch.arange(H, dtype=torch.float32))  # one decay per head


class Retention(Block):
    """Retention, parallel form: ``(q k^T / sqrt(Dh) * D) v``, ``D[i, j] = gamma_h^(i - j)`` for ``j <= i``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gamma", _gammas())

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n = torch.arange(q.shape[-2])
        gap = (n[:, None] - n[None, :]).float()  # (S, S)
        decay = torch.where(gap >= 0, self.gamma[:, None, None] ** gap.clamp(min=0), torch.zeros(()))  # (H, S, S)
        return ((q @ k.transpose(-2, -1)) / DH**0.5 * decay) @ v


class RetentionRecurrent(Retention):
    """The same retention token by token: ``state = gamma state + k_t^T v_t``, ``o_t = q_t state / sqrt(Dh)``."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        state = q.new_zeros(q.shape[0], H, DH, DH)
        out = []
        for t in range(q.shape[-2]):
            kv = k[:, :, t : t + 1].transpose(-2, -1) @ v[:, :, t : t + 1]  # (B, H, Dh, Dh)
            state = self.gamma[:, None, None] * state + kv
            out.append(q[:, :, t : t + 1] @ state / DH**0.5)
        return torch.cat(out, dim=2)


class LogsumexpSoftmax(Block):
    """Softmax attention written as ``exp(s - logsumexp(s)) @ v`` (Reformer's local attention): not a linear form."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        s = q @ k.transpose(-2, -1) / DH**0.5
        return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True)) @ v


class LSH(Block):
    """Bucketed attention: tokens sorted by a hash of k (fixed random rotations, an argmax), softmax
    attention inside chunks of the sorted order, then unsorted (Reformer's LSH attention, one round)."""

    chunk = 8

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rotations", torch.randn(DH, 2, generator=torch.Generator().manual_seed(7)))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rotated = k.detach() @ self.rotations  # (B, H, S, 2)
        buckets = torch.cat([rotated, -rotated], -1).argmax(-1)  # (B, H, S)
        order = torch.argsort(buckets * q.shape[-2] + torch.arange(q.shape[-2]), dim=-1)  # stable by position
        idx = order[..., None].expand(-1, -1, -1, DH)
        qs, ks, vs = (t.gather(2, idx).unflatten(2, (-1, self.chunk)) for t in (q, k, v))  # (B, H, n, c, Dh)
        out = torch.softmax(qs @ ks.transpose(-2, -1) / DH**0.5, dim=-1) @ vs
        return torch.empty_like(q).scatter(2, idx, out.flatten(2, 3))


class Net(nn.Module):
    """Two blocks of one form."""

    def __init__(self, block: type[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _split(role: str) -> Any:
    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        return fns[role](y.unflatten(-1, (H, DH))).flatten(-2)

    return split


def layout(model: nn.Module, cfg: Any) -> list[Proj]:
    """The q, k, v linears of every block, each (H, Dh) head-major: the :class:`reference.Reference` layout."""
    return [Proj(f"blocks.{i}.{r}", (r,), _split(r)) for i in range(len(model.blocks)) for r in "qkv"]
