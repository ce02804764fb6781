"""A submodule whose forward branches on its inputs' values is traced with the recorded inputs' real values.

Reformer's LSH layer checks ``if attention_mask.sum() < n`` before hashing: torch.export cannot guard
on that, so neither the whole model nor the layer traces on fake tensors alone, and the layer's
attention used to be missing from the report. Traced again with real tensors beside the fake ones
(``analysis.trace.real_values``), the branch takes the example inputs' way and the attention is a site.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import kha_compile as kc
from helpers import perturb
from linear_forms import DH, B, D, H, S, layout
from reference import Reference


class MaskedAttention(nn.Module):
    """Self-attention that zeroes padded tokens first, only when there are any (a branch on data)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        if mask.sum() < mask.numel():  # padding present
            x = x * mask[..., None]
        q, k, v = (p(x).unflatten(-1, (H, DH)).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(o.transpose(1, 2).flatten(2))


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MaskedAttention(), MaskedAttention()])

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x, mask)
        return x


@pytest.mark.parametrize("cfg", [dict(q="linear", k="linear", v="linear"), dict(v="mlp")], ids=["linear_qkv", "mlp_v"])
def test_a_branch_on_data_is_traced_with_real_values_and_its_attention_is_a_site(cfg):
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, S)
    torch.manual_seed(0)
    model = Masked().eval()
    report = kc.inspect(model, example_args=(x, mask))
    assert [(s.name, s.status) for s in report.sites] == [("blocks.0", "matched"), ("blocks.1", "matched")], str(report)
    assert report.trace_path.startswith("per submodule") and not report.untraced
    with torch.no_grad():
        before = model(x, mask)
    kc.apply(model, kc.KHAConfig(**cfg), example_args=(x, mask))
    with torch.no_grad():
        assert torch.equal(model(x, mask), before)
    perturb(model)
    ref = Reference(Masked(), layout, cfg={}).load(model.state_dict(), expect=cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(x, mask), ref.no_grad(x, mask), rtol=1e-5, atol=1e-5)
