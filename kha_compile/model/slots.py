"""Head slots: where one role's heads sit in a projection's output features, and how to cut them out.

Feature of head ``h``, dim ``j`` = ``offset + h * head_stride + j``. Separate projections
(``head_stride == head_dim``), fused [Q|K|V] blocks and interleaved [H, 3, Dh] layouts are all of
this form. :func:`layout_plan` picks how a set of slots is cut out of one output ("blocks" or
"interleaved"); :func:`apply_segments` applies the transforms to those pieces.

Example::

    slot = HeadSlot("v", offset=128, num_heads=4, head_dim=16, head_stride=16)
    slot.index()          # (4, 16) feature numbers
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..core.errors import UnsupportedLayoutError
from ..core.kinds import Role

__all__ = ["HeadSlot", "Piece", "apply_segments", "layout_plan", "segment_pieces", "transform_slices"]

# (start, length, (head dim, transform) | None): one piece of a projection output's last axis
Piece = tuple[int, int, "tuple[int, Callable[[Tensor], Tensor]] | None"]


@dataclasses.dataclass(frozen=True)
class HeadSlot:
    """Where one role's heads sit in a projection's output features.

    Feature of head ``h``, dim ``j`` = ``offset + h * head_stride + j``.
    """

    role: Role
    offset: int
    num_heads: int
    head_dim: int
    head_stride: int

    @property
    def span(self) -> int:
        return (self.num_heads - 1) * self.head_stride + self.head_dim

    def index(self) -> Tensor:  # (H, Dh) feature indices
        h = torch.arange(self.num_heads).unsqueeze(1) * self.head_stride
        return self.offset + h + torch.arange(self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def layout_plan(slots: tuple[HeadSlot, ...], out_features: int) -> tuple[str, int]:
    """Choose how to cut the heads out of the projection output: 'blocks' or 'interleaved'."""
    if all(s.head_stride == s.head_dim for s in slots):
        spans = sorted((s.offset, s.offset + s.num_heads * s.head_dim) for s in slots)
        if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and spans[-1][1] <= out_features:
            return "blocks", 0
    strides = {s.head_stride for s in slots}
    heads = {s.num_heads for s in slots}
    if len(strides) == 1 and len(heads) == 1:
        stride = strides.pop()
        if stride * heads.pop() == out_features and all(s.offset + s.head_dim <= stride for s in slots):
            return "interleaved", stride
    raise UnsupportedLayoutError(
        f"head layout {[s.to_dict() for s in slots]} over {out_features} features is neither "
        "separate/fused blocks nor an interleaved [H, roles, Dh] layout; kha_compile cannot "
        "insert transforms into this projection."
    )


def apply_segments(y: Tensor, width: int, pieces: Sequence[Piece]) -> Tensor:
    """Rebuild the last axis of ``y`` (…, width) from pieces (start, length, (head_dim, transform) | None)."""
    out = []
    for start, length, tf in pieces:
        seg = y.narrow(-1, start, length)
        if tf is not None:
            head_dim, fn = tf
            lead = seg.shape[:-1]
            seg = fn(seg.reshape(*lead, length // head_dim, head_dim)).reshape(*lead, length)
        out.append(seg)
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def segment_pieces(bounds: Sequence[Piece], width: int) -> list[Piece]:
    """Fill the gaps between transformed segments with untouched ones, in order."""
    pieces: list[Piece] = []
    pos = 0
    for start, length, tf in sorted(bounds, key=lambda b: b[0]):
        if start > pos:
            pieces.append((pos, start - pos, None))
        pieces.append((start, length, tf))
        pos = start + length
    if pos < width:
        pieces.append((pos, width - pos, None))
    return pieces


def transform_slices(
    y: Tensor, slots: Sequence[HeadSlot], mode: str, stride: int, fns: dict[str, Callable[[Tensor], Tensor]]
) -> Tensor:
    """Apply ``fns[role]`` to the head vectors of each slot in ``y`` (…, out), cut as ``layout_plan`` said.

    Example::

        mode, stride = layout_plan(slots, y.shape[-1])
        y = transform_slices(y, slots, mode, stride, {"v": kha.v})
    """
    if not slots:
        return y
    width = y.shape[-1]
    if mode == "blocks":  # heads of a role are contiguous: (…, H*Dh) -> (…, H, Dh)
        bounds: list[Piece] = [(s.offset, s.num_heads * s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
        return apply_segments(y, width, segment_pieces(bounds, width))
    # interleaved: (…, H*S) -> (…, H, S); each role is a Dh-wide column block of S
    lead = y.shape[:-1]
    y3 = y.reshape(*lead, width // stride, stride)  # (…, H, S)
    bounds = [(s.offset, s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
    return apply_segments(y3, stride, segment_pieces(bounds, stride)).reshape(*lead, width)
