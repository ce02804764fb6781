"""The verbs apply, inspect and remove: analysis (trace, match), then the handlers (plan, insert)."""

from __future__ import annotations

import copy
import logging
import warnings
import weakref
from typing import Any

from torch import nn

from ..analysis.inputs import example_inputs as _example_inputs
from ..analysis.submodules import trace_and_match
from ..core.devices import own_tensors_on_cpu
from ..core.errors import AlreadyAppliedError, AnalysisError, KHAConfigError, KHAError, NoAttentionFoundError
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
    model = unwrap_model(model)  # a PeftModel: paths and inputs of the model inside
    args, kwargs = _step("inputs", model, _example_inputs, model, example_args, example_kwargs)
    # parametrized weights read as stored; adapters off; the model's own forward, not accelerate's autocast wrapper
    with raw_parameters(), _adapter.adapters_off(model), plain_forward(model):
        # the whole model, or submodule by submodule where torch.export cannot trace it whole
        cap, raw = _step("trace", model, trace_and_match, model, args, kwargs)
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
) -> nn.Module:
    """Insert KHA transforms after the q/k/v projections of every attention in ``model``, in place.

    The transforms start at identity, so the model's outputs do not change until training moves
    them. Repeated blocks are traced once. Returns ``model``.

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
        report, plan = analyse(inner, cfg, example_args, example_kwargs)
        if not report.matched:
            message = _nothing_found(model, report)
            if strict:
                raise NoAttentionFoundError(message + "\nPass strict=False to return the model unchanged instead.")
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            return model
        count = insert(inner, plan)
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
