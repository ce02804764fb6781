"""The verbs apply, inspect and remove: analysis (trace, match), then the handlers (plan, insert)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import warnings
import weakref
from typing import Any

from torch import nn

from ..analysis.inputs import example_inputs as _example_inputs
from ..analysis.match import RawSite
from ..analysis.submodules import trace_and_match
from ..analysis.trace import Capture
from ..core.devices import own_tensors_on_cpu
from ..core.errors import (
    AlreadyAppliedError,
    AnalysisError,
    KHAConfigError,
    KHAError,
    NoAttentionFoundError,
    SelfCheckError,
)
from ..core.report import Report
from ..handlers import adapter as _adapter
from ..handlers import handler_of, projection_handlers
from ..handlers.insert import insert
from ..handlers.plan import build_sites, current_transforms
from ..model.adapter import unwrap_model
from ..model.carrier import kha_modules
from ..model.config import KHAConfig
from ..model.parametrized import raw_parameters
from ..model.sharded import refuse_sharded
from ..model.wrappers import plain_forward
from ..store.hf import record_config
from .validate import Finding, reference_outputs, self_check

__all__ = ["analyse", "apply", "inspect", "recorded_report", "remove"]

log = logging.getLogger(__name__)

# the report of the last apply of each model (what exporters record as metadata without tracing again)
_REPORTS: weakref.WeakKeyDictionary[nn.Module, Report] = weakref.WeakKeyDictionary()


def _step(step: str, model: nn.Module, fn: Any, *args: Any) -> Any:
    """Run one analysis step; an unexpected exception becomes an AnalysisError naming the step."""
    try:
        return fn(*args)
    except KHAError:
        raise
    except Exception as exc:  # a bug or an unforeseen graph: never a raw crash, the model is unchanged
        raise AnalysisError(
            f"kha_compile failed in the {step} step on {type(model).__name__}: {type(exc).__name__}: {exc}. "
            "The model is unchanged. Set KHA_MATCH_DEBUG=<node name> for the matcher's decisions, and "
            "report this with the model's code."
        ) from exc


def analyse(model: nn.Module, cfg: KHAConfig | None, example_args: Any, example_kwargs: dict | None):
    """(report, insertion plan) of ``model`` (a ``PeftModel`` is analysed as the model inside it)."""
    report, plan, _ = _analysed(unwrap_model(model), cfg, example_args, example_kwargs)
    return report, plan


@dataclasses.dataclass
class _Analysis:
    """What apply keeps of the analysis for its self-check: the inputs, the capture and the raw sites."""

    args: tuple
    kwargs: dict
    cap: Capture
    raw: list[RawSite]


def _analysed(model: nn.Module, cfg: KHAConfig | None, example_args: Any, example_kwargs: dict | None):
    args, kwargs = _step("inputs", model, _example_inputs, model, example_args, example_kwargs)
    # parametrized weights read as stored; adapters off; the model's own forward, not accelerate's autocast wrapper
    with raw_parameters(), _adapter.adapters_off(model), plain_forward(model):
        # the whole model, or submodule by submodule where torch.export cannot trace it whole
        cap, raw = _step("trace", model, trace_and_match, model, args, kwargs)
    report, plan = _planned(model, raw, cap, cfg)
    return report, plan, _Analysis(args, kwargs, cap, raw)


def _planned(model: nn.Module, raw: list[RawSite], cap: Capture, cfg: KHAConfig | None) -> tuple[Report, list]:
    sites, plan = _step("plan", model, build_sites, model, raw, cap, cfg)
    _adapter.retarget(model, plan, sites)  # <wrapper>.base_layer -> the adapter wrapper
    report = Report(type(model).__name__, sites, cap.seconds, cap.traced_blocks, cap.path, list(cap.untraced))
    return report, plan


def _nothing_found(model: nn.Module, report: Report) -> str:
    what = (
        f"kha_compile found no per-head attention to transform in {type(model).__name__}. It looked for "
        "aten.scaled_dot_product_attention, softmax(q @ k^T ...) @ v (matmul, bmm, baddbmm), flex_attention, "
        "attention without a softmax (linear attention, retention, gated-delta-rule and other linear-attention "
        "kernels) and ops registered with kc.register_attention_op in the "
        "torch.export graph and walked q, k, v back to their projections."
    )
    unknown = [s for s in report.skipped if s.anchor == "unregistered"]
    known = [s for s in report.skipped if s.anchor != "unregistered"]
    if known:
        near = max(known, key=lambda s: len(s.found))  # the candidate whose walk got furthest
        found = f"{', '.join(near.found)} traced back to projections" if near.found else "no role traced back"
        what += (
            f"\nNearest candidate: {near.name} (rule {near.anchor}; {found}); the walk stopped: {near.reason}"
            "\nAttention ops were found but skipped:\n" + "\n".join(f"  {s.name}: {s.reason}" for s in known[:12])
        )
    if unknown:
        what += (
            "\nThe graph has no attention op kha_compile knows, but ops that look like attention are not "
            "registered:\n" + "\n".join(f"  {s.name}: {s.reason}" for s in unknown)
        )
    if not report.skipped:
        what += (
            " The graph contains no attention op; check that the example inputs run the attention path. Layers "
            "with no per-head q, k, v (state-space layers such as Mamba's, RWKV, convolutions, Fourier mixing) "
            "have nothing for KHA to transform."
        )
    if report.untraced:
        what += f"\nTraced {report.trace_path}; these submodules could not be traced:\n" + "\n".join(
            f"  {path}: {why}" for path, why in report.untraced[:8]
        )
    return what


def apply(
    model: nn.Module,
    cfg: KHAConfig | None = None,
    example_args: Any = (),
    example_kwargs: dict | None = None,
    strict: bool = True,
    check: bool = True,
) -> nn.Module:
    """Insert KHA transforms after the q/k/v projections of every attention in ``model``, in place.

    The transforms start at identity, so the model's outputs do not change until training moves
    them. Repeated blocks are traced once. Returns ``model``.

    Before it returns, apply checks its own rewrite (``check=True``, the default): where the example
    inputs are real, the model gives exactly the outputs it gave before; no fake tensor of the trace
    is left in the model or its code's globals; and, on a trace of the rewritten model, each site's
    q, k and v operands carry exactly their own transform. A failure undoes the insertion and raises
    ``SelfCheckError`` naming the site; with ``strict=False`` the sites that fail are skipped with the
    reason instead. ``check=False`` skips the check (it costs one more trace of each site's module).

    Example::

        import kha_compile as kc
        model = kc.apply(model, kc.KHAConfig(v="mlp"))          # transformers: inputs built from config
        model = kc.apply(block, example_args=(x,))              # any other nn.Module
        print(kc.inspect(model))
    """
    refuse_sharded(model, "apply")  # before anything is touched: apply before fully_shard/parallelize
    if cfg is None:
        cfg = KHAConfig()
    if not isinstance(cfg, KHAConfig):
        raise KHAConfigError(f"cfg must be a kha_compile.KHAConfig, got {type(cfg).__name__}; e.g. KHAConfig(v='mlp').")
    existing = kha_modules(model)
    if existing:
        raise AlreadyAppliedError(
            f"{type(model).__name__} already carries KHA transforms ({len(existing)} modules, e.g. "
            f"{existing[0][0]!r}); apply() runs once per model. Use kc.fold(model) or kc.remove(model) first, "
            "or start from a fresh model."
        )
    inner = unwrap_model(model)  # a PeftModel: the model inside carries the transforms and the config
    with own_tensors_on_cpu():  # inside `with torch.device("meta"):` too; the model's code runs as it would
        report, plan, analysis = _analysed(inner, cfg, example_args, example_kwargs)
        if not report.matched:
            message = _nothing_found(model, report)
            if strict:
                raise NoAttentionFoundError(message + "\nPass strict=False to return the model unchanged instead.")
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            return model
        before = reference_outputs(inner, analysis.args, analysis.kwargs) if check else None
        count = insert(inner, plan)
        if check:
            report, plan, count = _checked(inner, cfg, report, plan, count, analysis, before, strict)
    _adapter.watch(inner)
    record_config(inner)
    _REPORTS[inner] = report
    for s in report.skipped:
        log.warning("KHA skipped %s: %s", s.name, s.reason)
    log.info(
        "KHA inserted %d transforms into %d modules at %d attention sites (%d skipped) in %.2fs",
        count,
        len(plan),
        len(report.matched),
        len(report.skipped),
        report.trace_seconds,
    )
    return model


def _undo(model: nn.Module) -> None:
    """Take out what insert() put in (the classes and parameters of before)."""
    for _, module in kha_modules(model):
        handler_of(module).detach(module)
    for handler in projection_handlers():
        handler.cleanup(model)


def _refusal(model: nn.Module, findings: list[Finding], strict: bool) -> str:
    lines = "\n".join(f"  {f}" for f in findings[:12])
    how = (
        "Pass strict=False to skip the sites that fail (the others keep KHA), or check=False to skip the check."
        if strict and all(f.site for f in findings)
        else "Pass check=False to skip the check."
    )
    return (
        f"kha_compile's check of its own rewrite of {type(model).__name__} failed, so the insertion was undone "
        f"and the model is as it was:\n{lines}\nThis is a bug of kha_compile or a form it misreads: please report "
        f"it with the model's code. {how}"
    )


def _planned_sites(report: Report, analysis: _Analysis) -> dict[str, str]:
    """Traced name -> report name of every site apply matched and planned, in a trace of the whole model."""
    if analysis.cap.exported is None:  # traced per submodule: the check matches what it finds
        return {}
    matched = {s.name for s in report.matched}
    out = {}
    for raw in analysis.raw:
        name = next((n for n in analysis.cap.expand_path(raw.name) if n in matched), None)
        if name is not None:
            out[raw.name] = name
    return out


def _findings(model: nn.Module, cfg: KHAConfig, report: Report, analysis: _Analysis, before: Any) -> list[Finding]:
    """The self-check of the rewrite ``report`` describes (passes/validate.py)."""
    planned = _planned_sites(report, analysis)
    return self_check(
        model, report, analysis.args, analysis.kwargs, before, set(cfg.roles()), planned, analysis.cap.inputs
    )


def _checked(
    model: nn.Module,
    cfg: KHAConfig,
    report: Report,
    plan: list,
    count: int,
    analysis: _Analysis,
    before: Any,
    strict: bool,
) -> tuple[Report, list, int]:
    """The self-check (passes/validate.py); on a failure undo, then raise or (strict=False) re-plan without
    the sites that failed."""
    findings = _findings(model, cfg, report, analysis, before)
    if not findings:
        return report, plan, count
    _undo(model)
    if strict or not all(f.site for f in findings):
        raise SelfCheckError(_refusal(model, findings, strict))
    why: dict[str, list[str]] = {}
    for f in findings:
        why.setdefault(f.traced, []).append(f.what)
    for raw in analysis.raw:
        if raw.name in why:
            raw.reason = "kha_compile's self-check refused its rewrite: " + "; ".join(why[raw.name])
    report, plan = _planned(model, analysis.raw, analysis.cap, cfg)
    if not report.matched:
        raise SelfCheckError(_refusal(model, findings, strict))
    count = insert(model, plan)
    again = _findings(model, cfg, report, analysis, before)
    if again:
        _undo(model)
        raise SelfCheckError(_refusal(model, again, strict))
    return report, plan, count


def inspect(model: nn.Module, example_args: Any = (), example_kwargs: dict | None = None) -> Report:
    """Report every attention site of ``model`` (before or after apply) without changing it.

    Example::

        report = kc.inspect(model)
        print(report)                     # a table: kind, heads, kv heads, head dim, rope, qk-norm, kha
        report.sites[0].transforms        # {"v": "mlp"} after apply
    """
    refuse_sharded(model, "inspect")
    with own_tensors_on_cpu():
        report, _ = analyse(model, None, example_args, example_kwargs)
    if not report.matched:  # say so, with apply's hints, rather than print an empty table
        report.note = _nothing_found(model, report)
        log.warning(report.note)
    return report


def remove(model: nn.Module) -> nn.Module:
    """Take every KHA transform out of ``model`` (no folding): the original classes and outputs come back.

    Example::

        kc.remove(model)                  # the model computes exactly what it did before apply
    """
    for _, module in kha_modules(model):
        handler_of(module).detach(module)
    for handler in projection_handlers():
        handler.cleanup(model)
    _adapter.unwatch(model)
    record_config(unwrap_model(model))
    _REPORTS.pop(unwrap_model(model), None)
    return model


def recorded_report(model: nn.Module) -> Report | None:
    """The report of the ``kc.apply`` that put KHA into ``model`` (transforms as the model carries them
    now), or None when this process did not apply it (a pickled or deep-copied model).

    Example::

        kc.apply(model)
        [s.name for s in recorded_report(model).matched]
    """
    inner = unwrap_model(model)
    report = _REPORTS.get(inner)
    if report is None or not kha_modules(inner):
        return None
    report = copy.deepcopy(report)
    for site in report.matched:
        paths = {r: p for r, p in (("q", site.q_proj), ("k", site.k_proj), ("v", site.v_proj)) if p}
        site.transforms = {}
        current_transforms(inner, site, paths)
    return report
