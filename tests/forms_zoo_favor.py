"""Random-feature linear attention (FAVOR+, Performer) written by hand, with per-head references (issue 34, forms 5, 6).

FAVOR+ puts ``phi(x) = (exp(x' W^T - |x'|^2 / 2 - max) + eps) / sqrt(m)`` (``x' = x / Dh^(1/4)``, ``W`` (m, Dh)
a fixed random projection held in a seeded buffer, the max over the features of each query, over every
key feature and token for the keys) into linear attention, ``phi(q) (phi(k)^T v) / (phi(q) sum_j phi(k_j))``.
The forms:

* :class:`FavorMatmul`: separate q, k, v, o linears; the random projection ``x @ W^T`` of a (m, Dh) buffer,
  the key-value state ``phi(k)^T @ v`` first, the normaliser a product with the summed keys;
* :class:`FavorEinsum`: the same, written with ``'...'`` einsums: the projection matrix expanded over the
  batch and the heads, the state ``einsum('...nd,...ne->...de', phi(k), v)``, the output one three-operand
  einsum with the inverse normaliser;
* :class:`HalfFavorHalfLocal`: one fused qkv linear whose heads feed two forms: the first half FAVOR+,
  the second half softmax attention inside a band of ``W`` tokens; the outputs concatenated over heads.

Every model has ``reference(x)``: its output computed from its state dict head by head, with KHA as
docs/method.md writes it (:func:`kha_fn`: the tensors named ``<projection>.kha.<role>.<param>``; ``expect``
asserts the kind each role carries, so a missing MLP-value or a linear one in its place fails). It never
runs the model's modules: the projections are ``F.linear`` of the stored weights, the attention per head
below. One transform per role is shared by every head of a projection, the two forms of
:class:`HalfFavorHalfLocal` included (the definition kha_compile keeps for one projection read by several
attention calls; ``docs/attention_forms.md``).

Example::

    model = Net(FavorEinsum)
    kc.apply(model, kc.KHAConfig(), example_args=(x,))
    torch.testing.assert_close(model(x), model.reference(x, expect={"v": "mlp"}))
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from projection_reference import spec_transform

D, H = 32, 4
DH = D // H
M = 16  # random features per head
WINDOW = 4  # the local half: keys within WINDOW tokens of the query
B, S = 2, 40  # more tokens than d_model: the token-side strategy runs
EPS = 1e-4

__all__ = [
    "DH",
    "FORMS",
    "B",
    "D",
    "FavorEinsum",
    "FavorMatmul",
    "H",
    "HalfFavorHalfLocal",
    "Net",
    "S",
    "kha_fn",
]


def _omega() -> Tensor:
    """The fixed random projection (m, Dh), the same for every layer (seeded)."""
    return torch.randn(M, DH, generator=torch.Generator().manual_seed(11))


def _heads(y: Tensor, n: int = H) -> Tensor:
    """(B, S, n*Dh) -> (B, n, S, Dh)."""
    return y.unflatten(-1, (n, DH)).transpose(1, 2)


# ---- the forms --------------------------------------------------------------------------------


class FavorMatmul(nn.Module):
    """FAVOR+ with the random projection as ``x @ W^T`` and matmuls for the products."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.register_buffer("omega", _omega())

    def features(self, x: Tensor, query: bool) -> Tensor:  # (B, H, S, Dh) -> (B, H, S, m)
        x = x * DH**-0.25
        proj = x @ self.omega.t()
        norm = (x**2).sum(-1, keepdim=True) / 2
        top = proj.amax(-1, keepdim=True) if query else proj.amax(dim=(-1, -2), keepdim=True)
        return (torch.exp(proj - norm - top.detach()) + EPS) / math.sqrt(M)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_heads(p(x)) for p in (self.q, self.k, self.v))
        qf, kf = self.features(q, True), self.features(k, False)
        state = kf.transpose(-2, -1) @ v  # (B, H, m, Dh)
        norm = qf @ kf.sum(-2, keepdim=True).transpose(-2, -1)  # (B, H, S, 1)
        return x + self.o(((qf @ state) / norm).transpose(1, 2).flatten(2))

    def reference(self, x: Tensor, sd: dict[str, Tensor], prefix: str, expect: dict[str, str]) -> Tensor:
        t = {r: kha_fn(sd, f"{prefix}.{r}", r, expect.get(r)) for r in "qkv"}
        heads = {r: _ref_heads(sd, f"{prefix}.{r}", x, t[r]) for r in "qkv"}
        out = [_ref_favor(heads["q"][h], heads["k"][h], heads["v"][h], sd[f"{prefix}.omega"]) for h in range(H)]
        return x + F.linear(torch.cat(out, -1), sd[f"{prefix}.o.weight"], sd[f"{prefix}.o.bias"])


class FavorEinsum(FavorMatmul):
    """FAVOR+ with ``'...'`` einsums: the projection matrix expanded over (B, H), a three-operand output einsum."""

    def features(self, x: Tensor, query: bool) -> Tensor:
        x = x * DH**-0.25
        omega = self.omega.expand(*x.shape[:2], *self.omega.shape)  # (B, H, m, Dh)
        proj = torch.einsum("...id,...jd->...ij", x, omega)
        norm = (x**2).sum(-1, keepdim=True) / 2
        top = proj.amax(-1, keepdim=True) if query else proj.amax(dim=(-1, -2), keepdim=True)
        return (torch.exp(proj - norm - top.detach()) + EPS) / math.sqrt(M)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (_heads(p(x)) for p in (self.q, self.k, self.v))
        qf, kf = self.features(q, True), self.features(k, False)
        inv = 1.0 / torch.einsum("...nd,...d->...n", qf, kf.sum(-2))  # (B, H, S)
        state = torch.einsum("...nd,...ne->...de", kf, v)  # (B, H, m, Dh)
        out = torch.einsum("...de,...nd,...n->...ne", state, qf, inv)  # (B, H, S, Dh)
        return x + self.o(out.transpose(1, 2).flatten(2))


class HalfFavorHalfLocal(nn.Module):
    """One fused qkv linear, (B, S, 3, H, Dh); heads 0..H/2-1 FAVOR+, heads H/2.. banded softmax attention."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("omega", _omega())

    features = FavorMatmul.features

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, H, DH)).permute(2, 0, 3, 1, 4)  # each (B, H, S, Dh)
        h = H // 2
        qf, kf = self.features(q[:, :h], True), self.features(k[:, :h], False)
        lin = (qf @ (kf.transpose(-2, -1) @ v[:, :h])) / (qf @ kf.sum(-2, keepdim=True).transpose(-2, -1))
        scores = q[:, h:] @ k[:, h:].transpose(-2, -1) / math.sqrt(DH)  # (B, H/2, S, S)
        local = torch.softmax(scores.masked_fill(~_band(x.shape[1]), float("-inf")), dim=-1) @ v[:, h:]
        out = torch.cat([lin, local], dim=1)  # (B, H, S, Dh)
        return x + self.o(out.transpose(1, 2).flatten(2))

    def reference(self, x: Tensor, sd: dict[str, Tensor], prefix: str, expect: dict[str, str]) -> Tensor:
        w, b = sd[f"{prefix}.qkv.weight"], sd[f"{prefix}.qkv.bias"]
        out = []
        for h in range(H):
            qkv = []
            for i, r in enumerate("qkv"):
                rows = slice(i * D + h * DH, i * D + (h + 1) * DH)  # role block i, head h
                qkv.append(kha_fn(sd, f"{prefix}.qkv", r, expect.get(r))(F.linear(x, w[rows], b[rows])))
            if h < H // 2:
                out.append(_ref_favor(*qkv, sd[f"{prefix}.omega"]))
            else:
                out.append(_ref_local(*qkv))
        return x + F.linear(torch.cat(out, -1), sd[f"{prefix}.o.weight"], sd[f"{prefix}.o.bias"])


FORMS: dict[str, type[nn.Module]] = {
    "favor_matmul": FavorMatmul,
    "favor_einsum": FavorEinsum,
    "half_favor_half_local": HalfFavorHalfLocal,
}


class Net(nn.Module):
    """Two blocks of one form."""

    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x

    def reference(self, x: Tensor, expect: dict[str, str]) -> Tensor:
        """The output from the state dict, head by head; ``expect``: role -> the kind it must carry."""
        sd = {n: t.detach() for n, t in self.state_dict().items()}
        for i, blk in enumerate(self.blocks):
            x = blk.reference(x, sd, f"blocks.{i}", expect)
        return x


# ---- the reference, head by head ----------------------------------------------------------------


def kha_fn(sd: dict[str, Tensor], proj: str, role: str, kind: str | None) -> Callable[[Tensor], Tensor]:
    """docs/method.md's transform of ``role`` held at ``proj`` (``<proj>.kha.<role>.*``), checked to be ``kind``."""
    pre = f"{proj}.kha.{role}."
    params = {n[len(pre) :]: t for n, t in sd.items() if n.startswith(pre)}
    got = None if not params else "linear" if set(params) == {"weight"} else "mlp"
    assert got == kind, f"{proj} {role}: KHA {got!r} in the state dict, expected {kind!r} ({sorted(params)})"
    return spec_transform(params) if params else (lambda h: h)


def _ref_heads(sd: dict[str, Tensor], proj: str, x: Tensor, t: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """Each head's vectors (B, S, Dh) of a separate projection, its rows h*Dh..(h+1)*Dh, transformed by ``t``."""
    w, b = sd[f"{proj}.weight"], sd[f"{proj}.bias"]
    return [t(F.linear(x, w[h * DH : (h + 1) * DH], b[h * DH : (h + 1) * DH])) for h in range(H)]


def _phi(x: Tensor, omega: Tensor, over: tuple[int, ...]) -> Tensor:
    """FAVOR+'s positive random features of one head's vectors (B, S, Dh) -> (B, S, m)."""
    c = DH**-0.25
    logits = torch.einsum("bsd,md->bsm", c * x, omega) - (c * c / 2) * (x * x).sum(-1, keepdim=True)
    top = torch.einsum("bsd,md->bsm", c * x, omega).amax(dim=over, keepdim=True)
    return (torch.exp(logits - top) + EPS) / math.sqrt(omega.shape[0])


def _ref_favor(q: Tensor, k: Tensor, v: Tensor, omega: Tensor) -> Tensor:
    """One head of FAVOR+ linear attention: (B, S, Dh) each -> (B, S, Dh)."""
    qf, kf = _phi(q, omega, (-1,)), _phi(k, omega, (-1, -2))
    num = torch.einsum("bsm,btm,btd->bsd", qf, kf, v)
    den = torch.einsum("bsm,btm->bs", qf, kf)
    return num / den[..., None]


def _band(n: int) -> Tensor:
    i = torch.arange(n)
    return (i[:, None] - i[None, :]).abs() <= WINDOW


def _ref_local(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One head of softmax attention inside the band: (B, S, Dh) each -> (B, S, Dh)."""
    s = torch.einsum("bsd,btd->bst", q, k) / math.sqrt(DH)
    return torch.softmax(s.masked_fill(~_band(q.shape[1]), float("-inf")), dim=-1) @ v
