"""One case of a sweep: a tiny model (a transformers model type, a timm architecture, a diffusers
class), a KHA config, and the checks.

:func:`run_case` builds the type (:mod:`sweep_configs`), counts its attention calls in one plain
forward independently of kha_compile (:class:`AttentionCounter`), then runs ``kc.apply`` with
example inputs kha_compile builds from the config, and checks:

* nothing but a ``KHAError`` is raised;
* every counted attention call is a site of the report, matched or skipped with a reason
  (the calls the sites stand for equal ``count``: one per head where heads are modules; sites beyond the count must be skipped ones, as for a
  softmax(q @ k^T) of rank 2 the count leaves out);
* logits bit-identical at init; perturbing every ``.kha.`` parameter moves them;
* for the linear config, ``kc.fold`` keeps them (within 1e-4) and leaves no ``.kha.`` parameter;
* where the caller names a standard layout, the perturbed output matches a per-head reference
  (:class:`reference.Reference`: KHA written by hand with hooks on an untouched copy).

:func:`run_built` runs the same checks on any model the caller builds (the timm and diffusers sweeps).

Statuses: ``pass``; ``skipped`` (apply raised ``NoAttentionFoundError`` and every counted call is
a site skipped with its reason: KHA declined, and said why); ``no_attention`` (no attention call
counted, and apply says so); ``fail`` (with a category); ``not_counted`` (transformers itself cannot
build or run the tiny model).

Example::

    rec = run_case("llama", "linear_qkv")
    rec["status"]      # "pass"
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import kha_compile as kc
from kha_compile.analysis.inputs import example_inputs
from kha_compile.analysis.rules.base import is_linear_form
from kha_compile.core.errors import NoAttentionFoundError
from kha_compile.passes.apply import analyse, recorded_report
from reference import Reference, rel_err
from sweep_configs import build, model_types

__all__ = [
    "CI_TYPES",
    "KHA_CONFIGS",
    "NO_QKV",
    "SOFTMAX_FREE_CLASSES",
    "AttentionCounter",
    "linear_sites",
    "logits",
    "run_built",
    "run_case",
    "run_type",
    "standard_layout",
]

# the chunk the test suite runs (tests/integrations/test_transformers_sweep.py): llama for the sweep's
# own path (default config shrunk, attention counted), then one type per form that once failed. The
# families (gpt2, bert, t5, gpt_neox, deepseek_v3, ...) run in the zoo tests against per-head
# references; scripts/sweep_transformers.py runs every type
CI_TYPES = (
    "llama",  # SDPA, GQA, rotary
    "fsmt",  # `if not padding_mask.any()`: traced per submodule
    "switch_transformers",  # a router cast inside forward: traced per submodule
    "ibert",  # projections returning tuples
    "squeezebert",  # grouped 1x1 Conv1d projections in (B, C, T)
    "longt5",  # block-local plus global tokens
    "perceiver",  # a generic main input that takes input_ids
    "deepseek_v4",  # k = v from one kv projection: transforms on the attention arguments, not foldable
    "jetmoe",  # routed heads: expert query projections with data-dependent row counts
)

KHA_CONFIGS: dict[str, dict[str, str]] = {
    "linear_qkv": dict(q="linear", k="linear", v="linear"),
    "mlp_v": dict(v="mlp"),
}
FOLDABLE = {"linear_qkv"}
PERTURB_SEED, PERTURB_SCALE = 1234, 0.1
FOLD_ATOL, MOVED_ATOL = 1e-4, 1e-6
REFERENCE_RTOL = 1e-4  # max |KHA model - per-head reference| / max |reference|, fp32

_F = torch.nn.functional
_FUSED = {_F.scaled_dot_product_attention, _F.multi_head_attention_forward}
try:
    from torch.nn.attention.flex_attention import flex_attention as _flex

    _FUSED.add(_flex)
    _FUSED.add(torch.ops.higher_order.flex_attention)  # what a TorchFunctionMode sees of an eager flex call
except (ImportError, AttributeError):  # pragma: no cover - an older torch
    pass
_SOFTMAX = {torch.softmax, _F.softmax, torch.Tensor.softmax, torch.special.softmax}
_PRODUCTS = {
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.bmm,
    torch.Tensor.bmm,
    torch.baddbmm,
    torch.Tensor.baddbmm,
    torch.einsum,
}
_CLEAR = {_F.linear, _F.bilinear, _F.conv1d, _F.conv2d, _F.conv3d, torch.addmm, torch.Tensor.addmm}


# attention layers without a softmax call, counted once per forward of their module (class names of the
# module or of its attention processor, in the installed libraries): transformers' gated delta rule, Kimi's
# delta attention, MiniMax's lightning attention, YOSO's kernelised attention, Reformer's LSH and local
# attention (a softmax written as exp(s - logsumexp(s))); timm's EfficientViT LiteMLA (ReLU linear attention)
# and CoaT's factorised attention (softmax over the keys' tokens, then k^T v), its lambda layers (the same with
# a positional lambda); diffusers' Sana linear attention (SanaVideo's with RoPE)
SOFTMAX_FREE_CLASSES = re.compile(
    r"\w*(GatedDeltaNet|DeltaAttention|LightningAttention)|YosoSelfAttention|LSHSelfAttention|LocalSelfAttention"
    r"|LiteMLA|FactorAttnConvRelPosEnc|LambdaLayer|\w*SanaLinearAttnProcessor\d_0|SanaMultiscaleAttnProcessor2_0"
)
# why a model type's forward has no attention: none of these layers has per-head q, k, v
NO_QKV = {
    "mamba": "Mamba (state-space) layers: a selective scan over per-channel states; no per-head q, k, v",
    "falcon_mamba": "Mamba (state-space) layers: a selective scan over per-channel states; no per-head q, k, v",
    "mamba2": "Mamba-2 layers: B and C (the state-space counterparts of k and q) are shared by every head of a "
    "group, only x is per head; no per-head q, k, v",
    "rwkv": "RWKV time mixing: per-channel receptance, key and value with a learned decay, no heads; no per-head "
    "q, k, v",
    "fnet": "Fourier transforms mix the tokens; no q, k, v",
    "mra": "without its CUDA kernel (none on CPU) transformers' MRA attention returns zeros: q, k, v are projected "
    "but no attention runs",
}


class AttentionCounter(TorchFunctionMode):
    """Count the attention calls of one forward, independently of kha_compile.

    An attention call is a fused attention op (``F.scaled_dot_product_attention``,
    ``F.multi_head_attention_forward``, ``flex_attention``), or a softmax over the last axis of a
    tensor of rank >= 3 whose values descend, through masks, scaling, soft-capping and views, from a
    product of two tensors of rank >= 3 where at least one is an activation and neither is a
    parameter itself (``q @ k^T``; a learned query expanded over the batch counts, ``x @ W`` does
    not; a Linear or conv on the way clears the mark, unless it keeps the scores' shape: talking
    heads mix the heads axis with a Linear). A TorchFunctionMode sees every torch call
    however it is spelled; the inner calls of a fused op are not seen. Attention without a softmax call
    (linear attention, delta rules, LSH) is counted once per forward of a module whose class, or whose
    attention processor's class (diffusers), is in :data:`SOFTMAX_FREE_CLASSES`.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.count = 0
        self.calls: list[str] = []
        self._keep: list[torch.Tensor] = []  # every tensor seen stays alive, so ids stay unique
        self._marked: set[int] = set()  # descends from a score product, not yet softmaxed
        self._static: set[int] = set()  # computed from parameters, buffers and constants only
        self._params = {id(p) for p in model.parameters()}
        self._model = model
        self._hooks: list[Any] = []
        for t in [*model.parameters(), *model.buffers()]:
            self._static.add(id(t))
            self._keep.append(t)

    def __enter__(self):
        def count(module: torch.nn.Module, _args: Any) -> None:
            self.count += 1
            self.calls.append(type(module).__name__)

        self._hooks = [
            m.register_forward_pre_hook(count)
            for m in self._model.modules()
            if any(
                SOFTMAX_FREE_CLASSES.fullmatch(type(c).__name__)
                for c in (m, getattr(m, "processor", None))
                if c is not None
            )
        ]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return super().__exit__(*exc)

    def _score_product(self, tensors: list[torch.Tensor]) -> bool:
        big = [t for t in tensors if t.dim() >= 3]
        return (
            len(big) >= 2
            and any(id(t) not in self._static for t in big)
            and not any(id(t) in self._params for t in tensors)
        )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat: list[Any] = [*args, *kwargs.values()]
        for a in list(flat):
            if isinstance(a, (list, tuple)):
                flat.extend(a)
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if func in _FUSED:
            self.count += 1
            self.calls.append(getattr(func, "__name__", str(func)))
            return out
        if func in _SOFTMAX:
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            if isinstance(dim, int) and x.dim() >= 3 and dim in (-1, x.dim() - 1) and id(x) in self._marked:
                self.count += 1
                self.calls.append(f"softmax{tuple(x.shape)}")
            return out
        if func in _PRODUCTS:
            mark = self._score_product(tensors) or (
                not any(id(t) in self._params for t in tensors) and any(id(t) in self._marked for t in tensors)
            )
        elif func in _CLEAR:  # a projection clears the mark, but not a mixing of the heads axis that keeps
            # the scores' shape (talking heads: a Linear over (B, Sq, Sk, H) before the softmax)
            shapes = {tuple(t.shape) for t in tensors if id(t) in self._marked}
            mark = isinstance(out, torch.Tensor) and tuple(out.shape) in shapes
        else:
            mark = any(id(t) in self._marked for t in tensors)
        static = all(id(t) in self._static for t in tensors)
        for o in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(o, torch.Tensor) and not any(o is t for t in tensors):
                self._keep.append(o)
                if static:
                    self._static.add(id(o))
                if mark and o.is_floating_point():
                    self._marked.add(id(o))
        return out


def logits(out: Any) -> torch.Tensor:
    """The main tensor of a transformers output."""
    for name in ("logits", "prediction_logits", "last_hidden_state"):
        v = getattr(out, name, None)
        if isinstance(v, torch.Tensor):
            return v
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    for v in out if isinstance(out, (list, tuple)) else []:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    raise TypeError(f"no logits in output of type {type(out).__name__}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else "")[:300]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return math.inf
    d = torch.nan_to_num((a.double() - b.double()).abs(), nan=math.inf)
    return float(d.max()) if d.numel() else 0.0


def _kha_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".kha." in f".{n}"}


def _fail(rec: dict, category: str, exc: BaseException | None = None) -> dict:
    rec.update(status="fail", category=category)
    if exc is not None:
        rec.update(exc_type=type(exc).__name__, error=_first_line(exc), kha_error=isinstance(exc, kc.KHAError))
    return rec


def run_case(model_type: str, cfg_name: str) -> dict:
    """Build, count, apply, check one (model type, KHA config) case; never raises."""
    return run_type(model_type, (cfg_name,))[0]


def run_type(model_type: str, configs: tuple[str, ...] = tuple(KHA_CONFIGS)) -> list[dict]:
    """One record per config: the type built and counted once, each config applied to a copy."""

    def make() -> tuple[Any, tuple, dict]:
        model, base["attn_implementation"] = build(model_type)
        return (model, *example_inputs(model))

    base: dict[str, Any] = {"model_type": model_type, "cls": model_types()[model_type][0]}
    return run_built(make, configs, base)


def run_built(
    make: Callable[[], tuple[Any, tuple, dict]],
    configs: tuple[str, ...],
    base: dict[str, Any],
    *,
    output: Callable[[Any], torch.Tensor] = logits,
    pass_inputs: bool = False,
    layout: Callable[[Any, tuple, dict], Callable | None] | None = None,
) -> list[dict]:
    """The checks of every config on the model ``make()`` returns: ``(model, args, kwargs)``.

    ``output`` picks the tensor compared from a forward's output; ``pass_inputs`` gives apply the
    inputs (otherwise apply builds its own from the model's config, as a transformers user's call
    does); ``layout(untouched model, args, kwargs)`` is a layout function for
    :class:`reference.Reference` where the model's attention has a standard layout (``None``
    otherwise; see :func:`standard_layout`), and each perturbed forward is then compared with the
    per-head reference it computes.
    """
    t0 = time.perf_counter()
    built = _prepare(make, base, output)
    out = []
    for i, cfg_name in enumerate(configs):
        rec = {**base, "config": cfg_name}
        if built is not None:
            model = built[0]
            if i < len(configs) - 1:
                try:
                    model = copy.deepcopy(model)
                except Exception:  # a model that does not deep-copy: build it again
                    again = _prepare(make, {}, output)
                    model = again[0] if again is not None else model
            case = _Case(*built[1:], output=output, pass_inputs=pass_inputs, layout=layout)
            if i and out[0].get("status") == "no_attention":  # no attention: what apply says is the same
                rec.update({k: v for k, v in out[0].items() if k not in ("config", "seconds")})
            else:
                rec.update(_check(model, case, cfg_name, rec, reinspect=i == 0))
        rec["seconds"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        out.append(rec)
    return out


@dataclasses.dataclass
class _Case:
    """What every config of one model is checked with: its inputs, plain output and attention count."""

    args: tuple
    kwargs: dict
    ref: torch.Tensor
    count: int
    output: Callable[[Any], torch.Tensor] = logits
    pass_inputs: bool = False
    layout: Callable[[Any, tuple, dict], Callable | None] | None = None


def standard_layout(model: Any, args: tuple, kwargs: dict, modules: list[str], layout: Callable) -> Callable | None:
    """``layout`` where every attention call of one forward runs inside one of ``modules`` (module paths
    of a standard attention class) and each of them runs one or more; ``None`` otherwise (some
    attention is another class's, or a module of the class does not run)."""
    if not modules:
        return None
    counter = AttentionCounter(model)
    inside = dict.fromkeys(modules, 0)
    handles = []
    for path in modules:

        def pre(m: Any, a: Any, path: str = path) -> None:
            inside[path] -= counter.count

        def post(m: Any, a: Any, out: Any, path: str = path) -> None:
            inside[path] += counter.count

        mod = model.get_submodule(path)
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with torch.no_grad(), counter:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    ok = all(n >= 1 for n in inside.values()) and sum(inside.values()) == counter.count
    return layout if ok else None


def _prepare(make: Callable[[], tuple[Any, tuple, dict]], rec: dict, output: Callable) -> tuple | None:
    """(model, args, kwargs, reference output, attention count), or None (``rec`` says why)."""
    try:
        model, args, kwargs = make()
    except Exception as exc:  # the library cannot build it this way (or kha_compile builds no inputs)
        rec.update(status="not_counted", stage="build", error=f"{type(exc).__name__}: {_first_line(exc)}")
        return None
    counter = AttentionCounter(model)
    try:
        with torch.no_grad(), counter:
            ref = output(model(*args, **kwargs)).clone()
    except Exception as exc:
        rec.update(status="not_counted", stage="forward", error=f"{type(exc).__name__}: {_first_line(exc)}")
        return None
    rec["attn_count"] = counter.count
    return model, args, kwargs, ref, counter.count


def linear_sites(report: Any) -> list[int]:
    """[matched, all] sites of attention without a softmax (linear attention, delta rules) in ``report``."""
    mine = [s for s in report.sites if is_linear_form(s.anchor)]
    return [sum(s.matched for s in mine), len(mine)]


def _calls(sites: list) -> int:
    """The attention calls the sites stand for (a site of heads written as modules is one per head)."""
    return sum(s.calls for s in sites)


def _check(model: Any, case: _Case, cfg_name: str, rec: dict, reinspect: bool = True) -> dict:
    """The checks of one config on ``model`` (a copy); the report is ``kc.inspect`` of the rewritten model
    where ``reinspect`` and apply built its own inputs (the first config of a model: inspect must read an
    applied model as apply did), else the report apply recorded (a second analysis costs as much as apply)."""
    args, kwargs, ref, count = case.args, case.kwargs, case.ref, case.count
    inputs = (args, kwargs) if case.pass_inputs else ((), None)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return case.output(model(*args, **kwargs)).clone()

    layout = case.layout(model, args, kwargs) if case.layout is not None else None
    untouched = copy.deepcopy(model) if layout is not None else None
    try:
        kc.apply(model, kc.KHAConfig(**KHA_CONFIGS[cfg_name]), *inputs)
    except NoAttentionFoundError as exc:
        try:  # the report apply made (with the config: K = V, say, is skipped for it), nothing changed
            report, _ = analyse(model, kc.KHAConfig(**KHA_CONFIGS[cfg_name]), *inputs)
        except Exception as inner:
            return _fail(rec, "analysis after a refused apply fails", inner)
        rec["sites"] = [(s.name, s.status, s.reason[:300]) for s in report.sites]
        rec["linear_sites"] = linear_sites(report)
        if count == 0 and not report.sites:
            rec.update(status="no_attention")
            if rec.get("model_type") in NO_QKV:
                rec["reason"] = NO_QKV[rec["model_type"]]
        elif _calls(report.sites) == count and all(s.reason for s in report.sites):
            rec.update(status="skipped", reason=report.sites[0].reason[:300])
        else:
            _fail(rec, "site count mismatch", exc)
        return rec
    except Exception as exc:
        return _fail(rec, "KHAError on apply" if isinstance(exc, kc.KHAError) else "raw exception on apply", exc)
    try:
        recorded = recorded_report(model) if case.pass_inputs or not reinspect else None
        report = recorded or kc.inspect(model, *inputs)
        out0 = call()
    except Exception as exc:
        return _fail(rec, "inspect or forward after apply fails", exc)
    rec.update(matched=len(report.matched), skipped=len(report.skipped), trace_path=report.trace_path)
    rec["sites"] = [(s.name, s.status, s.reason[:300]) for s in report.sites]
    rec["linear_sites"] = linear_sites(report)
    if _calls(report.sites) != count:  # more sites than counted calls is fine where the extra ones are skipped
        extra = _calls(report.sites) - count  # (a degenerate softmax(q @ k^T) of rank 2 the count leaves out)
        if extra < 0 or _calls(report.matched) > count:
            return _fail(rec, f"site count mismatch ({_calls(report.sites)} site calls, {count} calls)")
        rec["extra_skipped_sites"] = extra
    if not torch.equal(out0, ref):
        rec["identity_max_diff"] = _max_diff(out0, ref)
        return _fail(rec, "identity broken")
    params = _kha_params(model)
    gen = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for _, p in sorted(params.items()):
            p.add_(PERTURB_SCALE * torch.randn(p.shape, generator=gen).to(p.dtype))
    try:
        out1 = call()
    except Exception as exc:
        return _fail(rec, "forward after perturb fails", exc)
    if not _max_diff(out1, ref) > MOVED_ATOL:
        return _fail(rec, "perturb has no effect")
    if untouched is not None:
        try:
            expect = KHA_CONFIGS[cfg_name] if not report.skipped else None  # every projection, every role
            reference = Reference(untouched, layout).load(model.state_dict(), expect=expect)
            rec["reference_rel_err"] = rel_err(case.output(reference.no_grad(*args, **kwargs)), out1)
        except Exception as exc:
            return _fail(rec, "per-head reference fails", exc)
        if not rec["reference_rel_err"] <= REFERENCE_RTOL:
            return _fail(rec, "per-head reference mismatch")
    if cfg_name in FOLDABLE:
        # sites whose report says their transforms do not fold (k = v) keep them; every other one folds
        kept = {s.name for s in report.matched if "not foldable" in s.note}
        try:
            kc.fold(model, strict=not kept)
            out2 = call()
        except Exception as exc:
            return _fail(rec, "fold fails", exc)
        rec["fold_max_diff"] = _max_diff(out2, out1)
        left = {n.partition(".kha.")[0] for n in _kha_params(model)}
        if kept:
            rec["fold_kept"] = sorted(left)
        if (
            not rec["fold_max_diff"] <= FOLD_ATOL
            or (left and not kept)
            or not all(any(p == site or p.startswith(site + ".") for site in kept) for p in left)
        ):
            return _fail(rec, "fold mismatch")
    rec["status"] = "pass"
    return rec
