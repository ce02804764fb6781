"""Attention rules as a registry: each recognises one attention form and returns an :class:`Anchor`.

Built in, in this order: ``sdpa`` (``aten.scaled_dot_product_attention`` and fused variants) and
``manual_softmax`` (``softmax(q @ k^T ...) @ v``). Every other file in this package is imported on
first use, so a new form is one new file that ends with ``register_rule(MyRule())``.

The API::

    @dataclasses.dataclass(frozen=True)
    class Anchor:
        node: Node; rule: str; roles: dict[str, Node]; head_dims: dict[str, int]; reason: str = ""
    class AttentionRule(Protocol):
        name: str
        def match(self, g: MatchGraph, node: Node) -> Optional[Anchor]: ...   # None: not this rule's op
    register_rule(rule, *, first=False)      # a duplicate name replaces the old one (logged)
    attention_rules() -> list[AttentionRule]  # in the order they are tried; the first Anchor wins
"""
from __future__ import annotations

import importlib
import logging
import pkgutil

from .base import Anchor, AttentionRule

__all__ = ["Anchor", "AttentionRule", "attention_rules", "register_rule"]

log = logging.getLogger(__name__)

_RULES: list[AttentionRule] = []
_LOADED = False
_BUILTIN = ("sdpa", "manual_softmax")


def _load() -> None:
    """Register the built-in rules, then import every other file of this package (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from .manual_softmax import ManualSoftmaxRule
    from .sdpa import SDPARule

    for rule in (SDPARule(), ManualSoftmaxRule()):
        if all(r.name != rule.name for r in _RULES):
            _RULES.append(rule)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name not in ("base", *_BUILTIN):
            importlib.import_module(f"{__name__}.{info.name}")


def register_rule(rule: AttentionRule, *, first: bool = False) -> None:
    """Add ``rule`` last (or first); a rule of the same name is replaced, with a log line.

    Example::

        register_rule(FlexAttentionRule())
    """
    _load()
    for i, old in enumerate(_RULES):
        if old.name == rule.name:
            log.info("attention rule %r replaced by %s", rule.name, type(rule).__name__)
            del _RULES[i]
            break
    if first:
        _RULES.insert(0, rule)
    else:
        _RULES.append(rule)


def attention_rules() -> list[AttentionRule]:
    """The registered rules in the order they are tried.

    Example::

        [r.name for r in attention_rules()]     # ["sdpa", "manual_softmax", ...]
    """
    _load()
    return list(_RULES)
