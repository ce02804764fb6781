"""Extensions defined outside the library, for the tests that register them: a toy transform kind.

``DiagScaleKind`` is a per-feature scale shared by every head of its role (``x * s``, identity at
``s = 1``): linear in ``x``, so foldable, with a fold matrix the library derives itself (diag(s)).

Example::

    with registered_kind(DiagScaleKind()):
        kc.apply(model, kc.KHAConfig(k="diag_scale", v="diag_scale"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kha_compile.model.transforms import TransformKind, base, register_transform


class DiagScale(nn.Module):
    """A per-feature scale shared by every head: ``x * s``, identity at s = 1."""

    kind = "diag_scale"

    def __init__(self, head_dim, *, dtype=None, device=None):
        super().__init__()
        self.s = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device))

    def forward(self, x):  # (..., Dh)
        return x * self.s


class DiagScaleKind(TransformKind):
    name = "diag_scale"
    roles = ("q", "k", "v")
    module_cls = DiagScale
    param_names = ("s",)
    foldable = True

    def functional(self, x, *params):
        return x * params[0]


@contextlib.contextmanager
def registered_kind(kind: TransformKind) -> Iterator[TransformKind]:
    """Register ``kind`` for the duration of the block; the kind registry is restored afterwards."""
    saved = base.KINDS.items()
    register_transform(kind)
    try:
        yield kind
    finally:
        base.KINDS.restore(saved)
