"""Attention forms that share, tie or compress (issue 28), each with an independent per-head reference.

Like ``tests/forms_zoo.py`` and ``tests/forms_zoo_more.py``: every model has ``reference(*inputs)``,
its output computed from the stored parameters head by head, with KHA as docs/method.md writes it at
the place kha_compile puts it: after the projection, or, where two roles read the same features of
one projection, on the attention call's argument of each role (``docs/attention_forms.md``).
``shared_kha`` fails when a block holds two transforms of one role.

Example::

    model = TwoWayNet()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(a, b))
    torch.testing.assert_close(model(a, b), model.reference(a, b))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import forms_zoo_more as fm
from forms_zoo import DH, D, H, TwoBlocks, attend, each, from_heads, kha_of, lin, split_heads, to_heads
from forms_zoo_more import shared_kha

S = 40  # tokens (more than d_model); Linformer's compression is built for this length
R = 3  # rows of an alignment (tied row attention)

# ---- 1. one projection called on both inputs of a two-way cross-attention ----------------------


class TwoWayBlock(nn.Module):
    """Two-way cross-attention with one query/key projection ``qk`` run on both inputs: the queries of
    ``a``'s direction and the keys of ``b``'s come from ``qk(a)``, and the other way round. ``einsum``:
    the attention written with einsums, so ``qk(a)`` is an operand of both directions' score products."""

    einsum = False

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.v_a, self.v_b, self.o_a, self.o_b = (nn.Linear(D, D) for _ in range(5))

    def attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not self.einsum:
            return F.scaled_dot_product_attention(q, k, v)
        p = torch.einsum("bhid,bhjd->bhij", q, k).div(math.sqrt(DH)).softmax(-1)
        return torch.einsum("bhij,bhjd->bhid", p, v)

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        qa, qb = to_heads(self.qk(a)), to_heads(self.qk(b))  # (B, H, S, Dh): two calls of one module
        a_from_b = self.attend(qa, qb, to_heads(self.v_b(b)))
        b_from_a = self.attend(qb, qa, to_heads(self.v_a(a)))
        return a + self.o_a(from_heads(a_from_b)), b + self.o_b(from_heads(b_from_a))


class TwoWayEinsumBlock(TwoWayBlock):
    einsum = True


class TwoWayNet(nn.Module):
    block: type[nn.Module] = TwoWayBlock

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.block(), self.block()])

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        for blk in self.blocks:
            a, b = blk(a, b)
        return torch.cat([a, b], dim=1)

    def reference(self, a: Tensor, b: Tensor) -> Tensor:
        """T^Q on the queries and T^K on the keys of both directions (one each per block, on the
        attention arguments), each direction's T^V after its own value projection."""
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            tq, tk = shared_kha(self, "q", p), shared_kha(self, "k", p)
            qa, qb = (split_heads(lin(sd, f"{p}.qk", t)) for t in (a, b))
            va = each(kha_of(self, "v", f"{p}.v_a"), split_heads(lin(sd, f"{p}.v_a", a)))
            vb = each(kha_of(self, "v", f"{p}.v_b"), split_heads(lin(sd, f"{p}.v_b", b)))
            a, b = (
                a + lin(sd, f"{p}.o_a", attend(each(tq, qa), each(tk, qb), vb)),
                b + lin(sd, f"{p}.o_b", attend(each(tq, qb), each(tk, qa), va)),
            )
        return torch.cat([a, b], dim=1)


class TwoWayEinsumNet(TwoWayNet):
    block = TwoWayEinsumBlock


class HalfSkippedTwoWay(nn.Module):
    """Two directions that meet in one projection ``p``: ``p(a)`` is the queries of ``a``'s direction and
    the keys of ``b``'s. ``b``'s direction reads ``a`` itself as values (no projection), so it is a
    skipped site: its keys must stay untouched by ``a``'s T^Q."""

    def __init__(self) -> None:
        super().__init__()
        self.p, self.k_b, self.v_b, self.q_b = (nn.Linear(D, D) for _ in range(4))

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        pa = to_heads(self.p(a))
        a_from_b = F.scaled_dot_product_attention(pa, to_heads(self.k_b(b)), to_heads(self.v_b(b)))
        b_from_a = F.scaled_dot_product_attention(to_heads(self.q_b(b)), pa, to_heads(a))
        return torch.cat([from_heads(a_from_b), from_heads(b_from_a)], dim=1)

    def reference(self, a: Tensor, b: Tensor) -> Tensor:
        """KHA on ``a``'s direction only (T^Q on its query argument), ``b``'s direction as without KHA."""
        sd = self.state_dict()
        pa = split_heads(lin(sd, "p", a))
        k, v = (each(kha_of(self, r, f"{r}_b"), split_heads(lin(sd, f"{r}_b", b))) for r in "kv")
        a_from_b = attend(each(kha_of(self, "q", ""), pa), k, v)
        return torch.cat([a_from_b, attend(split_heads(lin(sd, "q_b", b)), pa, split_heads(a))], dim=1)


# ---- 2. shared-QK attention: one projection read as queries and keys ---------------------------


class SharedQKBlock(nn.Module):
    """Shared-QK attention (Reformer's shared query-key space, without LSH): ``qk`` gives queries and
    keys. ``manual``: written with einsums, ``qk`` at both operands of the scores, each token's score
    with itself masked (as Reformer does)."""

    manual = False

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.v, self.o = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        qk, v = to_heads(self.qk(x)), to_heads(self.v(x))  # (B, H, S, Dh)
        if not self.manual:
            return x + self.o(from_heads(F.scaled_dot_product_attention(qk, qk, v)))
        scores = torch.einsum("bhid,bhjd->bhij", qk, qk) / math.sqrt(DH) + _self_mask(x.shape[1])
        return x + self.o(from_heads(torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)))


def _self_mask(n: int) -> Tensor:
    """(n, n): a large negative score on the diagonal (a token does not attend to itself)."""
    return torch.eye(n) * -1e4


class SharedQKManualBlock(SharedQKBlock):
    manual = True


class SharedQKNet(TwoBlocks):
    block = SharedQKBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        """T^Q and T^K on the attention's query and key arguments, both read from ``qk``."""
        qk = split_heads(lin(sd, f"{p}.qk", x))
        v = each(kha_of(self, "v", f"{p}.v"), split_heads(lin(sd, f"{p}.v", x)))
        q, k = each(shared_kha(self, "q", p), qk), each(shared_kha(self, "k", p), qk)
        return x + lin(sd, f"{p}.o", attend(q, k, v, _self_mask(x.shape[1]) if self.block.manual else None))


class SharedQKManualNet(SharedQKNet):
    block = SharedQKManualBlock


class SharedQKGraphLayer(nn.Module):
    """Graph attention whose queries and keys are one projection's features: the score is a product of
    gathers (no attention call to put T^Q and T^K on), so the site is skipped with the reason."""

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.v, self.o = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index
        n = x.shape[0]
        qk, v = self.qk(x).view(n, H, DH), self.v(x).view(n, H, DH)
        alpha = fm.segment_softmax((qk[dst] * qk[src]).sum(-1) / math.sqrt(DH), dst, n)
        return x + self.o(torch.zeros(n, H, DH).index_add(0, dst, v[src] * alpha[..., None]).view(n, D))


class SharedQKGraphNet(fm.GraphAttnNet):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([SharedQKGraphLayer(), SharedQKGraphLayer()])


# ---- 3. tied row attention over an alignment: scores summed over the rows ------------------------


class TiedRowBlock(nn.Module):
    """ESM-MSA / AlphaFold tied row attention over (B, R, C, D): one attention map per head for all
    R rows, ``einsum("brihd,brjhd->bhij")`` contracting the rows with the head dim."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (m(x).unflatten(-1, (H, DH)) for m in (self.q, self.k, self.v))  # (B, R, C, H, Dh)
        scores = torch.einsum("brihd,brjhd->bhij", q, k) / math.sqrt(DH * x.shape[1])
        o = torch.einsum("bhij,brjhd->brihd", scores.softmax(-1), v)
        return x + self.o(o.flatten(-2))


class TiedRowNet(TwoBlocks):
    block = TiedRowBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        """Per head: the rows' head vectors side by side, (B, C, R*Dh), one score matrix for all rows."""
        q, k, v = (each(kha_of(self, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", x))) for r in "qkv")
        outs = []
        for qh, kh, vh in zip(q, k, v):  # (B, R, C, Dh) each
            wide_q, wide_k = (t.transpose(1, 2).flatten(2) for t in (qh, kh))  # (B, C, R*Dh)
            probs = torch.softmax(wide_q @ wide_k.transpose(-1, -2) / math.sqrt(DH * x.shape[1]), dim=-1)
            outs.append(probs[:, None] @ vh)  # (B, R, C, Dh)
        return x + lin(sd, f"{p}.o", torch.cat(outs, dim=-1))


# ---- 4. Linformer: keys and values compressed along the sequence before the head split ------------


class LinformerBlock(nn.Module):
    """Keys compressed by an ``nn.Linear`` over the token axis (``E``, to Dh tokens: the same width as a
    head), values by a matmul with a parameter (``F @ V``); then the head split and SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.E = nn.Linear(S, DH)
        self.F = nn.Parameter(torch.randn(DH, S) / math.sqrt(S))

    def forward(self, x: Tensor) -> Tensor:
        k = self.E(self.k(x).transpose(1, 2)).transpose(1, 2)  # (B, Dh, D): Dh compressed tokens
        v = torch.matmul(self.F, self.v(x))  # (B, Dh, D)
        return x + self.o(from_heads(F.scaled_dot_product_attention(to_heads(self.q(x)), to_heads(k), to_heads(v))))


class LinformerNet(TwoBlocks):
    block = LinformerBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        """KHA after each projection, then the compression of each head's tokens."""
        q, k, v = (each(kha_of(self, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", x))) for r in "qkv")
        k = [lin(sd, f"{p}.E", h.transpose(1, 2)).transpose(1, 2) for h in k]  # (B, Dh tokens, Dh)
        v = [sd[f"{p}.F"] @ h for h in v]
        return x + lin(sd, f"{p}.o", attend(q, k, v))


class PerChannelBlock(nn.Module):
    """Keys and values compressed along the sequence with a kernel per channel (a fixed weight per
    feature): a shared transform of the features does not commute with it, so the walk stops there
    and says where."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.register_buffer("kernel", torch.rand(DH, S, D) / S)  # (compressed tokens, tokens, features)

    def forward(self, x: Tensor) -> Tensor:
        k = torch.einsum("bnd,mnd->bmd", self.k(x), self.kernel)  # (B, Dh, D): each feature its own weights
        v = torch.einsum("bnd,mnd->bmd", self.v(x), self.kernel)
        return x + self.o(from_heads(F.scaled_dot_product_attention(*(to_heads(t) for t in (self.q(x), k, v)))))


class PerChannelNet(TwoBlocks):
    block = PerChannelBlock


# ---- 5. heads as separate modules, 12 of them; graph attention written key-first -----------------

HEADS = 12


class TwelveHeadsBlock(fm.HeadModulesBlock):
    """``heads.0`` ... ``heads.11``: two-digit list indices."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.heads = nn.ModuleList([fm.Head() for _ in range(HEADS)])
        self.o = nn.Linear(HEADS * DH, D)


class TwelveHeadsNet(fm.HeadModulesNet):
    """One block of twelve heads (the per-head reference of ``HeadModulesNet``)."""

    block = TwelveHeadsBlock

    def __init__(self) -> None:
        super().__init__()
        del self.blocks[1]


class OrderedGraphLayer(fm.GraphAttnLayer):
    """PyG-style message passing with the score written ``(k[src] * q[dst])`` (``key_first``) or the
    other way round, the edge index read again at each use (``edge_index[1]``, not one ``dst``)."""

    key_first = True

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = (m(x).view(n, H, DH) for m in (self.q, self.k, self.v))  # (N, H, Dh)
        qe, ke = q[edge_index[1]], k[edge_index[0]]
        score = (ke * qe).sum(-1) if self.key_first else (qe * ke).sum(-1)
        alpha = fm.segment_softmax(score / math.sqrt(DH), edge_index[1], n)
        out = torch.zeros(n, H, DH).index_add(0, edge_index[1], v[edge_index[0]] * alpha[..., None])
        return x + self.o(out.view(n, D))


class QueryFirstGraphLayer(OrderedGraphLayer):
    key_first = False


class KeyFirstGraphNet(fm.GraphAttnNet):
    layer: type[nn.Module] = OrderedGraphLayer

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([self.layer(), self.layer()])


class QueryFirstGraphNet(KeyFirstGraphNet):
    layer = QueryFirstGraphLayer
