"""Layout ops beyond reshapes: keys and values padded along the sequence and cut into overlapping windows
(HaloNet's halo attention), and heads cut with ``reshape_as`` another tensor (LeViT):
``F.pad`` on an axis that holds no features and ``Tensor.unfold`` are layout ops the walk follows
(``analysis/layout.py``), so each role reaches its projection; the perturbed output equals a per-head
reference written from the state dict, and linear KHA folds.
RoPE on interleaved pairs, unbound and written back into slices of ``empty_like`` (Wan's), stacked
back (Mochi's) or rotated as products over (..., Dh/2, 1, 2) (PRX's), keeps each feature in place:
the walk goes through the region to the tensor of the shape it started from. A constant pad on the
head axis appends channels that hold no feature (v zero-padded to q's width); a pad that copies features
(reflect) is no layout. Tokens picked by a
mask (a data-dependent count) after or before the head split are tokens, and keep every head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import forms_zoo as fz
import kha_compile as kc
from form_checks import check_form
from forms_zoo import DH, H, TwoBlocks, attend, kha_of, lin

BLOCK, HALO = 4, 2  # queries in blocks of 4; each attends to its block and 2 positions either side


class HaloAttention(nn.Module):
    """q in blocks; k and v zero-padded by the halo and unfolded into windows of BLOCK + 2 * HALO."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        n = s // BLOCK
        q = self.q(x).reshape(b, n, BLOCK, H, DH).transpose(2, 3)  # (B, n, H, BLOCK, Dh)

        def windows(y: Tensor) -> Tensor:
            y = F.pad(y.transpose(1, 2), (HALO, HALO))  # (B, D, S + 2 HALO): zeros outside
            y = y.unfold(2, BLOCK + 2 * HALO, BLOCK)  # (B, D, n, W)
            return y.reshape(b, H, DH, n, -1).permute(0, 3, 1, 4, 2)  # (B, n, H, W, Dh)

        o = F.scaled_dot_product_attention(q, windows(self.k(x)), windows(self.v(x)))  # (B, n, H, BLOCK, Dh)
        return x + self.o(o.transpose(2, 3).reshape(b, s, d))


class HaloNet(TwoBlocks):
    block = HaloAttention

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        s = x.shape[1]
        q, k, v = (lin(sd, f"{p}.{r}", x).unflatten(-1, (H, DH)) for r in "qkv")  # (B, S, H, Dh)
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(t[:, :, h]) for h in range(H)] for r, t in zip("qkv", (q, k, v)))
        out = []
        for i in range(s // BLOCK):  # block i: its queries, keys of positions i*BLOCK - HALO ... (zeros outside)
            lo, hi = i * BLOCK - HALO, (i + 1) * BLOCK + HALO

            def window(t: Tensor, lo: int = lo, hi: int = hi) -> Tensor:
                return F.pad(t, (0, 0, HALO, HALO))[:, lo + HALO : hi + HALO]  # (B, W, Dh)

            qs = [t[:, i * BLOCK : (i + 1) * BLOCK] for t in q]
            out.append(attend(qs, [window(t) for t in k], [window(t) for t in v]))
        return x + lin(sd, f"{p}.o", torch.cat(out, dim=1))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_padded_and_unfolded_keys_match_a_per_head_reference(v):
    x = torch.randn(fz.B, 4 * BLOCK, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(HaloNet, (x,), v, qk=True, reference=lambda m: m.reference(x))


class FeaturePad(nn.Module):
    """v zero-padded on its head axis (Dh 8 -> 12, the width of q and k) for the attention call, the padding
    cut off after it: the padded channels hold no feature, T^V acts on the 8 real ones at the projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(fz.D, H * 12), nn.Linear(fz.D, H * 12), nn.Linear(fz.D, H * DH)
        self.o = nn.Linear(H * DH, fz.D)

    def forward(self, x: Tensor) -> Tensor:
        q, k = (t(x).unflatten(-1, (H, 12)).transpose(1, 2) for t in (self.q, self.k))  # (B, H, S, 12)
        v = F.pad(self.v(x).unflatten(-1, (H, DH)).transpose(1, 2), (0, 4))  # (B, H, S, 12)
        o = F.scaled_dot_product_attention(q, k, v)[..., :DH]
        return x + self.o(o.transpose(1, 2).flatten(2))


class FeaturePadNet(TwoBlocks):
    block = FeaturePad

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(h) for h in fz.split_heads(lin(sd, f"{p}.{r}", x))] for r in "qkv")
        v = [F.pad(h, (0, 4)) for h in v]  # T^V on the real channels, then the zeros
        o = attend(q, k, v).unflatten(-1, (H, 12))[..., :DH].flatten(-2)
        return x + lin(sd, f"{p}.o", o)


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_a_constant_pad_on_the_head_axis_keeps_the_real_channels(v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    model = check_form(FeaturePadNet, (x,), v, qk=True, reference=lambda m: m.reference(x))
    assert {(s.num_heads, s.head_dim) for s in kc.inspect(model, (x,)).sites} == {(H, 12)}


class ReflectPad(FeaturePad):
    """v padded on its head axis by reflection: the new channels copy features, no head layout."""

    def forward(self, x: Tensor) -> Tensor:
        q, k = (t(x).unflatten(-1, (H, 12)).transpose(1, 2) for t in (self.q, self.k))
        v = self.v(x).unflatten(-1, (H, DH)).transpose(1, 2)  # (B, H, S, Dh)
        v = F.pad(v.flatten(0, 1), (0, 4), mode="reflect").unflatten(0, (x.shape[0], H))  # (B, H, S, 12)
        return F.scaled_dot_product_attention(q, k, v)


def test_a_pad_that_copies_features_is_not_followed():
    model, x = ReflectPad().eval(), torch.randn(1, 6, fz.D)
    report = kc.inspect(model, (x,))
    assert len(report.sites) == 1 and report.skipped, str(report)
    assert "v: cannot follow the layout op" in report.skipped[0].reason
    assert "reflect pad on an axis that carries features" in report.skipped[0].reason


class ShapeOfOther(nn.Module):
    """Heads cut with ``reshape_as`` / ``view_as`` a template of shape (B, S, H, Dh) (LeViT style)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.new_empty(x.shape[0], x.shape[1], H, DH)  # (B, S, H, Dh): only its shape is read
        q = self.q(x).reshape_as(shape).transpose(1, 2)
        k = self.k(x).view_as(shape).transpose(1, 2)
        v = self.v(x).reshape_as(shape).transpose(1, 2)  # (B, H, S, Dh)
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class ShapeOfOtherNet(TwoBlocks):
    block = ShapeOfOther

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(h) for h in fz.split_heads(lin(sd, f"{p}.{r}", x))] for r in "qkv")
        return x + lin(sd, f"{p}.o", attend(q, k, v))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_heads_cut_with_reshape_as_match_a_per_head_reference(v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(ShapeOfOtherNet, (x,), v, qk=True, reference=lambda m: m.reference(x))


def _pair_angles(s: int) -> tuple[Tensor, Tensor]:
    """cos, sin of each position for each interleaved pair (2i, 2i+1), as (S, 1, Dh/2)."""
    t = torch.arange(s, dtype=torch.float32)[:, None] * torch.arange(DH // 2)[None] / DH
    return t.cos()[:, None], t.sin()[:, None]


def pair_rope(x: Tensor) -> Tensor:
    """RoPE on interleaved pairs written as Wan does: pairs unbound, written back into slices of
    ``empty_like``, then ``type_as``. x: (B, S, H, Dh)."""
    cos, sin = _pair_angles(x.shape[1])
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


def stacked_pair_rope(x: Tensor) -> Tensor:
    """The same rotation written as Mochi does: even and odd features sliced, turned, stacked and
    flattened back (the walk meets a ``stack`` of shape (..., Dh/2, 2) between two of (..., Dh))."""
    cos, sin = _pair_angles(x.shape[1])
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x.dtype)


def product_pair_rope(x: Tensor) -> Tensor:
    """The same rotation written as PRX does: pairs as (..., Dh/2, 1, 2), products with a (Dh/2, 2, 2)
    rotation per position summed over the pair, reshaped back."""
    cos, sin = _pair_angles(x.shape[1])
    rot = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)  # (S, 1, Dh/2, 2, 2)
    pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (rot[..., 0] * pairs[..., 0] + rot[..., 1] * pairs[..., 1]).reshape(*x.shape).type_as(x)


def rotate(h: Tensor) -> Tensor:
    """The reference rotation of one head (B, S, Dh): pairs (2i, 2i+1) turned by position."""
    cos, sin = (a[:, 0] for a in _pair_angles(h.shape[1]))  # (S, Dh/2)
    a, b = h[..., 0::2], h[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class PairRopeAttention(nn.Module):
    """Heads split, then the pair RoPE above on q and k (the tuple of ``unbind`` comes back whole)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (p(x).unflatten(-1, (H, DH)) for p in (self.q, self.k, self.v))  # (B, S, H, Dh)
        q, k = pair_rope(q), pair_rope(k)
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return x + self.o(o.transpose(1, 2).flatten(2))


class PairRopeNet(TwoBlocks):
    block = PairRopeAttention

    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor) -> Tensor:
        q, k, v = ([kha_of(self, r, f"{p}.{r}")(t) for t in fz.split_heads(lin(sd, f"{p}.{r}", x))] for r in "qkv")
        return x + lin(sd, f"{p}.o", attend([rotate(t) for t in q], [rotate(t) for t in k], v))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_rope_on_unbound_pairs_written_back_matches_a_per_head_reference(v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    check_form(PairRopeNet, (x,), v, qk=True, reference=lambda m: m.reference(x))


class JointPairRope(nn.Module):
    """Image q and k rotated by a pair RoPE, then joined along the sequence with a context stream of its
    own projections (Mochi's and PRX's joint attention): the walk from the attention must cross the
    rotation, which changes the shape on the way, to reach the cat of both streams."""

    rope: staticmethod

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))
        self.cq, self.ck, self.cv = (nn.Linear(fz.D, fz.D) for _ in range(3))

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        img = [p(x).unflatten(-1, (H, DH)) for p in (self.q, self.k, self.v)]  # (B, S, H, Dh)
        img[0], img[1] = self.rope(img[0]), self.rope(img[1])
        q, k, v = (torch.cat([c(ctx).unflatten(-1, (H, DH)), t], 1) for c, t in zip((self.cq, self.ck, self.cv), img))
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
        return x + self.o(o.transpose(1, 2)[:, ctx.shape[1] :].flatten(2))


class JointPairRopeNet(TwoBlocks):
    def block_reference(self, sd: dict[str, Tensor], p: str, x: Tensor, ctx: Tensor) -> Tensor:
        def heads(r: str) -> list[Tensor]:  # one transform per role, shared by both streams
            t = kha_of(self, r, f"{p}.{r}", f"{p}.c{r}")
            own = [t(h) for h in fz.split_heads(lin(sd, f"{p}.{r}", x))]
            own = [rotate(h) for h in own] if r != "v" else own
            return [torch.cat([t(c), h], 1) for c, h in zip(fz.split_heads(lin(sd, f"{p}.c{r}", ctx)), own)]

        return x + lin(sd, f"{p}.o", attend(heads("q"), heads("k"), heads("v"))[:, ctx.shape[1] :])


@pytest.mark.parametrize("v", ["linear", "mlp"])
@pytest.mark.parametrize("rope", [pair_rope, stacked_pair_rope, product_pair_rope], ids=["wan", "mochi", "prx"])
def test_rope_on_pairs_before_a_joint_stream_matches_a_per_head_reference(rope, v):
    block = type("Block", (JointPairRope,), {"rope": staticmethod(rope)})
    net = type("Net", (JointPairRopeNet,), {"block": block})
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    ctx = torch.randn(fz.B, 6, fz.D, generator=torch.Generator().manual_seed(1))
    check_form(net, (x, ctx), v, qk=True, reference=lambda m: m.reference(x, ctx))


class SelectedTokensAttention(nn.Module):
    """Tokens picked by a mask (a data-dependent count, ``u0`` in the trace), heads split and scaled per
    token, then joined with a context stream along the sequence (HunyuanVideo-Framepack's clean latents)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))
        self.cq, self.ck, self.cv = (nn.Linear(fz.D, fz.D) for _ in range(3))

    def forward(self, x: Tensor, ctx: Tensor) -> Tensor:
        sel = x[:, (x[0, :, 0] > 0).nonzero()[:, 0]]  # (1, u0, D)
        torch._check(sel.shape[1] <= x.shape[1])  # what export needs told to trace it whole
        gain = sel.norm(dim=-1, keepdim=True)[..., None]  # (1, u0, 1, 1)
        q, k, v = (
            torch.cat([c(ctx).unflatten(-1, (H, DH)), p(sel).unflatten(-1, (H, DH)) * gain], 1).transpose(1, 2)
            for p, c in ((self.q, self.cq), (self.k, self.ck), (self.v, self.cv))
        )
        o = F.scaled_dot_product_attention(q, k, v)  # (1, H, Sc + u0, Dh)
        return self.o(o.transpose(1, 2).flatten(2))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_data_dependent_token_count_joined_with_a_context_matches_a_per_head_reference(v):
    x = torch.randn(1, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    ctx = torch.randn(1, 6, fz.D, generator=torch.Generator().manual_seed(1))

    def reference(m: nn.Module) -> Tensor:
        sd, sel = m.state_dict(), x[:, x[0, :, 0] > 0]
        gain = sel.norm(dim=-1, keepdim=True)

        def heads(r: str) -> list[Tensor]:  # one shared transform per role over both streams, as KHA is
            t = kha_of(m, r, r, f"c{r}")
            own = [t(h) * gain for h in fz.split_heads(lin(sd, r, sel))]
            return [torch.cat([t(c), h], 1) for c, h in zip(fz.split_heads(lin(sd, f"c{r}", ctx)), own)]

        return lin(sd, "o", attend(heads("q"), heads("k"), heads("v")))

    check_form(SelectedTokensAttention, (x, ctx), v, sites=1, qk=True, reference=reference)


class PerSampleSelection(nn.Module):
    """Mochi's joint attention: context tokens picked per sample by its mask after the head split
    (``t[i : i + 1, :, mask[i].nonzero()]``, a data-dependent count), joined with the sample's image
    tokens, attended one sample at a time, padded back to full length and stacked over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(fz.D, fz.D) for _ in range(4))
        self.cq, self.ck, self.cv = (nn.Linear(fz.D, fz.D) for _ in range(3))

    def forward(self, x: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        img = [p(x).unflatten(-1, (H, DH)).transpose(1, 2) for p in (self.q, self.k, self.v)]  # (B, H, S, Dh)
        txt = [p(ctx).unflatten(-1, (H, DH)).transpose(1, 2) for p in (self.cq, self.ck, self.cv)]
        total = x.shape[1] + ctx.shape[1]
        out = []
        for i in range(x.shape[0]):
            keep = mask[i].nonzero().flatten()
            q, k, v = (torch.cat([a[i : i + 1], c[i : i + 1, :, keep]], dim=2) for a, c in zip(img, txt))
            o = F.scaled_dot_product_attention(q, k, v)  # (1, H, S + n_i, Dh)
            out.append(F.pad(o, (0, 0, 0, total - o.shape[2])))
        return self.o(torch.cat(out).transpose(1, 2).flatten(2))


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_per_sample_selection_by_a_mask_after_the_head_split_matches_a_per_head_reference(v):
    x = torch.randn(fz.B, fz.S, fz.D, generator=torch.Generator().manual_seed(0))
    ctx = torch.randn(fz.B, 6, fz.D, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0, 1, 0, 1], [1, 0, 0, 1, 1, 1]], dtype=torch.bool)  # 4 and 4 kept, not the same

    def reference(m: nn.Module) -> Tensor:
        sd, out = m.state_dict(), []
        for i in range(fz.B):
            xi, ci = x[i : i + 1], ctx[i : i + 1, mask[i]]

            def heads(r: str, xi: Tensor = xi, ci: Tensor = ci) -> list[Tensor]:  # one transform per role
                t = kha_of(m, r, r, f"c{r}")
                own, picked = fz.split_heads(lin(sd, r, xi)), fz.split_heads(lin(sd, f"c{r}", ci))
                return [torch.cat([t(a), t(c)], 1) for a, c in zip(own, picked)]

            o = attend(heads("q"), heads("k"), heads("v"))  # (1, S + n_i, D)
            out.append(F.pad(o, (0, 0, 0, x.shape[1] + ctx.shape[1] - o.shape[1])))
        return lin(sd, "o", torch.cat(out))

    check_form(PerSampleSelection, (x, ctx, mask), v, sites=fz.B, qk=True, reference=reference)
