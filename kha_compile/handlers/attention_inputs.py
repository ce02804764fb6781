"""Projection handler for keys and values that are one projection's features (k = v).

DeepSeek-V4 projects one kv head (``kv_proj``) and passes it to the attention as both keys and
values. A transform after ``kv_proj`` would change both roles, which is not KHA. The match gives
such roles the attention argument that carries each (:mod:`kha_compile.analysis.attention_calls`);
this handler puts T^K on the key argument and T^V on the value argument of that call, in the
module whose forward makes it (:mod:`kha_compile.model.attention_inputs`). They sit after
whatever the shared path does between the projection and the attention (DeepSeek-V4: ``kv_norm``
and RoPE), and they never fold: one weight cannot carry two transforms. The site's note says so,
and ``kc.fold`` keeps them (``strict=True`` refuses, like MLP-value).

Example::

    handler.accepts(model, role_match)     # (True, "") when role_match.at_attention is set
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..core.errors import FoldError
from ..model.attention_inputs import ArgCall, attach_inputs, detach_inputs, is_attention_inputs
from ..model.carrier import set_handler, transforms_of
from . import register_handler
from .base import PlanEntry, ProjectionHandler

if TYPE_CHECKING:
    from ..analysis.match import RoleMatch

__all__ = ["AttentionInputsHandler", "InputsEntry"]


@dataclasses.dataclass
class InputsEntry:
    """The ``extra`` of a plan entry handled here: the arguments to transform and each role's head dim."""

    calls: list[ArgCall] = dataclasses.field(default_factory=list)
    head_dims: dict[str, int] = dataclasses.field(default_factory=dict)


class AttentionInputsHandler(ProjectionHandler):
    """Owns the k and v roles of a site whose keys are its values (see the module doc)."""

    name = "attention_inputs"
    priority = 1  # before every projection handler: these roles must not go after the projection
    plans_roles = True

    def accepts(self, model: nn.Module, m: RoleMatch) -> tuple[bool, str]:
        return (m.at_attention is not None), ""

    def entry_path(self, m: RoleMatch) -> str:
        assert m.at_attention is not None  # accepts() said so
        return m.at_attention.home

    def owns(self, module: nn.Module) -> bool:
        return is_attention_inputs(module)

    def plan_role(self, entry: PlanEntry, role: str, m: RoleMatch, kind: str) -> None:
        extra = entry.extra if isinstance(entry.extra, InputsEntry) else InputsEntry()
        entry.extra = extra
        arg = m.at_attention
        assert arg is not None
        call = ArgCall(role, arg.family, arg.occurrence, arg.position, arg.axis, arg.ranks)
        if call not in extra.calls:
            extra.calls.append(call)
        extra.head_dims[role] = m.head_map.head_dim
        entry.kinds[role] = kind

    def describe(
        self, model: nn.Module, roles: dict[str, RoleMatch], rename: Callable[[str], str] = lambda p: p
    ) -> str:
        if not roles:
            return ""
        m = next(iter(roles.values()))
        arg = m.at_attention
        assert arg is not None
        what = ", ".join(f"T^{r.upper()}" for r in sorted(roles))
        return (
            f"k = v: keys and values are the same features of {rename(m.projection.module_path)}; {what} act on the "
            f"key and value arguments of the attention call ({arg.family} in {rename(arg.home) or 'forward'}), "
            "where the two paths part, after what the shared path does on the way; not foldable (one weight "
            "cannot carry two transforms)"
        )

    def attach(self, module: nn.Module, entry: PlanEntry) -> None:
        extra: Any = entry.extra
        attach_inputs(module, extra.calls, entry.kinds, extra.head_dims)
        set_handler(module, self.name)

    def detach(self, module: nn.Module) -> None:
        set_handler(module, None)
        detach_inputs(module)

    def fixed_roles(self, module: nn.Module) -> list[str]:
        return list(transforms_of(module))

    def fold(self, module: nn.Module, roles: Sequence[str]) -> list[tuple[str, Tensor]]:
        if roles:
            raise FoldError(
                f"{type(module).__name__}: the k = v transforms on the attention arguments ({', '.join(roles)}) do "
                "not fold into the shared projection (one weight cannot carry T^K and T^V). Nothing was changed."
            )
        return []


register_handler(AttentionInputsHandler())
