"""What the backend uses from the rest of the package, imported in this one place.

The transform classes and the projection mixin live in :mod:`kha_compile.modules` today; when
they move (``kha_compile.transforms``, ``passes.handlers``) only these imports change.
"""

from __future__ import annotations

from ..modules import (
    HeadSlot,
    KHALinearTransform,
    KHAMLPValue,
    KHAMultiheadAttention,
    KHAProjection,
    KHATransforms,
    make_transform,
)
from ..passes.fold import fold_rows
from ..transforms import transform_kinds

__all__ = [
    "KHA_CLASSES",
    "TRANSFORM_PARAMS",
    "HeadSlot",
    "KHALinearTransform",
    "KHAMLPValue",
    "KHAMultiheadAttention",
    "KHAProjection",
    "KHATransforms",
    "fold_rows",
    "make_transform",
]

# the tensors of each transform kind, in the order the transform takes them (checkpoint keys ``kha.<role>.<name>``)
TRANSFORM_PARAMS: dict[str, tuple[str, ...]] = {n: k.param_names for n, k in transform_kinds().items()}

# classes whose presence in a node's module stack means the graph carries KHA
KHA_CLASSES: tuple[type, ...] = (KHAProjection, KHALinearTransform, KHAMLPValue, KHAMultiheadAttention)
