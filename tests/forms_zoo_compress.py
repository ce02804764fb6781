"""Attention forms of issue 34 (3, 7, 8), written by hand, each with an independent per-head reference.

- :class:`CompressedSparseNet`: native-sparse-attention style. One fused qkv projection grouped per kv
  head feeds three branches: keys and values compressed block by block by a small learned MLP
  (compressed attention), the top blocks of that attention (selected attention) and a sliding window,
  mixed by learned gates. KHA sits once per role right after the projection; every branch sees it.
- :class:`GatedUnitNet`: one head, q and k from one projection through a scale and an offset per role
  (a gated attention unit), the Laplace (erf) function or softmax with a relative position bias and
  causal zeroing, the value a Linear then an activation.

Like ``tests/forms_zoo_more.py``: ``reference(*inputs)`` computes the output from the stored
parameters head by head, with KHA as docs/method.md writes it (:func:`forms_zoo_more.shared_kha`).

Example::

    model = GatedUnitNet()
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    torch.testing.assert_close(model(x), model.reference(x))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forms_zoo import DH, D, H, lin
from forms_zoo_more import Head, HeadModulesBlock, HeadModulesNet, shared_kha

# ---- form 3: compressed, selected and sliding-window branches over one grouped qkv ----------------

KV = 2
REP = H // KV
BLOCK = 4  # tokens per compressed block
TOP = 2  # selected blocks per query
WINDOW = 6  # one-sided sliding window


def _compressor() -> nn.Module:
    """The small MLP that turns one block of BLOCK head vectors (flattened) into one head vector."""
    return nn.Sequential(nn.Linear(BLOCK * DH, 2 * DH), nn.GELU(), nn.Linear(2 * DH, DH))


class CompressedSparseAttn(nn.Module):
    """``wqkv`` viewed as (B, S, KV, REP + 2, Dh): per kv group its REP query heads, its key, its value."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(D, (H + 2 * KV) * DH)
        self.compress_k, self.compress_v = _compressor(), _compressor()
        self.gate = nn.Linear(D, 3 * H)
        self.wo = nn.Linear(H * DH, D)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, KV, REP + 2, DH)
        q = qkv[..., :REP, :].reshape(b, s, H, DH).transpose(1, 2)  # (B, H, S, Dh)
        k, v = qkv[..., REP, :].transpose(1, 2), qkv[..., REP + 1, :].transpose(1, 2)  # (B, KV, S, Dh)
        n = s // BLOCK
        kc = self.compress_k(k[:, :, : n * BLOCK].reshape(b, KV, n, BLOCK * DH))  # (B, KV, n, Dh)
        vc = self.compress_v(v[:, :, : n * BLOCK].reshape(b, KV, n, BLOCK * DH))
        qg = q.view(b, KV, REP, s, DH)  # (B, KV, REP, S, Dh): the query heads of each group
        p_cmp = torch.softmax(qg @ kc[:, :, None].transpose(-1, -2) / math.sqrt(DH), dim=-1)  # (B, KV, REP, S, n)
        o_cmp = (p_cmp @ vc[:, :, None]).reshape(b, H, s, DH)
        top = p_cmp.sum(2).topk(TOP, dim=-1).indices  # (B, KV, S, TOP): blocks picked per group and query
        picked = torch.zeros(b, KV, s, n, dtype=torch.bool).scatter(-1, top, True)
        token_block = (torch.arange(s) // BLOCK).clamp(max=n - 1)
        sel = picked[..., token_block].repeat_interleave(REP, dim=1)  # (B, H, S, S)
        o_sel = F.scaled_dot_product_attention(q, k, v, attn_mask=sel, enable_gqa=True)
        i = torch.arange(s)
        near = (i[:, None] - i[None, :]).abs() <= WINDOW
        o_win = F.scaled_dot_product_attention(q, k, v, attn_mask=near, enable_gqa=True)
        g = torch.sigmoid(self.gate(x)).view(b, s, H, 3).transpose(1, 2)  # (B, H, S, 3)
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_sel + g[..., 2:3] * o_win
        return x + self.wo(o.transpose(1, 2).flatten(2))


def _attend_masked(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """One head: (S, Dh) x (T, Dh) x (T, Dh), ``keep`` (S, T) -> (S, Dh)."""
    s = (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class CompressedSparseNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CompressedSparseAttn(), CompressedSparseAttn()])

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x

    def reference(self, x: Tensor) -> Tensor:
        """Each head's vectors sliced from ``wqkv`` by hand; one T per role on them; every branch reads them."""
        sd = self.state_dict()
        bsz, s, _ = x.shape
        n = s // BLOCK
        i = torch.arange(s)
        near = (i[:, None] - i[None, :]).abs() <= WINDOW
        for li in range(len(self.blocks)):
            p = f"blocks.{li}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            y = lin(sd, f"{p}.wqkv", x).unflatten(-1, (KV, REP + 2, DH))  # (B, S, KV, REP + 2, Dh)
            gates = torch.sigmoid(lin(sd, f"{p}.gate", x)).unflatten(-1, (H, 3))  # (B, S, H, 3)

            def mlp(name: str, blocks: Tensor, p: str = p) -> Tensor:
                hidden = F.gelu(lin(sd, f"{p}.{name}.0", blocks))
                return lin(sd, f"{p}.{name}.2", hidden)

            out = torch.empty(bsz, s, H, DH)
            for bb in range(bsz):
                for g in range(KV):
                    k, v = t["k"](y[bb, :, g, REP]), t["v"](y[bb, :, g, REP + 1])  # (S, Dh)
                    kc = mlp("compress_k", k[: n * BLOCK].reshape(n, BLOCK * DH))  # (n, Dh)
                    vc = mlp("compress_v", v[: n * BLOCK].reshape(n, BLOCK * DH))
                    qs = [t["q"](y[bb, :, g, r]) for r in range(REP)]
                    p_cmp = [torch.softmax(q @ kc.T / math.sqrt(DH), dim=-1) for q in qs]  # (S, n) each
                    top = sum(p_cmp).topk(TOP, dim=-1).indices  # (S, TOP)
                    block_of = (i // BLOCK).clamp(max=n - 1)
                    sel = (block_of[None, None, :] == top[:, :, None]).any(1)  # (S, S)
                    for r, q in enumerate(qs):
                        h = g * REP + r
                        o = (
                            gates[bb, :, h, 0:1] * (p_cmp[r] @ vc)
                            + gates[bb, :, h, 1:2] * _attend_masked(q, k, v, sel)
                            + gates[bb, :, h, 2:3] * _attend_masked(q, k, v, near)
                        )
                        out[bb, :, h] = o
            x = x + lin(sd, f"{p}.wo", out.flatten(2))
        return x


# ---- forms 7 and 8: a single-head gated attention unit, shared q/k projection -------------------

DZ, DV = 16, 24  # the shared q/k width and the value width
MAX_LEN = 64


def laplace(s: Tensor, mu: float = math.sqrt(0.5), sigma: float = math.sqrt(0.25 / math.pi)) -> Tensor:
    """The Laplace attention function: 0.5 * (1 + erf((s - mu) / (sigma * sqrt(2))))."""
    return 0.5 * (1.0 + torch.erf((s - mu) / (sigma * math.sqrt(2.0))))


def relative_bias(table: Tensor, s: int) -> Tensor:
    """(S, S) bias ``table[MAX_LEN - 1 + j - i]`` for query i and key j."""
    i = torch.arange(s)
    return table[MAX_LEN - 1 + i[None, :] - i[:, None]]


class GatedUnit(nn.Module):
    """One head: z = silu(x W_z); q = z * g_q + b_q, k = z * g_k + b_k (``einsum``: both roles at once,
    ``z (B, S, Dz) x gamma (2, Dz) -> (B, S, 2, Dz)`` plus beta, unbound); v = silu(x W_v); ``fn`` over
    the scores (scaled by 1/S for Laplace) plus a relative position bias, zeroed (Laplace) or masked
    (softmax) above the diagonal."""

    fn = "laplace"
    einsum = True

    def __init__(self) -> None:
        super().__init__()
        self.z, self.v = nn.Linear(D, DZ), nn.Linear(D, DV)
        self.gamma = nn.Parameter(1 + 0.2 * torch.randn(2, DZ))
        self.beta = nn.Parameter(0.5 * torch.randn(2, DZ))
        self.rel = nn.Parameter(0.2 * torch.randn(2 * MAX_LEN - 1))
        self.o = nn.Linear(DV, D)

    def forward(self, x: Tensor) -> Tensor:
        s = x.shape[1]
        z = F.silu(self.z(x))  # (B, S, Dz): one projection and activation for q and k
        if self.einsum:
            q, k = (torch.einsum("bsd,hd->bshd", z, self.gamma) + self.beta).unbind(-2)
        else:
            q, k = z * self.gamma[0] + self.beta[0], z * self.gamma[1] + self.beta[1]
        v = F.silu(self.v(x))  # (B, S, Dv): a Linear, then an activation
        scale = 1 / s if self.fn == "laplace" else 1 / math.sqrt(DZ)
        scores = torch.einsum("bid,bjd->bij", q, k) * scale + relative_bias(self.rel, s)  # (B, S, S)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        if self.fn == "laplace":
            p = laplace(scores).masked_fill(future, 0.0)
        else:
            p = torch.softmax(scores.masked_fill(future, -torch.finfo(scores.dtype).max), dim=-1)
        return x + self.o(torch.einsum("bij,bjd->bid", p, v))


class SoftmaxGatedUnit(GatedUnit):
    fn = "softmax"


class ProductGatedUnit(GatedUnit):
    einsum = False


class GatedUnitNet(nn.Module):
    unit: type[GatedUnit] = GatedUnit

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.unit(), self.unit()])

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x

    def reference(self, x: Tensor) -> Tensor:
        """T^Q and T^K where q and k part (each role's head vector as the scores read it: after the
        shared activation and each role's scale and offset), T^V on the value projection's output
        before the activation."""
        sd = self.state_dict()
        s = x.shape[1]
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        for li in range(len(self.blocks)):
            p = f"blocks.{li}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            z = F.silu(lin(sd, f"{p}.z", x))
            gamma, beta = sd[f"{p}.gamma"], sd[f"{p}.beta"]
            q, k = t["q"](z * gamma[0] + beta[0]), t["k"](z * gamma[1] + beta[1])
            v = F.silu(t["v"](lin(sd, f"{p}.v", x)))
            scale = 1 / s if self.unit.fn == "laplace" else 1 / math.sqrt(DZ)
            scores = q @ k.transpose(-1, -2) * scale + relative_bias(sd[f"{p}.rel"], s)
            if self.unit.fn == "laplace":
                w = laplace(scores).masked_fill(future, 0.0)
            else:
                w = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            x = x + lin(sd, f"{p}.o", w @ v)
        return x


class SoftmaxGatedUnitNet(GatedUnitNet):
    unit = SoftmaxGatedUnit


class ProductGatedUnitNet(GatedUnitNet):
    unit = ProductGatedUnit


# ---- behaviour B: heads as separate modules with two-digit indices (11 or more heads) ---------


def many_heads_net(n: int) -> type[nn.Module]:
    """Two blocks of ``n`` heads as modules (``heads.0`` ... ``heads.{n-1}``), outputs concatenated."""

    class ManyHeadsBlock(HeadModulesBlock):
        def __init__(self) -> None:
            nn.Module.__init__(self)
            self.heads = nn.ModuleList([Head() for _ in range(n)])
            self.o = nn.Linear(n * DH, D)

    return type(f"Heads{n}Net", (HeadModulesNet,), {"block": ManyHeadsBlock})
