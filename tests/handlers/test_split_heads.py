"""One projection read by several attention calls, each over a part of its heads (handlers/plan.py).

diffusers' ``SlicedAttnProcessor`` runs attention on slices of the (batch x heads) axis, one call per
slice; a differential attention splits each query/key head into two halves, one call per half.
Every call is a site of its own, and each reads only some heads of the projections: the shared
transform of a role must reach all of them. Checked against a per-head reference written here
(one T per role for every head, by hooks on an untouched copy), with perturbed KHA weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
from kha_compile.model.slots import HeadSlot, union_slots

H, DH, D = 4, 16, 64


class Sliced(nn.Module):
    """Attention on slices of the (B*H) axis, ``slice_size`` rows per call, written into a buffer."""

    def __init__(self, slice_size: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))
        self.o = nn.Linear(H * DH, D)
        self.slice_size = slice_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, L, H*Dh) -> (B*H, L, Dh)
            return t.view(B, L, H, DH).transpose(1, 2).reshape(B * H, L, DH)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        out = torch.zeros_like(q)
        for i in range(0, B * H, self.slice_size):
            s = slice(i, i + self.slice_size)
            w = torch.softmax(q[s] @ k[s].transpose(1, 2) / DH**0.5, dim=-1)
            out[s] = w @ v[s]
        return self.o(out.view(B, H, L, DH).transpose(1, 2).reshape(B, L, H * DH))


class Differential(nn.Module):
    """Each q/k head holds two halves of DH // 2; one SDPA per half over the same values, subtracted."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q(x).view(B, L, H, 2, DH // 2).transpose(1, 2)  # (B, H, L, 2, Dh/2)
        k = self.k(x).view(B, L, H, 2, DH // 2).transpose(1, 2)
        v = self.v(x).view(B, L, H, DH).transpose(1, 2)  # (B, H, L, Dh)
        a = F.scaled_dot_product_attention(q[..., 0, :], k[..., 0, :], v)
        b = F.scaled_dot_product_attention(q[..., 1, :], k[..., 1, :], v)
        return (a - 0.5 * b).transpose(1, 2).reshape(B, L, H * DH)


def _reference(untouched: nn.Module, made: nn.Module, dims: dict[str, int]) -> nn.Module:
    """``untouched`` with every head vector of each role transformed by the made model's one T (by hooks)."""
    ref = copy.deepcopy(untouched)
    state = made.state_dict()
    for role, dh in dims.items():
        keys = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{role}.kha.{role}.")}
        if set(keys) == {"weight"}:
            t = keys["weight"]
            fn = lambda h, t=t: h @ t  # noqa: E731
        else:
            u, g, d = keys["up"], keys["gate"], keys["down"]
            fn = lambda h, u=u, g=g, d=d: (2 * (h @ u) * torch.sigmoid(h @ g)) @ d  # noqa: E731
        getattr(ref, role).register_forward_hook(
            lambda m, i, y, fn=fn, dh=dh: fn(y.unflatten(-1, (-1, dh))).flatten(-2)
        )
    return ref


def _perturb(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".kha." in f".{n}":
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("cfg", [kc.KHAConfig(q="linear", k="linear", v="mlp"), kc.KHAConfig(v="linear")])
@pytest.mark.parametrize("slice_size", [1, 2, 3])
def test_sliced_attention_transforms_every_head(cfg, slice_size):
    torch.manual_seed(0)
    model = Sliced(slice_size)
    untouched = copy.deepcopy(model)
    x = torch.randn(2, 40, D)
    kc.apply(model, cfg, example_args=(x,))
    for role in ("q", "k", "v"):
        if role in cfg.roles():
            (slot,) = getattr(model, role)._kha_slots
            assert (slot.num_heads, slot.head_dim) == (H, DH), slot  # every head, not the first slice's
    _perturb(model)
    ref = _reference(untouched, model, dict.fromkeys(cfg.roles(), DH))
    with torch.no_grad():
        got, want, plain = model(x), ref(x), untouched(x)
    assert (want - plain).abs().max() > 1e-2  # KHA moves the output: the comparison can fail
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # ... and after folding
    if all(k == "linear" for k in cfg.roles().values()):
        kc.fold(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_differential_halves_share_one_transform_per_role():
    torch.manual_seed(0)
    model = Differential()
    untouched = copy.deepcopy(model)
    x = torch.randn(2, 40, D)
    cfg = kc.KHAConfig(q="linear", k="linear", v="mlp")
    kc.apply(model, cfg, example_args=(x,))
    (q_slot,) = model.q._kha_slots
    assert (q_slot.num_heads, q_slot.head_dim) == (2 * H, DH // 2)  # both halves of every head
    _perturb(model)
    ref = _reference(untouched, model, {"q": DH // 2, "k": DH // 2, "v": DH})
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_union_of_slots():
    a, b = HeadSlot("q", 0, 2, 16, 16), HeadSlot("q", 32, 2, 16, 16)
    assert union_slots(a, b) == HeadSlot("q", 0, 4, 16, 16)
    halves = union_slots(HeadSlot("q", 0, 4, 8, 16), HeadSlot("q", 8, 4, 8, 16))
    assert halves == HeadSlot("q", 0, 8, 8, 8)
    assert union_slots(HeadSlot("v", 0, 1, 16, 16), HeadSlot("v", 48, 1, 16, 16)) == HeadSlot("v", 0, 2, 16, 48)
    gapped = union_slots(HeadSlot("v", 0, 2, 16, 48), HeadSlot("v", 64, 1, 16, 16))  # heads at 0, 48, 64
    assert gapped is not None and gapped.rows is not None
    assert [row[0] for row in gapped.index().tolist()] == [0, 48, 64]
    assert union_slots(a, HeadSlot("q", 8, 2, 16, 16)) is None  # heads overlapping in part
    assert union_slots(a, HeadSlot("k", 32, 2, 16, 16)) is None  # another role
    assert union_slots(a, HeadSlot("q", 0, 4, 8, 8)) is None  # another head size
