"""The rule base: ``pattern`` finds candidates, ``check`` accepts or declines, ``rewrite`` changes the graph."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Protocol

from torch import fx

from ...core.errors import BackendError, KHAError
from ..graph import BackendOptions, GraphContext
from ..stats import Decline, RuleName, Verdict, fail

__all__ = ["Declined", "Match", "Rule", "RuleSetup"]

log = logging.getLogger(__name__)


class Match(Protocol):
    """What ``pattern`` yields: an anchor node and every node the rewrite consumes."""

    anchor: fx.Node

    def nodes(self) -> list[fx.Node]: ...


@dataclasses.dataclass
class Declined:
    """A candidate that ``pattern`` already knows it must decline, with the reason."""

    anchor: fx.Node
    reason: str


@dataclasses.dataclass(frozen=True)
class RuleSetup:
    """What a backend hands each rule class to build its rule for one graph."""

    options: BackendOptions
    deploy_entries: Sequence[Any] | None = None  # deploy.DeployEntry list in deploy mode, else None
    checkpoint: str = "the checkpoint"  # deploy mode: the checkpoint directory, for messages
    placed: set[str] = dataclasses.field(default_factory=set)  # deploy mode: projections placed in earlier graphs


class Rule:
    """A graph rewrite: ``pattern`` finds candidates, ``check`` accepts or declines with a reason,
    ``rewrite`` changes the graph and returns how many rewrites it made.

    A match carries everything ``rewrite`` needs; rules keep no state between the calls. Each
    rule class says with :meth:`create` whether it runs under a backend's options.
    """

    name: ClassVar[RuleName]
    strict: ClassVar[bool] = False  # a strict rule raises instead of declining (skipping would change results)
    error: ClassVar[type[BackendError]] = BackendError  # what a strict rule raises

    @classmethod
    def create(cls, setup: RuleSetup) -> Rule | None:
        """The rule for one graph under ``setup``, or None when it does not run."""
        return cls()

    def pattern(self, ctx: GraphContext) -> Iterator[Any]:
        raise NotImplementedError

    def check(self, match: Any, ctx: GraphContext) -> Verdict:
        raise NotImplementedError

    def rewrite(self, match: Any, ctx: GraphContext) -> int:
        raise NotImplementedError

    def run(self, ctx: GraphContext) -> int:
        """Apply the rule everywhere it fits; record each decline; returns the rewrites made.

        A KHAError (a user-facing problem, such as a deploy checkpoint that cannot be placed)
        propagates; any other error inside ``pattern`` or ``check`` declines instead of failing
        the compile, and is logged as a warning.
        """
        total = 0
        try:
            matches = list(self.pattern(ctx))
        except KHAError:
            raise
        except Exception as exc:  # a bug here must not cost the user their compile
            if self.strict:
                raise self.error(f"{self.name}: internal error while matching: {exc!r}") from exc
            log.warning("kha backend: rule %s failed on this graph and was skipped: %r", self.name, exc)
            ctx.stats.declined.append(Decline(self.name, "<graph>", f"internal error: {exc!r}"))
            matches = []
        for match in matches:
            if isinstance(match, Declined):
                verdict, anchor = fail(match.reason), match.anchor
            else:
                if any(n.graph is None or getattr(n, "_erased", False) for n in match.nodes()):
                    continue  # an earlier rewrite already consumed part of this match
                anchor = match.anchor
                try:
                    verdict = self.check(match, ctx)
                except KHAError:
                    raise
                except Exception as exc:
                    log.warning("kha backend: %s check failed at %s: %r", self.name, anchor.name, exc)
                    verdict = fail(f"internal error: {exc!r}")
            if not verdict:
                if self.strict:
                    raise self.error(f"{self.name}: cannot rewrite at {anchor.name}: {verdict.reason}")
                ctx.stats.declined.append(Decline(self.name, anchor.name, verdict.reason))
                log.debug("kha backend: %s declined at %s: %s", self.name, anchor.name, verdict.reason)
                continue
            total += self.rewrite(match, ctx)
        ctx.stats.rewrites[self.name] = ctx.stats.rewrites.get(self.name, 0) + total
        return total
