"""Attention forms of issue 34 that read scores another way, each with an independent per-head reference.

Like ``tests/forms_zoo_shared.py``: every model has ``reference(*inputs)``, its output computed from the
stored parameters head by head, with KHA as docs/method.md writes it at the place kha_compile puts it.

* Bidirectional cross-attention: ONE score matrix per head, from a query/key projection per side (or one
  projection run on both sides), read both ways: softmax over its last axis for a's tokens (b's values),
  over its first axis for b's tokens (a's values). T^Q and T^K are one transform T there
  (``docs/attention_forms.md``): the reference applies the block's one q transform to both sides, in both
  directions, and fails if the block holds a T^K of its own.
* Keys and values pooled over the sequence into a few "interests" by a learned softmax over the tokens,
  then scores of each query with each interest, normalised over the QUERY axis. The queries come from
  ``q``, the keys from ``k`` and the values from ``v`` (the pooling mixes tokens, not features), so KHA
  goes after those three, before the pooling.

Example::

    model = BidirNet()
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="linear"), example_args=(a, b))
    torch.testing.assert_close(model(a, b), model.reference(a, b))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from forms_zoo import DH, D, TwoBlocks, each, from_heads, kha_of, lin, split_heads, to_heads
from forms_zoo_more import shared_kha
from forms_zoo_shared import TwoWayNet

S, SB = 40, 48  # tokens of a and of b (more than d_model; unequal, so an axis read wrong fails)
INTERESTS = 3

# ---- 1. bidirectional cross-attention: one score matrix, a softmax over each of its axes ---------------


class BidirBlock(nn.Module):
    """``sim = einsum(qk_a(a), qk_b(b))`` once per head; a's tokens read b's values with ``sim.softmax(-1)``,
    b's tokens read a's values with ``sim.softmax(-2)`` (the same scores, the other axis)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk_a, self.qk_b, self.v_a, self.v_b, self.o_a, self.o_b = (nn.Linear(D, D) for _ in range(6))

    def sides(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        return to_heads(self.qk_a(a)), to_heads(self.qk_b(b))

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        qa, qb = self.sides(a, b)  # (B, H, S, Dh), (B, H, SB, Dh)
        sim = torch.einsum("bhid,bhjd->bhij", qa, qb) / math.sqrt(DH)  # one score matrix
        a_from_b = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), to_heads(self.v_b(b)))
        b_from_a = torch.einsum("bhij,bhid->bhjd", sim.softmax(dim=-2), to_heads(self.v_a(a)))
        return a + self.o_a(from_heads(a_from_b)), b + self.o_b(from_heads(b_from_a))


class BidirOneProjectionBlock(BidirBlock):
    """One query/key projection ``qk`` run on both sides, the attention written with matmuls: the
    reverse direction transposes the probabilities normalised over the first axis."""

    def __init__(self) -> None:
        super().__init__()
        del self.qk_a, self.qk_b
        self.qk = nn.Linear(D, D)

    def forward(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        qa, qb = to_heads(self.qk(a)), to_heads(self.qk(b))
        sim = qa @ qb.transpose(-1, -2) / math.sqrt(DH)  # (B, H, S, SB)
        a_from_b = sim.softmax(dim=-1) @ to_heads(self.v_b(b))
        b_from_a = sim.softmax(dim=-2).transpose(-1, -2) @ to_heads(self.v_a(a))
        return a + self.o_a(from_heads(a_from_b)), b + self.o_b(from_heads(b_from_a))


def one_transform(model: nn.Module, prefix: str) -> Callable[[Tensor], Tensor]:
    """The one transform of the queries and keys under ``prefix``: a T^Q, or a T^K where only k asked for
    it; fails when the block holds both (two transforms where the scores have room for one)."""
    held = {r for n, _ in model.named_parameters() for r in "qk" if n.startswith(f"{prefix}.") and f".kha.{r}." in n}
    assert len(held) <= 1, f"{prefix}: T^Q and T^K held apart, one transform expected"
    return shared_kha(model, held.pop() if held else "q", prefix)


def _softmax_rows(q: list[Tensor], k: list[Tensor], v: list[Tensor]) -> Tensor:
    """Per head: softmax over the keys of ``q_h k_h^T / sqrt(Dh)``, times ``v_h``; (B, Sq, H*Dh)."""
    return torch.cat(
        [torch.softmax(qh @ kh.transpose(-1, -2) / math.sqrt(DH), dim=-1) @ vh for qh, kh, vh in zip(q, k, v)], -1
    )


class BidirNet(TwoWayNet):
    """Two bidirectional blocks (``TwoWayNet``'s stream of a and b), with a reference of their own."""

    block: type[nn.Module] = BidirBlock

    def reference(self, a: Tensor, b: Tensor) -> Tensor:
        """Per direction, per head: the block's one T (its T^Q, or T^K, not both) on both sides' head vectors,
        so each direction's queries and keys carry T; each direction's T^V after its value projection."""
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            t = one_transform(self, p)
            if isinstance(self.blocks[i], BidirOneProjectionBlock):
                qa, qb = (each(t, split_heads(lin(sd, f"{p}.qk", x))) for x in (a, b))
            else:
                qa, qb = (each(t, split_heads(lin(sd, f"{p}.qk_{s}", x))) for s, x in (("a", a), ("b", b)))
            va = each(kha_of(self, "v", f"{p}.v_a"), split_heads(lin(sd, f"{p}.v_a", a)))
            vb = each(kha_of(self, "v", f"{p}.v_b"), split_heads(lin(sd, f"{p}.v_b", b)))
            a, b = (  # direction a <- b: a's queries, b's keys; direction b <- a: b's queries, a's keys
                a + lin(sd, f"{p}.o_a", _softmax_rows(qa, qb, vb)),
                b + lin(sd, f"{p}.o_b", _softmax_rows(qb, qa, va)),
            )
        return torch.cat([a, b], dim=1)


class BidirOneProjectionNet(BidirNet):
    block = BidirOneProjectionBlock


# ---- 2. keys and values pooled into interests, scores normalised over the queries ------------------------


class InterestPoolBlock(nn.Module):
    """Keys and values pooled over the sequence by learned softmax weights (``pool_k``, ``pool_v``: one
    logit per token and interest, softmax over the tokens), then each interest scored against every
    query and the scores normalised over the query axis; einsums with the interests first."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.pool_k, self.pool_v = nn.Linear(D, INTERESTS), nn.Linear(D, INTERESTS)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))  # (B, H, S, Dh)
        wk, wv = self.pool_k(x).softmax(dim=1), self.pool_v(x).softmax(dim=1)  # (B, S, I), over the tokens
        k_int = torch.einsum("bsi,bhsd->bhid", wk, k)  # (B, H, I, Dh)
        v_int = torch.einsum("bsi,bhsd->bhid", wv, v)
        p = (torch.einsum("bhid,bhqd->bhiq", k_int, q) / math.sqrt(DH)).softmax(dim=-1)  # over the queries
        return x + self.o(from_heads(torch.einsum("bhiq,bhid->bhqd", p, v_int)))


class InterestPoolMatmulBlock(InterestPoolBlock):
    """One pooling for keys and values, matmuls, scores (B, H, S, I) normalised over the queries (axis -2)."""

    def __init__(self) -> None:
        super().__init__()
        del self.pool_v

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        w = self.pool_k(x).softmax(dim=1)[:, None]  # (B, 1, S, I)
        k_int, v_int = w.transpose(-1, -2) @ k, w.transpose(-1, -2) @ v  # (B, H, I, Dh)
        p = (q @ k_int.transpose(-1, -2) / math.sqrt(DH)).softmax(dim=-2)
        return x + self.o(from_heads(p @ v_int))


class InterestPoolTransposedBlock(InterestPoolMatmulBlock):
    """Scores written interests first, (B, H, I, S) normalised over the queries (axis -1), the
    probabilities transposed for the value product."""

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        w = self.pool_k(x).softmax(dim=1)[:, None]
        k_int, v_int = w.transpose(-1, -2) @ k, w.transpose(-1, -2) @ v
        p = (k_int @ q.transpose(-1, -2) / math.sqrt(DH)).softmax(dim=-1)  # (B, H, I, S)
        return x + self.o(from_heads(p.transpose(-1, -2) @ v_int))


class InterestPoolNet(TwoBlocks):
    block = InterestPoolBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        """KHA on each token's q, k, v head vectors, then the pooling, then per head a softmax over the queries."""
        q, k, v = (each(kha_of(self, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", x))) for r in "qkv")
        wk = torch.softmax(lin(sd, f"{p}.pool_k", x), dim=1)  # (B, S, I)
        wv = wk if self.block is not InterestPoolBlock else torch.softmax(lin(sd, f"{p}.pool_v", x), dim=1)
        outs = []
        for qh, kh, vh in zip(q, k, v):  # (B, S, Dh) each
            k_int, v_int = wk.transpose(1, 2) @ kh, wv.transpose(1, 2) @ vh  # (B, I, Dh)
            probs = torch.softmax(qh @ k_int.transpose(1, 2) / math.sqrt(DH), dim=1)  # (B, S, I): over the queries
            outs.append(probs @ v_int)
        return x + lin(sd, f"{p}.o", torch.cat(outs, dim=-1))


class InterestPoolMatmulNet(InterestPoolNet):
    block = InterestPoolMatmulBlock


class InterestPoolTransposedNet(InterestPoolNet):
    block = InterestPoolTransposedBlock
