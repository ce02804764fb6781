"""Projection handlers, tried in order, first match wins: who owns a projection and how KHA goes in.

Built in, in this order: ``mha`` (``nn.MultiheadAttention`` in-projections), ``conv1d`` (module
calls with an (in, out) weight, e.g. GPT-2's Conv1D), ``linear`` (every other module-call
projection, e.g. ``nn.Linear``; the fallback). Every other file in this package is imported on
first use, so a new handler is one new file that ends with ``register_handler(MyHandler(), first=True)``
(``first=True`` puts it before the fallback ``linear``).

The API (see :class:`.base.ProjectionHandler`)::

    class ProjectionHandler:
        name: str                       # recorded in PlanEntry.handler and on the module
        param_space: bool = False       # slots index the weight's output axis, not the traced output
        def accepts(self, model, role_match) -> tuple[bool, str]   # (True, "") owns it; (False, why) next
        def owns(self, module) -> bool                              # fallback lookup for old pickles
        def attach(self, module, entry: PlanEntry) -> None
        def detach(self, module) -> None
        def fold(self, module, roles) -> list[tuple[str, Tensor]]  # new param values; nothing written

    register_handler(handler, *, first=False)   # a duplicate name replaces the old one (logged)
    projection_handlers() -> list[ProjectionHandler]
    get_handler(name) -> ProjectionHandler
    choose_handler(model, role_match) -> tuple[Optional[ProjectionHandler], str]
    handler_of(module) -> ProjectionHandler      # the handler that attached a module's KHA

Shared helpers for handler files: ``PlanEntry``, ``ModuleProjectionHandler`` (attach/detach/fold of a
module with a 2-D weight), ``weight_out_axis``, ``owner_of`` and the fold primitive
:func:`kha_compile.passes.rows.fold_rows`.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
from typing import TYPE_CHECKING

from torch import nn

from ...errors import RegistryError
from .base import HANDLER_ATTR, ModuleProjectionHandler, PlanEntry, ProjectionHandler, owner_of, weight_out_axis

if TYPE_CHECKING:
    from ..match import RoleMatch

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
    "weight_out_axis",
]

log = logging.getLogger(__name__)

_HANDLERS: list[ProjectionHandler] = []
_LOADED = False
_BUILTIN = ("mha", "conv1d", "linear")


def _load() -> None:
    """Register the built-in handlers, then import every other file of this package (once)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from .conv1d import Conv1DHandler
    from .linear import LinearHandler
    from .mha import MHAHandler

    for h in (MHAHandler(), Conv1DHandler(), LinearHandler()):
        if all(x.name != h.name for x in _HANDLERS):
            _HANDLERS.append(h)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name not in ("base", *_BUILTIN):
            importlib.import_module(f"{__name__}.{info.name}")


def register_handler(handler: ProjectionHandler, *, first: bool = False) -> ProjectionHandler:
    """Add ``handler`` last (or first); one of the same name is replaced, with a log line.

    Example::

        register_handler(ShardedLinearHandler(), first=True)
    """
    _load()
    for i, old in enumerate(_HANDLERS):
        if old.name == handler.name:
            log.info("projection handler %r replaced by %s", handler.name, type(handler).__name__)
            del _HANDLERS[i]
            break
    if first:
        _HANDLERS.insert(0, handler)
    else:
        _HANDLERS.append(handler)
    return handler


def projection_handlers() -> list[ProjectionHandler]:
    """The handlers in the order they are tried.

    Example::

        [h.name for h in projection_handlers()]     # ["mha", "conv1d", "linear"]
    """
    _load()
    return list(_HANDLERS)


def get_handler(name: str) -> ProjectionHandler:
    """The handler called ``name``; :class:`RegistryError` lists the registered ones."""
    for h in projection_handlers():
        if h.name == name:
            return h
    raise RegistryError(f"no projection handler named {name!r}; registered: "
                        f"{', '.join(h.name for h in _HANDLERS)}.")


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
    name = module.__dict__.get(HANDLER_ATTR)
    if name is not None:
        return get_handler(name)
    for h in projection_handlers():
        if h.owns(module):
            return h
    raise RegistryError(f"no projection handler owns {type(module).__name__}; register the handler that "
                        "attached its KHA transforms before folding or removing them.")
