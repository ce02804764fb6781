"""Projection handler for roles that read the same features of one projection (k = v, q = k, ...).

DeepSeek-V4 projects one kv head (``kv_proj``) and passes it to the attention as both keys and
values; shared-QK attention reads one projection as queries and keys; two-way cross-attention
calls one query/key projection on both inputs. A transform after such a projection would change
every role it feeds, which is not KHA. The match gives such roles the attention argument that
carries each (:mod:`kha_compile.analysis.shared_roles`); this handler puts each role's transform
(T^K on the key argument, T^V on the value argument, ...) on that argument of that call, in the
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

from ..analysis.shared_roles import sharing_words
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
    """Owns the roles of a site that read the same features of one projection (see the module doc)."""

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
        what = ", ".join(f"T^{r.upper()}" for r in "qkv" if r in roles)
        shared = "; ".join(dict.fromkeys(sharing_words(m, rename) for m in roles.values()))
        calls = dict.fromkeys(
            f"{m.at_attention.family} in {rename(m.at_attention.home) or 'forward'}"
            for m in roles.values()
            if m.at_attention is not None
        )
        return (
            f"{shared}; {what} {'act' if len(roles) > 1 else 'acts'} on the arguments of the attention call ({', '.join(calls)}) that carry "
            "each role, where the paths part, after what the shared path does on the way; not foldable (one "
            "weight cannot carry two transforms)"
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
                f"{type(module).__name__}: the transforms on the attention arguments ({', '.join(roles)}) of roles "
                "that read the same features of one projection do not fold into it (one weight cannot carry two "
                "transforms). Nothing was changed."
            )
        return []


register_handler(AttentionInputsHandler())
