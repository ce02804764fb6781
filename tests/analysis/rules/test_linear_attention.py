"""Attention without a softmax, hand-written (tests/linear_forms.py): every layer a site, KHA against a per-head reference.

Linear attention (the key-value state first), retention in its parallel form (decay-masked scores)
and its recurrent form (one state update per token: one site, not one per token), and a softmax
written as ``exp(s - logsumexp(s))`` (matched as such, not as a linear form), both KHA configs,
perturbed, against :class:`reference.Reference` (hooks on an untouched copy's own projections); fold
and save/load. LSH attention (tokens sorted by a hash of k) is a site skipped with its reason, and
a state-space layer whose "queries" are shared by every head stays no attention.
"""

from __future__ import annotations

import pytest
import torch

import kha_compile as kc
from helpers import kha_params, perturb
from kha_compile.core.errors import NoAttentionFoundError
from linear_forms import (
    DH,
    LSH,
    B,
    D,
    EfficientAttention,
    H,
    LinearAttention,
    LinearAttentionChannelsFirst,
    LinearAttentionOnesColumn,
    LinearAttentionRotary,
    LogsumexpSoftmax,
    Net,
    Retention,
    RetentionRecurrent,
    S,
    layout,
)
from reference import Reference

FORMS = {
    "linear_attention": LinearAttention,
    "channels_first": LinearAttentionChannelsFirst,  # (v @ k^T) @ q: the product pair read the other way
    "ones_column": LinearAttentionOnesColumn,  # Sana: a constant row padded onto the values' head vector
    "rotary": LinearAttentionRotary,  # SanaVideo: RoPE tables expanded over the heads (no shared queries)
    "efficient": EfficientAttention,  # CoaT, lambda layers: softmax of k over the tokens, of q over its features
    "retention": Retention,
    "retention_recurrent": RetentionRecurrent,
    "logsumexp_softmax": LogsumexpSoftmax,  # a softmax written out: matched, named as such, no linear-form note
}
CONFIGS = {"linear_qkv": dict(q="linear", k="linear", v="linear"), "mlp_v": dict(v="mlp")}


def _x() -> torch.Tensor:
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(0))


def _net(form: str) -> Net:
    torch.manual_seed(0)
    return Net(FORMS[form]).eval()


@pytest.mark.parametrize("form", list(FORMS))
def test_every_layer_is_a_site_with_its_heads(form):
    report = kc.inspect(_net(form), example_args=(_x(),))
    assert [s.name for s in report.sites] == ["blocks.0", "blocks.1"], str(report)  # recurrent: 1 site, not S
    for s in report.sites:
        linear = form != "logsumexp_softmax"
        assert s.status == "matched" and s.anchor == ("linear_attention" if linear else form), str(report)
        assert (s.num_heads, s.num_kv_heads, s.head_dim) == (H, H, DH)
        assert (s.q_proj, s.k_proj, s.v_proj) == tuple(f"{s.name}.{r}" for r in "qkv")
        assert ("attention without softmax" in s.note and "extension of the paper" in s.note) == linear


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("form", list(FORMS))
def test_kha_on_attention_without_softmax_matches_the_per_head_reference(form, cfg, tmp_path):
    x = _x()
    model = _net(form)
    with torch.no_grad():
        before = model(x)
    kc.apply(model, kc.KHAConfig(**CONFIGS[cfg]), example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), before)  # identity at init
    perturb(model)
    with torch.no_grad():
        moved = model(x)
    assert (moved - before).abs().max() > 1e-3
    ref = Reference(Net(FORMS[form]), layout, cfg={}).load(model.state_dict(), expect=CONFIGS[cfg])
    torch.testing.assert_close(moved, ref.no_grad(x), rtol=1e-5, atol=1e-5)

    kc.save_pretrained(model, tmp_path / "kha")
    fresh = _net(form)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if ".kha." not in k})
    kc.load_pretrained(fresh, tmp_path / "kha", example_args=(x,))
    with torch.no_grad():
        assert torch.equal(fresh(x), moved)

    if cfg == "linear_qkv":  # folds into the q, k, v linears: the original classes, no KHA left
        kc.fold(model)
        assert not kha_params(model) and all(
            type(getattr(b, r)) is torch.nn.Linear for b in model.blocks for r in "qkv"
        )
        with torch.no_grad():
            torch.testing.assert_close(model(x), moved, rtol=1e-5, atol=1e-5)


def test_the_recurrent_and_parallel_forms_are_one_retention():
    """The hand-written forms agree (so the two tests above check one attention written two ways)."""
    x, par, rec = _x(), _net("retention"), _net("retention_recurrent")
    rec.load_state_dict(par.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(rec(x), par(x), rtol=1e-4, atol=1e-5)


def test_lsh_attention_is_a_site_skipped_with_its_reason():
    torch.manual_seed(0)
    model = Net(LSH).eval()
    report = kc.inspect(model, example_args=(_x(),))
    assert [s.name for s in report.sites] == ["blocks.0", "blocks.1"], str(report)
    for s in report.sites:
        assert s.status == "skipped" and s.anchor == "lsh_attention"
        assert "sorted into buckets by a hash of q/k" in s.reason and "not applied to bucketed attention" in s.reason
    with pytest.raises(NoAttentionFoundError, match="LSH attention"):
        kc.apply(model, kc.KHAConfig(v="mlp"), example_args=(_x(),))
    assert not kha_params(model)


class SharedQueryScan(torch.nn.Module):
    """A state-space layer written as products (Mamba-2's SSD): C and B from one projection, the same for
    every head (``repeat_interleave``), x per head: ``((C B^T) * L) x``. No per-head queries."""

    def __init__(self) -> None:
        super().__init__()
        self.bc, self.x, self.o = torch.nn.Linear(D, 2 * DH), torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c = self.bc(x).unsqueeze(1).repeat_interleave(H, dim=1).chunk(2, dim=-1)  # (B, H, S, Dh) each
        v = self.x(x).unflatten(-1, (H, DH)).transpose(1, 2)
        mask = torch.ones(x.shape[1], x.shape[1]).tril()
        return x + self.o(((c @ b.transpose(-2, -1) * mask) @ v).transpose(1, 2).flatten(2))


def test_a_state_space_layer_whose_queries_every_head_shares_is_no_attention():
    with pytest.raises(NoAttentionFoundError, match="no per-head q, k, v"):
        kc.apply(SharedQueryScan(), kc.KHAConfig(v="mlp"), example_args=(_x(),))


class IndexedAttention(torch.nn.Module):
    """Softmax attention over the top-k keys a scorer picks (DeepSeek sparse attention's lightning indexer):
    ``sum_h w_h relu(q_h k^T)`` is a product pair without a softmax, but it only selects tokens; it weighs
    no values. One attention site (the SDPA), no linear-attention site for the scorer."""

    def __init__(self, topk: int = 6) -> None:
        super().__init__()
        self.topk = topk
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D) for _ in range(4))
        self.iq, self.ik, self.iw = torch.nn.Linear(D, D), torch.nn.Linear(D, DH), torch.nn.Linear(D, H)

    def heads(self, y: torch.Tensor) -> torch.Tensor:  # (B, S, D) -> (B, H, S, Dh)
        return y.unflatten(-1, (H, DH)).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        iq = self.iq(x).unflatten(-1, (H, DH))  # (B, S, H, Dh)
        scores = torch.relu(iq @ self.ik(x).transpose(-1, -2).unsqueeze(1))  # (B, S, H, S)
        index = (self.iw(x).unsqueeze(-2) @ scores).squeeze(-2)  # (B, S, S): heads summed with weights
        keep = torch.zeros_like(index, dtype=torch.bool).scatter(-1, index.topk(self.topk, dim=-1).indices, True)
        out = torch.nn.functional.scaled_dot_product_attention(
            self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x)), attn_mask=keep.unsqueeze(1)
        )
        return x + self.o(out.transpose(1, 2).flatten(2))


def test_a_scorer_that_only_selects_tokens_is_no_site():
    report = kc.inspect(IndexedAttention(), example_args=(_x(),))
    assert [(s.status, s.anchor, s.projections("q")) for s in report.sites] == [("matched", "sdpa", ["q"])], str(report)


class StreamMixingLayer(torch.nn.Module):
    """Residual streams mixed by hyper-connections, as DeepSeek-V4's layers do: ``n`` copies of the hidden
    state, mixed around the attention and again around the MLP by ``comb^T @ h``, comb a softmax of a
    projection normalised further (a Sinkhorn step). The two mixings of a layer are a product pair without a
    softmax between them, but no attention over tokens: neither comb reaches a projection through its
    normalisation."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o, self.mlp = (torch.nn.Linear(D, D) for _ in range(5))
        self.attn_hc, self.mlp_hc = (torch.nn.Linear(n * D, n * n) for _ in range(2))

    @staticmethod
    def comb(hc: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:  # h: (B, S, n, D) -> (B, S, n, n)
        comb = torch.softmax(hc(h.flatten(-2)).unflatten(-1, (h.shape[-2], h.shape[-2])), dim=-1)
        return comb / comb.sum(dim=-2, keepdim=True)  # one Sinkhorn step

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        attn_comb, mlp_comb = self.comb(self.attn_hc, h), self.comb(self.mlp_hc, h)  # both from the layer's input
        heads = [p(h.mean(-2)).unflatten(-1, (H, DH)).transpose(1, 2) for p in (self.q, self.k, self.v)]
        out = self.o(torch.nn.functional.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(2))
        h = attn_comb.transpose(-1, -2) @ h + out.unsqueeze(-2)
        return mlp_comb.transpose(-1, -2) @ h + torch.relu(self.mlp(h.mean(-2))).unsqueeze(-2)


class StreamMixing(torch.nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.layers = torch.nn.ModuleList(StreamMixingLayer(n) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(-2).expand(-1, -1, self.n, -1)
        for layer in self.layers:
            h = layer(h)
        return h.mean(-2)


def test_products_of_stream_mixing_weights_are_no_site():
    torch.manual_seed(0)
    report = kc.inspect(StreamMixing(), example_args=(_x(),))
    assert [(s.anchor, s.status) for s in report.sites] == [("sdpa", "matched")] * 2, str(report)


class _Unpatchified(Net):
    """The blocks, then a one-operand einsum (DiT's unpatchify: ``einsum('nhwpqc->nchpwq', x)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bsd->bds", super().forward(x))


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_a_one_operand_einsum_is_no_product(cfg):
    """An einsum of one operand (a transpose) is no product of two: the rules pass over it (it raised
    IndexError in the self-check's trace of DiT, PixArt, SD3 and six other diffusers models)."""
    x = _x()
    torch.manual_seed(0)
    model = _Unpatchified(LinearAttention).eval()
    kc.apply(model, kc.KHAConfig(**CONFIGS[cfg]), example_args=(x,))
    perturb(model)
    torch.manual_seed(0)
    untouched = _Unpatchified(LinearAttention).eval()
    ref = Reference(untouched, layout, cfg={}).load(model.state_dict(), expect=CONFIGS[cfg])
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref.no_grad(x), rtol=1e-5, atol=1e-5)
