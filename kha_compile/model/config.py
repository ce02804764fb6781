"""KHAConfig: which knocking-heads transforms to insert, per role."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..core.errors import KHAConfigError
from ..core.kinds import ROLES, Role, TransformName
from .carrier import kha_modules, transforms_of
from .strategy import check_strategy
from .transforms import get_transform, kind_of, transform_kinds

__all__ = ["CONFIG_VERSION", "READABLE_VERSIONS", "KHAConfig", "allowed_kinds", "config_of"]

# 2: adds ``strategy`` (version 1 loads as strategy="auto"); 3: kha_config.json also records the insertion
# plan (``plan``: per carrier, its path, handler, head slots, kinds and out features), which deploy mode
# reads instead of analysing the model (versions 1 and 2, without a plan, still load)
CONFIG_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)


def allowed_kinds(role: Role) -> tuple[str | None, ...]:
    """The values ``KHAConfig.<role>`` accepts: ``None`` and every registered kind allowed on ``role``."""
    return (None, *(name for name, kind in transform_kinds().items() if role in kind.roles))


@dataclasses.dataclass(frozen=True)
class KHAConfig:
    """Which KHA transform each attention role gets (docs/method.md).

    ``q`` and ``k``: ``None`` or ``"linear"``; ``v``: ``None``, ``"linear"`` or ``"mlp"``.
    The default is the paper's best configuration: MLP-value KHA, no query/key transform.
    ``strategy`` says how linear transforms run (:mod:`kha_compile.model.strategy`): ``"auto"`` (folded
    into the weight on the fly when a call has more tokens than the projection has inputs, or when
    no gradient is needed), ``"weight"`` (always folded on the fly) or ``"token"`` (always applied
    to the projection output). Results agree to rounding; only the cost differs.

    Example::

        cfg = KHAConfig(q="linear", k="linear", v="linear")   # all foldable
        cfg = KHAConfig()                                       # v="mlp"
        cfg = KHAConfig(v="linear", strategy="token")
    """

    q: TransformName | None = None
    k: TransformName | None = None
    v: TransformName | None = "mlp"
    strategy: str = "auto"

    def __post_init__(self) -> None:
        check_strategy(self.strategy, "KHAConfig.strategy")
        for role in ROLES:
            allowed = allowed_kinds(role)
            value = getattr(self, role)
            if value not in allowed:
                shown = ", ".join(repr(a) for a in allowed)
                raise KHAConfigError(f"KHAConfig.{role}={value!r} is not allowed; use one of {shown}.")
        if self.q is None and self.k is None and self.v is None:
            raise KHAConfigError(
                "KHAConfig(q=None, k=None, v=None) inserts nothing; set at least one of "
                "q='linear', k='linear', v='linear' or v='mlp'."
            )

    def roles(self) -> dict[Role, str]:
        """The roles that get a transform, mapped to its kind."""
        return {r: getattr(self, r) for r in ROLES if getattr(self, r) is not None}

    @property
    def foldable(self) -> bool:
        """True when every transform folds (is linear), so fold() can remove all of them."""
        return all(get_transform(k).foldable for k in self.roles().values())

    def to_dict(self) -> dict[str, Any]:
        return {"version": CONFIG_VERSION, "q": self.q, "k": self.k, "v": self.v, "strategy": self.strategy}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KHAConfig:
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            raise KHAConfigError(
                f"KHA config version {version!r} is not supported (this kha_compile reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}); re-save the checkpoint with a matching kha_compile."
            )
        return cls(q=data.get("q"), k=data.get("k"), v=data.get("v"), strategy=data.get("strategy", "auto"))


def config_of(model: nn.Module) -> dict[str, Any]:
    """The KHAConfig (as a dict) that reproduces the model's transforms.

    Where a kind stood in for another (MLA sites carry v='linear' under v='mlp': the kind's
    ``fold_substitute``), the requested kind is what the config says. ``strategy`` is the modules'
    common ``kha_strategy`` (``"auto"`` when they differ).

    Example::

        config_of(model)        # {"version": 3, "q": None, "k": None, "v": "mlp", "strategy": "auto"}
    """
    roles: dict[str, str] = {}
    strategies: set[str] = set()
    for _, module in kha_modules(model):
        strategies.add(getattr(module, "kha_strategy", "auto"))
        for role, t in transforms_of(module).items():
            name = kind_of(t).name
            seen = roles.get(role)
            if seen is None or get_transform(name).fold_substitute == seen:
                roles[role] = name  # the requested kind wins over its stand-in
    strategy = strategies.pop() if len(strategies) == 1 else "auto"  # set per module: not one config value
    return {
        "version": CONFIG_VERSION,
        "q": roles.get("q"),
        "k": roles.get("k"),
        "v": roles.get("v"),
        "strategy": strategy,
    }
