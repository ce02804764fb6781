"""An attention that fills a module-level scratch buffer in place (issue 34, form 1), written by hand.

Megatron-style: sequence-first activations (S, B, D); one fused projection whose output is, per group
of heads, that group's REP query heads, then its key, then its value; the scores are written into a
buffer kept at module level and reused across calls (``torch.baddbmm(..., beta=0, out=<buffer>)``),
allocated on the first call. A trace that runs this code on fake tensors must not leave a fake buffer
behind: the next real call would write into it and return a fake tensor.

Example::

    model = ScratchNet()
    kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,))    # x: (S, B, D)
    torch.testing.assert_close(model(x), model.reference(x))
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from forms_zoo import DH, D, H, lin
from forms_zoo_more import shared_kha

GROUPS = 2
REP = H // GROUPS

_SCORES: Tensor | None = None  # the library's scratch buffer: (B*H, S, S), grown on demand, reused


def scores_buffer(n: int, s: int, t: int, like: Tensor) -> Tensor:
    """The module-level buffer for (n, s, t) scores, allocated when the shape or dtype changes."""
    global _SCORES
    if _SCORES is None or _SCORES.shape != (n, s, t) or _SCORES.dtype != like.dtype:
        _SCORES = torch.empty(n, s, t, dtype=like.dtype, device=like.device)
    return _SCORES


class ScratchAttention(nn.Module):
    """q, k, v fused per group of heads, sequence first, scores written into the module-level buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(D, GROUPS * (REP + 2) * DH)
        self.dense = nn.Linear(H * DH, D)

    def forward(self, x: Tensor) -> Tensor:
        s, b, _ = x.shape
        y = self.query_key_value(x).view(s, b, GROUPS, REP + 2, DH)
        q = y[..., :REP, :].reshape(s, b * H, DH)  # head g * REP + r
        k = y[..., REP : REP + 1, :].expand(s, b, GROUPS, REP, DH).reshape(s, b * H, DH)
        v = y[..., REP + 1 :, :].expand(s, b, GROUPS, REP, DH).reshape(s, b * H, DH)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (B*H, S, Dh)
        buf = scores_buffer(b * H, s, s, q)
        scores = torch.baddbmm(buf, q, k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(DH), out=buf)
        out = torch.bmm(torch.softmax(scores, dim=-1), v)  # (B*H, S, Dh)
        return x + self.dense(out.transpose(0, 1).reshape(s, b, H * DH))


class ScratchNet(nn.Module):
    """Two blocks of :class:`ScratchAttention`, with ``reference`` computed head by head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ScratchAttention() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def reference(self, x: Tensor) -> Tensor:
        """Head by head from the state dict, one shared KHA transform per role (docs/method.md)."""
        sd = self.state_dict()
        for i in range(2):
            p = f"blocks.{i}"
            t = {r: shared_kha(self, r, p) for r in "qkv"}
            y = lin(sd, f"{p}.query_key_value", x).unflatten(-1, (GROUPS, REP + 2, DH))  # (S, B, G, REP+2, Dh)
            outs = []
            for h in range(H):
                g, r = divmod(h, REP)
                q = t["q"](y[:, :, g, r, :]).transpose(0, 1)  # (B, S, Dh)
                k = t["k"](y[:, :, g, REP, :]).transpose(0, 1)
                v = t["v"](y[:, :, g, REP + 1, :]).transpose(0, 1)
                att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(DH), dim=-1)
                outs.append((att @ v).transpose(0, 1))  # (S, B, Dh)
            x = x + lin(sd, f"{p}.dense", torch.cat(outs, dim=-1))
        return x
