"""More attention forms from real code (issue 22), each with an independent per-head reference.

Like ``tests/forms_zoo.py``: every model has ``reference(*inputs)``, its output computed from the
stored parameters head by head with KHA as docs/method.md writes it. The reference looks KHA up with
:func:`shared_kha`, which finds the one transform of a role anywhere under a module and fails when
there are several: one shared T per role for all heads is part of what it checks.

Example::

    model = HeadModulesNet()
    kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(x,))
    torch.testing.assert_close(model(x), model.reference(x))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from forms_zoo import DH, D, H, attend, from_heads, lin, to_heads
from projection_reference import spec_transform


def shared_kha(model: nn.Module, role: str, prefix: str) -> Callable[[Tensor], Tensor]:
    """The spec transform of ``role`` held anywhere under ``prefix`` (identity if none); exactly one.

    Example::

        t_v = shared_kha(model, "v", "blocks.0")     # fails if two modules under blocks.0 hold a T^V
    """
    found: dict[str, dict[str, Tensor]] = {}
    for name, p in model.named_parameters():
        if not name.startswith(prefix + ".") and prefix:
            continue
        owner, sep, leaf = f".{name}".partition(f".kha.{role}.")
        if sep:
            found.setdefault(owner, {})[leaf] = p.detach()
    assert len(found) <= 1, f"{role}: one shared transform expected under {prefix!r}, found {sorted(found)}"
    return spec_transform(next(iter(found.values()))) if found else (lambda h: h)


def _softmax_attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One head: (B, S, Dh) each -> (B, S, Dh)."""
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


# ---- 1. heads as separate modules -------------------------------------------------------------


class Head(nn.Module):
    """One head with its own q, k, v projections and its own attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, DH), nn.Linear(D, DH), nn.Linear(D, DH)

    def forward(self, x: Tensor) -> Tensor:
        return _softmax_attend(self.q(x), self.k(x), self.v(x))


class HeadModulesBlock(nn.Module):
    """``ModuleList`` of heads, outputs concatenated (``combine="cat"``) or averaged (``"mean"``)."""

    combine = "cat"

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([Head() for _ in range(H)])
        self.o = nn.Linear(D if self.combine == "cat" else DH, D)

    def forward(self, x: Tensor) -> Tensor:
        outs = [h(x) for h in self.heads]
        y = torch.cat(outs, dim=-1) if self.combine == "cat" else torch.stack(outs).mean(0)
        return x + self.o(y)


class MeanHeadsBlock(HeadModulesBlock):
    combine = "mean"


class SharedValueBlock(nn.Module):
    """Per-head q and k projections in two lists, one value projection shared by all heads, SDPA per
    head, outputs summed and divided (``sum(outs) / H``)."""

    def __init__(self) -> None:
        super().__init__()
        self.qs = nn.ModuleList([nn.Linear(D, DH) for _ in range(H)])
        self.ks = nn.ModuleList([nn.Linear(D, DH) for _ in range(H)])
        self.v, self.o = nn.Linear(D, DH), nn.Linear(DH, D)

    def forward(self, x: Tensor) -> Tensor:
        v = self.v(x)
        outs = [F.scaled_dot_product_attention(q(x), k(x), v) for q, k in zip(self.qs, self.ks)]
        return x + self.o(sum(outs) / H)


class _TwoOf(nn.Module):
    block: type[nn.Module]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([self.block(), self.block()])

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class HeadModulesNet(_TwoOf):
    block = HeadModulesBlock

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        for i, blk in enumerate(self.blocks):
            p = f"blocks.{i}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            outs = [
                _softmax_attend(*(t[r](lin(sd, f"{p}.heads.{h}.{r}", x)) for r in "qkv")) for h in range(len(blk.heads))
            ]
            y = torch.cat(outs, dim=-1) if blk.combine == "cat" else torch.stack(outs).mean(0)
            x = x + lin(sd, f"{p}.o", y)
        return x


class MeanHeadsNet(HeadModulesNet):
    block = MeanHeadsBlock


class SharedValueNet(_TwoOf):
    block = SharedValueBlock

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            v = t["v"](lin(sd, f"{p}.v", x))
            outs = [
                _softmax_attend(t["q"](lin(sd, f"{p}.qs.{h}", x)), t["k"](lin(sd, f"{p}.ks.{h}", x)), v)
                for h in range(H)
            ]
            x = x + lin(sd, f"{p}.o", sum(outs) / H)
        return x


# ---- 2. attention over a KV cache written in place ----------------------------------------------

MAX_LEN = 48


def causal_from(pos: int, s: int, total: int) -> Tensor:
    """(s, total) additive mask: query i (at position pos + i) sees keys 0 .. pos + i."""
    return torch.full((s, total), float("-inf")).triu(pos + 1)


class MetaCacheAttn(nn.Module):
    """Meta's Llama reference code: cache buffers, ``cache_k[:b, pos:pos + s] = xk``, read back sliced."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.register_buffer("cache_k", torch.zeros(2, MAX_LEN, H, DH), persistent=False)
        self.register_buffer("cache_v", torch.zeros(2, MAX_LEN, H, DH), persistent=False)

    def forward(self, x: Tensor, start_pos: int) -> Tensor:
        b, s, _ = x.shape
        xq, xk, xv = (m(x).view(b, s, H, DH) for m in (self.wq, self.wk, self.wv))  # (B, S, H, Dh)
        self.cache_k[:b, start_pos : start_pos + s] = xk
        self.cache_v[:b, start_pos : start_pos + s] = xv
        keys, values = self.cache_k[:b, : start_pos + s], self.cache_v[:b, : start_pos + s]
        q, k, v = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)  # (B, H, T, Dh)
        scores = q @ k.transpose(2, 3) / math.sqrt(DH) + causal_from(start_pos, s, start_pos + s)
        return x + self.wo(from_heads(torch.softmax(scores, dim=-1) @ v))


class FastCacheAttn(nn.Module):
    """gpt-fast: a fused wqkv, ``k_cache[:, :, input_pos] = k`` (``index_put_``), SDPA over the whole cache."""

    def __init__(self, style: str = "index_put") -> None:
        super().__init__()
        self.style = style
        self.wqkv, self.wo = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.register_buffer("k_cache", torch.zeros(2, H, MAX_LEN, DH), persistent=False)
        self.register_buffer("v_cache", torch.zeros(2, H, MAX_LEN, DH), persistent=False)

    def forward(self, x: Tensor, input_pos: Tensor, mask: Tensor) -> Tensor:
        q, k, v = (to_heads(t) for t in self.wqkv(x).split([D, D, D], dim=-1))  # (B, H, S, Dh)
        if self.style == "index_put":
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        else:
            self.k_cache.index_copy_(2, input_pos, k)
            self.v_cache.index_copy_(2, input_pos, v)
        o = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return x + self.wo(from_heads(o))


class ListCacheAttn(FastCacheAttn):
    """The cache as an argument: a list ``[k, v]`` of tensors written by slice assignment."""

    def forward(self, x: Tensor, input_pos: Tensor, mask: Tensor, cache: list[Tensor]) -> Tensor:  # type: ignore[override]
        q, k, v = (to_heads(t) for t in self.wqkv(x).split([D, D, D], dim=-1))
        cache[0][:, :, input_pos] = k
        cache[1][:, :, input_pos] = v
        o = F.scaled_dot_product_attention(q, cache[0], cache[1], attn_mask=mask)
        return x + self.wo(from_heads(o))


def cache_reference(model: nn.Module, x_all: Tensor, wq: Callable, wk: Callable, wv: Callable, wo: str) -> Tensor:
    """Causal attention over every token so far (no cache), head by head, with the shared KHA of ``model``."""
    sd = model.state_dict()
    t = {r: shared_kha(model, r, "") for r in "qkv"}
    q, k, v = ([t[r](h) for h in heads] for r, heads in zip("qkv", (wq(sd, x_all), wk(sd, x_all), wv(sd, x_all))))
    n = x_all.shape[1]
    return x_all + F.linear(attend(q, k, v, causal_from(0, n, n)), sd[f"{wo}.weight"])


def _split(y: Tensor) -> list[Tensor]:
    return list(y.unflatten(-1, (H, DH)).unbind(-2))


def meta_reference(model: nn.Module, x_all: Tensor) -> Tensor:
    def role(name: str) -> Callable:
        return lambda sd, x: _split(F.linear(x, sd[f"{name}.weight"]))

    return cache_reference(model, x_all, role("wq"), role("wk"), role("wv"), "wo")


def fast_reference(model: nn.Module, x_all: Tensor) -> Tensor:
    def role(i: int) -> Callable:
        return lambda sd, x: _split(F.linear(x, sd["wqkv.weight"]).split([D, D, D], dim=-1)[i])

    return cache_reference(model, x_all, role(0), role(1), role(2), "wo")


# ---- 3. sparse query and key selection --------------------------------------------------------


class TopQueries(nn.Module):
    """Informer's ProbSparse form: the top queries per head (a computed index along the sequence),
    ``q[arange(B)[:, None, None], arange(H)[None, :, None], top]``; the other positions get the
    mean of the values."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))  # (B, H, S, Dh)
        b, _, s, _ = q.shape
        top = (q @ k.mean(2, keepdim=True).transpose(-1, -2)).squeeze(-1).topk(s // 4, dim=-1).indices  # (B, H, u)
        bi, hi = torch.arange(b)[:, None, None], torch.arange(H)[None, :, None]
        p = torch.softmax(q[bi, hi, top] @ k.transpose(-1, -2) / math.sqrt(DH), dim=-1)  # (B, H, u, S)
        out = v.mean(2, keepdim=True).expand(b, H, s, DH).clone()
        out[bi, hi, top] = p @ v
        return x + self.o(from_heads(out))

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        q, k, v = (
            torch.stack([shared_kha(self, r, "")(h) for h in _split(lin(sd, r, x))], dim=1) for r in "qkv"
        )  # (B, H, S, Dh), the KHA transform on each head vector
        b, _, s, _ = q.shape
        out = torch.empty_like(v)
        for bb in range(b):
            for h in range(H):
                score = q[bb, h] @ k[bb, h].mean(0)
                top = score.topk(s // 4).indices
                out[bb, h] = v[bb, h].mean(0)
                p = torch.softmax(q[bb, h, top] @ k[bb, h].T / math.sqrt(DH), dim=-1)
                out[bb, h, top] = p @ v[bb, h]
        return x + lin(sd, "o", from_heads(out))


class SampledKeys(nn.Module):
    """Keys and values sampled along the sequence (``index_select`` with a computed index), queries all."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        keep = x[0, :, 0].argsort()[: x.shape[1] // 2]  # data-dependent positions
        o = F.scaled_dot_product_attention(q, k.index_select(2, keep), v.index_select(2, keep))
        return x + self.o(from_heads(o))

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        keep = x[0, :, 0].argsort()[: x.shape[1] // 2]
        q, k, v = ([shared_kha(self, r, "")(h) for h in _split(lin(sd, r, x))] for r in "qkv")
        return x + lin(sd, "o", attend(q, [h[:, keep] for h in k], [h[:, keep] for h in v]))


class HeadPicked(SampledKeys):
    """Heads picked by a computed index (``index_select`` on the head axis): refused."""

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (to_heads(m(x)) for m in (self.q, self.k, self.v))
        order = q.abs().sum((0, 2, 3)).argsort()  # (H,) data-dependent
        return x + self.o(from_heads(F.scaled_dot_product_attention(q.index_select(1, order), k, v)))


# ---- 4. a fused wqkv interleaved per kv group (InternLM2, torchtitan's fuse_qkv) -------------------

KV = 2
REP = H // KV


class GroupedWqkv(nn.Module):
    """``wqkv`` output viewed as (B, S, kv groups, REP + 2, Dh): per group its REP query heads, then
    its key and its value. Query head h = g * REP + r sits at rows g * (REP + 2) * Dh + r * Dh: a
    permutation of rows, not an affine layout."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(D, (H + 2 * KV) * DH)
        self.wo = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, KV, REP + 2, DH)
        q = qkv[..., :REP, :].reshape(b, s, H, DH).transpose(1, 2)  # (B, H, S, Dh)
        k, v = qkv[..., -2, :].transpose(1, 2), qkv[..., -1, :].transpose(1, 2)  # (B, KV, S, Dh)
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.wo(from_heads(o))


class GroupedWqkvNet(_TwoOf):
    block = GroupedWqkv

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            y = lin(sd, f"{p}.wqkv", x).unflatten(-1, (KV, REP + 2, DH))  # (B, S, KV, REP + 2, Dh)
            q = [t["q"](y[..., g, r, :]) for g in range(KV) for r in range(REP)]
            k = [t["k"](y[..., g, REP, :]) for g in range(KV)]
            v = [t["v"](y[..., g, REP + 1, :]) for g in range(KV)]
            x = x + lin(sd, f"{p}.wo", attend(q, k, v))
        return x


# ---- 5. routed heads: a mixture of attention heads (JetMoE's MoA) ---------------------------------

EXPERTS, TOP = 4, 2


class RoutedHeads(nn.Module):
    """Each token's router picks TOP of EXPERTS query projections (one (E, KV*Dh, D) parameter); the
    tokens routed to each expert go through its projection (``split`` by expert, ``F.linear``,
    ``cat``), ``zeros.index_add`` puts the rows back in token order: TOP * KV query heads per token
    over KV shared key/value heads; each expert's output projection, weighted by the gates, brings
    them back."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.wq = nn.Parameter(torch.randn(EXPERTS, KV * DH, D) / math.sqrt(D))
        self.wo = nn.Parameter(torch.randn(EXPERTS, D, KV * DH) / math.sqrt(KV * DH))
        self.kv = nn.Linear(D, 2 * KV * DH)

    def _route(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor, list[int]]:
        top = self.router(flat).topk(TOP, dim=-1)  # (N, TOP)
        experts = top.indices.flatten()  # (N * TOP,)
        order = experts.argsort(stable=True)
        sizes = F.one_hot(experts, EXPERTS).sum(0).tolist()
        return top.values.softmax(-1).flatten()[order], order, order // TOP, sizes

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        gates, order, token, sizes = self._route(flat)
        rows = flat[token].split(sizes, dim=0)
        q = torch.cat([F.linear(r, self.wq[e]) for e, r in enumerate(rows)], dim=0)  # (N * TOP, KV * Dh) by expert
        q = torch.zeros(b * s * TOP, KV * DH, dtype=x.dtype).index_add(0, order, q)  # token order
        q = q.view(b, s, TOP * KV, DH).transpose(1, 2)  # (B, TOP * KV, S, Dh)
        k, v = (t.view(b, s, KV, DH).transpose(1, 2).repeat(1, TOP, 1, 1) for t in self.kv(x).chunk(2, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * s * TOP, KV * DH)
        back = o[order].split(sizes, dim=0)
        y = torch.cat([F.linear(r, self.wo[e]) for e, r in enumerate(back)], dim=0) * gates[:, None]
        return x + torch.zeros(b * s, D, dtype=x.dtype).index_add(0, token, y).view(b, s, D)

    def reference(self, x: Tensor) -> Tensor:
        sd = self.state_dict()
        t = {r: shared_kha(self, r, "") for r in "qkv"}
        b, s, _ = x.shape
        flat = x.reshape(-1, D)
        top = F.linear(flat, sd["router.weight"]).topk(TOP, dim=-1)
        gates = top.values.softmax(-1)  # (N, TOP)
        kv = F.linear(x, sd["kv.weight"], sd["kv.bias"]).unflatten(-1, (2, KV, DH))  # (B, S, 2, KV, Dh)
        k, v = t["k"](kv[:, :, 0]), t["v"](kv[:, :, 1])  # (B, S, KV, Dh)
        out = torch.zeros(b * s, D)
        for n in range(b * s):
            bi = n // s
            for i in range(TOP):
                e = int(top.indices[n, i])
                qn = t["q"]((sd["wq"][e] @ flat[n]).view(KV, DH))  # (KV, Dh): this slot's heads
                o = torch.stack(
                    [torch.softmax(k[bi, :, h] @ qn[h] / math.sqrt(DH), dim=0) @ v[bi, :, h] for h in range(KV)]
                )
                out[n] += gates[n, i] * (sd["wo"][e] @ o.flatten())
        return x + out.view(b, s, D)


# ---- 6. message-passing (graph) attention with heads: a segment softmax from scatter ops ---------


def segment_softmax(score: Tensor, index: Tensor, n: int) -> Tensor:
    """Softmax of per-edge scores (E, H) over the edges of each target node (PyG's ``softmax``)."""
    top = torch.full((n, score.shape[1]), float("-inf")).scatter_reduce(
        0, index[:, None].expand_as(score), score, "amax", include_self=True
    )
    e = (score - top[index]).exp()
    return e / (torch.zeros(n, score.shape[1]).index_add(0, index, e)[index] + 1e-16)


class GraphAttnLayer(nn.Module):
    """PyG's ``TransformerConv`` written out: per-edge scores q[dst] . k[src], the segment softmax,
    values v[src] summed per target with ``index_add``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index
        n = x.shape[0]
        q, k, v = (m(x).view(n, H, DH) for m in (self.q, self.k, self.v))  # (N, H, Dh)
        alpha = segment_softmax((q[dst] * k[src]).sum(-1) / math.sqrt(DH), dst, n)  # (E, H)
        out = torch.zeros(n, H, DH).index_add(0, dst, v[src] * alpha[..., None])
        return x + self.o(out.view(n, D))


class GraphAttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([GraphAttnLayer(), GraphAttnLayer()])

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, edge_index)
        return x

    def reference(self, x: Tensor, edge_index: Tensor) -> Tensor:
        sd = self.state_dict()
        src, dst = edge_index.tolist()
        for i in range(2):
            p = f"layers.{i}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            q, k, v = (torch.stack([t[r](h) for h in _split(lin(sd, f"{p}.{r}", x))], dim=1) for r in "qkv")
            out = torch.zeros(x.shape[0], H, DH)
            for node in range(x.shape[0]):
                edges = [e for e, d in enumerate(dst) if d == node]
                if not edges:
                    continue
                ks, vs = k[[src[e] for e in edges]], v[[src[e] for e in edges]]  # (n_in, H, Dh)
                for h in range(H):
                    a = torch.softmax(ks[:, h] @ q[node, h] / math.sqrt(DH), dim=0)
                    out[node, h] = a @ vs[:, h]
            x = x + lin(sd, f"{p}.o", out.reshape(-1, D))
        return x


class AdditiveGraphAttn(nn.Module):
    """GAT: additive scores from learned per-head vectors, a segment softmax, values summed per target."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.att_src, self.att_dst = nn.Parameter(torch.randn(1, H, DH)), nn.Parameter(torch.randn(1, H, DH))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        src, dst = edge_index
        h = self.lin(x).view(-1, H, DH)
        a_src, a_dst = (h * self.att_src).sum(-1), (h * self.att_dst).sum(-1)  # (N, H)
        alpha = segment_softmax(F.leaky_relu(a_src[src] + a_dst[dst], 0.2), dst, x.shape[0])
        return torch.zeros_like(h).index_add(0, dst, h[src] * alpha[..., None]).view(-1, D)


# ---- 7. sliding-window attention written as chunked einsums (transformers' Longformer) ------------

WINDOW = 4  # one-sided: each token sees WINDOW tokens on each side


def longformer_attention() -> nn.Module:
    """transformers' ``LongformerSelfAttention`` (its own code: overlapping chunks by ``as_strided``,
    score einsum, diagonals padded into a band, softmax, padded values, chunked value einsum)."""
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    cfg = LongformerConfig(
        hidden_size=D, num_attention_heads=H, attention_window=[2 * WINDOW], attention_probs_dropout_prob=0.0
    )
    return LongformerSelfAttention(cfg, layer_id=0)


def longformer_inputs(x: Tensor) -> tuple:
    mask = torch.zeros(x.shape[:2])  # every token local, none masked, none global
    return (x, mask, mask < 0, mask > 0, False)


def longformer_reference(model: nn.Module, x: Tensor) -> Tensor:
    """Each token attends to the tokens within WINDOW of it, head by head, with the shared KHA."""
    sd = model.state_dict()
    q, k, v = (
        [shared_kha(model, r, "")(h) for h in _split(lin(sd, name, x))]
        for r, name in (("q", "query"), ("k", "key"), ("v", "value"))
    )
    i = torch.arange(x.shape[1])
    outside = (i[:, None] - i[None, :]).abs() > WINDOW
    return attend(q, k, v, torch.zeros(outside.shape).masked_fill(outside, float("-inf")))


# ---- 8. keys equal to values: one kv projection read as both (DeepSeek-V4) ----------------------


def rope(x: Tensor) -> Tensor:
    """Rotary embedding over (..., S, Dh) (rotate-half form)."""
    d, n = x.shape[-1] // 2, x.shape[-2]
    t = torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(d)[None] / d
    c, s = t.cos(), t.sin()
    return torch.cat([x[..., :d] * c - x[..., d:] * s, x[..., :d] * s + x[..., d:] * c], -1)


class SharedKV(nn.Module):
    """One kv head (``kv``, RMSNorm, RoPE) read as keys and as values; ``manual``: the softmax written
    out over the kv head broadcast to every query head, else SDPA(q, kv, kv)."""

    manual = False

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv, self.o = nn.Linear(D, D), nn.Linear(D, DH), nn.Linear(D, D)
        self.norm = nn.RMSNorm(DH)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: Tensor) -> Tensor:
        q = rope(to_heads(self.q(x)))  # (B, H, S, Dh)
        kv = rope(self.norm(self.kv(x)))[:, None].expand(-1, H, -1, -1)  # (B, H, S, Dh): one head, broadcast
        if self.manual:
            p = torch.softmax(q @ kv.transpose(-1, -2) / math.sqrt(DH), dim=-1)
            return x + self.o(from_heads(p @ kv))
        return x + self.o(from_heads(F.scaled_dot_product_attention(q, kv, kv)))

    def reference(self, x: Tensor) -> Tensor:
        """T^K on the key path and T^V on the value path after the shared norm and RoPE, where they part."""
        sd = self.state_dict()
        t = {r: shared_kha(self, r, "") for r in "qkv"}
        q = [rope(t["q"](h)) for h in _split(lin(sd, "q", x))]
        kv = rope(F.rms_norm(lin(sd, "kv", x), (DH,), sd["norm.weight"]))
        return x + lin(sd, "o", attend(q, [t["k"](kv)], [t["v"](kv)]))


class SharedKVManual(SharedKV):
    manual = True
