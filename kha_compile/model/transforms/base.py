"""The transform-kind spec and its registry: what one KHA transform kind is, in one place.

A :class:`TransformKind` says everything the rest of kha_compile needs about a kind: its name,
the roles it may sit on, its module (built at identity), a functional forward over the head
axis (..., Dh), whether it folds and the matrix it folds as, the foldable kind that stands in
for it where it cannot go, its ONNX translation, and its named matrices for pictures. Code outside
this package asks the kind (``kind_of(module).foldable``, ``.fold_matrix(module)``), never
compares kind names. A new kind is one new file that defines a spec and calls
:func:`register_transform` (this package imports every file in it on first use; a kind defined
elsewhere registers itself when its module is imported).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ...core.errors import KHAConfigError, UnknownTransformError
from ...core.kinds import Role, TransformName
from ...core.optional import is_dtensor
from ...core.registry import Registry

__all__ = [
    "IdentityInitModule",
    "TransformKind",
    "TransformName",
    "fill_whole",
    "get_transform",
    "kind_of",
    "register_transform",
    "transform_kinds",
]

log = logging.getLogger(__name__)


def fill_whole(param: Tensor, value: Tensor) -> None:
    """``param.copy_(value)`` with ``value`` given whole; a DTensor parameter (FSDP2, tensor parallel) takes its shard.

    Every rank computes the same ``value`` (an identity), so each keeps its own part without communication.

    Example::

        fill_whole(module.weight, torch.eye(64))
    """
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor  # loaded already: param is a DTensor

        mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
        value = distribute_tensor(value, mesh, placements, src_data_rank=None)
    param.copy_(value)


class IdentityInitModule(nn.Module):
    """Base of a transform module that is at identity whenever its memory is first given values.

    A subclass implements ``reset_parameters`` (identity; nothing on the meta device, which holds no
    values). A transform built on the meta device (``torch.device("meta")``, accelerate's
    ``init_empty_weights``, transformers' loading) has no values to keep, so leaving the meta device
    by any ``Module._apply`` route sets it to identity: ``to_empty`` (whose memory is uninitialised)
    and ``.to(device)`` (which cannot copy a meta tensor, and here gives the transform memory
    instead of raising). A later ``load_state_dict`` overwrites it as usual.

    Example::

        with torch.device("meta"):
            t = KHALinearTransform(64)
        t.to_empty(device="cpu")        # t.weight == I, not the uninitialised memory of to_empty
    """

    def reset_parameters(self) -> None:
        raise NotImplementedError

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> IdentityInitModule:
        if not any(p.is_meta for p in self.parameters(recurse=False)):
            return super()._apply(fn, recurse)

        def leave_meta(t: Tensor) -> Tensor:
            try:
                return fn(t)  # to_empty, .to("meta") and dtype casts run on meta tensors
            except NotImplementedError:  # .to(device) of a meta tensor: it has no values to copy
                if not t.is_meta:
                    raise
                probe = fn(torch.empty((), dtype=t.dtype))  # where and in which dtype fn puts a tensor
                return torch.empty_like(t, device=probe.device, dtype=probe.dtype)

        out = super()._apply(leave_meta, recurse)
        if not any(p.is_meta for p in self.parameters(recurse=False)):
            self.reset_parameters()
            log.debug("%s left the meta device: reset to identity", type(self).__name__)
        return out


class TransformKind:
    """The spec of one transform kind (subclass per kind, register one instance).

    Subclasses set ``name``, ``roles``, ``module_cls``, ``param_names`` and ``foldable``, and
    implement :meth:`functional`. A foldable kind must be linear in ``x``; its fold matrix is the
    transform of the identity (override :meth:`fold_matrix` only to make it cheaper).
    ``fold_substitute`` names the foldable kind used instead where this one cannot go (MLA sites,
    whose weight absorption needs a linear transform).

    Example::

        class Scale(TransformKind):
            name, roles, module_cls, param_names, foldable = "scale", ("q", "k", "v"), ScaleModule, ("s",), True
            def functional(self, x, s): return x * s
        register_transform(Scale())
    """

    name: ClassVar[str]
    roles: ClassVar[tuple[Role, ...]]
    module_cls: ClassVar[type[nn.Module]]
    param_names: ClassVar[tuple[str, ...]]  # the module's parameters, in the order functional() takes them
    foldable: ClassVar[bool] = False
    fold_substitute: ClassVar[str | None] = None  # the foldable kind used where this one cannot go (MLA)
    priority: ClassVar[int] = 50  # order in listings (KHAConfig's allowed values)

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
        return self.fold_matrix_of(*self.params(module))

    def fold_matrix_of(self, *params: Tensor) -> Tensor:
        """The fold matrix from the transform's tensors: the transform of the identity, ``I @ T = T``.

        Exact for a linear transform (every entry is one product with 1, plus zeros).
        """
        if not self.foldable:
            raise KHAConfigError(f"KHA transform kind {self.name!r} is not linear and does not fold.")
        ref = params[0]
        eye = torch.eye(self.head_dim_of(*params), dtype=ref.dtype, device=ref.device)
        return self.functional(eye, *params)

    def head_dim_of(self, *params: Tensor) -> int:
        """The head dim a transform with these tensors acts on (the last dim of its first tensor)."""
        return int(params[0].shape[-1])

    def matrices(self, module: nn.Module) -> dict[str, Tensor]:
        """Named (Dh, Dh) matrices for pictures, e.g. ``{"T": ...}`` or ``{"up": ..., "gate": ..., "down": ...}``."""
        return {p: getattr(module, p).detach() for p in self.param_names}

    def onnx_translations(self) -> dict[Any, Callable[..., Any]]:
        """torch op overload -> onnxscript translation, for ops this kind's forward emits (none: plain aten)."""
        return {}


KINDS: Registry[TransformKind] = Registry("KHA transform kind", __package__, skip=("base",))


def register_transform(kind: TransformKind) -> TransformKind:
    """Add ``kind`` to the registry (a kind of the same name is replaced, with a log line).

    Example::

        register_transform(MyKind())
        KHAConfig(v=MyKind.name)
    """
    return KINDS.register(kind)


def get_transform(name: str) -> TransformKind:
    """The registered kind called ``name``; an :class:`UnknownTransformError` lists the others.

    Example::

        get_transform("linear").foldable      # True
    """
    kind = KINDS.find(name)
    if kind is None:
        raise UnknownTransformError(
            f"unknown KHA transform kind {name!r}; use one of {', '.join(repr(k) for k in KINDS.names())}."
        )
    return kind


def transform_kinds() -> dict[str, TransformKind]:
    """Every registered kind by name, in priority order.

    Example::

        [n for n, k in transform_kinds().items() if "v" in k.roles]    # ["linear", "mlp"]
    """
    return {k.name: k for k in KINDS.items()}


def kind_of(module: nn.Module) -> TransformKind:
    """The spec of a transform module (its class's ``kind`` attribute)."""
    return get_transform(getattr(module, "kind", ""))
