"""Hypothesis cases for functional and N-d projections, and an independent per-head reference.

The reference never runs the model's forward: it slices each head's weight out of the stored
parameters by hand, applies the KHA transforms as docs/method.md writes them to each head vector, and
runs softmax attention head by head (GQA by integer division of the head number).

Example::

    model = FunctionalCase(d=8, n_head=2, n_kv=1, head_dim=4, fused=True, bias=True, op="linear")
    expected = reference(model, x, transforms)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn


def _attend(q, k, v):  # (B, H, S, Dh), (B, KV, S, Dh)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v)


class FunctionalCase(nn.Module):
    """q, k, v from bare 2-D weights (fused [Q|K|V] or separate) through F.linear or matmul."""

    def __init__(self, d, n_head, n_kv, head_dim, fused, bias, op):
        super().__init__()
        self.d, self.h, self.kv, self.dh, self.fused, self.op = d, n_head, n_kv, head_dim, fused, op
        sizes = [n_head * head_dim, n_kv * head_dim, n_kv * head_dim]
        if fused:
            self.w = nn.Parameter(torch.randn(sum(sizes), d))
            self.b = nn.Parameter(torch.randn(sum(sizes))) if bias else None
        else:
            for r, n in zip("qkv", sizes):
                setattr(self, f"w{r}", nn.Parameter(torch.randn(n, d)))
                setattr(self, f"b{r}", nn.Parameter(torch.randn(n)) if bias else None)
        self.o = nn.Parameter(torch.randn(n_head * head_dim, d))

    def _proj(self, x, w, b):
        if self.op == "linear":
            return F.linear(x, w, b)
        y = x @ w.t() if self.op == "matmul" else torch.matmul(x, w.T)
        return y if b is None else y + b

    def forward(self, x):
        B, S, _ = x.shape
        if self.fused:
            q, k, v = self._proj(x, self.w, self.b).split([self.h * self.dh, self.kv * self.dh, self.kv * self.dh], -1)
        else:
            q, k, v = (self._proj(x, getattr(self, f"w{r}"), getattr(self, f"b{r}")) for r in "qkv")
        q = q.view(B, S, self.h, self.dh).transpose(1, 2)  # (B, H, S, Dh)
        k, v = (t.view(B, S, self.kv, self.dh).transpose(1, 2) for t in (k, v))
        return _attend(q, k, v).transpose(1, 2).reshape(B, S, -1) @ self.o

    def head_weights(self, role: str, h: int):
        """(d, Dh) weight and (Dh,) bias of head ``h`` of ``role``, sliced from the stored parameters."""
        sd = self.state_dict()
        dh, offset = self.dh, {"q": 0, "k": self.h * self.dh, "v": (self.h + self.kv) * self.dh}[role]
        if self.fused:
            rows = slice(offset + h * dh, offset + (h + 1) * dh)
            return sd["w"][rows].t(), (sd["b"][rows] if "b" in sd else torch.zeros(dh))
        rows = slice(h * dh, (h + 1) * dh)
        return sd[f"w{role}"][rows].t(), (sd[f"b{role}"][rows] if f"b{role}" in sd else torch.zeros(dh))


class EinsumCase(nn.Module):
    """q, k, v from N-d weights: (d, H, Dh) or (H, d, Dh) with einsum, tensordot, or one (3, d, H, Dh)."""

    def __init__(self, d, n_head, n_kv, head_dim, layout, bias):
        super().__init__()
        self.d, self.h, self.kv, self.dh, self.layout = d, n_head, n_kv, head_dim, layout
        heads = {"q": n_head, "k": n_kv, "v": n_kv}
        if layout == "fused":
            self.w = nn.Parameter(torch.randn(3, d, n_head, head_dim))
        else:
            for r, n in heads.items():
                shape = (n, d, head_dim) if layout == "hdk" else (d, n, head_dim)
                setattr(self, f"w{r}", nn.Parameter(torch.randn(*shape)))
        for r, n in heads.items():
            setattr(self, f"b{r}", nn.Parameter(torch.randn(n, 1, head_dim)) if bias and layout != "fused" else None)
        self.o = nn.Parameter(torch.randn(n_head, head_dim, d))

    def forward(self, x):
        if self.layout == "fused":
            q, k, v = torch.einsum("bsd,tdhk->tbhsk", x, self.w).unbind(0)
        else:
            out = []
            for r in "qkv":
                w, b = getattr(self, f"w{r}"), getattr(self, f"b{r}")
                if self.layout == "hdk":
                    y = torch.einsum("bsd,hdk->bhsk", x, w)
                elif self.layout == "dhk":
                    y = torch.einsum("bsd,dhk->bhsk", x, w)
                else:  # tensordot: (B, S, H, Dh) -> (B, H, S, Dh)
                    y = torch.tensordot(x, w, dims=([2], [0])).transpose(1, 2)
                out.append(y if b is None else y + b)
            q, k, v = out
        return torch.einsum("bhsk,hkd->bsd", _attend(q, k, v), self.o)

    def head_weights(self, role: str, h: int):
        sd = self.state_dict()
        if self.layout == "fused":
            return sd["w"]["qkv".index(role), :, h, :], torch.zeros(self.dh)
        w = sd[f"w{role}"]
        wh = w[h] if self.layout == "hdk" else w[:, h, :]
        b = sd.get(f"b{role}")
        return wh, (b[h, 0] if b is not None else torch.zeros(self.dh))


def spec_transform(params: dict[str, torch.Tensor]):
    """docs/method.md: ``h @ T`` (linear) or ``2 * ((h W_up) * sigmoid(h W_gate)) W_down`` (MLP-value)."""
    if "weight" in params:
        return lambda h: h @ params["weight"]
    return lambda h: 2 * ((h @ params["up"]) * torch.sigmoid(h @ params["gate"])) @ params["down"]


def reference(model, x: torch.Tensor, transforms: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
    """The model's output computed head by head from its stored parameters, with KHA by the spec."""
    ident = {r: (lambda h: h) for r in "qkv"}
    tf = {**ident, **{r: spec_transform(p) for r, p in transforms.items()}}
    heads = {}
    for r, n in (("q", model.h), ("k", model.kv), ("v", model.kv)):
        heads[r] = []
        for h in range(n):
            w, b = model.head_weights(r, h)
            heads[r].append(tf[r](x @ w + b))  # (B, S, Dh)
    outs = []
    group = model.h // model.kv
    for h in range(model.h):
        q, k, v = heads["q"][h], heads["k"][h // group], heads["v"][h // group]
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(model.dh), dim=-1)
        outs.append(att @ v)  # (B, S, Dh)
    o = model.state_dict()["o"].reshape(model.h * model.dh, -1)
    return torch.cat(outs, dim=-1) @ o


def kha_transforms(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """{role: {param name: tensor}} of the KHA transforms in ``model`` (one per role)."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if ".kha." in f".{name}":
            role, pname = f".{name}".split(".kha.")[-1].split(".")
            found.setdefault(role, {})[pname] = p.detach()
    return found


@st.composite
def gqa_heads(draw):
    n_kv = draw(st.sampled_from([1, 2]))
    return n_kv * draw(st.sampled_from([1, 2])), n_kv, draw(st.sampled_from([2, 4]))
