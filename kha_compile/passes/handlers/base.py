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

import torch
from torch import Tensor, nn

from ...errors import FoldError
from ...modules import HeadSlot, KHAProjection, attach, detach, set_strategy, transforms_of
from ...transforms import kind_of
from ..rows import fold_rows

if TYPE_CHECKING:
    from ..match import RoleMatch

__all__ = ["HANDLER_ATTR", "ModuleProjectionHandler", "PlanEntry", "ProjectionHandler", "owner_of", "weight_out_axis"]

log = logging.getLogger(__name__)

HANDLER_ATTR = "_kha_handler"  # instance attribute of a module with KHA: the name of its handler


@dataclasses.dataclass
class PlanEntry:
    """One module to change: the handler that owns it, its head slots and the kind per role."""

    module_path: str
    handler: str  # a registered handler name: "mha" | "conv1d" | "linear" | ...
    slots: list[HeadSlot]
    kinds: dict[str, str]  # role -> transform kind
    out_features: int  # size of the weight's output axis (as the graph indexes it)
    strategy: str = "auto"  # linear KHA execution: "auto" | "weight" | "token" (kha_compile.strategy)
    extra: Any = None  # a handler's own plan, for handlers that plan roles themselves (``plans_roles``)


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

    Example::

        class MyHandler(ProjectionHandler):
            name = "mine"
            def accepts(self, model, m): ...           # (True, "") to own it
            def attach(self, module, entry): ...
            def detach(self, module): ...
            def fold(self, module, roles): ...         # [(param name, new tensor)], nothing written
        register_handler(MyHandler(), first=True)
    """

    name: ClassVar[str]
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

    def weight_side(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]] | None:
        """The parameters to run ``module`` with so its output carries the linear transforms of ``roles``.

        Like :meth:`fold`, but differentiable (autograd records the fold, so W, b and T get exact
        gradients) and called on every weight-side forward. ``None``: this handler has no
        weight-side execution, the transforms run on the output (token-side).
        """
        return None

    def drop(self, module: nn.Module, roles: Sequence[str]) -> None:
        """Remove the (folded) transforms of ``roles`` from ``module``; detach when none is left."""
        kha = transforms_of(module)
        for r in roles:
            if r in kha:
                del kha[r]
        if len(kha) == 0:
            self.detach(module)


def _base_class(module: nn.Module) -> type[nn.Module]:
    """The module's class before KHA (its own class when it carries none)."""
    cls: type[nn.Module] = getattr(type(module), "_kha_base_class", type(module))
    return cls


def weight_out_axis(module: nn.Module, out_features: int | None = None) -> int | None:
    """Which axis of ``module.weight`` indexes output features: 0 (``y = x W^T``), 1 (``y = x W``), None.

    Told by the weight's shape when ``out_features`` settles it, else by behaviour: one small
    probe through the module's own forward (e.g. GPT-2's Conv1D stores (in, out)).

    Example::

        weight_out_axis(nn.Linear(4, 8))     # 0
    """
    if isinstance(module, nn.Linear):
        return 0
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.dim() != 2 or not w.is_floating_point():
        return None
    if out_features is not None and w.shape[0] != w.shape[1] and out_features in tuple(w.shape):
        return 0 if w.shape[0] == out_features else 1
    if w.is_meta:
        return None
    b = getattr(module, "bias", None)
    b = b.detach().float() if isinstance(b, Tensor) else 0.0
    w32 = w.detach().float()
    gen = torch.Generator().manual_seed(0)
    forward = _base_class(module).forward
    tol = 1e-4 if w.dtype in (torch.float32, torch.float64) else 2e-2
    for axis, n_in, ref_w in ((1, w.shape[0], w32), (0, w.shape[1], w32.t())):
        x = torch.randn(2, n_in, generator=gen)
        try:
            with torch.no_grad():
                y = forward(module, x.to(w.dtype).to(w.device))
        except Exception:  # the forward does not take this input shape: not this orientation
            continue
        ref = x.to(w.device) @ ref_w + b
        if (
            isinstance(y, Tensor)
            and y.shape == ref.shape
            and torch.allclose(y.float(), ref, rtol=tol, atol=tol * float(ref.abs().max().clamp_min(1)))
        ):
            return axis
    return None


class ModuleProjectionHandler(ProjectionHandler):
    """Shared attach/detach/fold for projections that are module calls with a 2-D ``weight``."""

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, KHAProjection)

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        attach(module, tuple(entry.slots), entry.kinds, entry.out_features)
        setattr(module, HANDLER_ATTR, self.name)
        if entry.strategy != "auto":
            set_strategy(module, entry.strategy)

    def detach(self, module: nn.Module) -> None:
        module.__dict__.pop(HANDLER_ATTR, None)
        detach(module)

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        axis = weight_out_axis(module, module.__dict__["_kha_out_features"])
        if axis is None:
            raise FoldError(
                f"cannot fold into {_base_class(module).__name__}: the orientation of its weight "
                "(y = x W^T or y = x W) could not be told from its shape or a probe of its forward. "
                "Nothing was changed."
            )
        return self._folded(module, roles, axis, detach=True)

    def weight_side(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]] | None:
        if not isinstance(module._parameters.get("weight"), Tensor):
            return None
        axis = module.__dict__.get("_kha_weight_axis")
        if axis is None:
            axis = weight_out_axis(module, module.__dict__["_kha_out_features"])
            if axis is None:
                return None
            module.__dict__["_kha_weight_axis"] = axis
        return self._folded(module, roles, axis, detach=False)

    @staticmethod
    def _folded(module: nn.Module, roles: Sequence[str], axis: int, *, detach: bool) -> list[tuple[str, Tensor]]:
        """(name, tensor) of weight and bias with the transforms of ``roles`` folded in (fold_rows per slot)."""
        slots: list[HeadSlot] = [s for s in module.__dict__["_kha_slots"] if s.role in roles]
        if not slots:
            return []
        w: Tensor = module.get_parameter("weight")
        b: Tensor | None = getattr(module, "bias", None)
        for s in slots:
            kha = transforms_of(module)[s.role]
            w, b = fold_rows(w, b, s, kind_of(kha).fold_matrix(kha), axis, detach=detach)
        out = [("weight", w)]
        if b is not None:
            out.append(("bias", b))
        return out
