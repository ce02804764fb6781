"""KHA on the arguments of an attention call: roles that read the same features of one projection.

When one projection gives two roles (DeepSeek-V4's ``kv_proj``: k = v; shared-QK attention: q = k;
one query/key projection called on both inputs of a two-way cross-attention), a transform after it
would change both, so each role's transform goes where the paths part: on that role's argument of
the attention call (``scaled_dot_product_attention(q, kv, kv)``, or the score and value products
of a softmax written out). The module whose forward makes the call gets the
``KHAAttentionInputs<Base>`` class (same object, parameters and keys) and a ``kha`` child; its
forward runs under a ``TorchFunctionMode`` that finds each planned call by family and
occurrence (as in the traced graph) and applies the role's transform to that argument's head
axis. These transforms do not fold: one weight cannot carry two transforms.

Example::

    attach_inputs(attn, [ArgCall("v", "sdpa", 0, 2, -1)], {"v": "mlp"}, head_dims={"v": 64})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..core.errors import AlreadyAppliedError, TracedPathError
from ..core.mixins import mixin_class, module_class_named
from .carrier import KHATransforms, is_kha_projection, make_transform

__all__ = ["ArgCall", "KHAAttentionInputs", "attach_inputs", "detach_inputs", "is_attention_inputs"]

# family -> names of the torch functions that make such a call
_NAMES = {
    "sdpa": {"scaled_dot_product_attention"},
    "matmul": {"matmul", "__matmul__"},
    "bmm": {"bmm"},
    "baddbmm": {"baddbmm"},
    "einsum": {"einsum"},
}
_FAMILY = {name: fam for fam, names in _NAMES.items() for name in names}
_SDPA_KWARGS = ("query", "key", "value")


@dataclasses.dataclass(frozen=True)
class ArgCall:
    """The ``occurrence``-th call of ``family`` in the forward: transform argument ``position`` along ``axis``."""

    role: str
    family: str
    occurrence: int
    position: int
    axis: int
    ranks: tuple[int, ...] = ()  # the operands' ranks: calls of other ranks (KHA's own x @ T) do not count


def _apply(t: nn.Module, x: Any, axis: int) -> Any:
    if not isinstance(x, Tensor):
        raise TracedPathError(f"the attention argument to transform is a {type(x).__name__}, not a tensor")
    # one kv head broadcast to every query head (an expand): transform it once and broadcast it again
    spread = [a for a in range(x.dim()) if x.stride(a) == 0 and x.shape[a] > 1]
    base = x
    for a in spread:
        base = base.narrow(a, 0, 1)
    y = t(base) if axis % x.dim() == x.dim() - 1 else t(base.movedim(axis, -1)).movedim(-1, axis)
    if y.stride() != base.stride():  # the argument's own memory layout (a transposed key): the op then
        y = torch.empty_like(base, dtype=y.dtype).copy_(y)  # takes the same kernel, bit for bit
    return y.expand(x.shape) if spread else y


def _ranks(family: str, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """The operands' ranks of a call, as :func:`kha_compile.analysis.attention_calls.operand_ranks` reads them."""
    if family == "einsum":
        ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
    elif family == "sdpa":
        ops = [*args[:3], *(kwargs[k] for k in _SDPA_KWARGS[len(args[:3]) :] if k in kwargs)]
    else:
        ops = list(args[1:3] if family == "baddbmm" else args[:2])
    return tuple(o.dim() if isinstance(o, Tensor) else 0 for o in ops)


class _ArgMode(TorchFunctionMode):
    """Counts the attention-family calls of one forward and transforms the planned arguments."""

    def __init__(self, calls: Sequence[ArgCall], transforms: KHATransforms) -> None:
        super().__init__()
        self.calls, self.transforms = calls, transforms
        self.seen: dict[tuple[str, tuple[int, ...]], int] = {}
        self.done = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        family = _FAMILY.get(getattr(func, "__name__", ""))
        if family is not None:
            key = (family, _ranks(family, args, kwargs))
            n = self.seen.get(key, 0)
            self.seen[key] = n + 1
            todo = [c for c in self.calls if (c.family, c.ranks) == key and c.occurrence == n]
            if todo:
                args, kwargs = self._transformed(family, list(args), kwargs, todo)
                self.done += len(todo)
        return func(*args, **kwargs)

    def _transformed(self, family: str, args: list, kwargs: dict, todo: list[ArgCall]) -> tuple[tuple, dict]:
        if family == "einsum":  # torch.einsum(eq, a, b) or torch.einsum(eq, [a, b])
            listed = len(args) == 2 and isinstance(args[1], (list, tuple))
            ops = list(args[1]) if listed else args[1:]
            for c in todo:
                ops[c.position] = _apply(self.transforms[c.role], ops[c.position], c.axis)
            return ((args[0], ops) if listed else (args[0], *ops)), kwargs
        for c in todo:
            if c.position < len(args):
                args[c.position] = _apply(self.transforms[c.role], args[c.position], c.axis)
            elif family == "sdpa" and _SDPA_KWARGS[c.position] in kwargs:
                key = _SDPA_KWARGS[c.position]
                kwargs[key] = _apply(self.transforms[c.role], kwargs[key], c.axis)
        return tuple(args), kwargs


class KHAAttentionInputs(nn.Module):
    """Mixin of a module whose attention calls get KHA on their role arguments (see the module doc)."""

    _kha_base_class: ClassVar[type[Any]]
    kha: KHATransforms

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        calls: list[ArgCall] = self.__dict__.get("_kha_args", [])
        mode = _ArgMode(calls, self.kha)
        with mode:
            out = super().forward(*args, **kwargs)
        if mode.done != len(calls):
            raise TracedPathError(
                f"{type(self).__name__}: {len(calls) - mode.done} of {len(calls)} KHA attention arguments did not "
                "run in this forward (a code path other than the traced one); re-apply KHA with example inputs "
                "that take this path."
            )
        return out


def _class_for(base_cls: type) -> type:
    if issubclass(base_cls, KHAAttentionInputs):
        return base_cls
    name = f"KHAAttentionInputs{base_cls.__name__}"
    return mixin_class(KHAAttentionInputs, base_cls, name, __name__, _kha_base_class=base_cls)


def is_attention_inputs(module: nn.Module) -> bool:
    return isinstance(module, KHAAttentionInputs)


def attach_inputs(
    module: nn.Module, calls: Sequence[ArgCall], kinds: dict[str, str], head_dims: dict[str, int]
) -> nn.Module:
    """Give ``module`` transforms (identity at init) on the planned attention arguments, in place."""
    if is_kha_projection(module) or "kha" in module._modules:
        raise AlreadyAppliedError(
            f"{type(module).__name__} already carries KHA of another handler; kha_compile cannot also put "
            "transforms on its attention arguments."
        )
    ref = next(iter(module.parameters()), None)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    device = ref.device if ref is not None else None
    module.__class__ = _class_for(type(module))
    module.kha = KHATransforms(
        {r: make_transform(k, head_dims[r], dtype=dtype, device=device) for r, k in kinds.items()}
    )
    module.__dict__["_kha_args"] = list(calls)
    return module


def detach_inputs(module: nn.Module) -> nn.Module:
    """Undo :func:`attach_inputs`: the module gets its class back, its ``kha`` child goes."""
    if isinstance(module, KHAAttentionInputs):
        del module.kha
        module.__dict__.pop("_kha_args", None)
        module.__class__ = type(module)._kha_base_class
    return module


def __getattr__(name: str) -> type:
    """Recreate ``KHAAttentionInputs<Base>`` classes on demand (unpickling in a new process)."""
    prefix = "KHAAttentionInputs"
    base = (
        module_class_named(name[len(prefix) :], KHAAttentionInputs)
        if name.startswith(prefix) and len(name) > len(prefix)
        else None
    )
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _class_for(base)
