"""The attention-rule interface: an :class:`Anchor` per attention op a rule recognises.

A rule looks at one graph node. ``None``: not this rule's op. An :class:`Anchor` with roles: the
op is attention, and for each of q, k, v the node whose last axis is that role's head vector
(the walk back to the projections starts there). An :class:`Anchor` with empty roles and a
``reason``: it looks like attention but the rule declines, and says why.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

from torch.fx import Node

if TYPE_CHECKING:
    from ..graph import MatchGraph

__all__ = ["LINEAR_FORMS", "Anchor", "AttentionRule", "form_note", "is_linear_form"]


@dataclasses.dataclass(frozen=True)
class Anchor:
    """One attention op found by a rule.

    Example::

        Anchor(node, "sdpa", {"q": q, "k": k, "v": v}, {"q": 64, "k": 64, "v": 64})
        Anchor(softmax, "manual_softmax", {}, {}, reason="no value matmul after the softmax")
    """

    node: Node  # the attention op node
    rule: str  # rule name, e.g. "sdpa", "manual_softmax"
    roles: dict[str, Node]  # "q"/"k"/"v" -> node holding that role's head vector (empty if declined)
    head_dims: dict[str, int]  # role -> expected head dim at the anchor
    reason: str = ""  # non-empty: looks like attention, declined, with why
    # role -> the axis of the role's node that holds the head vector, where it is not the last
    # (K^T in q @ k^T: -2; an einsum over (B*H, Dh, T) tensors: 1)
    head_axes: dict[str, int] = dataclasses.field(default_factory=dict)
    # role -> other (node, head axis) pieces of the same heads, joined along the key axis (local
    # plus global tokens: scores of several key sets concatenated, probabilities cut again)
    extra: dict[str, tuple[tuple[Node, int], ...]] = dataclasses.field(default_factory=dict)
    # the same op read another way, tried when this reading leaves a role without its projection:
    # attention over channels (XCiT's cross-covariance attention: scores of (Dh, Dh) per head)
    alternative: Anchor | None = None


class AttentionRule(Protocol):
    """A named matcher of one attention form; register it with ``register_rule``.

    Example::

        class MyRule:
            name = "my_attention"
            def match(self, g, node):
                if node.target is not torch.ops.my.attention.default:
                    return None
                q, k, v = node.args[:3]
                return Anchor(node, self.name, {"q": q, "k": k, "v": v}, {r: shape_of(n)[-1] for ...})
        register_rule(MyRule())
    """

    name: str

    def match(self, g: MatchGraph, node: Node) -> Anchor | None: ...


# anchors of attention without a softmax (rules linear_attention, random_features: its FAVOR+ form, and
# linear_kernel; fla kernels: "fla.<name>")
LINEAR_FORMS = frozenset({"linear_attention", "random_features", "gated_delta_rule", "kimi_delta_attention"})


def is_linear_form(anchor: str) -> bool:
    """True for the anchor of an attention without softmax (linear attention, retention, a delta-rule kernel).

    Example::

        is_linear_form(site.anchor)      # True for a Qwen3-Next gated-delta-rule layer
    """
    return anchor in LINEAR_FORMS or anchor.startswith("fla.")


def form_note(anchor: str) -> str:
    """The report note of a site of this form ('' for softmax attention).

    Example::

        form_note("gated_delta_rule")     # "attention without softmax (gated_delta_rule): ..."
    """
    if not is_linear_form(anchor):
        return ""
    form = (
        f"{anchor}, FAVOR+: q and k through a fixed random projection and exp"
        if anchor == "random_features"
        else anchor
    )
    return (
        f"attention without softmax ({form}): KHA on the q, k, v heads right after their projection, before "
        "the short convolution, normalisation and feature map (so linear KHA folds into the projection); an "
        "extension of the paper, which measured softmax attention only"
    )
