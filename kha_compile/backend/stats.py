"""What the backend did: per-graph and summed rewrite counts, declines with their reasons."""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple, get_args

__all__ = ["RULE_NAMES", "BackendStats", "Decline", "GraphStats", "RuleName", "Verdict", "fail", "ok"]

# the rules, in the order they run (``rules.RULES`` holds their classes in the same order; a test checks)
RuleName = Literal["deploy", "fuse_mlp_value", "fold_linear"]
RULE_NAMES: tuple[RuleName, ...] = get_args(RuleName)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The answer of a rule's ``check``: ``ok``, or not with a ``reason``."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def ok() -> Verdict:
    """An accepting :class:`Verdict`."""
    return Verdict(True)


def fail(reason: str) -> Verdict:
    """A declining :class:`Verdict` that says why."""
    return Verdict(False, reason)


class Decline(NamedTuple):
    """A match a rule declined: which rule, at which graph node, and why."""

    rule: RuleName
    node: str
    reason: str


@dataclasses.dataclass
class GraphStats:
    """What the backend did to one Dynamo graph."""

    index: int
    rewrites: dict[RuleName, int] = dataclasses.field(default_factory=dict)  # rule name -> rewrites made
    declined: list[Decline] = dataclasses.field(default_factory=list)
    mlp_value_ops: int = 0  # kha::mlp_value ops in the graph handed to the compiler
    has_kha: bool = False  # the graph carried or received any KHA transform

    def count(self, rule: RuleName) -> int:
        return self.rewrites.get(rule, 0)


@dataclasses.dataclass
class BackendStats:
    """What one backend did, summed over the graphs it compiled (graph breaks give several).

    Example::

        be = kc.backend(compiler="eager")
        torch.compile(model, backend=be)(x)
        be.stats.rewrites            # {'deploy': 0, 'fuse_mlp_value': 0, 'fold_linear': 6}
    """

    graphs: list[GraphStats] = dataclasses.field(default_factory=list)

    @property
    def rewrites(self) -> dict[RuleName, int]:
        """Rewrites per rule over all graphs, every rule present (0 when it never fired)."""
        out: dict[RuleName, int] = {name: 0 for name in RULE_NAMES}
        for g in self.graphs:
            for k, v in g.rewrites.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def mlp_value_ops(self) -> int:
        return sum(g.mlp_value_ops for g in self.graphs)

    @property
    def declined(self) -> list[Decline]:
        return [d for g in self.graphs for d in g.declined]

    @property
    def has_kha(self) -> bool:
        return any(g.has_kha for g in self.graphs)

    def count(self, rule: RuleName) -> int:
        return self.rewrites.get(rule, 0)

    def __str__(self) -> str:
        r = self.rewrites
        return (
            f"{len(self.graphs)} graph(s): {self.mlp_value_ops} kha::mlp_value op(s) "
            f"({r['fuse_mlp_value']} fused from the decomposed form), "
            f"{r['fold_linear']} linear transform(s) folded, "
            f"{r['deploy']} transform(s) inserted from a checkpoint, "
            f"{len(self.declined)} declined"
        )
