"""The transform-kind spec and its registry: what one KHA transform kind is, in one place.

A :class:`TransformKind` says everything the rest of kha_compile needs about a kind: its name,
the roles it may sit on, its module (built at identity), a functional forward over the head
axis (..., Dh), whether it folds and the matrix it folds as, its ONNX translation, and its
named matrices for pictures. A new kind is one new file in this package that defines a spec and
calls :func:`register_transform`; the package imports every file in it on first use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..errors import KHAConfigError, UnknownTransformError
from ..kinds import Role, TransformName

__all__ = ["TransformKind", "TransformName", "get_transform", "kind_of", "register_transform", "transform_kinds"]

log = logging.getLogger(__name__)


class TransformKind:
    """The spec of one transform kind (subclass per kind, register one instance).

    Subclasses set ``name``, ``roles``, ``module_cls``, ``param_names`` and ``foldable``, and
    implement :meth:`functional`; foldable kinds implement :meth:`fold_matrix`.

    Example::

        class Scale(TransformKind):
            name, roles, module_cls, param_names, foldable = "scale", ("v",), ScaleModule, ("s",), True
            def functional(self, x, s): return x * s
            def fold_matrix(self, module): return torch.diag(module.s)
        register_transform(Scale())
    """

    name: ClassVar[str]
    roles: ClassVar[tuple[Role, ...]]
    module_cls: ClassVar[type[nn.Module]]
    param_names: ClassVar[tuple[str, ...]]  # the module's parameters, in the order functional() takes them
    foldable: ClassVar[bool] = False

    def create(
        self, head_dim: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> nn.Module:
        """A new module of this kind over heads of ``head_dim``, at identity (the model is unchanged)."""
        return self.module_cls(head_dim, dtype=dtype, device=device)

    def params(self, module: nn.Module) -> list[Tensor]:
        """The module's tensors in :attr:`param_names` order (what :meth:`functional` takes)."""
        return [getattr(module, p) for p in self.param_names]

    def functional(self, x: Tensor, *params: Tensor) -> Tensor:
        """The transform on ``x`` (..., Dh) -> (..., Dh) given its tensors."""
        raise NotImplementedError

    def fold_matrix(self, module: nn.Module) -> Tensor:
        """The (Dh, Dh) matrix T with ``transform(x) == x @ T``; only for foldable kinds."""
        raise KHAConfigError(f"KHA transform kind {self.name!r} is not linear and does not fold.")

    def matrices(self, module: nn.Module) -> dict[str, Tensor]:
        """Named (Dh, Dh) matrices for pictures, e.g. ``{"T": ...}`` or ``{"up": ..., "gate": ..., "down": ...}``."""
        return {p: getattr(module, p).detach() for p in self.param_names}

    def onnx_translations(self) -> dict[Any, Callable[..., Any]]:
        """torch op overload -> onnxscript translation, for ops this kind's forward emits (none: plain aten)."""
        return {}


_KINDS: dict[str, TransformKind] = {}
_LOADED = False


def _load() -> None:
    """Import every file of this package once, so each registers its kind."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib
    import pkgutil

    from . import __name__ as pkg_name
    from . import __path__ as pkg_path

    for info in sorted(pkgutil.iter_modules(pkg_path), key=lambda i: i.name):
        if info.name != "base":
            importlib.import_module(f"{pkg_name}.{info.name}")


def register_transform(kind: TransformKind) -> TransformKind:
    """Add ``kind`` to the registry (a kind of the same name is replaced, with a log line).

    Example::

        register_transform(MyKind())
        KHAConfig(v=MyKind.name)
    """
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        log.info("KHA transform kind %r replaced by %s", kind.name, type(kind).__name__)
    _KINDS[kind.name] = kind
    return kind


def get_transform(name: str) -> TransformKind:
    """The registered kind called ``name``; an :class:`UnknownTransformError` lists the others.

    Example::

        get_transform("linear").foldable      # True
    """
    _load()
    try:
        return _KINDS[name]
    except KeyError:
        raise UnknownTransformError(
            f"unknown KHA transform kind {name!r}; use one of {', '.join(repr(k) for k in _KINDS)}."
        ) from None


def transform_kinds() -> dict[str, TransformKind]:
    """Every registered kind by name, in registration order.

    Example::

        [n for n, k in transform_kinds().items() if "v" in k.roles]    # ["linear", "mlp"]
    """
    _load()
    return dict(_KINDS)


def kind_of(module: nn.Module) -> TransformKind:
    """The spec of a transform module (its class's ``kind`` attribute)."""
    return get_transform(getattr(module, "kind", ""))
