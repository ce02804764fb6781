"""KHA written by hand into an untouched model: trainable shared transforms in hooks on its q/k/v projections.

The reference of the training-regime tests. For a copy of a model made before ``kc.apply``,
:class:`HandKHA` adds to every attention a module ``hand_kha`` (a child of the module that owns the
q/k/v projections, so FSDP2, DDP and gradient checkpointing treat it as part of the layer) holding
docs/method.md's transforms as its own parameters, and a forward hook on each q/k/v projection that
cuts the projection output into heads the way the architecture's modeling code does
(:data:`reference.LAYOUTS`, written out per architecture with the head counts from the config),
applies the role's transform to every head vector and puts the heads back. That is after the
head split and before QK-norm, RoPE and repeat_kv, which all act on the projection's output later.

The matrices are stored transposed, the way ``nn.Linear`` stores a weight (``h -> h @ t.T``):
Adam is transpose-equivariant, so both sides train the same, and nothing here shares a layout or
a line of code with kha_compile. Initial KHA weights are copied from the pass-made model's state
dict by the names docs/concepts.md gives them (``<projection>.kha.<role>.<weight | up | gate | down>``).

``drop``: roles whose transform the hand model leaves out (identity), to show that a comparison
fails when KHA is missing on one role.

Example::

    untouched = copy.deepcopy(model)
    kc.apply(model, kc.KHAConfig(v="mlp"))
    perturb(model)
    hand = HandKHA(untouched, {"v": "mlp"}).load(model.state_dict())
    torch.testing.assert_close(model(ids).logits, hand.model(ids).logits)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from reference import LAYOUTS, ROLES, Proj

__all__ = ["PARAMS", "HandKHA", "permute_mlp_channels"]

PARAMS = {"linear": ("weight",), "mlp": ("up", "gate", "down")}  # the pass-made model's names, per kind


class HandTransforms(nn.Module):
    """One attention's hand-written transforms: ``<role>_<param>`` parameters, stored transposed."""

    def __init__(self, kinds: dict[str, str], head_dims: dict[str, int], drop: tuple[str, ...]) -> None:
        super().__init__()
        self.kinds, self.drop = dict(kinds), drop
        for role, kind in kinds.items():
            if role in drop:  # left out: no parameters (DDP would see them unused)
                continue
            eye = torch.eye(head_dims[role])
            init = {"weight": eye, "up": eye, "gate": torch.zeros_like(eye), "down": eye}
            for p in PARAMS[kind]:
                self.register_parameter(f"{role}_{p}", nn.Parameter(init[p].clone()))

    def apply_role(self, role: str, h: Tensor) -> Tensor:
        """docs/method.md's transform of ``role`` on head vectors ``h`` (..., Dh)."""
        kind = self.kinds.get(role)
        if kind is None or role in self.drop:
            return h
        p = {name: getattr(self, f"{role}_{name}").t() for name in PARAMS[kind]}  # stored transposed
        if kind == "linear":
            return h @ p["weight"]
        return (2 * (h @ p["up"]) * torch.sigmoid(h @ p["gate"])) @ p["down"]


class HandKHA:
    """``model`` (untouched, no kha_compile) with KHA written in by hand; ``kinds``: role -> "linear" | "mlp"."""

    def __init__(
        self,
        model: nn.Module,
        kinds: dict[str, str],
        *,
        arch: str | None = None,
        cfg: object = None,
        drop: tuple[str, ...] = (),
    ) -> None:
        self.model = model
        cfg = cfg if cfg is not None else model.config  # type: ignore[union-attr]
        self.projs: list[Proj] = LAYOUTS[arch or cfg.model_type](model, cfg)  # type: ignore[union-attr]
        self.kinds = {r: k for r, k in kinds.items() if k is not None}
        self.drop = drop
        self.owners: dict[str, str] = {}  # projection path -> path of its hand_kha module
        dims: dict[str, dict[str, int]] = {}  # owner -> role -> head size, over all its projections
        for proj in self.projs:
            owner = proj.path.rpartition(".")[0]
            self.owners[proj.path] = f"{owner}.hand_kha" if owner else "hand_kha"
            dims.setdefault(owner, {}).update(_head_dims(proj, model))
        for owner, head_dims in dims.items():
            kinds_here = {r: k for r, k in self.kinds.items() if r in head_dims}
            model.get_submodule(owner).hand_kha = HandTransforms(kinds_here, head_dims, drop)
        for proj in self.projs:
            hand = model.get_submodule(self.owners[proj.path])
            model.get_submodule(proj.path).register_forward_hook(
                lambda m, i, y, split=proj.split, hand=hand: split(y, _fns(hand))
            )

    def to(self, device: str | torch.device) -> HandKHA:
        """Move the model (and its hand-written transforms) to ``device``; returns self."""
        self.model.to(device)
        return self

    def load(self, state: dict[str, Tensor]) -> HandKHA:
        """Copy the pass-made model's weights: its own (strict), and its KHA tensors (transposed) by name."""
        own = {k: v for k, v in state.items() if ".kha." not in f".{k}"}
        hand_names = {n for n in self.model.state_dict() if ".hand_kha." in f".{n}"}
        missing, unexpected = self.model.load_state_dict(own, strict=False)
        assert not unexpected and set(missing) == hand_names, (unexpected, sorted(set(missing) ^ hand_names)[:4])
        loaded = set()
        with torch.no_grad():
            for proj in self.projs:
                hand = self.model.get_submodule(self.owners[proj.path])
                for role in proj.roles:
                    kind = self.kinds.get(role) if role not in hand.drop else None
                    for p in PARAMS.get(kind or "", ()):
                        key = f"{proj.path}.kha.{role}.{p}"
                        assert key in state, f"the pass-made model has no {key} (expected {kind} KHA on {role})"
                        getattr(hand, f"{role}_{p}").copy_(state[key].t())
                        loaded.add(key)
        dropped = {f".kha.{r}." for r in self.drop}
        left = sorted(k for k in state if ".kha." in f".{k}" and k not in loaded and not any(d in k for d in dropped))
        assert not left, f"KHA tensors the hand-written model does not hold: {left[:4]}"
        return self


def _fns(hand: HandTransforms) -> dict[str, object]:
    return {role: (lambda h, role=role: hand.apply_role(role, h)) for role in ROLES}


def _head_dims(proj: Proj, model: nn.Module) -> dict[str, int]:
    """Head size per role, read off the layout: push a probe through the split and see what each role gets."""
    seen: dict[str, int] = {}
    mod = model.get_submodule(proj.path)
    width = getattr(mod, "out_features", None) or mod.weight.shape[-1 if type(mod).__name__ == "Conv1D" else 0]

    def probe(role: str):
        def fn(h: Tensor) -> Tensor:
            seen[role] = h.shape[-1]
            return h

        return fn

    proj.split(torch.zeros(1, width), {r: probe(r) for r in ROLES})
    return seen


def permute_mlp_channels(model: nn.Module, seed: int = 0) -> int:
    """Permute the intermediate channels of every gated MLP (gate/up rows, down columns), in place.

    The model computes the same function, with the down projection's sums taken in another order:
    running it beside the original measures the rounding noise of a training run (bf16, fp16). Returns
    how many MLPs were permuted.
    """
    count = 0
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            gate, up, down = (getattr(mod, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
            if not all(isinstance(x, nn.Linear) for x in (gate, up, down)):
                continue
            perm = torch.randperm(gate.out_features, generator=gen)
            gate.weight.copy_(gate.weight[perm])
            up.weight.copy_(up.weight[perm])
            down.weight.copy_(down.weight[:, perm])
            for lin in (gate, up):
                if lin.bias is not None:
                    lin.bias.copy_(lin.bias[perm])
            count += 1
    return count
