"""The closed vocabularies of kha_compile as ``Literal`` types (roles, site kinds, statuses, names).

Registries (transform kinds, attention rules, projection handlers) accept more names at run time
than the built-in ones listed here; type checkers see those as plain ``str``.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["ROLES", "HandlerName", "Role", "RuleName", "SiteKind", "SiteStatus", "TransformName"]

Role = Literal["q", "k", "v"]
ROLES: tuple[Role, ...] = ("q", "k", "v")
SiteKind = Literal["mha", "gqa", "mqa", "mla", "cross"]
SiteStatus = Literal["matched", "skipped"]
TransformName = Literal["linear", "mlp"]
RuleName = Literal["sdpa", "manual_softmax"]
HandlerName = Literal["mha", "conv1d", "linear"]
