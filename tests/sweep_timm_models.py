"""Every timm model architecture, built tiny with random weights, for the timm sweep.

timm builds each architecture through ``build_model_with_cfg(model_cls, variant, pretrained, **kwargs)``;
:func:`build` catches that call and shrinks the architecture's own arguments before the model is made
(:func:`shrink`: every depth to at most 2 blocks, or 1 block per stage; widths, heads, patch and image
sizes stay as the architecture has them, so every layout is the real one), with random weights (zero
inits made non-zero, :func:`_randomize_zeros`), fp32, eval. :func:`variants` picks, for each model class, one architecture per distinct set of module types
(the smallest; one per class where no architecture has attention), so the sweep covers every form a
family has without building its 1,371 names.

timm imports ``torchvision`` at import time (``FrozenBatchNorm2d`` and its data transforms), and the
registry's torchvision does not load beside the CPU torch here (it breaks transformers too): when no
torchvision is installed, :func:`import_timm` imports timm beside a stand-in that has a
``FrozenBatchNorm2d`` of its own and raises on anything else, then takes the stand-in away again.

Example::

    model, how = build("vit_small_patch16_224")
    (x,) = example_args(model)
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from reference import Proj, _heads, _stacked
from sweep_cases import KHA_CONFIGS, AttentionCounter, run_built, standard_layout

__all__ = ["CI_ARCHS", "build", "example_args", "import_timm", "layout", "run_arch", "shrink", "variants"]

# the chunk the test suite runs (tests/integrations/test_timm_sweep.py): one per layout of timm's own
CI_ARCHS = (
    "vit_small_patch16_224",  # timm.layers.Attention: fused qkv [Q | K | V], SDPA; checked per head
    "swin_tiny_patch4_window7_224",  # windowed attention with a relative position bias
    "vit_dwee_patch16_reg1_gap_256",  # differential attention: each head's two halves in two calls
)

SEED = 0
BATCH = 2
STAGE_DEPTH, DEPTH = 1, 2  # blocks per stage of a staged network; blocks of a plain stack

# the architecture's arguments that count blocks: an int (a plain stack) or one int per stage
_DEPTH_KEYS = {
    "depth", "depths", "layers", "depth_list", "serial_depths", "parallel_depth", "num_blocks",
    "block_config", "transformer_depths", "num_blocks_list", "d",
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# importing timm without torchvision
# ----------------------------------------------------------------------------------------------
class FrozenBatchNorm2d(nn.Module):
    """BatchNorm2d with fixed statistics and affine terms (the one class timm takes from torchvision)."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((num_features,), fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()  # type: ignore[operator]
        shift = self.bias - self.running_mean * scale  # type: ignore[operator]
        return x * scale[:, None, None] + shift[:, None, None]  # (B, C, H, W)


class _Absent(type):
    """A torchvision name timm imports but the sweep never uses: any attribute, and calling it raises."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{cls.__name__}.{name}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{cls.__name__}: torchvision is not installed (the timm sweep runs without it)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}", (), {})


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != "torchvision":
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        mod = _StandInModule(spec.name)
        mod.__path__ = []
        if spec.name == "torchvision.ops.misc":
            mod.FrozenBatchNorm2d = FrozenBatchNorm2d  # type: ignore[attr-defined]
        return mod

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def import_timm() -> types.ModuleType:
    """``timm``, imported beside a torchvision stand-in when torchvision is not installed."""
    if "timm" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        import timm

        return timm
    finder = _StandIn()
    sys.meta_path.append(finder)
    try:
        import timm
        import timm.models  # every family module, so no later import needs the stand-in
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]  # nothing else (transformers) may take the stand-in for torchvision
    return timm


# ----------------------------------------------------------------------------------------------
# shrinking an architecture's arguments
# ----------------------------------------------------------------------------------------------
def shrink(value: Any, key: str = "") -> Any:
    """``value`` (an architecture argument named ``key``) with every block count made small."""
    if key in _DEPTH_KEYS:
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return min(value, DEPTH if key == "depth" else STAGE_DEPTH)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            return type(value)(min(v, STAGE_DEPTH) if v > 0 else v for v in value)
    if key == "block_args" and isinstance(value, list) and all(isinstance(st, list) for st in value):
        # EfficientNet-style stages of block dicts: each keeps its first block of each type, and its last
        return [[b for i, b in enumerate(st)
                 if i == len(st) - 1 or b.get("block_type") not in {c.get("block_type") for c in st[:i]}]
                for st in value]  # fmt: skip
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: shrink(getattr(value, f.name), f.name) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, (list, tuple)) and any(dataclasses.is_dataclass(v) for v in value):
        return type(value)(shrink(v, key) for v in value)
    if isinstance(value, dict) and key not in ("pretrained_cfg", "pretrained_cfg_overlay", "feature_cfg"):
        return {k: shrink(v, k) for k, v in value.items()}
    return value


def _shrink_kwargs(model_cls: Any, kwargs: dict) -> dict:
    """The arguments with small depths; a depth the class takes by default is passed, shrunk, too,
    and an argument with one entry per block (``num_kv_heads``) keeps the entries of the kept blocks."""
    with contextlib.suppress(TypeError, ValueError):
        for p in inspect.signature(model_cls).parameters.values():
            if p.name in _DEPTH_KEYS and p.name not in kwargs and p.default is not inspect.Parameter.empty:
                kwargs = {**kwargs, p.name: p.default}
    out = {k: shrink(v, k) for k, v in kwargs.items()}
    depth = kwargs.get("depth")
    if isinstance(depth, int) and out["depth"] != depth:
        for k, v in kwargs.items():
            if k != "depth" and isinstance(v, (list, tuple)) and len(v) == depth:
                out[k] = type(v)(v[: out["depth"]])
    return out


class _Captured(Exception):
    def __init__(self, model_cls: Any, kwargs: dict) -> None:
        super().__init__(getattr(model_cls, "__name__", str(model_cls)))
        self.model_cls, self.kwargs = model_cls, kwargs


@contextlib.contextmanager
def _builder(name: str, tiny: bool, capture: bool = False) -> Iterator[None]:
    """While open, the family module of ``name`` builds through a ``build_model_with_cfg`` that
    shrinks the arguments (``tiny``) or only reports them (``capture``: raises ``_Captured``)."""
    timm = import_timm()
    module = sys.modules[timm.models.model_entrypoint(name).__module__]
    real = module.build_model_with_cfg

    def build_model_with_cfg(model_cls, variant, pretrained, **kwargs):
        if tiny:
            kwargs = _shrink_kwargs(model_cls, kwargs)
        if capture:
            raise _Captured(model_cls, kwargs)
        return real(model_cls, variant, pretrained, **kwargs)

    module.build_model_with_cfg = build_model_with_cfg
    try:
        yield
    finally:
        module.build_model_with_cfg = real


def model_class(name: str) -> str:
    """The class ``name`` builds (``VisionTransformer``), without building it."""
    timm = import_timm()
    with _builder(name, tiny=False, capture=True):
        try:
            timm.create_model(name, pretrained=False)
        except _Captured as c:
            return getattr(c.model_cls, "__name__", str(c.model_cls))
    raise RuntimeError(f"{name} did not build through build_model_with_cfg")


def build(name: str, device: str | torch.device | None = None) -> tuple[nn.Module, str]:
    """(model, how): ``name`` with small depths (:func:`shrink`), random weights, fp32, eval.

    ``how`` is ``"depths shrunk"``, or ``"as defined"`` where the architecture refuses the small
    depths (RegNet derives its stages from its depth, an iFormer stage needs three blocks per
    attention): then it is built as timm defines it.
    """
    timm = import_timm()
    for tiny in (True, False):
        torch.manual_seed(SEED)
        try:
            with _builder(name, tiny=tiny), torch.device(device or "cpu"):
                model = timm.create_model(name, pretrained=False)
        except Exception:
            if not tiny:
                raise
            continue
        _randomize_zeros(model)
        return model.float().eval(), "depths shrunk" if tiny else "as defined"
    raise AssertionError("unreachable")


def _randomize_zeros(model: nn.Module) -> None:
    """Weights that init leaves at (almost) zero, as after training: a norm's zero scale
    (``zero_init_last``: the residual branch starts switched off) and a layer scale of 1e-5 get ones,
    a zero matrix small random values, so every attention reaches the output and a perturbed KHA
    weight shows in it."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta or not p.is_floating_point() or name.endswith("bias"):
                continue
            if p.dim() >= 2 and bool((p.abs() <= 1e-4).all()):  # a zero or tiny-init matrix (a classifier
                # head at head_init_scale): random, not ones (a matrix of ones sums LayerNorm'd features to 0)
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif bool((p.abs() <= 1e-4).all()):  # a zero norm scale, a 1e-5 layer scale (C,) or (C, 1, 1)
                p.fill_(1.0)


def example_args(model: nn.Module) -> tuple[torch.Tensor]:
    """One batch of images of the size the architecture was made for: ``(B, C, H, W)``."""
    c, h, w = model.pretrained_cfg.get("input_size", (3, 224, 224))
    return (torch.randn(BATCH, c, h, w, generator=torch.Generator().manual_seed(SEED)),)


# ----------------------------------------------------------------------------------------------
# which architectures the sweep runs
# ----------------------------------------------------------------------------------------------
def _signature(model: nn.Module) -> tuple[str, frozenset[str]]:
    return type(model).__name__, frozenset(type(m).__qualname__ for m in model.modules())


def _size(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def variants(names: list[str] | None = None, progress: Any = None) -> dict[str, str]:
    """architecture -> model class: per class, one architecture per distinct set of module types.

    Each is built tiny on the meta device (no memory, no compute) and its attention calls counted in
    a meta forward; of those sharing a class and a set of module types, the one with the fewest
    parameters stays. A class with no attention in any architecture keeps only its smallest (the
    sweep checks that apply says so). ``progress(i, n, name)`` is called per architecture (the 1,371
    builds take a few minutes).
    """
    timm = import_timm()
    names = names if names is not None else timm.list_models()
    best: dict[tuple, tuple[int, str, bool]] = {}
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        try:
            model, _ = build(name, device="meta")
        except Exception:  # kept: the sweep reports why it does not build
            best[("unbuilt", frozenset({name}))] = (0, name, True)
            continue
        sig, size = _signature(model), _size(model)
        if sig not in best or size < best[sig][0]:
            best[sig] = (size, name, _has_attention(model))
    attentive = {sig[0] for sig, (_, _, att) in best.items() if att}
    plain: dict[str, tuple[int, str]] = {}  # class without attention -> its smallest architecture
    for sig, (size, name, _) in best.items():
        if sig[0] not in attentive and (sig[0] not in plain or size < plain[sig[0]][0]):
            plain[sig[0]] = (size, name)
    keep = {name: sig[0] for sig, (_, name, att) in best.items() if att}
    keep.update({name: cls for cls, (_, name) in plain.items()})
    return dict(sorted(keep.items()))


def _has_attention(model: nn.Module) -> bool:
    """Whether a forward on the meta device makes an attention call (True where it cannot run)."""
    counter = AttentionCounter(model)
    try:
        with torch.no_grad(), counter:
            model(example_args(model)[0].to("meta"))
    except Exception:
        return True
    return counter.count > 0


# ----------------------------------------------------------------------------------------------
# one architecture through the sweep's checks
# ----------------------------------------------------------------------------------------------
def _standard(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules of timm's own layout: ``timm.layers.Attention`` and ``AttentionRope``,
    with their own forward (fused ``qkv`` [Q | K | V] or ``q_proj``/``k_proj``/``v_proj``, heads of
    ``head_dim``)."""
    layers = import_timm().layers
    found = []
    for path, m in model.named_modules():
        for cls in (layers.Attention, layers.AttentionRope):
            if isinstance(m, cls) and type(m).forward is cls.forward:
                found.append((path, m))
    return found


def _layout(model: nn.Module, cfg: Any) -> list[Proj]:
    """The per-head layout of every standard attention module, read from the module itself."""
    projs = []
    for path, m in _standard(model):
        h, dh = m.num_heads, m.head_dim
        kv = getattr(m, "num_kv_heads", h)
        if isinstance(getattr(m, "qkv", None), nn.Linear):
            projs.append(Proj(f"{path}.qkv", ("q", "k", "v"), _stacked((("q", h), ("k", h), ("v", h)), dh)))
        else:
            for role, n in (("q", h), ("k", kv), ("v", kv)):
                projs.append(Proj(f"{path}.{role}_proj", (role,), _heads(n, dh, role)))
    return projs


def layout(model: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The reference layout of ``model`` where every attention call is a standard module's (else None)."""
    return standard_layout(model, args, kwargs, [path for path, _ in _standard(model)], _layout)


def run_arch(name: str, configs: tuple[str, ...] = tuple(KHA_CONFIGS)) -> list[dict]:
    """One record per config for the architecture ``name`` (see ``tests/sweep_cases.py``)."""
    base: dict[str, Any] = {"model_type": name}

    def make() -> tuple[nn.Module, tuple, dict]:
        model, base["built"] = build(name)
        base["cls"] = type(model).__name__
        base["params"] = sum(p.numel() for p in model.parameters())
        return model, example_args(model), {}

    return run_built(make, configs, base, pass_inputs=True, layout=layout)
