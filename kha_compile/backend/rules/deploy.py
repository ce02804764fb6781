"""Deploy mode: insert a checkpoint's transforms after each projection op of a plain model.

Linear transforms are folded into the projection when gradients are off (as in
:class:`~kha_compile.backend.rules.fold_linear.FoldLinearKHA`); the others are applied to the
projection's output by one graph call that runs :meth:`KHAProjection.kha_transform` (the same
code as a model with KHA applied), with the checkpoint tensors as extra graph inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from torch import Tensor, fx

from ...core.errors import BackendError, DeployError
from ...core.kinds import Role
from ...model.slots import HeadSlot, layout_plan, transform_slices
from ...model.transforms import get_transform
from ..deploy import DeployEntry, RoleTransform
from ..graph import GraphContext
from ..projection import Projection, fold_fn, projection
from ..runtime import Recipe, Source
from ..stats import RuleName, Verdict, fail, ok
from .base import Rule, RuleSetup

__all__ = ["DeployKHA", "TransformCall"]


@dataclasses.dataclass
class _DeployMatch:
    anchor: fx.Node
    proj: Projection
    entry: DeployEntry

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
        self.kha_mlp_value_ops = sum(not get_transform(kind).foldable for kind in self.kinds.values())

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


class DeployKHA(Rule):
    """Deploy mode: insert a checkpoint's transforms after each projection op of the plain model.

    Linear transforms are folded into the projection when gradients are off (as in
    :class:`FoldLinearKHA`); the rest become one :class:`TransformCall` node after the projection.
    """

    name: ClassVar[RuleName] = "deploy"
    strict: ClassVar[bool] = True  # a transform left out would silently change the model's outputs
    error: ClassVar[type[BackendError]] = DeployError

    def __init__(self, entries: Sequence[DeployEntry]):
        self.entries = list(entries)

    @classmethod
    def create(cls, setup: RuleSetup) -> Rule | None:
        return cls(setup.deploy_entries) if setup.deploy_entries is not None else None

    def pattern(self, ctx: GraphContext) -> Iterator[Any]:
        by_weight: dict[int, DeployEntry] = {}
        for e in self.entries:
            mod = e.module()
            w = getattr(mod, "weight", None) if mod is not None else None
            if isinstance(w, Tensor):
                by_weight[id(w)] = e
        for node in list(ctx.graph.nodes):
            if node.op not in ("placeholder", "get_attr"):
                continue
            t = ctx.tensor_of(node)
            entry = by_weight.get(id(t)) if t is not None else None
            mod = entry.module() if entry is not None else None
            if entry is None or mod is None or t is not mod.weight:
                continue
            uses = list(node.users)
            found = False
            for u in uses:
                proj = projection(u, ctx)
                if proj is not None and proj.weight is node:
                    found = True
                    yield _DeployMatch(u, proj, entry)
            if not found:
                raise DeployError(
                    f"deploy: the weight of {entry.path} is used in the graph only by "
                    f"{', '.join(f'{u.op} {u.target}' for u in uses) or 'nothing'}, not by a linear/addmm/matmul "
                    "op, so its KHA transforms cannot be inserted. Use kc.load_pretrained(model, ckpt) and "
                    "torch.compile(model, backend='kha') instead."
                )

    def check(self, m: _DeployMatch, ctx: GraphContext) -> Verdict:
        w = ctx.tensor_of(m.proj.weight)
        assert w is not None  # projection() checked it
        if w.shape[m.proj.out_axis] != m.entry.out_features:
            return fail(
                f"{m.entry.path}: weight has {w.shape[m.proj.out_axis]} output features, the plan "
                f"{m.entry.out_features}"
            )
        return ok()

    def rewrite(self, m: _DeployMatch, ctx: GraphContext) -> int:
        proj, entry = m.proj, m.entry
        w = ctx.tensor_of(proj.weight)
        b = ctx.tensor_of(proj.bias)
        assert w is not None
        consts = {
            r: RoleTransform(rt.kind, tuple(t.to(device=w.device, dtype=w.dtype) for t in rt.tensors))
            for r, rt in entry.transforms.items()
        }
        slots = [s for s in entry.slots if s.role in consts]
        may_fold = ctx.options.get("fold", True) and not (
            ctx.grad_enabled and (w.requires_grad or (b is not None and b.requires_grad))
        )
        fold = [s for s in slots if get_transform(consts[s.role].kind).foldable] if may_fold else []
        keep = [s for s in slots if s not in fold]
        if fold:
            srcs = [ctx.source(proj.weight), ctx.source(proj.bias)]
            srcs += [
                Source.const(get_transform(consts[s.role].kind).fold_matrix_of(*consts[s.role].tensors)) for s in fold
            ]
            new = ctx.add_inputs(Recipe(srcs, fold_fn(fold, proj.out_axis)), f"kha_deploy_folded_{proj.node.name}")
            proj.replace(new[0], new[1] if proj.bias is not None else None)
        if keep:
            kinds = {s.role: consts[s.role].kind for s in keep}
            tensors = [t for role in kinds for t in consts[role].tensors]
            inputs = ctx.add_inputs(
                Recipe([Source.const(t) for t in tensors], lambda *xs: xs), f"kha_deploy_{proj.node.name}"
            )
            y = proj.node
            target = TransformCall(keep, kinds, entry.out_features, f"kha_deploy_transform_{proj.node.name}")
            with ctx.graph.inserting_after(y):
                z = ctx.call(target, (y, *inputs), like=y)
            y.replace_all_uses_with(z, delete_user_cb=lambda u: u is not z)
        return len(slots)
