"""What an attention rule is: a name and a ``match`` that turns one graph node into an :class:`Anchor`."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from torch.fx import Node

if TYPE_CHECKING:  # pragma: no cover
    from ..match import _Graph as MatchGraph

__all__ = ["Anchor", "AttentionRule"]


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One attention op and the nodes that carry its q, k and v head vectors."""

    node: Node                 # the attention op node
    rule: str                  # rule name, e.g. "sdpa", "manual_softmax", "flex_attention", "external"
    roles: dict[str, Node]     # "q"/"k"/"v" -> node whose LAST axis is that role's head vector (empty if declined)
    head_dims: dict[str, int]  # role -> expected head dim at the anchor
    reason: str = ""           # non-empty: looks like attention, declined, with why


class AttentionRule(Protocol):
    """A rule recognises one form of attention op in an exported graph."""

    name: str

    def match(self, g: MatchGraph, node: Node) -> Anchor | None:  # None: not this rule's op
        ...
