"""Projection handlers, tried in order, first match wins: who owns a projection and how KHA goes in.

Built in, by priority (lower is tried first): ``functional`` (10: weights used functionally or of
any rank), ``adapter`` (20: PEFT wrappers, reached by retargeting), ``mha`` (30:
``nn.MultiheadAttention`` in-projections), ``conv1d`` (40: module calls with an (in, out) weight,
e.g. GPT-2's Conv1D), ``linear`` (100: every other module-call projection, e.g. ``nn.Linear``; the
fallback). Every file in this package is imported on first use and registers its handler, so a
new handler is one new file (or any module) that calls ``register_handler(MyHandler())``; its
``priority`` (default 50) puts it after the specific built-ins and before the fallback.

The API (see :class:`.base.ProjectionHandler`)::

    class ProjectionHandler:
        name: str                       # recorded in PlanEntry.handler and on the module
        param_space: bool = False       # slots index the weight's output axis, not the traced output
        def accepts(self, model, role_match) -> tuple[bool, str]   # (True, "") owns it; (False, why) next
        def owns(self, module) -> bool                              # fallback lookup for old pickles
        def attach(self, module, entry: PlanEntry) -> None
        def detach(self, module) -> None
        def fold(self, module, roles) -> list[tuple[str, Tensor]]  # new param values; nothing written

    register_handler(handler, *, priority=None, first=False)   # a duplicate name replaces the old one (logged)
    projection_handlers() -> list[ProjectionHandler]
    get_handler(name) -> ProjectionHandler
    choose_handler(model, role_match) -> tuple[Optional[ProjectionHandler], str]
    handler_of(module) -> ProjectionHandler      # the handler that attached a module's KHA

Shared helpers for handler files: ``PlanEntry``, ``ModuleProjectionHandler`` (attach/detach/fold of a
module with a 2-D weight), ``weight_out_axis``, ``owner_of`` and the fold primitive
:func:`kha_compile.model.rows.fold_rows`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from ..core.errors import RegistryError
from ..core.registry import Registry
from ..model.carrier import handler_name
from .base import ModuleProjectionHandler, PlanEntry, ProjectionHandler, owner_of

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = [
    "ModuleProjectionHandler",
    "PlanEntry",
    "ProjectionHandler",
    "choose_handler",
    "get_handler",
    "handler_of",
    "owner_of",
    "projection_handlers",
    "register_handler",
]

log = logging.getLogger(__name__)

HANDLERS: Registry[ProjectionHandler] = Registry("projection handler", __name__, skip=("base", "plan", "insert"))


def register_handler(
    handler: ProjectionHandler, *, priority: int | None = None, first: bool = False
) -> ProjectionHandler:
    """Add ``handler`` at its priority (``first=True``: before every built-in); one of the same name is replaced.

    Example::

        register_handler(ShardedLinearHandler(), priority=5)
    """
    return HANDLERS.register(handler, priority=priority, first=first)


def projection_handlers() -> list[ProjectionHandler]:
    """The handlers in the order they are tried.

    Example::

        [h.name for h in projection_handlers()]     # ["functional", "adapter", "mha", "conv1d", "linear"]
    """
    return HANDLERS.items()


def get_handler(name: str) -> ProjectionHandler:
    """The handler called ``name``; :class:`RegistryError` lists the registered ones."""
    return HANDLERS.get(name)


def choose_handler(model: nn.Module, m: RoleMatch) -> tuple[ProjectionHandler | None, str]:
    """The first handler that accepts the role's projection, or (None, the first reason given)."""
    reasons = []
    for h in projection_handlers():
        ok, why = h.accepts(model, m)
        if ok:
            return h, ""
        if why:
            reasons.append(why)
    return None, reasons[0] if reasons else f"{m.role}: no projection handler accepts {m.projection.module_path!r}"


def handler_of(module: nn.Module) -> ProjectionHandler:
    """The handler that attached ``module``'s KHA (recorded name, else the first that ``owns`` it)."""
    name = handler_name(module)
    if name is not None:
        return get_handler(name)
    for h in projection_handlers():
        if h.owns(module):
            return h
    raise RegistryError(
        f"no projection handler owns {type(module).__name__}; register the handler that "
        "attached its KHA transforms before folding or removing them."
    )
