"""The insertion plan of a KHA model: per KHA carrier, where it sits and what goes after its projection.

``kha_config.json`` records it (``kc.save_pretrained``, config version 3; :mod:`.format` reads it back),
and the recorded sites of a transformers checkpoint are summarised from it (:mod:`.identity`).

Example::

    kha_plan(model)[0]      # {"module": "model.layers.0.self_attn.v_proj", "handler": "linear", ...}
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ..model.carrier import KHAProjection, carrier_state, handler_name, kha_modules, transforms_of
from ..model.slots import HeadSlot
from ..model.transforms import kind_of
from .names import canonical_name

__all__ = ["PlannedProjection", "kha_plan"]


@dataclasses.dataclass(frozen=True)
class PlannedProjection:
    """One KHA carrier as a checkpoint records it: where it sits and what goes after its projection.

    ``slots`` and ``out_features`` are empty / None for carriers whose projections are not a module's
    own forward (``nn.MultiheadAttention`` in-projections, functional weights).
    """

    path: str  # module path, canonical (no PEFT wrapping)
    handler: str | None  # the projection handler that attached it
    slots: tuple[HeadSlot, ...]
    kinds: dict[str, str]  # role -> transform kind
    out_features: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "module": self.path,
            "handler": self.handler,
            "slots": [s.to_dict() for s in self.slots],
            "kinds": dict(self.kinds),
            "out_features": self.out_features,
        }


def _canonical_path(path: str) -> str:
    return canonical_name(f"{path}.weight")[: -len(".weight")]


def kha_plan(model: nn.Module) -> list[dict[str, Any]]:
    """The insertion plan of ``model`` as it carries KHA now, as JSON-ready dicts (see the module docs).

    Example::

        kha_plan(model)[0]["module"]        # "model.layers.0.self_attn.v_proj"
    """
    out = []
    for path, module in kha_modules(model):
        kinds = {r: kind_of(t).name for r, t in transforms_of(module).items()}
        slots: tuple[HeadSlot, ...] = ()
        out_features: int | None = None
        if isinstance(module, KHAProjection):
            _, all_slots, out_features, _ = carrier_state(module)
            slots = tuple(s for s in all_slots if s.role in kinds)
        entry = PlannedProjection(_canonical_path(path), handler_name(module), slots, kinds, out_features)
        out.append(entry.to_dict())
    return out
