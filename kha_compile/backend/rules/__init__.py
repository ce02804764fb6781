"""The backend's graph rewrites, one file each, and the one list that orders them.

- :class:`DeployKHA` (deploy mode only): inserts the transforms of a ``save_pretrained``
  checkpoint after the projection ops of a model that never saw :func:`kha_compile.apply`.
- :class:`FuseMLPValue`: the hand-written KHA-MLP formula becomes one ``torch.ops.kha.mlp_value``.
- :class:`FoldLinearKHA`: with gradients off, every transform of a foldable kind is folded into the projection.

A new rule is one new file here and one entry in :data:`RULES` (and its name in
:data:`kha_compile.backend.stats.RuleName`).
"""

from __future__ import annotations

from .base import Declined, Rule, RuleSetup
from .deploy import DeployKHA, TransformCall
from .fold_linear import FoldLinearKHA
from .fuse_mlp_value import FuseMLPValue

__all__ = ["RULES", "Declined", "DeployKHA", "FoldLinearKHA", "FuseMLPValue", "Rule", "RuleSetup", "TransformCall"]

# the rules in the order they run on every graph
RULES: tuple[type[Rule], ...] = (DeployKHA, FuseMLPValue, FoldLinearKHA)
