"""What the compiled graphs read at run time: live parameters as graph inputs, checkpoint constants appended.

Nothing derived from a parameter is cached. A fold (``W' = T^T W`` per head slot, see
:mod:`kha_compile.backend.rules.fold_linear`) is a node of the graph whose inputs are the live
parameters, so every call computes it from the weights as they are now (Inductor compiles the
fold with the rest of the graph). Whatever changes a weight is seen: fused, foreach and for-loop
optimizers (fused ones do not move ``param._version``, so no version counter can be trusted),
``param.data.copy_``, ``.data`` assignment, ``load_state_dict``.

The only tensors kept across calls are constants the backend owns: a deploy checkpoint's transform
tensors (and their fold matrices), appended to the graph's arguments by :class:`Runner`. They belong
to one module, while Dynamo may run one compiled graph for several modules (a graph break inside a
repeated block: every layer runs the graph of the first, its parameters passed as arguments). So
each group of constants is tied to the weight it was made for (:class:`Switch`): when another
weight is passed, the constants of that weight's module are used, or, where the backend cannot tell
which module it is, the call raises :class:`~kha_compile.core.errors.DeployError` instead of running
the wrong transforms.

Cost: a folded projection recomputes ``T^T W`` on every call, ``out x in x Dh`` multiply-adds (the
projection's own cost at ``Dh`` tokens), plus a copy of ``W``. It pays off when a call has more
tokens than the projection has inputs; for short calls (decoding a few tokens) the ``x @ T`` it
removes is cheaper, and ``kc.backend(fold=False)`` keeps the transforms as they are.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal

from torch import Tensor

__all__ = ["Runner", "Source", "SourceKind", "Switch", "attribute"]

SourceKind = Literal["arg", "attr"]


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a graph input's real tensor comes from (at compile time): argument ``index`` or attribute ``qualname``."""

    kind: SourceKind
    where: int | str

    def resolve(self, args: Sequence[Any], attr: Callable[[str], Any]) -> Any:
        """The tensor behind this source, given the graph's arguments and an attribute getter."""
        if self.kind == "arg":
            assert isinstance(self.where, int)
            return args[self.where]
        assert isinstance(self.where, str)
        return attr(self.where)


def attribute(root: Any, qualname: str) -> Any:
    """``root.a.b.c`` for ``qualname`` "a.b.c"."""
    obj = root
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


Lookup = Callable[[Tensor], Sequence[Tensor]]  # the constants for another weight; raises when there are none


@dataclasses.dataclass
class Switch:
    """Constants made for the weight passed as graph argument ``arg``; ``lookup`` gives those of another weight."""

    arg: int  # the graph argument that holds the weight
    weight: weakref.ReferenceType[Tensor]  # the weight they were made for
    start: int  # their place in Runner.constants
    count: int
    lookup: Lookup
    _seen: dict[int, tuple[weakref.ReferenceType[Tensor], tuple[Tensor, ...]]] = dataclasses.field(default_factory=dict)

    def values(self, w: Tensor) -> tuple[Tensor, ...] | None:
        """None when ``w`` is the weight they were made for, else the constants of ``w``'s module."""
        if w is self.weight():
            return None
        hit = self._seen.get(id(w))
        if hit is None or hit[0]() is not w:
            hit = (weakref.ref(w), tuple(self.lookup(w)))
            self._seen[id(w)] = hit
        return hit[1]


class Runner:
    """The callable handed back to Dynamo: appends the backend's constant inputs, then runs the compiled graph.

    Example::

        run = Runner(compiled, [T_from_checkpoint])
        run(*dynamo_args)          # compiled(*dynamo_args, T_from_checkpoint)
    """

    def __init__(self, compiled: Callable[..., Any], constants: Sequence[Tensor], switches: Sequence[Switch] = ()):
        self.compiled = compiled
        self.constants = tuple(constants)
        self.switches = tuple(switches)

    def __call__(self, *args: Any) -> Any:
        swapped: list[Tensor] | None = None
        for s in self.switches:  # one identity check per deploy projection
            values = s.values(args[s.arg])
            if values is not None:
                swapped = list(self.constants) if swapped is None else swapped
                swapped[s.start : s.start + s.count] = values
        constants = self.constants if swapped is None else swapped
        return self.compiled(*args, *constants)  # Dynamo calls its compiled graphs positionally
