"""Linear-attention kernels kept whole in the trace (kha_compile/analysis/opaque_kernels.py).

A model calling an fla kernel by a module-level name (here a stand-in: a gated linear attention in
torch, named and placed like ``fla.ops.simple_gla.chunk_simple_gla``) shows one
``kha::linear_attention_kernel`` op in the analysis graph: its site anchors on the kernel's q, k,
v, and KHA on them matches the per-head reference. The function is put back after the trace.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import kha_compile as kc
from helpers import perturb
from kha_compile.analysis.opaque_kernels import kernel_form
from linear_forms import DH, B, Block, D, H, Net, S, layout
from reference import Reference


def _simple_gla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, output_final_state: bool = False, **_: object):
    """Gated linear attention over (B, S, H, D): state = exp(g_t) state + k_t^T v_t, o_t = q_t state."""
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    out = []
    for t in range(q.shape[1]):
        kv = k[:, t, :, :, None] * v[:, t, :, None, :]  # (B, H, Dk, Dv)
        state = g[:, t, :, None, None].exp() * state + kv
        out.append((q[:, t, :, :, None] * state).sum(-2))
    return torch.stack(out, dim=1), (state if output_final_state else None)


_simple_gla.__name__ = "chunk_simple_gla"
_simple_gla.__module__ = "fla.ops.simple_gla.chunk"  # where flash-linear-attention keeps it
chunk_simple_gla = _simple_gla  # the model calls it by this module-level name, as after `from fla.ops import ...`


class GLA(Block):
    """q, k, v linears (heads (B, S, H, Dh)), a decay from its own linear, the fla-style kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.g = torch.nn.Linear(D, H)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (p(x).unflatten(-1, (H, DH)) for p in (self.q, self.k, self.v))  # (B, S, H, Dh)
        g = torch.nn.functional.logsigmoid(self.g(x))  # (B, S, H)
        o, _ = chunk_simple_gla(q, k, v, g=g)
        return x + self.o(o.flatten(2))


def test_kernel_form_names_known_kernels_and_fla_ops():
    assert kernel_form(_simple_gla) == "fla.chunk_simple_gla"
    assert kernel_form(torch.matmul) is None and kernel_form(GLA) is None


@pytest.mark.parametrize("cfg", [dict(q="linear", k="linear", v="linear"), dict(v="mlp")], ids=["linear_qkv", "mlp_v"])
def test_an_fla_kernel_is_one_site_and_kha_on_its_heads_matches_the_reference(cfg):
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = Net(GLA).eval()
    report = kc.inspect(model, example_args=(x,))
    assert [(s.name, s.anchor, s.status) for s in report.sites] == [
        (f"blocks.{i}", "fla.chunk_simple_gla", "matched") for i in range(2)
    ], str(report)
    assert chunk_simple_gla is _simple_gla  # put back after the trace
    with torch.no_grad():
        before = model(x)
    kc.apply(model, kc.KHAConfig(**cfg), example_args=(x,))
    with torch.no_grad():
        assert torch.equal(model(x), before)
    perturb(model)
    ref = Reference(Net(GLA), layout, cfg={}).load(model.state_dict(), expect=cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref.no_grad(x), rtol=1e-5, atol=1e-5)
