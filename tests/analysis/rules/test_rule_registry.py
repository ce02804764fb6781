"""Attention rules are a registry: a new attention form is one rule, tried after (or before) the built-ins."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kha_compile as kc
from helpers import perturb
from kha_compile.analysis import rules
from kha_compile.analysis.layout import shape_of
from kha_compile.analysis.rules import Anchor, attention_rules, register_rule
from kha_compile.core.errors import NoAttentionFoundError


@torch.library.custom_op("kha_test::attention", mutates_args=())
def toy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


@toy_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class ToyAttention(nn.Module):
    """Attention through an op no built-in rule knows: (B, H, L, Dh) q, k, v."""

    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = (
            p(x).view(B, L, self.h, D // self.h).transpose(1, 2) for p in (self.q, self.k, self.v)
        )  # (B, H, L, Dh)
        return self.o(toy_attention(q, k, v).transpose(1, 2).reshape(B, L, D))


class ToyRule:
    name = "toy_attention"

    def match(self, g, node):
        if node.target is not torch.ops.kha_test.attention.default:
            return None
        roles = dict(zip("qkv", node.args[:3]))
        return Anchor(node, self.name, roles, {r: shape_of(n)[-1] for r, n in roles.items()})


class DeclineSDPA:
    name = "decline_sdpa"

    def match(self, g, node):
        if node.target is not torch.ops.aten.scaled_dot_product_attention.default:
            return None
        return Anchor(node, self.name, {}, {}, reason="declined by the test rule")


@pytest.fixture
def restore_rules():
    saved = attention_rules()
    yield
    rules.RULES.restore(saved)


def test_builtin_rules_come_first_in_order():
    names = [r.name for r in attention_rules()]
    assert names.index("sdpa") < names.index("manual_softmax")


def test_an_unknown_attention_op_is_not_matched_until_a_rule_is_registered(restore_rules):
    torch.manual_seed(0)
    model, x = ToyAttention().eval(), torch.randn(2, 5, 32)
    with pytest.raises(NoAttentionFoundError, match="no per-head attention"):
        kc.apply(model, kc.KHAConfig(v="linear"), example_args=(x,))
    register_rule(ToyRule())
    with torch.no_grad():
        ref = model(x)
    kc.apply(model, kc.KHAConfig(q="linear", v="mlp"), example_args=(x,))
    (site,) = kc.inspect(model, example_args=(x,)).matched
    assert site.anchor == "toy_attention" and site.num_heads == 4 and site.head_dim == 8
    assert site.transforms == {"q": "linear", "v": "mlp"}
    with torch.no_grad():
        assert torch.equal(model(x), ref)
        perturb(model)
        assert not torch.allclose(model(x), ref, atol=1e-5)


def test_a_rule_registered_first_wins_and_its_reason_is_reported(restore_rules, caplog):
    import zoo

    case = zoo.make("nanogpt")
    register_rule(DeclineSDPA(), first=True)
    report = kc.inspect(case.model, *case.example)
    assert not report.matched and report.skipped
    assert all(s.anchor == "decline_sdpa" and s.reason == "declined by the test rule" for s in report.skipped)
    with caplog.at_level(logging.INFO, logger="kha_compile.analysis.rules"):
        register_rule(DeclineSDPA())  # same name: replaces, logged, and now tried at the default priority
    names = [r.name for r in attention_rules()]
    assert names.count("decline_sdpa") == 1
    assert names.index("sdpa") < names.index("decline_sdpa") < names.index("external")
    assert any("replaced" in r.message for r in caplog.records)
    assert kc.inspect(case.model, *case.example).matched
