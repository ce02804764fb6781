"""Completeness: every attention a traced module computes is a site, matched or skipped with a reason."""

from __future__ import annotations

import torch
from torch import nn

import forms_zoo as fz
import kha_compile as kc
from kha_compile.analysis.hops import inline_wrappers
from kha_compile.analysis.trace import capture

x = torch.randn(2, 12, fz.D, generator=torch.Generator().manual_seed(0))


class Unread(fz.SelfAttn):
    """Scores q @ k^T through a longer chain of score ops than the rules follow, a value product no
    rule reads: ``(p[..., None] * v[:, :, None]).sum(-2)``."""

    def forward(self, x):
        q, k, v = (fz.to_heads(m(x)) for m in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2)  # (B, H, S, S)
        for i in range(12):  # twelve soft-capping-like steps
            s = torch.tanh(s / (i + 2)) * (i + 2)
        p = torch.softmax(s, dim=-1)
        return fz.from_heads((p[..., None] * v[:, :, None]).sum(-2))


class Unread3D(fz.SelfAttn):
    """``Unread`` with the heads folded into the batch: 3-D scores (B*H, S, S) from ``bmm``."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (fz.to_heads(m(x)).reshape(b * fz.H, s, fz.DH) for m in (self.q, self.k, self.v))
        scores = torch.bmm(q, k.transpose(1, 2))  # (B*H, S, S)
        for i in range(12):
            scores = torch.tanh(scores / (i + 2)) * (i + 2)
        p = torch.softmax(scores, dim=-1)
        return (p[..., None] * v[:, None]).sum(-2).reshape(b, fz.H, s, fz.DH).transpose(1, 2).flatten(2)


class Router(nn.Module):
    """A softmax over x @ W (a router): a projection, not attention scores."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(fz.D, 4)
        self.attn = fz.SelfAttn()

    def forward(self, x):
        return self.attn(x) * torch.softmax(self.gate(x), dim=-1).sum(-1, keepdim=True)


def test_a_softmax_no_rule_claims_is_a_skipped_site_with_the_reason():
    report = kc.inspect(Unread(), example_args=(x,))
    (site,) = report.sites
    assert site.status == "skipped" and site.anchor == "unmatched"
    assert "looks like attention" in site.reason and "no attention rule recognises this form" in site.reason


def test_a_softmax_over_3d_scores_with_heads_in_the_batch_no_rule_claims_is_a_skipped_site():
    """(B*H, S, S) scores: the completeness check must not need a separate head axis."""
    (site,) = kc.inspect(Unread3D(), example_args=(x,)).sites
    assert site.status == "skipped" and site.anchor == "unmatched"
    assert "softmax" in site.reason and "[8, 12, 12]" in site.reason


def test_a_router_softmax_is_no_site():
    report = kc.inspect(Router(), example_args=(x,))
    assert [s.name for s in report.sites] == ["attn"] and report.sites[0].matched


def test_a_block_the_representative_did_not_run_traces_the_model_whole():
    report = kc.inspect(fz.ZipNet(), example_args=(x,))
    assert [s.name for s in report.matched] == ["blocks.0.attentions.0", "blocks.1.attentions.0"]
    assert report.trace_path.startswith("whole model (") and "did not run" in report.trace_path


def test_an_attention_outside_the_blocks_using_their_projections_traces_every_block():
    report = kc.inspect(fz.TupleNet(), example_args=(x,))
    assert len(report.matched) == 2 and {s.q_proj for s in report.matched} == {"blocks.0.q", "blocks.1.q"}
    assert "uses the projections of a repeated block" in report.trace_path


def test_wrapping_regions_are_inlined_so_their_attention_is_in_the_graph():
    ep = capture(fz.RegionsNet(), (x,), {}).exported
    hops = [n for n in ep.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert [h.target.name() for h in hops] == ["wrap_with_set_grad_enabled", "wrap_with_autocast"]
    assert inline_wrappers(ep.graph_module) == 3  # the no_grad region and the autocast regions of both blocks
    sdpa = [n for n in ep.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 2 and not any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in ep.graph.nodes)
