"""The projection-handler base: who owns a projection weight, and how KHA goes in, out and folds.

A handler is tried on each matched role (q, k, v) in registry order; the first whose
:meth:`ProjectionHandler.accepts` returns ``(True, "")`` owns that projection. It then attaches
the transforms a :class:`PlanEntry` lists, detaches them (``remove``) and computes folded weights
(``fold``). A module that carries KHA records its handler's name, so remove and fold find it again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from ..core.errors import FoldError
from ..model.carrier import KHAProjection, attach, detach, transforms_of
from ..model.slots import HeadSlot

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = ["ModuleProjectionHandler", "PlanEntry", "ProjectionHandler", "owner_of"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PlanEntry:
    """One module to change: the handler that owns it, its head slots and the kind per role."""

    module_path: str
    handler: str  # a registered handler name: "mha" | "conv1d" | "linear" | ...
    slots: list[HeadSlot]
    kinds: dict[str, str]  # role -> transform kind
    out_features: int  # size of the weight's output axis (as the graph indexes it)
    strategy: str = "auto"  # linear KHA execution: "auto" | "weight" | "token" (kha_compile.model.strategy)
    extra: Any = None  # a handler's own plan, for handlers that plan roles themselves (``plans_roles``)
    parent: nn.Module | None = dataclasses.field(default=None, repr=False)  # set by insert: the module holding it
    # joint streams: role -> the module path whose transform this projection shares (not registered here)
    borrow: dict[str, str] = dataclasses.field(default_factory=dict)
    borrowed: Any = dataclasses.field(default=None, repr=False)  # set by insert: the KHATransforms shared
    # set by insert: the model's floating dtype, for a quantized linear that does not tell its compute dtype
    model_dtype: Any = dataclasses.field(default=None, repr=False)


def owner_of(model: nn.Module, m: RoleMatch) -> nn.Module | None:
    """The module that owns the role's projection weight, or None."""
    try:
        return model.get_submodule(m.projection.module_path)
    except AttributeError:
        return None


class ProjectionHandler:
    """Base class of a projection handler; register an instance with ``register_handler``.

    ``param_space``: True when head slots are given in the weight's own output axis (e.g. rows of
    ``nn.MultiheadAttention.in_proj_weight``) instead of the traced projection output.
    ``priority``: where it is tried (lower first; the fallback ``linear`` is 100). ``module_call``:
    it owns projections that are a module's own forward (what adapter retargeting and deploy need).
    The carrier runs and folds itself (weight-side execution lives in :mod:`kha_compile.model`).

    Example::

        class MyHandler(ProjectionHandler):
            name = "mine"
            def accepts(self, model, m): ...           # (True, "") to own it
            def attach(self, module, entry): ...
            def detach(self, module): ...
            def fold(self, module, roles): ...         # [(param name, new tensor)], nothing written
        register_handler(MyHandler(), priority=5)
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 50
    module_call: ClassVar[bool] = False
    param_space: ClassVar[bool] = False
    plans_roles: ClassVar[bool] = False  # True: head positions come from plan_role, not affine HeadSlots

    def plan_role(self, entry: PlanEntry, role: str, m: RoleMatch, kind: str) -> None:
        """Record ``role`` of a matched site in ``entry`` (``entry.extra``, ``entry.kinds``); only
        called when ``plans_roles`` is True."""
        raise NotImplementedError

    def describe(
        self, model: nn.Module, roles: dict[str, RoleMatch], rename: Callable[[str], str] = lambda p: p
    ) -> str:
        """A site-report note for the roles this handler carries ('' when there is nothing to say)."""
        return ""

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        """``(True, "")``: this handler owns the projection; ``(False, why)``: try the next one
        (a non-empty ``why`` is reported when no handler takes it)."""
        raise NotImplementedError

    def owns(self, module: nn.Module) -> bool:
        """True when ``module`` carries KHA in this handler's form (for modules without a recorded name)."""
        return False

    def entry_path(self, m: RoleMatch) -> str:
        """The traced path of the module whose plan entry carries the role (its projection's, by default)."""
        return m.projection.module_path

    def fixed_roles(self, module: nn.Module) -> list[str]:
        """Roles of ``module`` whose transforms do not fold here, whatever their kind (``kc.fold`` keeps them)."""
        return []

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        """Give ``module`` the transforms of ``entry`` in place (identity at init)."""
        raise NotImplementedError

    def detach(self, module: nn.Module) -> None:
        """Take every KHA transform out of ``module``; its original class and keys return."""
        raise NotImplementedError

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        """New values of ``module``'s parameters with the (foldable) transforms of ``roles`` folded in.

        Computes only; the caller checks and writes them. Raises :class:`FoldError` when it cannot.
        """
        raise FoldError(f"the {self.name!r} projection handler cannot fold KHA transforms. Nothing was changed.")

    def cleanup(self, model: nn.Module) -> None:
        """After ``kc.fold`` / ``kc.remove`` detached modules: undo what attach did beyond the module itself."""

    def drop(self, module: nn.Module, roles: Sequence[str]) -> None:
        """Remove the (folded) transforms of ``roles`` from ``module``; detach when none is left."""
        kha = transforms_of(module)
        for r in roles:
            if r in kha:
                del kha[r]
        if len(kha) == 0:
            self.detach(module)


class ModuleProjectionHandler(ProjectionHandler):
    """Shared attach/detach/fold for projections that are module calls with a 2-D ``weight``.

    The carrier (:class:`~kha_compile.model.carrier.KHAProjection`) folds itself; the handler plans
    and attaches.
    """

    module_call: ClassVar[bool] = True

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, KHAProjection)

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        attach(
            module,
            tuple(entry.slots),
            entry.kinds,
            entry.out_features,
            handler=self.name,
            strategy=entry.strategy,
            transforms=entry.borrowed,
            borrowed=entry.borrowed is not None,
            quantized_dtype=entry.model_dtype,
        )

    def detach(self, module: nn.Module) -> None:
        detach(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        if not isinstance(module, KHAProjection):
            raise FoldError(f"{type(module).__name__} carries no KHA projection state. Nothing was changed.")
        return module.kha_fold(roles)
