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
  compiling, or none of the weight, bias and transform parameters requires grad), every transform
  of a foldable kind (KHA-Linear, or any registered kind with ``foldable = True``) is folded into
  the rows of the projection that feeds it (``W[R_h] <- T^T W[R_h]``, ``b[R_h] <- b[R_h] T`` with
  ``T = kind.fold_matrix_of(*params)``, docs/method.md) and the transform disappears.

Then the graph goes to Inductor (``torch._inductor.compile_fx.compile_fx``).

Design notes
------------
- Folding works on the graph, not on modules (the backend never sees the modules): a transform
  is found by the module that traced it (``nn_module_stack`` holds a module of a foldable kind),
  its parameters by their names, and the path from the projection op (``linear``, Conv1D's
  ``addmm``, ``matmul``) to its input is replayed on a meta stand-in whose token axes have stride
  0, so any chain of views (``narrow``, ``reshape``, ``unflatten``, ``split`` ...) of separate,
  fused or interleaved projections gives the head slot exactly. The fold is refused when anything
  else reads the transformed features. The transform is replaced by its input; the layout ops
  around it stay and cost nothing.
- Folded weights are never cached: the fold is a node of the graph over the live parameters, so
  every call folds the weights as they are now (fused optimizers, ``copy_``, ``load_state_dict``:
  nothing can leave a stale fold). It costs ``out x in x Dh`` multiply-adds per folded projection
  and call (:mod:`.runtime`); ``fold=False`` keeps the transforms instead.
- Deploy mode places the transforms where the checkpoint's recorded plan says (``kc.save_pretrained``
  records it): each planned projection is found in the graph by its weight's name, read from the
  sources Dynamo records for its inputs, and validated there on the first compile (a planned weight
  the model lacks, or of another size, raises ``CheckpointError``). No model object is needed, so
  ``torch.compile`` of a function that calls the model works too. ``kc.backend(from_pretrained=...,
  model=m)`` instead analyses ``m`` (``kc.apply``'s trace and match) and validates right away,
  before anything compiles; a checkpoint without a plan (older kha_compile, or a transformers
  directory) needs it. A ``KHAError`` raised while compiling passes through Dynamo unwrapped
  (Dynamo wraps backend errors in ``BackendCompilerFailed`` except its own ``ShortenTraceback``
  family, so the error is re-raised as a subclass of both), and ``except kc.KHAError`` catches it.
  A transform that deploy mode cannot place raises too, since leaving it out would change the
  outputs. Dynamo may run one graph for every layer (a graph break inside a repeated block, the
  layer's parameters passed as arguments); the checkpoint tensors put into it are tied to the
  weight they were made for, and each call gets those of the module whose weight it passes (with
  ``model=``), or raises ``DeployError`` (from the plan alone, which cannot tell the layers apart). ``nn.MultiheadAttention`` (projections used functionally) is not supported in deploy
  mode: use ``kc.load_pretrained`` and ``"kha"``.
- The rules work on a copy of the graph: Dynamo keeps using the placeholders of the graph it
  passed after the backend returns.

The package: ``compiler`` (:class:`KHABackend`, the ``"kha"`` function), ``stats``, ``graph``
(graph context, parameter names and FX predicates), ``projection`` (projection ops, view replay and
the fold node), ``runtime`` (what the compiled graphs read at run time), ``deploy`` (checkpoint and
where its transforms go), ``rules/`` (one file per rule, :data:`rules.RULES`), ``registration`` (Dynamo).

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
