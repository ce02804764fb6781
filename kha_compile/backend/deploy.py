"""Deploy preparation: a checkpoint and where its transforms go, validated before anything is inserted.

Where the transforms go comes from one of two places:

- the insertion plan the checkpoint records (``kc.save_pretrained`` writes it since config version
  3): per projection its module path, head slots, kinds and output features. The deploy rule finds
  each planned projection in the Dynamo graph by its weight's name (:func:`~kha_compile.backend.graph.param_names`)
  and validates it there, on the first compile. No model object is needed.
- the model's analysis (``kc.apply``'s trace and match), when ``kc.backend(from_pretrained=...,
  model=m)`` is given the model: ``m`` is analysed and the checkpoint validated right away, so a misfit
  raises before anything compiles. A checkpoint without a plan (config version 1 or 2, or a
  transformers directory) needs this.

The tensor shapes a checkpoint must hold come from the transform kinds (the module each kind creates
at the head dim). ``nn.MultiheadAttention`` (projections used functionally) is not supported in
deploy mode: use ``kc.load_pretrained`` and ``"kha"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core.errors import AlreadyAppliedError, CheckpointError, DeployError, NoAttentionFoundError, RegistryError
from ..handlers import get_handler
from ..model.carrier import kha_modules
from ..model.slots import HeadSlot
from ..model.transforms import get_transform
from ..passes.apply import analyse
from ..store.format import PlannedProjection, checkpoint_misfit, read_checkpoint, read_plan

__all__ = ["DeployEntry", "DeployPlan", "RoleTransform", "expected_shapes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoleTransform:
    """One role's transform from the checkpoint: its kind and tensors (in the kind's ``param_names`` order)."""

    kind: str
    tensors: tuple[Tensor, ...]


@dataclasses.dataclass
class DeployEntry:
    """One projection of the model and the checkpoint transforms that go after it.

    ``module`` is set when the model was analysed (the graph input is then found by identity);
    without it the projection is found by the name of its weight, ``f"{path}.weight"``.
    """

    path: str
    module: weakref.ReferenceType[nn.Module] | None
    slots: list[HeadSlot]
    transforms: dict[str, RoleTransform]  # role -> transform
    out_features: int

    @property
    def weight_name(self) -> str:
        return f"{self.path}.weight"


def expected_shapes(path: str, slots: Iterable[HeadSlot], kinds: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a projection's transforms need, with their shapes (from each kind's module)."""
    out: dict[str, tuple[int, ...]] = {}
    for s in slots:
        if s.role not in kinds:
            continue
        kind = get_transform(kinds[s.role])
        module = kind.create(s.head_dim, device=torch.device("meta"))
        for p in kind.param_names:
            out[f"{path}.kha.{s.role}.{p}"] = tuple(getattr(module, p).shape)
    return out


def _module_call_only(paths_handlers: Sequence[tuple[str, str | None, bool]]) -> None:
    """Refuse projections that are not a module's own forward (what deploy mode inserts after)."""
    unsupported = []
    for path, handler, has_slots in paths_handlers:
        try:
            module_call = handler is not None and get_handler(handler).module_call
        except RegistryError:
            module_call = has_slots  # a handler this process has not registered: its recorded slots decide
        if not (module_call and has_slots):
            unsupported.append(path)
    if unsupported:
        raise DeployError(
            f"deploy mode inserts transforms after projection modules only; {unsupported[:3]} "
            "are not (nn.MultiheadAttention in-projections or functional weights). Use "
            "kc.load_pretrained(model, ckpt) and torch.compile(model, backend='kha')."
        )


class DeployPlan:
    """A read checkpoint, and the validated entries saying where its transforms go (from its plan or a model).

    Raises :class:`DeployError` at once for a checkpoint without a plan when no model is given.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        example_args: Any = (),
        example_kwargs: dict[str, Any] | None = None,
        *,
        model_given: bool = False,
    ):
        self.directory = str(directory)
        self.cfg, self.tensors = read_checkpoint(directory)
        self.plan: list[PlannedProjection] | None = read_plan(directory)
        if self.plan is None and not model_given:
            raise DeployError(
                f"the KHA checkpoint in {self.directory!r} records no insertion plan (it was written by an "
                "older kha_compile, or by the model's own save_pretrained), so deploy mode cannot tell where "
                "its transforms go without the model. Pass the model: kc.backend(from_pretrained="
                f"{self.directory!r}, model=model), or re-save the checkpoint with kc.save_pretrained."
            )
        self.example_args, self.example_kwargs = example_args, example_kwargs
        self._plans: weakref.WeakKeyDictionary[nn.Module, list[DeployEntry]] = weakref.WeakKeyDictionary()
        self._planned: list[DeployEntry] | None = None

    def _misfit(self, expected: dict[str, tuple[int, ...]], what: str, todo: str) -> None:
        misfit = checkpoint_misfit(expected, {k: tuple(v.shape) for k, v in self.tensors.items()})
        if misfit:
            raise CheckpointError(f"the KHA checkpoint in {self.directory!r} does not fit {what}: {misfit}. {todo}")

    def _transforms(self, path: str, slots: Sequence[HeadSlot], kinds: dict[str, str]) -> dict[str, RoleTransform]:
        return {
            s.role: RoleTransform(
                kinds[s.role],
                tuple(self.tensors[f"{path}.kha.{s.role}.{q}"] for q in get_transform(kinds[s.role]).param_names),
            )
            for s in slots
            if s.role in kinds
        }

    def planned(self) -> list[DeployEntry]:
        """The entries of the checkpoint's recorded plan, validated against its tensors (once).

        Raises :class:`CheckpointError` when the tensors do not fit the plan, :class:`DeployError` for
        a checkpoint without a plan or with projections deploy mode cannot place.
        """
        if self._planned is not None:
            return self._planned
        if self.plan is None:
            raise DeployError(
                f"the KHA checkpoint in {self.directory!r} records no insertion plan; pass the model: "
                "kc.backend(from_pretrained=..., model=model), or re-save it with kc.save_pretrained."
            )
        _module_call_only([(p.path, p.handler, bool(p.slots) and p.out_features is not None) for p in self.plan])
        expected: dict[str, tuple[int, ...]] = {}
        for p in self.plan:
            expected.update(expected_shapes(p.path, p.slots, p.kinds))
        self._misfit(
            expected,
            "the insertion plan it records",
            "Its two files come from different saves: re-save the checkpoint with kc.save_pretrained.",
        )
        entries = []
        for p in self.plan:
            slots = [s for s in p.slots if s.role in p.kinds]
            assert p.out_features is not None  # _module_call_only checked it
            entries.append(DeployEntry(p.path, None, slots, self._transforms(p.path, slots, p.kinds), p.out_features))
        self._planned = entries
        return entries

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
                f"deploy: kha_compile found no attention site in {name} to put the checkpoint {self.directory!r} "
                "into. Deploy it into the model class it was saved from."
            )
        _module_call_only([(p.module_path, p.handler, True) for p in plan])
        expected: dict[str, tuple[int, ...]] = {}
        for p in plan:
            expected.update(expected_shapes(p.module_path, p.slots, p.kinds))
        self._misfit(expected, name, "Deploy it into the model class it was saved from.")
        entries = []
        for p in plan:
            slots = [s for s in p.slots if s.role in p.kinds]
            entries.append(
                DeployEntry(
                    p.module_path,
                    weakref.ref(model.get_submodule(p.module_path)),
                    slots,
                    self._transforms(p.module_path, slots, p.kinds),
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
