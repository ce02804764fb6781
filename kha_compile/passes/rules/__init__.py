"""Attention rules, tried in order on every graph node; the first that answers wins.

(Placeholder of helper "forms": the registry of helper "arch" replaces this file; the interface is
the same. Forms' rules: ``einsum_softmax``, ``flex_attention`` then ``external``, registered after sdpa/manual_softmax.)
"""
from __future__ import annotations

from .base import Anchor, AttentionRule
from .einsum_softmax import EinsumSoftmaxRule
from .external import ExternalAttentionRule, register_attention_op
from .flex_attention import FlexAttentionRule

__all__ = ["Anchor", "AttentionRule", "attention_rules", "register_attention_op", "register_rule"]

_RULES: list[AttentionRule] = []


def register_rule(rule: AttentionRule, *, first: bool = False) -> None:
    """Add ``rule`` to the rules tried on every node (last, or first with ``first=True``).

    Example::

        register_rule(EinsumSoftmaxRule())
register_rule(FlexAttentionRule())
    """
    if any(r.name == rule.name for r in _RULES):
        raise ValueError(f"an attention rule named {rule.name!r} is registered already")
    if first:
        _RULES.insert(0, rule)
    else:
        _RULES.append(rule)


def attention_rules() -> list[AttentionRule]:
    """The registered rules, in the order they are tried.

    Example::

        [r.name for r in attention_rules()]   # ["flex_attention", "external"]
    """
    return list(_RULES)


register_rule(EinsumSoftmaxRule())
register_rule(FlexAttentionRule())
register_rule(ExternalAttentionRule())
