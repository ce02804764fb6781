"""apply's check of its own rewrite (translation validation), run before ``kc.apply`` returns.

Three checks, each cheap next to the analysis itself:

1. **Identity.** Where the example inputs and the model's weights are real tensors, the model runs
   on them before the insertion and after it, and every tensor of the outputs must be exactly equal
   (the transforms start at identity). Both runs are under ``no_grad``, with the RNG seeded alike
   (dropout in train mode draws the same masks) and the buffers put back after each (BatchNorm's
   running statistics). A model on the meta device skips this check (nothing to run).
2. **No fake tensor left.** Nothing of the trace may stay in the outputs, the parameters and
   buffers, the modules' attributes or the globals of the model's code (:mod:`..analysis.owned_state`).
3. **Each operand carries its own transform.** Each site's module (:func:`scope_of`, in the block
   apply traced) is traced again on the inputs recorded in the check's forward, or where the model cannot
   run (the meta device) on those it had in apply's trace (:mod:`..analysis.call_inputs`); the whole model,
   one block per type, where neither can be. Then matched; for each role of each site, the KHA transforms acting on
   the features from the role's projection to the attention's operand (:mod:`..analysis.kha_reach`)
   must be exactly the one planned for that role of that site: not another role's (swapped roles),
   not two (a role transformed twice), not one planned for another site. Where the walk sees none (a
   transform folded into a computed weight, a convolution), the operand is not judged.

Example::

    before = reference_outputs(model, args, kwargs)
    insert(model, plan)
    findings = self_check(model, report, args, kwargs, before, {"v"}, planned)     # [] when the rewrite is right
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree

from ..analysis.call_inputs import materialize
from ..analysis.describe import without_source_lines
from ..analysis.graph import MatchGraph
from ..analysis.kha_reach import transforms_reaching
from ..analysis.match import RawSite, sites_in
from ..analysis.owned_state import fake_tensors_in
from ..analysis.submodules import capture_submodules, prefix_sites, why_trace_failed
from ..analysis.trace import Capture, capture, no_cache
from ..core.devices import callers_device
from ..core.errors import KHAError, TraceError
from ..core.quantized import weights_kept_trainable
from ..core.report import AttentionSite, Report
from ..handlers import adapter as _adapter
from ..model.carrier import kha_modules, transforms_of
from ..model.parametrized import raw_parameters
from ..model.wrappers import plain_forward

__all__ = ["Finding", "reference_outputs", "self_check"]

log = logging.getLogger(__name__)

_SEED = 34  # both runs draw the same random numbers (dropout, random features)


@dataclasses.dataclass
class Finding:
    """One failure of the self-check: the site (its report name, '' for the whole model), the traced
    name of its site in apply's analysis (to skip it), and what failed."""

    site: str
    traced: str
    what: str

    def __str__(self) -> str:
        return f"{self.site or 'the model'}: {self.what}"


def _not_real(model: nn.Module, args: Any, kwargs: Any) -> str:
    tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if any(isinstance(t, FakeTensor) or t.is_meta for t in tensors):
        return "the example inputs are not real tensors"
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return "the model is on the meta device"
    return ""


@contextlib.contextmanager
def _one_run(model: nn.Module) -> Iterator[None]:
    """A forward that changes nothing: no_grad, the RNG seeded (and put back), buffers put back,
    no cache filled, MHA's fused fast path off (KHA's carriers take the regular path), quantized weights
    left in their layout (bitsandbytes' CPU repacking has no backward)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    fastpath = torch.backends.mha.get_fastpath_enabled()
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"})
    try:
        torch.backends.mha.set_fastpath_enabled(False)
        with (
            torch.random.fork_rng(devices=cuda),
            torch.no_grad(),
            no_cache(model),
            callers_device(),
            weights_kept_trainable(model),
        ):
            torch.manual_seed(_SEED)
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        with torch.no_grad():
            for b, old in buffers:
                if b.shape == old.shape and not torch.equal(b, old):
                    b.copy_(old)


def _detached(out: Any) -> Any:
    return _pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, out)


def reference_outputs(model: nn.Module, args: Any, kwargs: Any) -> Any | None:
    """The model's outputs on the example inputs before the insertion, or None when they cannot be had
    (inputs or weights not real, or the forward fails): the identity check is then skipped.

    Example::

        before = reference_outputs(model, (x,), {})
    """
    why = _not_real(model, args, kwargs)
    if why:
        log.info("KHA self-check: %s, so the rewritten model is not run (the graph is still checked)", why)
        return None
    try:
        with _one_run(model):
            return _detached(model(*args, **kwargs))
    except Exception as exc:  # the analysis traced it; a real run may still refuse (a device, a kernel)
        log.info(
            "KHA self-check: the model's own forward failed (%s: %s); identity not checked", type(exc).__name__, exc
        )
        return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not (a.is_floating_point() or a.is_complex()):
        return False
    both_nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a == b) | both_nan).all())


def _compare(before: Any, after: Any) -> str:
    """'' when every tensor of the two output structures is equal; else what differs."""
    la = _pytree.tree_leaves(before)
    lb = _pytree.tree_leaves(after)
    if len(la) != len(lb):
        return f"the outputs changed structure ({len(la)} leaves before, {len(lb)} after)"
    for i, (a, b) in enumerate(zip(la, lb)):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"output {i} changed type ({type(a).__name__} -> {type(b).__name__})"
        if isinstance(a, torch.Tensor) and not _equal(a, b.detach()):
            diff = ""
            if a.shape == b.shape and a.is_floating_point() and b.is_floating_point():
                diff = f", max difference {(a.float() - b.detach().float()).abs().nan_to_num().max().item():.3g}"
            return f"output {i} differs from the model's before the insertion (identity at init broken{diff})"
    return ""


def _recording(model: nn.Module, scopes: list[str], calls: dict[str, tuple[tuple, dict]]) -> list[Any]:
    """Forward pre-hooks keeping the inputs of each scope module's first call (tensors copied)."""

    def keep(t: Any) -> Any:
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    def hook_for(path: str) -> Any:
        def hook(module: nn.Module, a: tuple, kw: dict) -> None:
            if path not in calls:
                calls[path] = (_pytree.tree_map(keep, tuple(a)), _pytree.tree_map(keep, dict(kw)))

        return hook

    handles = []
    for path in scopes:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        handles.append(module.register_forward_pre_hook(hook_for(path), with_kwargs=True))
    return handles


def _run_findings(
    model: nn.Module, args: Any, kwargs: Any, before: Any, scopes: list[str], calls: dict[str, tuple[tuple, dict]]
) -> list[Finding]:
    out = None
    handles = _recording(model, scopes, calls)
    try:
        with _one_run(model):
            out = model(*args, **kwargs)  # also on the meta device: the inputs of each scope to trace
    except Exception as exc:
        if before is not None:
            return [Finding("", "", f"the rewritten model fails on the example inputs: {type(exc).__name__}: {exc}")]
        out = None
    finally:
        for h in handles:
            h.remove()
    fakes = fake_tensors_in(model, out)
    if fakes:
        return [Finding("", "", "fake tensors left behind by the trace: " + ", ".join(fakes[:6]))]
    if before is not None:
        what = _compare(before, out)
        if what:
            return [Finding("", "", what)]
    return []


@dataclasses.dataclass
class _Part:
    """One traced graph of the rewritten model: its view and sites, and how its paths map to the model's."""

    g: MatchGraph
    raw: list[RawSite]
    cap: Capture  # expands paths below ``scope`` (the whole model's when scope is '')
    prefix: str = ""  # added to the graph's parameter names
    scope: str = ""  # the module traced on its own (its sites' paths are prefixed with it)

    def real(self, path: str) -> str:
        """The model's path of a site, projection or (prefixed) parameter path of this graph: a traced
        representative block's path is its first copy's."""
        if not self.scope:
            return self.cap.expand_path(path)[0]
        local = path[len(self.scope) + 1 :] if path.startswith(self.scope + ".") else ""
        return ".".join(x for x in (self.scope, self.cap.expand_path(local)[0] if local else "") if x)

    def param(self, name: str) -> str:
        return self.real(f"{self.prefix}.{name}" if self.prefix else name)


def _graphs(model: nn.Module, args: Any, kwargs: Any, whole: bool) -> list[_Part]:
    """The rewritten model traced as apply traced it (``whole``: the whole model, one block per type)."""
    with raw_parameters(), _adapter.adapters_off(model), plain_forward(model), without_source_lines():
        try:
            cap = capture(model, args, kwargs)
        except TraceError as exc:
            if whole:  # it traced whole before the insertion
                raise TraceError(f"it traced before the insertion, not after: {why_trace_failed(exc)}") from exc
            cap = capture_submodules(model, args, kwargs, f"the whole-model trace failed: {exc}")[0]
    parts = []
    for prefix, ep in cap.programs():
        g = MatchGraph(ep, cap.aliases if not prefix else {})
        parts.append(_Part(g, prefix_sites(sites_in(g), prefix), cap, prefix))
    return parts


def scope_of(model: nn.Module, site: AttentionSite) -> str:
    """The smallest module holding a site's attention and all its projections ('' : the whole model).

    Example::

        scope_of(model, site)      # "model.layers.0.self_attn"
    """
    paths = [site.name.partition("@")[0], *(p for r in "qkv" for p in site.projections(r))]
    common = paths[0].split(".")
    for p in paths[1:]:
        parts = p.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    scope = ".".join(common)
    try:
        model.get_submodule(scope)
    except AttributeError:
        return ""
    return scope


def _scoped(model: nn.Module, calls: dict[str, tuple[tuple, dict]]) -> list[_Part] | None:
    """Each scope module traced on its own, on the inputs recorded in the check's forward (None when one
    cannot be: the caller traces the whole model instead)."""
    parts = []
    with raw_parameters(), _adapter.adapters_off(model), plain_forward(model), without_source_lines():
        for scope, (a, kw) in calls.items():
            try:
                cap = capture(model.get_submodule(scope), a, kw)
            except (KHAError, AttributeError):
                return None
            g = MatchGraph(cap.exported, cap.aliases)
            parts.append(_Part(g, prefix_sites(sites_in(g), scope), cap, scope, scope))
    return parts


def _role_transform(module: nn.Module, role: str) -> nn.Module | None:
    kha = transforms_of(module)
    return kha[role] if role in kha else None  # noqa: SIM401 - a ModuleDict has no get


def _allowed(model: nn.Module, paths: list[str], role: str) -> set[int]:
    """Ids of the transforms of ``role`` held by the modules at ``paths`` (and their parents)."""
    out: set[int] = set()
    for path in paths:
        parts = path.split(".") if path else []
        for i in range(len(parts), -1, -1):
            try:
                module = model.get_submodule(".".join(parts[:i]))
            except AttributeError:
                continue
            t = _role_transform(module, role)
            if t is not None:
                out.add(id(t))
    return out


def _graph_findings(
    model: nn.Module,
    report: Report,
    args: Any,
    kwargs: Any,
    roles: set[str],
    planned: dict[str, str],
    calls: dict[str, tuple[tuple, dict]],
) -> tuple[list[Finding], int]:
    """The third check (see the module doc); also how many role operands it could follow."""
    parts = _scoped(model, calls) if calls else None
    if parts is None:
        parts = _graphs(model, args, kwargs, whole=bool(planned) and "per submodule" not in report.trace_path)
    owner: dict[int, tuple[str, str, int]] = {}  # id(param) -> (transform's name, its role, id(transform))
    for path, module in kha_modules(model):
        for role, t in transforms_of(module).items():
            for p in t.parameters():
                owner.setdefault(id(p), (f"{path}.kha.{role}", role, id(t)))
    by_name = {s.name: s for s in report.matched}
    findings: list[Finding] = []
    followed = 0
    for part in parts:
        for site in part.raw:
            if site.reason or set(site.roles) != {"q", "k", "v"}:
                continue
            rep = by_name.get(part.real(site.name))
            if rep is None:  # a site named by a node is renamed by the inserted ops: not followed
                continue
            for role in "qkv":
                target = site.targets[role][0] if role in site.targets else site.node
                for m in [site.roles[role], *site.joint.get(role, [])]:
                    reach = transforms_reaching(part.g, m.projection, target)
                    if reach is None:
                        continue
                    followed += 1
                    what = _judge(model, part, site, role in roles, role, m, reach, owner)
                    if what:
                        traced = next((t for t, n in planned.items() if n == rep.name), site.name)
                        findings.append(Finding(rep.name, traced, f"{role}: {what}"))
                        break
    return findings, followed


def _judge(model, part, site, planned, role, m, reach, owner) -> str:
    """What is wrong with the transforms reaching one role's operand ('' when it is as planned)."""
    found: dict[int, tuple[str, str, int]] = {}
    for name in reach.params:
        full = part.param(name)
        try:
            p = model.get_parameter(full)
        except AttributeError:
            continue
        if id(p) in owner:
            found[owner[id(p)][2]] = owner[id(p)]
    names = ", ".join(sorted(n for n, _, _ in found.values()))
    if len(found) > 1:
        return f"{len(found)} KHA transforms act on its features ({names}); one is planned"
    if reach.twice:
        return f"the transform {names} acts twice on its features"
    if not found:  # a transform this walk cannot see (a weight computed from it, a convolution): not judged
        return ""
    (name, t_role, tid) = next(iter(found.values()))
    shares = m.shares or (role,)
    if t_role not in shares:
        return f"it carries {name}, the transform of {t_role} (the roles are swapped)"
    if not planned:
        return f"it carries {name}, but no transform was planned for {role}"
    homes = [part.real(x.projection.module_path) for x in [site.roles[role], *site.joint.get(role, [])]]
    homes.append(part.real(site.name.partition("@")[0]))
    if tid not in _allowed(model, homes, role):
        return f"it carries {name}, which is planned for another site"
    return ""


def _scopes(model: nn.Module, report: Report, planned: dict[str, str]) -> list[str]:
    """The modules to trace on their own, one per site apply traced (a representative block's); [] when
    one of them is the whole model (the whole model is traced instead)."""
    by_name = {s.name: s for s in report.matched}
    scopes = {scope_of(model, by_name[n]) for n in planned.values() if n in by_name}
    if not scopes or "" in scopes:
        return []
    return sorted(s for s in scopes if not any(s.startswith(o + ".") for o in scopes))


def _traced_calls(model: nn.Module, scopes: list[str], traced: dict[int, Any]) -> dict[str, tuple[tuple, dict]]:
    """Each scope module's inputs as apply's trace saw them, made afresh ({} when one is missing)."""
    out = {}
    for path in scopes:
        call = traced.get(id(model.get_submodule(path)))
        if call is None:
            return {}
        out[path] = materialize(call)
    return out


def self_check(
    model: nn.Module,
    report: Report,
    args: Any,
    kwargs: Any,
    before: Any,
    roles: set[str],
    planned: dict[str, str],
    traced_inputs: dict[int, Any] | None = None,
) -> list[Finding]:
    """Every failure of the three checks of the module doc on the rewritten ``model`` ([] when none).

    ``before``: :func:`reference_outputs` taken before the insertion (None: identity not checked);
    ``roles``: the roles the config gives a transform; ``planned``: traced name -> report name of each site
    apply matched in a whole-model trace (each must be found again); ``traced_inputs``: the inputs of each
    module in apply's trace (``Capture.inputs``), for the scopes the check's forward could not reach (a model
    on the meta device), so that the check traces those modules, not the whole model, again.

    Example::

        findings = self_check(model, report, args, kwargs, before, {"v"}, {"layers.0.attn": "layers.0.attn"})
    """
    start = time.perf_counter()
    scopes = _scopes(model, report, planned)
    calls: dict[str, tuple[tuple, dict]] = {}
    findings = _run_findings(model, args, kwargs, before, scopes, calls)
    if set(calls) != set(scopes):  # a scope did not run: its inputs in apply's trace, else the whole model
        calls = _traced_calls(model, scopes, traced_inputs or {})
    followed = 0
    if not findings:
        try:
            graph, followed = _graph_findings(model, report, args, kwargs, roles, planned, calls)
        except KHAError as exc:
            graph = [
                Finding("", "", f"the rewritten model cannot be traced as the model was: {str(exc).splitlines()[0]}")
            ]
        findings.extend(graph)
    log.info(
        "KHA self-check of %s in %.2fs: identity %s, %d role operands followed, %d failures",
        type(model).__name__,
        time.perf_counter() - start,
        "checked" if before is not None else "not checked",
        followed,
        len(findings),
    )
    return findings
