"""KHA transform kinds as a registry: one file per kind (``linear.py``, ``mlp.py``).

See :mod:`.base` for the spec. ``get_transform(name)`` / ``transform_kinds()`` load every file of
this package on first use, so a new kind is one new file that calls ``register_transform``.
"""

from .base import TransformKind, TransformName, get_transform, kind_of, register_transform, transform_kinds

__all__ = ["TransformKind", "TransformName", "get_transform", "kind_of", "register_transform", "transform_kinds"]
