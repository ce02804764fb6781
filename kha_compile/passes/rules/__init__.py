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

import logging

from ...registry import Registry
from .base import Anchor, AttentionRule

__all__ = ["Anchor", "AttentionRule", "attention_rules", "register_rule"]

log = logging.getLogger(__name__)


def _builtins() -> list[AttentionRule]:
    from .manual_softmax import ManualSoftmaxRule
    from .sdpa import SDPARule

    return [SDPARule(), ManualSoftmaxRule()]


RULES: Registry[AttentionRule] = Registry(
    "attention rule", __name__, __path__, builtins=_builtins, skip=("base", "sdpa", "manual_softmax")
)


def register_rule(rule: AttentionRule, *, first: bool = False) -> None:
    """Add ``rule`` last (or first); a rule of the same name is replaced, with a log line.

    Example::

        register_rule(FlexAttentionRule())
    """
    RULES.register(rule, first=first)


def attention_rules() -> list[AttentionRule]:
    """The registered rules in the order they are tried.

    Example::

        [r.name for r in attention_rules()]     # ["sdpa", "manual_softmax", ...]
    """
    return RULES.items()
