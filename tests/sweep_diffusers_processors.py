"""Every attention processor class of ``diffusers.models.attention_processor``, in an ``Attention`` module.

:func:`run_processor` sets one processor on a diffusers ``Attention`` of 2 heads of 16 and runs the
checks of ``tests/sweep_cases.py``. Which ``Attention`` and which inputs a processor needs is tried
in order from :data:`SETUPS` (self-attention over tokens, cross-attention, added key/value
projections over a (B, C, H, W) map, joint text + image streams, and the model files' own
``FluxAttention``/``MochiAttention``; projections fused when the processor's name says so); the first
whose plain forward runs is the case. Constructor arguments
the processors require are in :data:`PROCESSOR_ARGS`. A processor that needs a package or device
this machine lacks (xformers, torch_npu, torch_xla) is not counted, with the error.

Example::

    recs = run_processor("AttnProcessor2_0")
    recs[0]["status"]     # "pass"
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from reference import Proj, _stacked
from sweep_cases import KHA_CONFIGS, run_built
from sweep_diffusers_models import _layout as _split_layout
from sweep_diffusers_models import output

__all__ = ["CI_PROCESSORS", "SETUPS", "processor_classes", "run_processor"]

SEED = 0
DIM, HEADS, DH, CTX, BATCH, TOKENS, CTX_TOKENS = 32, 2, 16, 24, 6, 10, 7  # BATCH 6: PAG splits it in 2 or 3

CI_PROCESSORS = (
    "AttnProcessor2_0",  # the default processor of every Attention
    "SlicedAttnProcessor",  # one attention call per slice of (batch x heads): heads split over calls
    "SlicedAttnAddedKVProcessor",  # ... with added (joint) key/value streams
)

# constructor arguments the processors require
PROCESSOR_ARGS: dict[str, dict[str, Any]] = {
    "SlicedAttnProcessor": dict(slice_size=1),
    "SlicedAttnAddedKVProcessor": dict(slice_size=1),
    **{key: dict(train_kv=True, train_q_out=True, hidden_size=DIM, cross_attention_dim=CTX) for key in ("CustomDiffusionAttnProcessor", "CustomDiffusionAttnProcessor2_0", "CustomDiffusionXFormersAttnProcessor")},
    **{key: dict(hidden_size=DIM, cross_attention_dim=CTX, num_tokens=(4,), scale=1.0) for key in ("IPAdapterAttnProcessor", "IPAdapterAttnProcessor2_0", "IPAdapterXFormersAttnProcessor")},
    "SD3IPAdapterJointAttnProcessor2_0": dict(hidden_size=DIM, ip_hidden_states_dim=DIM, head_dim=DH,
                                              timesteps_emb_dim=DIM),
    "FluxIPAdapterJointAttnProcessor2_0": dict(hidden_size=DIM, cross_attention_dim=CTX, num_tokens=(4,)),
}  # fmt: skip


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_randn.gen)  # type: ignore[attr-defined]


_randn.gen = torch.Generator()  # type: ignore[attr-defined]


Setup = tuple[Callable[[Any], nn.Module], dict[str, Any]]  # (processor -> module, forward kwargs)


def _attention(**init: Any) -> Callable[[Any], nn.Module]:
    """A diffusers ``Attention`` of HEADS heads of DH with ``init``, then the processor set on it."""
    return _own("diffusers.models.attention_processor", "Attention", **init)


def _own(path: str, cls: str, with_processor: bool = False, **init: Any) -> Callable[[Any], nn.Module]:
    """An attention class of ``path`` (``Attention``; a model file's ``FluxAttention``, ``MochiAttention``)
    with the processor: set on it, or given to its constructor (``with_processor``)."""

    def make(processor: Any) -> nn.Module:
        owner = getattr(importlib.import_module(path), cls)
        if with_processor:
            return owner(heads=HEADS, dim_head=DH, processor=processor, **init)
        attn = owner(heads=HEADS, dim_head=DH, **init)
        if "Fused" in type(processor).__name__:
            attn.fuse_projections()
        attn.set_processor(processor)
        return attn

    return make


def _tokens(ctx: int | None = None) -> dict[str, torch.Tensor]:
    out = {"hidden_states": _randn(BATCH, TOKENS, DIM)}
    if ctx is not None:
        out["encoder_hidden_states"] = _randn(BATCH, CTX_TOKENS, ctx)
    return out


_FLUX = "diffusers.models.transformers.transformer_flux"
_MOCHI = "diffusers.models.transformers.transformer_mochi"

# (name, () -> (module maker, forward kwargs)), tried in this order
SETUPS: tuple[tuple[str, Callable[[], Setup]], ...] = (
    ("self", lambda: (_attention(query_dim=DIM), _tokens())),
    ("cross", lambda: (_attention(query_dim=DIM, cross_attention_dim=CTX), _tokens(CTX))),
    ("cross, key mask", lambda: (_attention(query_dim=DIM, cross_attention_dim=CTX),
                                 {**_tokens(CTX), "attention_mask": torch.ones(BATCH, CTX_TOKENS)})),
    ("cross, qk-norm", lambda: (_attention(query_dim=DIM, cross_attention_dim=CTX, qk_norm="layer_norm"), _tokens(CTX))),
    ("joint", lambda: (_attention(query_dim=DIM, added_kv_proj_dim=DIM, context_pre_only=False, out_dim=DIM, bias=True),
                       _tokens(DIM))),
    ("joint, IP-adapter", lambda: (_attention(query_dim=DIM, added_kv_proj_dim=DIM, context_pre_only=False, out_dim=DIM,
                                              bias=True),
                                   {**_tokens(DIM), "ip_hidden_states": _randn(BATCH, 4, DIM), "temb": _randn(BATCH, DIM)})),
    ("FluxAttention, joint", lambda: (_own(_FLUX, "FluxAttention", query_dim=DIM, added_kv_proj_dim=DIM, bias=True),
                                      _tokens(DIM))),
    ("FluxAttention, single stream", lambda: (_own(_FLUX, "FluxAttention", query_dim=DIM, bias=True, pre_only=True),
                                              _tokens())),
    ("MochiAttention", lambda: (_own(_MOCHI, "MochiAttention", True, query_dim=DIM, added_kv_proj_dim=DIM),
                                {**_tokens(DIM), "attention_mask": torch.ones(BATCH, CTX_TOKENS, dtype=torch.bool)})),
    ("added kv, (B, C, H, W)", lambda: (_attention(query_dim=DIM, cross_attention_dim=DIM, added_kv_proj_dim=CTX,
                                                   norm_num_groups=8, only_cross_attention=False),
                                        {"hidden_states": _randn(BATCH, DIM, 3, 3),
                                         "encoder_hidden_states": _randn(BATCH, CTX_TOKENS, CTX)})),
    ("IP-adapter", lambda: (_attention(query_dim=DIM, cross_attention_dim=CTX),
                            {"hidden_states": _randn(BATCH, TOKENS, DIM),
                             "encoder_hidden_states": (_randn(BATCH, CTX_TOKENS, CTX), [_randn(BATCH, 1, 4, CTX)])})),
    ("SanaMultiscaleLinearAttention", lambda: (_sana, {"hidden_states": _randn(BATCH, DIM, 3, 3)})),
)  # fmt: skip


def _sana(processor: Any) -> nn.Module:
    from diffusers.models.attention_processor import SanaMultiscaleLinearAttention

    attn = SanaMultiscaleLinearAttention(DIM, DIM, num_attention_heads=HEADS, attention_head_dim=DH, kernel_sizes=(3,))
    attn.processor = processor
    return attn


def processor_classes() -> list[str]:
    """Every attention processor class defined in ``diffusers.models.attention_processor``."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.models import attention_processor as ap

    return sorted(
        name
        for name, cls in vars(ap).items()
        if isinstance(cls, type) and cls.__module__ == ap.__name__ and "Processor" in name
        and not issubclass(cls, VaeImageProcessor)  # IPAdapterMaskProcessor: masks, not attention
    )  # fmt: skip


_NEEDS = {"XFormers": "xformers", "NPU": "torch_npu", "XLA": "torch_xla"}  # processor name part -> package


def _build(name: str) -> tuple[nn.Module, dict, str]:
    """(module with the processor ``name``, forward kwargs, setup): the first setup whose forward runs."""
    from diffusers.models import attention_processor as ap

    needs = next((pkg for key, pkg in _NEEDS.items() if key in name), None)
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise ModuleNotFoundError(f"{name} needs {needs}, which is not installed here (CPU only)")
    if not callable(getattr(ap, name)(**PROCESSOR_ARGS.get(name, {}))):
        raise TypeError(f"{name} is a deprecated stub with no __call__ (diffusers keeps the name only)")
    errors = []
    joint_first = sorted(SETUPS, key=lambda s: "Joint" in name and "joint" not in s[0])  # stable
    for setup, make in joint_first:
        _randn.gen.manual_seed(SEED)  # type: ignore[attr-defined]
        build, kwargs = make()
        torch.manual_seed(SEED)
        try:
            attn = build(getattr(ap, name)(**PROCESSOR_ARGS.get(name, {}))).eval()
            with torch.no_grad():
                copy.deepcopy(attn)(**kwargs)
        except Exception as exc:
            errors.append(f"{setup}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
            continue
        return attn, kwargs, setup
    raise RuntimeError("no setup runs it; " + "; ".join(errors[:2]))


def _layout(model: nn.Module, cfg: Any) -> list[Proj]:
    """The per-head layout of an Attention: separate projections, or fused [Q | K | V] ``to_qkv``."""
    if not getattr(model, "fused_projections", False):
        return _split_layout(model, cfg)
    h, dh = model.heads, model.to_q.out_features // model.heads
    return [
        Proj(path, ("q", "k", "v"), _stacked((("q", h), ("k", h), ("v", h)), dh), kha=kha)
        for path, kha in (("to_qkv", ("to_added_qkv",)), ("to_added_qkv", ("to_qkv",)))
        if isinstance(getattr(model, path, None), nn.Linear)
    ]


def run_processor(name: str, configs: tuple[str, ...] = tuple(KHA_CONFIGS)) -> list[dict]:
    """One record per config for the processor class ``name`` (see ``tests/sweep_cases.py``)."""
    base: dict[str, Any] = {"model_type": f"processor:{name}", "cls": "Attention"}

    def make() -> tuple[nn.Module, tuple, dict]:
        attn, kwargs, base["setup"] = _build(name)
        base["cls"] = f"{type(attn).__name__} ({base['setup']})"
        return attn, (), kwargs

    def standard(model: nn.Module, args: tuple, kwargs: dict) -> Any:
        return _layout if base.get("attn_count") and type(model.processor).__name__ in _STANDARD else None

    return run_built(make, configs, base, output=output, pass_inputs=True, layout=standard)


# processors whose every q, k, v is the projection output cut into ``heads`` heads, as the reference assumes
_STANDARD = {
    "AttnProcessor", "AttnProcessor2_0", "FusedAttnProcessor2_0", "SlicedAttnProcessor", "JointAttnProcessor2_0",
    "FusedJointAttnProcessor2_0", "FluxAttnProcessor2_0", "FusedFluxAttnProcessor2_0", "FluxSingleAttnProcessor2_0",
    "AttnAddedKVProcessor", "AttnAddedKVProcessor2_0", "SlicedAttnAddedKVProcessor",
}  # fmt: skip
