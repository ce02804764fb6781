"""Deploy preparation: the model's head layout and a checkpoint, validated before anything compiles.

Deploy mode needs the head layout, which only the model's analysis gives (``kc.apply``'s trace
and match). ``kc.backend(from_pretrained=..., model=m)`` analyses ``m`` and validates the
checkpoint right away: a misfit raises before anything compiles. Without ``model`` the backend
takes the module handed to ``torch.compile`` and validates on the first compile.
``nn.MultiheadAttention`` (projections used functionally) is not supported in deploy mode: use
``kc.load_pretrained`` and ``"kha"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from typing import Any

from torch import Tensor, nn

from ..core.errors import AlreadyAppliedError, CheckpointError, DeployError, NoAttentionFoundError
from ..handlers import get_handler
from ..model.carrier import kha_modules
from ..model.slots import HeadSlot
from ..model.transforms import get_transform
from ..passes.apply import analyse
from ..store.format import checkpoint_misfit, read_checkpoint

__all__ = ["DeployEntry", "DeployPlan", "RoleTransform"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoleTransform:
    """One role's transform from the checkpoint: its kind and tensors (``[T]`` or ``[up, gate, down]``)."""

    kind: str
    tensors: tuple[Tensor, ...]


@dataclasses.dataclass
class DeployEntry:
    """One projection module of the model and the checkpoint transforms that go after it."""

    path: str
    module: weakref.ReferenceType[nn.Module]
    slots: list[HeadSlot]
    transforms: dict[str, RoleTransform]  # role -> transform
    out_features: int


class DeployPlan:
    """A read checkpoint, and per model the validated entries saying where its transforms go."""

    def __init__(
        self, directory: str | os.PathLike[str], example_args: Any = (), example_kwargs: dict[str, Any] | None = None
    ):
        self.directory = str(directory)
        self.cfg, self.tensors = read_checkpoint(directory)
        self.example_args, self.example_kwargs = example_args, example_kwargs
        self._plans: weakref.WeakKeyDictionary[nn.Module, list[DeployEntry]] = weakref.WeakKeyDictionary()

    def entries(self, model: nn.Module) -> list[DeployEntry]:
        """The entries for ``model`` (analysed and validated once per model)."""
        plan = self._plans.get(model)
        if plan is None:
            plan = self._prepare(model)
            self._plans[model] = plan
        return plan

    def _prepare(self, model: nn.Module) -> list[DeployEntry]:
        name = type(model).__name__
        if kha_modules(model):
            raise AlreadyAppliedError(
                f"deploy: {name} already carries KHA transforms; compile it with backend='kha' "
                "instead of backend=kc.backend(from_pretrained=...)."
            )
        report, plan = analyse(model, self.cfg, self.example_args, self.example_kwargs)
        if not report.matched:
            raise NoAttentionFoundError(
                f"deploy: kha_compile found no attention site in {name} to put the checkpoint {self.directory!r} into."
            )
        unsupported = [p.module_path for p in plan if not get_handler(p.handler).module_call]
        if unsupported:
            raise DeployError(
                f"deploy mode inserts transforms after projection modules only; {unsupported[:3]} "
                "are nn.MultiheadAttention in-projections. Use kc.load_pretrained(model, ckpt) and "
                "torch.compile(model, backend='kha')."
            )
        expected: dict[str, tuple[int, ...]] = {}
        for p in plan:
            for s in p.slots:
                if s.role in p.kinds:
                    for param in get_transform(p.kinds[s.role]).param_names:
                        expected[f"{p.module_path}.kha.{s.role}.{param}"] = (s.head_dim, s.head_dim)
        misfit = checkpoint_misfit(expected, {k: tuple(v.shape) for k, v in self.tensors.items()})
        if misfit:
            raise CheckpointError(f"the KHA checkpoint in {self.directory!r} does not fit {name}: {misfit}.")
        entries = []
        for p in plan:
            transforms = {
                s.role: RoleTransform(
                    p.kinds[s.role],
                    tuple(
                        self.tensors[f"{p.module_path}.kha.{s.role}.{q}"]
                        for q in get_transform(p.kinds[s.role]).param_names
                    ),
                )
                for s in p.slots
                if s.role in p.kinds
            }
            entries.append(
                DeployEntry(
                    p.module_path,
                    weakref.ref(model.get_submodule(p.module_path)),
                    [s for s in p.slots if s.role in p.kinds],
                    transforms,
                    p.out_features,
                )
            )
        log.info(
            "deploy: %d KHA transforms from %s fit %s (%d projections)",
            sum(len(e.transforms) for e in entries),
            self.directory,
            name,
            len(entries),
        )
        return entries
