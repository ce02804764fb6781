"""Every diffusers transformer and UNet class, built tiny with random weights, for the diffusers sweep.

:func:`model_classes` lists the classes of the installed diffusers (``*Transformer*`` and ``*UNet*``
models); :func:`build` makes one from the tiny config of diffusers' own tests
(:mod:`sweep_diffusers_specs`), random weights (weights that init leaves at zero, such as adaLN-Zero
modulations and zero-initialised output projections, get small random values, so every attention
reaches the output as after training), fp32, eval, with its inputs. :func:`run_class` takes one
through ``tests/sweep_cases.py``; the per-head reference covers diffusers' ``Attention`` modules
(``to_q``/``to_k``/``to_v`` and a joint text stream's ``add_*_proj`` or ``to_*_t``, which share the
site's transform per role; ``heads`` heads of ``to_q``'s width / heads).

Example::

    model, kwargs = build("FluxTransformer2DModel")
    model(**kwargs).sample.shape
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reference import Proj, _heads
from sweep_cases import KHA_CONFIGS, run_built, standard_layout
from sweep_configs import _randomize_zeros
from sweep_diffusers_specs import SPECS

__all__ = ["CI_CLASSES", "build", "layout", "model_classes", "output", "run_class"]

SEED = 0

# the chunk the test suite runs (tests/integrations/test_diffusers_sweep.py)
CI_CLASSES = (
    "FluxTransformer2DModel",  # joint attention over text + image streams, then single-stream blocks
    "UNet2DConditionModel",  # Stable Diffusion's UNet: self- and cross-attention in Transformer2DModel blocks
)

# classes with no tiny config of their own that take another's (the same constructor and inputs)
SIBLINGS = {
    "AudioLDM2UNet2DConditionModel": "UNet2DConditionModel",
    "DreamLiteUNetModel": "UNet2DConditionModel",
    "Transformer2DModel": "DiTTransformer2DModel",
}

# diffusers' Attention projections of each role: the image stream's, then a joint text stream's
_PROJS = {role: (f"to_{role}", f"add_{role}_proj", f"to_{role}_t") for role in ("q", "k", "v")}


def model_classes() -> list[str]:
    """Every transformer and UNet model class the installed diffusers exports."""
    import diffusers

    out = []
    for name in dir(diffusers):
        if "Transformer" not in name and "UNet" not in name:
            continue
        cls = getattr(diffusers, name, None)
        if isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin):
            out.append(name)
    return sorted(out)


def _tensor(spec: Any, gen: torch.Generator) -> Any:
    """An input from its spec (see :mod:`sweep_diffusers_specs`)."""
    if isinstance(spec, list):
        return [_tensor(s, gen) for s in spec]
    if isinstance(spec, dict):
        return {k: _tensor(s, gen) for k, s in spec.items()}
    if not (isinstance(spec, tuple) and spec and isinstance(spec[0], str)):
        return spec
    kind, shape = spec[0], spec[1]
    if kind == "randn":
        return torch.randn(shape, generator=gen)
    if kind == "rand":
        return torch.rand(shape, generator=gen)
    dtype = getattr(torch, spec[2])
    if kind == "fill":
        return torch.full(shape, spec[3], dtype=dtype)
    if kind == "values":
        return torch.tensor(spec[3], dtype=dtype).reshape(shape)
    raise ValueError(f"input spec {spec!r}: not one this sweep builds")


def build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """(model, forward kwargs): the class ``name`` from its tiny test config, random weights, eval."""
    import diffusers

    spec = SPECS.get(SIBLINGS.get(name, name))
    if spec is None:
        raise LookupError(f"no tiny config for {name} (diffusers' tests at the commit read have none)")
    torch.manual_seed(SEED)
    model = getattr(diffusers, name)(**spec.init).float().eval()
    _randomize_zeros(model)
    gen = torch.Generator().manual_seed(SEED)
    return model, {k: _tensor(v, gen) for k, v in spec.inputs.items()}


def output(out: Any) -> torch.Tensor:
    """The main tensor of a diffusers output (``.sample``, or the first tensor)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    for v in out if isinstance(out, (list, tuple)) else []:
        found = v if isinstance(v, torch.Tensor) else (output(v) if isinstance(v, (list, tuple)) else None)
        if isinstance(found, torch.Tensor) and found.is_floating_point():
            return found
    raise TypeError(f"no tensor in output of type {type(out).__name__}")


# ----------------------------------------------------------------------------------------------
# the per-head reference layout of diffusers' Attention
# ----------------------------------------------------------------------------------------------
def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (path, m)
        for path, m in model.named_modules()
        if all(isinstance(getattr(m, a, None), nn.Linear) for a in ("to_q", "to_k", "to_v"))
        and isinstance(getattr(m, "heads", None), int)
    ]


def _layout(model: nn.Module, cfg: Any) -> list[Proj]:
    """q/k/v (and joint add_*) projections of every Attention: ``heads`` heads of to_q's width / heads."""
    projs = []
    for path, m in _attention_modules(model):
        dh = m.to_q.out_features // m.heads
        pre = f"{path}." if path else ""
        for role, attrs in _PROJS.items():
            found = {a: p for a in attrs if isinstance(p := getattr(m, a, None), nn.Linear)}
            for attr, proj in found.items():  # the streams' heads share the site's transform per role
                split = _heads(proj.out_features // dh, dh, role)
                projs.append(Proj(f"{pre}{attr}", (role,), split, kha=tuple(f"{pre}{a}" for a in found if a != attr)))
    return projs


def layout(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The reference layout where every attention call is an Attention module's (else None)."""
    return standard_layout(model, args, kwargs, [path for path, _ in _attention_modules(model)], _layout)


def run_class(name: str, configs: tuple[str, ...] = tuple(KHA_CONFIGS)) -> list[dict]:
    """One record per config for the class ``name`` (see ``tests/sweep_cases.py``)."""
    base: dict[str, Any] = {"model_type": name, "cls": name}

    def make() -> tuple[nn.Module, tuple, dict]:
        model, kwargs = build(name)
        base["params"] = sum(p.numel() for p in model.parameters())
        return model, (), kwargs

    return run_built(make, configs, base, output=output, pass_inputs=True, layout=layout)
