"""Attention forms from code nobody here wrote, each with an independent per-head reference.

Every model has ``reference(*inputs)``: its output computed from the stored parameters
(``state_dict``), head by head, with the KHA transforms applied to each head vector as
docs/method.md writes them (:func:`kha_of`). The reference never runs the model's attention modules;
helpers here (rope, the per-head attention) are plain functions of tensors.

Example::

    model = ZipNet()
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    torch.testing.assert_close(model(x), model.reference(x))
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from projection_reference import spec_transform

D, H = 32, 4
DH = D // H
B, S = 2, 40  # more tokens than d_model: the token-side strategy runs


# ---- reference primitives -------------------------------------------------------------------


def kha_of(model: nn.Module, role: str, *homes: str) -> Callable[[Tensor], Tensor]:
    """The spec transform of ``role`` registered at the first of ``homes`` carrying one (identity if none)."""
    for home in homes:
        pre = f"{home}.kha.{role}." if home else f"kha.{role}."
        params = {n[len(pre) :]: p.detach() for n, p in model.named_parameters() if n.startswith(pre)}
        if params:
            return spec_transform(params)
    return lambda h: h


def lin(sd: dict, name: str, x: Tensor) -> Tensor:
    return F.linear(x, sd[f"{name}.weight"], sd.get(f"{name}.bias"))


def split_heads(y: Tensor, n: int = H) -> list[Tensor]:
    """(..., S, n*Dh) -> n tensors (..., S, Dh)."""
    return list(y.unflatten(-1, (n, -1)).unbind(-2))


def each(t: Callable[[Tensor], Tensor], heads: list[Tensor]) -> list[Tensor]:
    return [t(h) for h in heads]


def attend(q: list[Tensor], k: list[Tensor], v: list[Tensor], bias: Tensor | None = None) -> Tensor:
    """Softmax attention head by head (GQA by integer division); (..., Sq, n*Dh)."""
    group = len(q) // len(k)
    out = []
    for h, qh in enumerate(q):
        s = qh @ k[h // group].transpose(-1, -2) / math.sqrt(qh.shape[-1])
        if bias is not None:
            s = s + bias
        out.append(torch.softmax(s, dim=-1) @ v[h // group])
    return torch.cat(out, dim=-1)


def rope(x: Tensor) -> Tensor:
    """Rotary embedding over (..., S, Dh) (rotate-half form)."""
    d, n = x.shape[-1] // 2, x.shape[-2]
    t = torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(d)[None] / d
    c, s = t.cos(), t.sin()
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def to_heads(y: Tensor, n: int = H) -> Tensor:
    """(B, S, n*Dh) -> (B, n, S, Dh)."""
    return y.unflatten(-1, (n, -1)).transpose(1, 2)


def from_heads(o: Tensor) -> Tensor:
    """(B, n, S, Dh) -> (B, S, n*Dh)."""
    return o.transpose(1, 2).flatten(2)


def _mha_ref(model: nn.Module, p: str, x: Tensor, ctx: Tensor | None = None) -> Tensor:
    """Reference of :class:`SelfAttn` at path ``p``: x + o(attention(q(x), k(c), v(c)))."""
    sd = model.state_dict()
    c = x if ctx is None else ctx
    q, k, v = (
        each(kha_of(model, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", inp)))
        for r, inp in (("q", x), ("k", c), ("v", c))
    )
    return x + lin(sd, f"{p}.o", attend(q, k, v))


class TwoBlocks(nn.Module):
    """Two blocks of ``block`` in a row; extra inputs (positions, a context) go to each block."""

    block: type[nn.Module]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.block(), self.block()])

    def forward(self, x: Tensor, *extra: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x, *extra)
        return x

    def reference(self, x: Tensor, *extra: Tensor) -> Tensor:
        """The per-head reference computed from the state dict, block by block."""
        sd = self.state_dict()
        for i in range(len(self.blocks)):
            x = self.block_reference(sd, f"blocks.{i}", x, *extra)
        return x

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor, *extra: Tensor) -> Tensor:
        """The reference of the block named ``p`` (``blocks.0``, ...)."""
        raise NotImplementedError


class SelfAttn(nn.Module):
    """Separate q/k/v/o linears and SDPA, with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))  # (B, H, S, Dh)
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v)))


# ---- 1. a block a representative did not run: zip(attentions, resnets[1:]) -----------------


class Res(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.relu(self.lin(x))


class ZipBlock(nn.Module):
    """Two alike resnets and one attention: ``for attn, res in zip(attentions, resnets[1:])``."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(), Res()])
        self.attentions = nn.ModuleList([SelfAttn()])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        for attn, res in zip(self.attentions, self.resnets[1:]):
            x = res(attn(x))
        return x


class ZipNet(TwoBlocks):
    block = ZipBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        x = x + torch.relu(lin(sd, f"{p}.resnets.0.lin", x))
        x = _mha_ref(self, f"{p}.attentions.0", x)
        x = x + torch.relu(lin(sd, f"{p}.resnets.1.lin", x))
        return x


# ---- 2. joint streams: text and image tokens concatenated along the sequence ----------------


class JointBlock(nn.Module):
    """Fused qkv for text, separate q/k/v for image; cat along the sequence, QK-norm, RoPE, SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.txt_qkv = nn.Linear(D, 3 * D)
        self.img_q, self.img_k, self.img_v = (nn.Linear(D, D) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(DH), nn.RMSNorm(DH)
        with torch.no_grad():
            self.norm_q.weight.uniform_(0.5, 1.5)
            self.norm_k.weight.uniform_(0.5, 1.5)
        self.o_txt, self.o_img = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, txt: Tensor, img: Tensor) -> tuple[Tensor, Tensor]:
        b, st, _ = txt.shape
        tq, tk, tv = self.txt_qkv(txt).view(b, st, 3, H, DH).unbind(2)  # (B, St, H, Dh) each
        iq, ik, iv = (m(img).unflatten(-1, (H, DH)) for m in (self.img_q, self.img_k, self.img_v))
        q, k, v = (torch.cat(pair, dim=1) for pair in ((tq, iq), (tk, ik), (tv, iv)))  # (B, S, H, Dh)
        q = rope(self.norm_q(q).transpose(1, 2))
        k = rope(self.norm_k(k).transpose(1, 2))
        o = from_heads(F.scaled_dot_product_attention(q, k, v.transpose(1, 2)))
        return txt + self.o_txt(o[:, :st]), img + self.o_img(o[:, st:])


class JointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([JointBlock(), JointBlock()])

    def forward(self, txt: Tensor, img: Tensor) -> Tensor:
        for b in self.blocks:
            txt, img = b(txt, img)
        return torch.cat([txt, img], dim=1)

    def reference(self, txt: Tensor, img: Tensor) -> Tensor:
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            t = lin(sd, f"{p}.txt_qkv", txt).unflatten(-1, (3, H, DH))  # (B, St, 3, H, Dh)
            roles = {}
            for j, r in enumerate("qkv"):
                tf = kha_of(self, r, f"{p}.txt_qkv", f"{p}.img_{r}")
                mine = [tf(t[..., j, h, :]) for h in range(H)]
                theirs = each(tf, split_heads(lin(sd, f"{p}.img_{r}", img)))
                roles[r] = [torch.cat([a, c], dim=-2) for a, c in zip(mine, theirs)]  # (B, S, Dh)
            for r in "qk":
                w = sd[f"{p}.norm_{r}.weight"]
                roles[r] = [rope(F.rms_norm(h, (DH,), w)) for h in roles[r]]
            o = attend(roles["q"], roles["k"], roles["v"])
            st = txt.shape[1]
            txt, img = txt + lin(sd, f"{p}.o_txt", o[:, :st]), img + lin(sd, f"{p}.o_img", o[:, st:])
        return torch.cat([txt, img], dim=1)


# ---- 3. q and k sums of two projections; 4. merged self- and cross-attention -----------------


class SumBlock(nn.Module):
    """q = Wa x + Wb pos, k = Wc x + Wd pos (a learned position term added before the head split)."""

    def __init__(self) -> None:
        super().__init__()
        self.qa, self.qb, self.ka, self.kb, self.v, self.o = (nn.Linear(D, D) for _ in range(6))

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        q = to_heads(self.qa(x) + self.qb(pos))
        k = to_heads(self.ka(x) + self.kb(pos))
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, to_heads(self.v(x)))))


class SumNet(TwoBlocks):
    block = SumBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor, pos: Tensor) -> Tensor:
        tq, tk = kha_of(self, "q", f"{p}.qa", f"{p}.qb"), kha_of(self, "k", f"{p}.ka", f"{p}.kb")
        q = each(tq, split_heads(lin(sd, f"{p}.qa", x) + lin(sd, f"{p}.qb", pos)))
        k = each(tk, split_heads(lin(sd, f"{p}.ka", x) + lin(sd, f"{p}.kb", pos)))
        v = each(kha_of(self, "v", f"{p}.v"), split_heads(lin(sd, f"{p}.v", x)))
        x = x + lin(sd, f"{p}.o", attend(q, k, v))
        return x


class SumV(nn.Module):
    """v = Wa x + Wb pos: linear KHA after each is exact, MLP-value is not (skipped with the reason)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.va, self.vb = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        q, k, v = to_heads(self.q(x)), to_heads(self.k(x)), to_heads(self.va(x) + self.vb(pos))
        return from_heads(F.scaled_dot_product_attention(q, k, v))


class SelfCrossBlock(nn.Module):
    """Keys and values of both sources concatenated along the key axis: [self | cross]."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.k_ctx, self.v_ctx, self.o = (nn.Linear(D, D) for _ in range(6))

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        q = to_heads(self.q(x))
        k = torch.cat([to_heads(self.k(x)), to_heads(self.k_ctx(ctx))], dim=2)  # (B, H, S + C, Dh)
        v = torch.cat([to_heads(self.v(x)), to_heads(self.v_ctx(ctx))], dim=2)
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v)))


class SelfCrossNet(TwoBlocks):
    block = SelfCrossBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor, ctx: Tensor) -> Tensor:
        q = each(kha_of(self, "q", f"{p}.q"), split_heads(lin(sd, f"{p}.q", x)))
        kv = {}
        for r in "kv":
            t = kha_of(self, r, f"{p}.{r}", f"{p}.{r}_ctx")
            own, other = split_heads(lin(sd, f"{p}.{r}", x)), split_heads(lin(sd, f"{p}.{r}_ctx", ctx))
            kv[r] = [torch.cat([t(a), t(c)], dim=-2) for a, c in zip(own, other)]
        x = x + lin(sd, f"{p}.o", attend(q, kv["k"], kv["v"]))
        return x


# ---- 5. talking heads (einsum everywhere); 6. a learned query token -------------------------


class TalkingBlock(nn.Module):
    """Heads mixed by (H, H) parameters before and after the softmax (Shazeer et al. 2020)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.pre = nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H))
        self.post = nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, H, DH)).unbind(2)  # (B, S, H, Dh)
        s = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(DH)
        s = torch.einsum("bhij,hg->bgij", s, self.pre)
        p = torch.einsum("bhij,hg->bgij", s.softmax(-1), self.post)
        return x + self.o(torch.einsum("bhij,bjhd->bihd", p, v).flatten(2))


class TalkingNet(TwoBlocks):
    block = TalkingBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        t = lin(sd, f"{p}.qkv", x).unflatten(-1, (3, H, DH))
        q, k, v = ([kha_of(self, r, f"{p}.qkv")(t[..., j, h, :]) for h in range(H)] for j, r in enumerate("qkv"))
        pre, post = sd[f"{p}.pre"], sd[f"{p}.post"]
        scores = [q[h] @ k[h].transpose(-1, -2) / math.sqrt(DH) for h in range(H)]
        mixed = [sum(pre[h, g] * scores[h] for h in range(H)) for g in range(H)]
        probs = [torch.softmax(m, dim=-1) for m in mixed]
        mixed_p = [sum(post[h, g] * probs[h] for h in range(H)) for g in range(H)]
        x = x + lin(sd, f"{p}.o", torch.cat([mixed_p[g] @ v[g] for g in range(H)], dim=-1))
        return x


class ClassAttnBlock(nn.Module):
    """CaiT-style class attention: q projects a learned token expanded over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        c = self.cls.expand(x.shape[0], -1, -1)  # (B, 1, D)
        q, k, v = to_heads(self.q(c)), to_heads(self.k(x)), to_heads(self.v(x))
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v)))  # broadcast over tokens


class ClassAttnNet(TwoBlocks):
    block = ClassAttnBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        c = sd[f"{p}.cls"].expand(x.shape[0], -1, -1)
        q, k, v = (
            each(kha_of(self, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", inp)))
            for r, inp in (("q", c), ("k", x), ("v", x))
        )
        x = x + lin(sd, f"{p}.o", attend(q, k, v))
        return x


# ---- 7. RoPE in an autocast-off region, a block under no_grad (wrapping higher-order ops) ----


class AutocastBlock(SelfAttn):
    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        with torch.autocast("cpu", enabled=False):
            q, k = rope(q.float()), rope(k.float())
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v)))


class RegionsNet(nn.Module):
    """The first block runs under ``torch.no_grad()``, RoPE under ``autocast(enabled=False)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = AutocastBlock(), AutocastBlock()

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            x = self.a(x)
        return self.b(x)

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        for p in "ab":
            q, k, v = (each(kha_of(self, r, f"{p}.{r}"), split_heads(lin(sd, f"{p}.{r}", x))) for r in "qkv")
            x = x + lin(sd, f"{p}.o", attend([rope(h) for h in q], [rope(h) for h in k], v))
        return x


# ---- 8. a class whose bases put an ABC first ---------------------------------------------


class AttnBase(abc.ABC, nn.Module):
    def __init__(self) -> None:
        nn.Module.__init__(self)

    @abc.abstractmethod
    def heads(self) -> int: ...


class ABCAttn(AttnBase):
    """Functional fused qkv (a bare parameter) in a class whose primary base is ``abc.ABC``."""

    def __init__(self) -> None:
        super().__init__()
        self.w_qkv = nn.Parameter(torch.randn(3 * D, D) / math.sqrt(D))
        self.o = nn.Linear(D, D)

    def heads(self) -> int:
        return H

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = F.linear(x, self.w_qkv).unflatten(-1, (3, self.heads(), DH)).permute(2, 0, 3, 1, 4)
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v)))


class ABCLinear(abc.ABC, nn.Linear):
    """A projection class with an ABC first among its bases."""


class ABCNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = ABCAttn()
        self.b = SelfAttn()
        for r in "qkv":  # module projections of an ABC-first class
            setattr(self.b, r, ABCLinear(D, D))

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        t = F.linear(x, sd["a.w_qkv"]).unflatten(-1, (3, H, DH))
        q, k, v = ([kha_of(self, r, "a")(t[..., j, h, :]) for h in range(H)] for j, r in enumerate("qkv"))
        x = x + lin(sd, "a.o", attend(q, k, v))
        return _mha_ref(self, "b", x)


# ---- 9. flex_attention with a BlockMask passed in, fused qkv, complex RoPE --------------------


def rope_cis(n: int) -> Tensor:
    """Complex rotary factors (S, Dh/2), the Llama-2 reference code's ``freqs_cis``."""
    f = 1.0 / (10000 ** (torch.arange(0, DH, 2).float() / DH))
    return torch.polar(torch.ones(n, DH // 2), torch.outer(torch.arange(n).float(), f))


def apply_cis(x: Tensor, cis: Tensor) -> Tensor:
    """x (B, S, H, Dh) rotated by cis (B, S, Dh/2), as complex numbers."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * cis[:, :, None, :]).flatten(3).type_as(x)


class FlexLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x: Tensor, cis: Tensor, mask) -> Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        q, k, v = (t.unflatten(-1, (H, DH)) for t in self.wqkv(x).split([D, D, D], -1))  # (B, S, H, Dh)
        q, k = apply_cis(q, cis), apply_cis(k, cis)
        o = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask)
        return x + self.wo(from_heads(o))


class FlexLlama(nn.Module):
    """tokens, positions and a BlockMask built outside the model (gpt-fast / torchtitan style)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.layers = nn.ModuleList([FlexLayer(), FlexLayer()])
        self.register_buffer("cis", rope_cis(64), persistent=False)

    def forward(self, tokens: Tensor, input_pos: Tensor, mask) -> Tensor:
        x, cis = self.emb(tokens), self.cis[input_pos]
        for layer in self.layers:
            x = layer(x, cis, mask)
        return x

    def reference(self, tokens: Tensor, input_pos: Tensor, mask) -> Tensor:
        sd = self.state_dict()
        x, cis = F.embedding(tokens, sd["emb.weight"]), rope_cis(64)[input_pos]
        n = tokens.shape[1]
        causal = torch.full((n, n), float("-inf")).triu(1)
        for i in range(2):
            p = f"layers.{i}"
            y = F.linear(x, sd[f"{p}.wqkv.weight"]).split([D, D, D], -1)
            roles = {}
            for r, t in zip("qkv", y):
                hv = t.unflatten(-1, (H, DH))  # (B, S, H, Dh)
                hv = torch.stack([kha_of(self, r, f"{p}.wqkv")(hv[:, :, h]) for h in range(H)], dim=2)
                roles[r] = hv if r == "v" else apply_cis(hv, cis)
            heads = {r: list(t.unbind(2)) for r, t in roles.items()}
            x = x + F.linear(attend(heads["q"], heads["k"], heads["v"], causal), sd[f"{p}.wo.weight"])
        return x


def causal_block_mask(n: int):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, n, n, device="cpu")


# ---- 10. a model torch.export cannot trace whole ---------------------------------------------


class Experts(nn.Module):
    """Top-1 MoE with a loop over the experts that were hit and a router cast inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 2, bias=False)
        self.experts = nn.ModuleList([nn.Linear(D, D), nn.Linear(D, D)])

    def forward(self, x: Tensor) -> Tensor:
        self.router = self.router.to(x.dtype)  # nllb-moe / switch-transformers do this
        choice = self.router(x).argmax(-1)  # (B, S)
        out = torch.zeros_like(x)
        for e in choice.unique().tolist():  # data-dependent: the experts that were hit
            hit = choice == e
            out[hit] = self.experts[e](x[hit])
        return x + out


class UntraceableLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.moe = SelfAttnMasked(), Experts()

    def forward(self, x: Tensor, pad: Tensor | None) -> Tensor:
        return self.moe(self.attn(x, pad))


class SelfAttnMasked(SelfAttn):
    def forward(self, x: Tensor, pad: Tensor | None = None) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        mask = None if pad is None else ~pad[:, None, None, :]  # (B, 1, 1, S): keys that are not padding
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class Untraceable(nn.Module):
    """``if not pad.any(): pad = None`` (ESM-2, FSMT) and MoE layers torch.export refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, D)
        self.layers = nn.ModuleList([UntraceableLayer(), UntraceableLayer()])

    def forward(self, tokens: Tensor) -> Tensor:
        pad = tokens.eq(0)
        if not pad.any():
            pad = None
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x, pad)
        return x

    def reference(self, tokens: Tensor) -> Tensor:
        sd = self.state_dict()
        pad = tokens.eq(0)
        bias = torch.zeros(pad.shape, dtype=torch.float32).masked_fill(pad, float("-inf"))[:, None, :]  # (B, 1, S)
        x = F.embedding(tokens, sd["emb.weight"])
        for i in range(2):
            p = f"layers.{i}"
            q, k, v = (each(kha_of(self, r, f"{p}.attn.{r}"), split_heads(lin(sd, f"{p}.attn.{r}", x))) for r in "qkv")
            x = x + lin(sd, f"{p}.attn.o", attend(q, k, v, bias))
            choice = F.linear(x, sd[f"{p}.moe.router.weight"]).argmax(-1)
            expert = torch.stack([lin(sd, f"{p}.moe.experts.{e}", x) for e in range(2)], dim=-2)  # (B, S, 2, D)
            x = x + expert.gather(-2, choice[..., None, None].expand(-1, -1, 1, D)).squeeze(-2)
        return x


# ---- 11. pointwise Conv1d projections in (B, C, T) -------------------------------------------


class ConvBlock(nn.Module):
    """Audio / diffusion style: qkv and out are 1x1 Conv1d over (B, C, T); heads merged with batch."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Conv1d(D, 3 * D, 1), nn.Conv1d(D, D, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, c, t = x.shape
        q, k, v = self.qkv(x).reshape(b * H, 3 * DH, t).split(DH, dim=1)  # (B*H, Dh, T)
        w = torch.softmax(torch.einsum("bct,bcs->bts", q, k) / math.sqrt(DH), dim=-1)
        return x + self.o(torch.einsum("bts,bcs->bct", w, v).reshape(b, c, t))


class ConvNet(TwoBlocks):
    block = ConvBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        xt = x.transpose(1, 2)  # (B, T, C)
        w, bias = sd[f"{p}.qkv.weight"][..., 0], sd[f"{p}.qkv.bias"]  # (3D, D): per head [q | k | v]
        y = F.linear(xt, w, bias).unflatten(-1, (H, 3, DH))  # channel = h * 3Dh + role * Dh + j
        q, k, v = ([kha_of(self, r, f"{p}.qkv")(y[..., h, j, :]) for h in range(H)] for j, r in enumerate("qkv"))
        o = attend(q, k, v)  # (B, T, D)
        x = x + F.linear(o, sd[f"{p}.o.weight"][..., 0], sd[f"{p}.o.bias"]).transpose(1, 2)
        return x


# ---- 12. block-local attention plus global tokens (LongT5 transient-global style) -------------

BLOCK = 8


class LocalGlobalBlock(SelfAttn):
    """Each block of 8 tokens attends to itself and to one global token per block (the block means);
    the global tokens go through the same k and v projections, joined along the key axis."""

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        nb = s // BLOCK
        side = x.view(b, nb, BLOCK, D).mean(2)  # (B, nb, D)
        q = self.q(x).view(b, nb, BLOCK, H, DH)
        k, v = (
            torch.cat([m(x).view(b, nb, BLOCK, H, DH), m(side).view(b, 1, nb, H, DH).expand(b, nb, nb, H, DH)], dim=2)
            for m in (self.k, self.v)
        )  # (B, nb, BLOCK + nb, H, Dh)
        p = torch.softmax(torch.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(DH), dim=-1)
        return x + self.o(torch.einsum("...hqk,...khd->...qhd", p, v).reshape(b, s, D))


class LocalGlobalNet(TwoBlocks):
    block = LocalGlobalBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        nb = s // BLOCK
        side = x.view(b, nb, BLOCK, D).mean(2)
        blocks = x.view(b, nb, BLOCK, D)
        q = each(kha_of(self, "q", f"{p}.q"), split_heads(lin(sd, f"{p}.q", blocks)))  # (B, nb, BLOCK, Dh)
        kv = {}
        for r in "kv":
            t = kha_of(self, r, f"{p}.{r}")
            loc, glob = split_heads(lin(sd, f"{p}.{r}", blocks)), split_heads(lin(sd, f"{p}.{r}", side))
            kv[r] = [torch.cat([t(a), t(g)[:, None].expand(b, nb, nb, DH)], dim=2) for a, g in zip(loc, glob)]
        x = x + lin(sd, f"{p}.o", attend(q, kv["k"], kv["v"]).reshape(b, s, D))
        return x


# ---- 13. one layer reused in a loop (the early passes under no_grad, as HRM does) -------------


class LoopNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = SelfAttn()

    def forward(self, x: Tensor) -> Tensor:
        for i in range(3):
            with torch.no_grad() if i < 2 else torch.enable_grad():
                x = self.layer(x)
        return x

    def reference(self, x: Tensor) -> Tensor:
        for _ in range(3):
            x = _mha_ref(self, "layer", x)
        return x


# ---- 14. projection modules that return a tuple (a quantized linear's (y, scale)) -------------


class QuantLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / math.sqrt(D))
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        return F.linear(x, self.weight, self.bias), scale


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SelfAttn(), SelfAttn()])
        for blk in self.blocks:
            blk.q, blk.k, blk.v = QuantLinear(), QuantLinear(), QuantLinear()

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks:
            q, k, v = (to_heads(m(x)[0]) for m in (blk.q, blk.k, blk.v))
            x = x + blk.o(from_heads(F.scaled_dot_product_attention(q, k, v)))
        return x

    def reference(self, x: Tensor) -> Tensor:
        for i in range(2):
            x = _mha_ref(self, f"blocks.{i}", x)
        return x


# ---- 15. a vision transformer: bias assembled with cat, RoPE on the patch tokens only ----------


class ViTBlock(nn.Module):
    def __init__(self, n_prefix: int = 1) -> None:
        super().__init__()
        self.n = n_prefix
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.q_bias, self.v_bias = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))
        self.proj = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        bias = torch.cat([self.q_bias, torch.zeros_like(self.v_bias), self.v_bias])
        q, k, v = F.linear(x, self.qkv.weight, bias).reshape(b, s, 3, H, DH).permute(2, 0, 3, 1, 4).unbind(0)
        q = torch.cat([q[:, :, : self.n], rope(q[:, :, self.n :])], dim=2).type_as(v)  # (B, H, S, Dh)
        k = torch.cat([k[:, :, : self.n], rope(k[:, :, self.n :])], dim=2).type_as(v)
        return x + self.proj(from_heads(F.scaled_dot_product_attention(q, k, v)))


class ViTNet(TwoBlocks):
    block = ViTBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        bias = torch.cat([sd[f"{p}.q_bias"], torch.zeros(D), sd[f"{p}.v_bias"]])
        y = F.linear(x, sd[f"{p}.qkv.weight"], bias).unflatten(-1, (3, H, DH))
        q, k, v = ([kha_of(self, r, p)(y[..., j, h, :]) for h in range(H)] for j, r in enumerate("qkv"))
        q, k = ([torch.cat([h[:, :1], rope(h[:, 1:])], dim=1) for h in t] for t in (q, k))
        x = x + lin(sd, f"{p}.proj", attend(q, k, v))
        return x


# ---- 16. local plus global tokens with their own projections, scores joined, probabilities split ---


class SplitBlock(SelfAttn):
    """PEGASUS-X / Longformer style: global tokens (block means) have their own k and v projections;
    the local and global scores are concatenated along the key axis, the probabilities cut again and
    each piece multiplied with its own values."""

    def __init__(self) -> None:
        super().__init__()
        self.k_glob, self.v_glob = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        nb = s // BLOCK
        side = x.view(b, nb, BLOCK, D).mean(2)  # (B, G, D)
        q, kl, vl = (m(x).view(b, nb, BLOCK, H, DH) for m in (self.q, self.k, self.v))
        kg, vg = (m(side).view(b, nb, H, DH) for m in (self.k_glob, self.v_glob))  # (B, G, H, Dh)
        scores = torch.cat(
            [torch.einsum("bnqhd,bghd->bnhqg", q, kg), torch.einsum("bnqhd,bnkhd->bnhqk", q, kl)], dim=-1
        )
        p = torch.softmax(scores / math.sqrt(DH), dim=-1)  # (B, nb, H, BLOCK, G + BLOCK)
        o = torch.einsum("bnhqg,bghd->bnqhd", p[..., :nb], vg) + torch.einsum("bnhqk,bnkhd->bnqhd", p[..., nb:], vl)
        return x + self.o(o.reshape(b, s, D))


class SplitNet(TwoBlocks):
    block = SplitBlock

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        nb = s // BLOCK
        blocks, side = x.view(b, nb, BLOCK, D), x.view(b, nb, BLOCK, D).mean(2)
        q = each(kha_of(self, "q", f"{p}.q"), split_heads(lin(sd, f"{p}.q", blocks)))  # (B, nb, BLOCK, Dh)
        kv = {}
        for r in "kv":
            t = kha_of(self, r, f"{p}.{r}", f"{p}.{r}_glob")
            loc, glob = split_heads(lin(sd, f"{p}.{r}", blocks)), split_heads(lin(sd, f"{p}.{r}_glob", side))
            kv[r] = [torch.cat([t(g)[:, None].expand(b, nb, nb, DH), t(a)], dim=2) for a, g in zip(loc, glob)]
        x = x + lin(sd, f"{p}.o", attend(q, kv["k"], kv["v"]).reshape(b, s, D))
        return x


# ---- 17. tied projection weights (Zamba2's shared blocks); 18. K = V ----------------------------


class TiedNet(nn.Module):
    """Two attention blocks whose projections share their parameters (tied, separate modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([SelfAttn(), SelfAttn()])
        for r in "qkvo":
            getattr(self.blocks[1], r).weight = getattr(self.blocks[0], r).weight
            getattr(self.blocks[1], r).bias = getattr(self.blocks[0], r).bias

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        for _ in range(2):  # both blocks: the tied weights and the one shared transform per role
            q, k, v = (
                each(kha_of(self, r, f"blocks.0.{r}", f"blocks.1.{r}"), split_heads(lin(sd, f"blocks.0.{r}", x)))
                for r in "qkv"
            )
            x = x + lin(sd, "blocks.0.o", attend(q, k, v))
        return x


class KEqualsV(nn.Module):
    """One projection gives both keys and values (DeepSeek-V4's kv_proj): K = V."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        kv = to_heads(self.kv(x))
        return from_heads(F.scaled_dot_product_attention(to_heads(self.q(x)), kv, kv))


class GroupedConv(nn.Module):
    """q, k, v from one grouped 1x1 conv (SqueezeBERT style): groups of 12 channels cut the heads of 8
    (8 groups), groups of 24 hold whole heads (4 groups)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.qkv = nn.Conv1d(D, 3 * D, 1, groups=groups)

    def forward(self, x: Tensor) -> Tensor:
        b, _, t = x.shape
        q, k, v = self.qkv(x).reshape(b, 3, H, DH, t).transpose(-1, -2).unbind(1)  # (B, H, T, Dh)
        return F.scaled_dot_product_attention(q, k, v)
