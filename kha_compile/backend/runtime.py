"""Extra graph inputs computed at run time from the live tensors (folded weights, deploy constants).

Folded weights are not baked into the compiled code: they are extra graph inputs that the
returned callable computes from the live parameters, and recomputes whenever a source tensor is
replaced or modified in place (its version counter moves). An optimizer step between two
``no_grad`` calls therefore never leaves a stale fold behind.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, fx

__all__ = ["Recipe", "Runner", "Source", "SourceKind"]

log = logging.getLogger(__name__)

SourceKind = Literal["arg", "attr", "const"]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a real tensor comes from: graph argument ``index``, attribute ``qualname``, or a constant."""

    kind: SourceKind
    where: int | str | Tensor

    @staticmethod
    def const(t: Tensor) -> Source:
        return Source("const", t)

    def resolve(self, args: Sequence[Any], attr: Callable[[str], Any]) -> Any:
        """The tensor behind this source, given the graph's arguments and an attribute getter."""
        if self.kind == "arg":
            assert isinstance(self.where, int)
            return args[self.where]
        if self.kind == "attr":
            assert isinstance(self.where, str)
            return attr(self.where)
        return self.where


def attribute(root: Any, qualname: str) -> Any:
    """``root.a.b.c`` for ``qualname`` "a.b.c"."""
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return -1


class Recipe:
    """Tensors computed by ``fn`` from ``sources``; recomputed when a source tensor changes."""

    def __init__(self, sources: Sequence[Source | None], fn: Callable[..., Sequence[Tensor]]):
        self.sources = list(sources)
        self.fn = fn
        self._refs: list[weakref.ReferenceType[Tensor] | None] = []
        self._versions: list[int] = []
        self._values: tuple[Tensor, ...] = ()

    def _inputs(self, get: Callable[[Source], Tensor | None]) -> list[Tensor | None]:
        return [get(s) if s is not None else None for s in self.sources]

    def compute(self, get: Callable[[Source], Tensor | None]) -> tuple[Tensor, ...]:
        """Compute the values now (at compile time), from the tensors ``get`` returns."""
        tensors = self._inputs(get)
        with torch.no_grad():
            self._values = tuple(self.fn(*tensors))
        self._remember(tensors)
        return self._values

    def _remember(self, tensors: list[Tensor | None]) -> None:
        self._refs = [weakref.ref(t) if t is not None else None for t in tensors]
        self._versions = [_version(t) if t is not None else 0 for t in tensors]

    def values(self, args: Sequence[Any], attr: Callable[[str], Any]) -> tuple[Tensor, ...]:
        """The values for this call: cached, or recomputed when a source tensor changed."""
        tensors = self._inputs(lambda s: s.resolve(args, attr))
        stale = any(
            (r is None) != (t is None) or (t is not None and r is not None and (r() is not t or _version(t) != v))
            for r, t, v in zip(self._refs, tensors, self._versions)
        )
        if stale:
            with torch.no_grad():
                self._values = tuple(self.fn(*tensors))
            self._remember(tensors)
            log.debug("kha backend: recomputed %d folded tensor(s) after a source tensor changed", len(self._values))
        return self._values


class Runner:
    """The callable handed back to Dynamo: adds the computed inputs, then runs the compiled graph."""

    def __init__(self, compiled: Callable[..., Any], recipes: list[Recipe], gm: fx.GraphModule):
        self.compiled = compiled
        self.recipes = recipes
        self._gm = gm

    def _attr(self, qualname: str) -> Any:
        return attribute(self._gm, qualname)

    def __call__(self, *args: Any) -> Any:
        extra = [t for r in self.recipes for t in r.values(args, self._attr)]
        return self.compiled(*args, *extra)  # Dynamo calls its compiled graphs positionally
