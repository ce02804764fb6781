"""The ``"kha"`` torch.compile backend: KHA rewrites on the Dynamo graph, then Inductor.

Importing :mod:`kha_compile` registers the name ``"kha"`` with Dynamo lazily: if Dynamo's backend
registry is not imported yet, a one-shot import hook registers the backend when it is, so
``import kha_compile`` imports nothing of Dynamo or Inductor.

Every Dynamo graph goes through the rules of :data:`rules.RULES`, each a small class with
``pattern`` / ``check`` / ``rewrite`` in a file of its own; a declined match is recorded with its
reason (``stats.declined``, DEBUG log):

- :class:`DeployKHA` (deploy mode only): inserts the transforms of a ``save_pretrained`` checkpoint
  after the projection ops of a model that never saw :func:`kha_compile.apply`.
- :class:`FuseMLPValue`: the hand-written form ``2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down``
  (``torch.matmul`` or ``@``, either operand order of ``*``, ``2 *``, ``2.0 *``, ``* 2``, or the
  factor after the down-projection) becomes one ``torch.ops.kha.mlp_value`` node.
  ``KHAMLPValue`` already traces to that node; ``stats.mlp_value_ops`` counts both.
- :class:`FoldLinearKHA`: when gradients are off (``torch.is_grad_enabled()`` is False while
  compiling, or none of the weight, bias and transforms requires grad), every KHA-Linear
  ``x @ T`` is folded into the rows of the projection that feeds it (``W[R_h] <- T^T W[R_h]``,
  ``b[R_h] <- b[R_h] T``, KHA_SPEC.md) and the matmul disappears.

Then the graph goes to Inductor (``torch._inductor.compile_fx.compile_fx``).

Design notes
------------
- Folding works on the graph, not on modules (the backend never sees the modules): the matmul
  is anchored by the module that traced it (``nn_module_stack`` holds a ``KHALinearTransform``),
  and the path from the projection op (``linear``, Conv1D's ``addmm``, ``matmul``) to it is
  replayed on a meta stand-in whose token axes have stride 0, so any chain of views (``narrow``,
  ``reshape``, ``unflatten``, ``split`` ...) of separate, fused or interleaved projections gives
  the head slot exactly. The fold is refused when anything else reads the transformed features.
  The matmul is replaced by its input; the layout ops around it stay and cost nothing.
- Folded weights are not baked into the compiled code: they are extra graph inputs that the
  returned callable computes from the live parameters, and recomputes whenever a source tensor
  is replaced or modified in place (its version counter moves). An optimizer step between two
  ``no_grad`` calls therefore never leaves a stale fold behind.
- Deploy mode needs the head layout, which only the model's analysis gives (``kc.apply``'s
  trace and match). ``kc.backend(from_pretrained=..., model=m)`` analyses ``m`` and validates the
  checkpoint right away: a misfit raises ``KHAError`` before anything compiles. Without ``model``
  the backend takes the module handed to ``torch.compile`` (the ``OptimizedModule`` on the call
  stack) and validates on the first compile; the ``KHAError`` is then raised through Dynamo
  unwrapped (Dynamo wraps backend errors in ``BackendCompilerFailed`` except its own
  ``ShortenTraceback`` family, so the error is re-raised as a subclass of both), and
  ``except kc.KHAError`` catches it. A transform that deploy mode cannot place raises too,
  since leaving it out would change the outputs. ``nn.MultiheadAttention`` (projections used
  functionally) is not supported in deploy mode: use ``kc.load_pretrained`` and ``"kha"``.
- The rules work on a copy of the graph: Dynamo keeps using the placeholders of the graph it
  passed after the backend returns.

The package: ``compiler`` (:class:`KHABackend`, the ``"kha"`` function), ``stats``, ``graph``
(graph context and FX predicates), ``projection`` (projection ops and view replay), ``runtime``
(inputs recomputed at run time), ``deploy`` (checkpoint + head layout), ``rules/`` (one file per
rule, :data:`rules.RULES`), ``registration`` (Dynamo), ``deps`` (what it uses from the package).

``kha_compile.backend`` is this package and is also callable:
``kha_compile.backend(from_pretrained=..., **options)`` returns a :class:`KHABackend`.

Example::

    import kha_compile as kc
    compiled = torch.compile(model_with_kha, backend="kha")              # train or infer
    compiled = torch.compile(vanilla, backend=kc.backend(from_pretrained="kha_ckpt"))   # deploy
    kc.backend.last_stats().rewrites      # {'deploy': 2, 'fuse_mlp_value': 0, 'fold_linear': 0}
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .compiler import NAME, KHABackend, create, kha, last_stats, reset
from .registration import install
from .rules import RULES, DeployKHA, FoldLinearKHA, FuseMLPValue, Rule
from .stats import BackendStats, Decline, GraphStats, RuleName, Verdict

__all__ = [
    "NAME",
    "RULES",
    "BackendStats",
    "Decline",
    "DeployKHA",
    "FoldLinearKHA",
    "FuseMLPValue",
    "GraphStats",
    "KHABackend",
    "Rule",
    "RuleName",
    "Verdict",
    "create",
    "kha",
    "last_stats",
    "reset",
]

install()


class _CallableModule(types.ModuleType):
    """This package, callable: ``kha_compile.backend(...)`` is :func:`create`."""

    def __call__(self, from_pretrained: Any = None, **options: Any) -> KHABackend:
        return create(from_pretrained, **options)


sys.modules[__name__].__class__ = _CallableModule
