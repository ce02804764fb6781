"""Attention rules as a registry: each recognises one attention form and returns an :class:`Anchor`.

Built in, by priority (lower is tried first): ``lsh_attention`` (5, bucketed attention, declined
with the reason), ``sdpa`` (10, ``aten.scaled_dot_product_attention`` and fused variants),
``manual_softmax`` (20, ``softmax(q @ k^T ...) @ v``), ``einsum_softmax`` (30), ``segment_softmax``
(35), ``flex_attention`` (40), ``linear_kernel`` (45, linear-attention kernels kept whole),
``logsumexp_softmax`` (55), ``linear_attention`` (60, attention without a softmax) and ``external``
(90, ops registered with ``kc.register_attention_op``, and the hint for unregistered ones). Every file in this package is imported on first use and
registers its rule, so a new form is one new file (or any module) that calls
``register_rule(MyRule())``; a rule's ``priority`` (default 50) says where it is tried.

The API::

    @dataclasses.dataclass(frozen=True)
    class Anchor:
        node: Node; rule: str; roles: dict[str, Node]; head_dims: dict[str, int]; reason: str = ""
    class AttentionRule(Protocol):
        name: str
        priority: int                # optional, default 50
        def match(self, g: MatchGraph, node: Node) -> Optional[Anchor]: ...   # None: not this rule's op
    register_rule(rule, *, priority=None, first=False)      # a duplicate name replaces the old one (logged)
    attention_rules() -> list[AttentionRule]  # in the order they are tried; the first Anchor wins
"""

from __future__ import annotations

import logging

from ...core.registry import Registry
from .base import Anchor, AttentionRule

__all__ = ["Anchor", "AttentionRule", "attention_rules", "register_rule"]

log = logging.getLogger(__name__)


RULES: Registry[AttentionRule] = Registry("attention rule", __name__, skip=("base",))


def register_rule(rule: AttentionRule, *, priority: int | None = None, first: bool = False) -> None:
    """Add ``rule`` at its priority (``first=True``: before every built-in); one of the same name is replaced.

    Example::

        register_rule(MyRule(), priority=15)        # between sdpa (10) and manual_softmax (20)
    """
    RULES.register(rule, priority=priority, first=first)


def attention_rules() -> list[AttentionRule]:
    """The registered rules in the order they are tried.

    Example::

        [r.name for r in attention_rules()]     # ["sdpa", "manual_softmax", ...]
    """
    return RULES.items()
