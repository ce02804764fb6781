"""Deploy mode: insert a checkpoint's transforms after each projection op of a plain model.

Each planned projection is found in the graph by its weight: by identity when the model was
analysed, else by the weight's name (the checkpoint's recorded plan; a graph Dynamo compiled for a
part of the model names its weights from that part, so a name that ends exactly one planned
weight's name is that one).

Transforms of a foldable kind are folded into the projection when gradients are off (as in
:class:`~kha_compile.backend.rules.fold_linear.FoldLinearKHA`: a fold node over the live weight and
the kind's ``fold_matrix_of`` of the checkpoint tensors); the others are applied to the projection's
output by one graph call that runs each kind's functional form on the head slices (the same code as
a model with KHA applied), with the checkpoint tensors as constant graph inputs.

Those constants are tied to the weight they were made for (:class:`~kha_compile.backend.runtime.Switch`):
a graph that Dynamo runs for several layers (a graph break inside a repeated block) gets each
layer's tensors per call when the model was given, and raises otherwise.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, fx

from ...core.errors import AlreadyAppliedError, BackendError, CheckpointError, DeployError
from ...core.kinds import Role
from ...model.slots import HeadSlot, layout_plan, transform_slices
from ...model.transforms import get_transform
from ...store.names import canonical_name, is_kha_key
from ..deploy import DeployEntry
from ..graph import GraphContext
from ..projection import FoldCall, Projection, projection, same
from ..stats import RuleName, Verdict, ok
from .base import Rule, RuleSetup

__all__ = ["DeployKHA", "TransformCall"]


@dataclasses.dataclass
class _DeployMatch:
    anchor: fx.Node
    proj: Projection
    entry: DeployEntry
    by_suffix: bool  # found by the end of its name (a graph of a part of the model)

    def nodes(self) -> list[fx.Node]:
        return [self.anchor]


class TransformCall:
    """Graph target ``(y, *tensors) -> y'``: a projection's KHA transforms applied to its output ``y``.

    Cuts the head slices out of ``y`` as a carrier does (:func:`~kha_compile.model.slots.transform_slices`)
    and runs each kind's functional form on them, so the layout and the transforms are the package's own.
    ``tensors`` are the roles' tensors in role order (``param_names`` order of the kind within a role).
    """

    def __init__(self, slots: Sequence[HeadSlot], kinds: Mapping[Role, str], out_features: int, name: str):
        self.slots = tuple(slots)
        self.kinds = dict(kinds)  # role -> kind, in the order of the tensors
        self.out_features = out_features
        self.mode, self.stride = layout_plan(self.slots, out_features)
        self.__name__ = name  # how the generated graph code names it
        self.__module__ = __name__
        # the kha::mlp_value ops this call runs: kinds whose forward emits that op (their ONNX translations say so)
        op = torch.ops.kha.mlp_value.default
        self.kha_mlp_value_ops = sum(op in get_transform(kind).onnx_translations() for kind in self.kinds.values())

    def __call__(self, y: Tensor, *tensors: Tensor) -> Tensor:
        it = iter(tensors)
        fns: dict[str, Callable[[Tensor], Tensor]] = {}
        for role, kind in self.kinds.items():
            spec = get_transform(kind)
            params = [next(it) for _ in spec.param_names]
            fns[role] = _bound(spec, params)
        return transform_slices(y, self.slots, self.mode, self.stride, fns)  # (…, out_features)

    def __repr__(self) -> str:
        return f"TransformCall({self.__name__}, {self.kinds})"


def _bound(spec: Any, params: list[Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda x: spec.functional(x, *params)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


class DeployKHA(Rule):
    """Deploy mode: insert a checkpoint's transforms after each projection op of the plain model.

    Foldable transforms are folded into the projection when gradients are off (as in
    :class:`FoldLinearKHA`); the rest become one :class:`TransformCall` node after the projection.
    Entries without a module (the checkpoint's plan) are found by name and validated against the
    graph: a planned weight the graph's model does not have, or of another size, raises
    :class:`CheckpointError`.
    """

    name: ClassVar[RuleName] = "deploy"
    strict: ClassVar[bool] = True  # a transform left out would silently change the model's outputs
    error: ClassVar[type[BackendError]] = DeployError

    def __init__(
        self, entries: Sequence[DeployEntry], checkpoint: str = "the checkpoint", placed: set[str] | None = None
    ):
        self.entries = list(entries)
        self.checkpoint = checkpoint
        self.placed = placed if placed is not None else set()  # owned by the backend: paths placed in any graph

    @classmethod
    def create(cls, setup: RuleSetup) -> Rule | None:
        if setup.deploy_entries is None:
            return None
        return cls(setup.deploy_entries, setup.checkpoint, setup.placed)

    def _does_not_fit(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"the KHA checkpoint in {self.checkpoint!r} does not fit the compiled model: {what}. Deploy it into "
            "the model it was saved from (its recorded plan names that model's modules); for a model whose "
            "module names differ, pass it, kc.backend(from_pretrained=..., model=model), and kha_compile "
            "analyses it instead."
        )

    def _find(self, ctx: GraphContext) -> list[tuple[fx.Node, DeployEntry, bool]]:
        """(graph input, entry, found by suffix) for every planned weight in this graph; a misfit raises."""
        by_id: dict[int, tuple[DeployEntry, Tensor]] = {}
        by_name: dict[str, DeployEntry] = {}
        for e in self.entries:
            if e.module is None:
                by_name[e.weight_name] = e
                continue
            w = getattr(e.module(), "weight", None)
            if isinstance(w, Tensor):
                by_id[id(w)] = (e, w)
        names = {node: canonical_name(path) for node, path in ctx.names.items()}
        if by_name and any(is_kha_key(n) for n in names.values()):
            raise AlreadyAppliedError(
                "deploy: the compiled model already carries KHA transforms; compile it with backend='kha' "
                "instead of backend=kc.backend(from_pretrained=...)."
            )
        projected = {n for n in names if any((p := projection(u, ctx)) is not None and p.weight is n for u in n.users)}
        found: list[tuple[fx.Node, DeployEntry, bool]] = []
        for node in ctx.graph.nodes:
            if node.op not in ("placeholder", "get_attr"):
                continue
            t = ctx.tensor_of(node)
            hit = by_id.get(id(t)) if t is not None else None
            if hit is not None and hit[1] is t:
                found.append((node, hit[0], False))
                continue
            name = names.get(node)
            if name is None or not by_name:
                continue
            if name in by_name:
                found.append((node, by_name[name], False))
            elif node in projected:
                ends = [e for w, e in by_name.items() if w.endswith(f".{name}")]
                if len(ends) > 1:
                    raise DeployError(
                        f"deploy: graph {ctx.stats.index} is one part of the model that repeats: Dynamo names its "
                        f"projection weight {name!r}, which ends {len(ends)} planned weights ({ends[0].weight_name!r}, "
                        f"{ends[1].weight_name!r}, ...), and runs the same graph for each of them (a graph break "
                        "inside a repeated block). Pass the model, kc.backend(from_pretrained=..., model=model): "
                        "each call then gets its own module's transforms; or remove the graph break "
                        "(torch._dynamo.explain(model)(...) lists them)."
                    )
                if ends:
                    found.append((node, ends[0], True))
        if by_name:
            self._refuse_missing(by_name, found, bool(projected))
        self.placed.update(e.path for _, e, _ in found)
        return found

    def _refuse_missing(
        self, by_name: dict[str, DeployEntry], found: list[tuple[fx.Node, DeployEntry, bool]], projects: bool
    ) -> None:
        """Refuse planned weights the compiled model does not have; the others may sit in another graph.

        Missing for sure: a planned weight whose module's parent holds a planned weight found in this
        graph (another layout or naming), or all of them when this graph has projections, none of
        them planned, and no graph so far had one (another model). Graph breaks may put the rest in
        graphs of their own (a graph of only ``lm_head`` comes after the layers).
        """
        here = {e.path for _, e, _ in found}
        parents = {_parent(p) for p in here}
        unplaced = [e for e in by_name.values() if e.path not in here and e.path not in self.placed]
        missing = [e.weight_name for e in unplaced if _parent(e.path) in parents]
        if not missing and not here and not self.placed and projects:
            missing = [e.weight_name for e in unplaced]
        if missing:
            shown = f"{sorted(missing)[:5]}{' ...' if len(missing) > 5 else ''}"
            raise self._does_not_fit(f"its plan's projection weights are not in this model: {shown}")

    def pattern(self, ctx: GraphContext) -> Iterator[Any]:
        for node, entry, by_suffix in self._find(ctx):
            uses = list(node.users)
            matches = [
                _DeployMatch(u, p, entry, by_suffix)
                for u in uses
                if (p := projection(u, ctx)) is not None and p.weight is node
            ]
            if not matches:
                raise DeployError(
                    f"deploy: the weight of {entry.path} is used in the graph only by "
                    f"{', '.join(f'{u.op} {u.target}' for u in uses) or 'nothing'}, not by a linear/addmm/matmul "
                    "op, so its KHA transforms cannot be inserted. Use kc.load_pretrained(model, ckpt) and "
                    "torch.compile(model, backend='kha') instead."
                )
            yield from matches

    def check(self, m: _DeployMatch, ctx: GraphContext) -> Verdict:
        w = ctx.tensor_of(m.proj.weight)
        assert w is not None  # projection() checked it
        if w.shape[m.proj.out_axis] != m.entry.out_features:
            raise self._does_not_fit(
                f"shape mismatch: {m.entry.weight_name} has {w.shape[m.proj.out_axis]} output features, "
                f"the checkpoint's plan {m.entry.out_features}"
            )
        return ok()

    @staticmethod
    def _constants(entry: DeployEntry, w: Tensor, fold: Sequence[HeadSlot], keep: Sequence[HeadSlot]) -> list[Tensor]:
        """The checkpoint tensors a site needs, on ``w``'s device and dtype: the fold matrices of the
        ``fold`` slots, then the tensors of the ``keep`` roles."""
        out = []
        for s in fold:
            rt = entry.transforms[s.role]
            out.append(get_transform(rt.kind).fold_matrix_of(*rt.tensors).to(device=w.device, dtype=w.dtype))
        for s in keep:
            out.extend(t.to(device=w.device, dtype=w.dtype) for t in entry.transforms[s.role].tensors)
        return out

    def _lookup(self, m: _DeployMatch, fold: Sequence[HeadSlot], keep: Sequence[HeadSlot]) -> Any:
        """The constants for another weight passed where ``m``'s weight was: those of its module's entry."""
        layout = [(s, m.entry.transforms[s.role].kind) for s in (*fold, *keep)]

        def lookup(w: Tensor) -> list[Tensor]:
            entry = None
            if not m.by_suffix:  # the model was analysed: find the module by its weight
                entry = next((e for e in self.entries if e.module is not None and _weight(e) is w), None)
            if entry is None or [(s, entry.transforms[s.role].kind) for s in (*fold, *keep)] != layout:
                raise DeployError(
                    f"deploy: the graph compiled for {m.entry.path} now runs another module (a graph break "
                    "inside a repeated block makes Dynamo share one graph between them), and kha_compile "
                    "cannot tell which module that is. Pass the model, kc.backend(from_pretrained=..., "
                    "model=model), so each call gets its own module's transforms; or remove the graph break "
                    "(torch._dynamo.explain(model)(...) lists them)."
                )
            return self._constants(entry, w, fold, keep)

        return lookup

    def rewrite(self, m: _DeployMatch, ctx: GraphContext) -> int:
        proj, entry = m.proj, m.entry
        w = ctx.tensor_of(proj.weight)
        b = ctx.tensor_of(proj.bias)
        assert w is not None
        slots = [s for s in entry.slots if s.role in entry.transforms]
        may_fold = ctx.options.get("fold", True) and not (
            ctx.grad_enabled and (w.requires_grad or (b is not None and b.requires_grad))
        )
        fold = [s for s in slots if get_transform(entry.transforms[s.role].kind).foldable] if may_fold else []
        keep = [s for s in slots if s not in fold]
        nodes = ctx.add_constants(self._constants(entry, w, fold, keep), f"kha_deploy_{proj.node.name}")
        if m.by_suffix or entry.module is not None:  # the graph may run for other modules too
            ctx.tie(nodes, proj.weight, self._lookup(m, fold, keep))
        if fold:
            fold_call = FoldCall(fold, proj.out_axis, [(same, 1)] * len(fold), f"kha_deploy_fold_{proj.node.name}")
            with ctx.graph.inserting_before(proj.node):
                folded = ctx.call(fold_call, (proj.weight, proj.bias, *nodes[: len(fold)]), like=proj.node)
                nw = ctx.call(operator.getitem, (folded, 0), like=proj.node)
                nb = ctx.call(operator.getitem, (folded, 1), like=proj.node) if proj.bias is not None else None
            proj.replace(nw, nb)
        if keep:
            kinds = {s.role: entry.transforms[s.role].kind for s in keep}
            y = proj.node
            target = TransformCall(keep, kinds, entry.out_features, f"kha_deploy_transform_{proj.node.name}")
            with ctx.graph.inserting_after(y):
                z = ctx.call(target, (y, *nodes[len(fold) :]), like=y)
            y.replace_all_uses_with(z, delete_user_cb=lambda u: u is not z)
        return len(slots)


def _weight(e: DeployEntry) -> Any:
    mod = e.module() if e.module is not None else None
    return getattr(mod, "weight", None)
