"""Head slots: where one role's heads sit in a projection's output features, and how to cut them out.

Feature of head ``h``, dim ``j`` = ``offset + h * head_stride + j``. Separate projections
(``head_stride == head_dim``), fused [Q|K|V] blocks and interleaved [H, 3, Dh] layouts are all of
this form. Any other layout in which every head's features are a fixed set of output features (a
fused wqkv interleaved per kv group, InternLM2 / torchtitan style) is an *index map*: ``rows`` lists
the feature of every (head, dim). :func:`layout_plan` picks how a set of slots is cut out of one
output ("blocks", "interleaved" or "indexed"); :func:`apply_segments` applies the transforms to
those pieces.

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

__all__ = ["HeadSlot", "Piece", "apply_segments", "layout_plan", "segment_pieces", "transform_slices", "union_slots"]

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
    rows: tuple[int, ...] | None = None  # an index map: feature of (h, j) at h * head_dim + j (head_stride 0)

    @classmethod
    def indexed(cls, role: Role, index: Tensor) -> HeadSlot:
        """A slot from an explicit (H, Dh) feature index (any layout, one fixed feature per head and dim).

        Example::

            HeadSlot.indexed("q", torch.tensor([[0, 1], [4, 5]]))     # heads at features 0-1 and 4-5
        """
        flat = tuple(int(f) for f in index.flatten().tolist())
        return cls(role, min(flat), int(index.shape[0]), int(index.shape[1]), 0, flat)

    @property
    def span(self) -> int:
        if self.rows is not None:
            return max(self.rows) - self.offset + 1
        return (self.num_heads - 1) * self.head_stride + self.head_dim

    def index(self) -> Tensor:  # (H, Dh) feature indices
        if self.rows is not None:
            return torch.tensor(self.rows, dtype=torch.long).view(self.num_heads, self.head_dim)
        h = torch.arange(self.num_heads).unsqueeze(1) * self.head_stride
        return self.offset + h + torch.arange(self.head_dim)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.rows is None:
            del d["rows"]
        else:
            d["rows"] = list(self.rows)
        return d


def union_slots(a: HeadSlot, b: HeadSlot) -> HeadSlot | None:
    """One slot holding the heads of both (one role of one projection read by several attention calls).

    Heads split over calls (diffusers' sliced attention, a differential attention's two halves) each
    see a part of a projection's heads; the shared transform belongs on all of them. None when the two
    cannot be one role's heads: another role or head size, or a head of one overlapping a head of the
    other in part.

    Example::

        union_slots(HeadSlot("q", 0, 2, 16, 16), HeadSlot("q", 32, 2, 16, 16))     # 4 heads at 0..63
    """
    if a.role != b.role or a.head_dim != b.head_dim:
        return None
    heads: dict[tuple[int, ...], None] = {}
    for slot in (a, b):
        for row in slot.index().tolist():
            heads[tuple(row)] = None
    rows = sorted(heads, key=lambda r: r[0])
    seen: set[int] = set()
    for row in rows:
        if seen & set(row):  # a head sharing some of its features with another head
            return None
        seen.update(row)
    index = torch.tensor(rows, dtype=torch.long)  # (H, Dh)
    H, Dh = index.shape
    offset = int(index[0, 0])
    stride = int(index[1, 0] - index[0, 0]) if H > 1 else Dh
    affine = offset + torch.arange(H).unsqueeze(1) * stride + torch.arange(Dh)
    if stride >= Dh and torch.equal(index, affine):
        return HeadSlot(a.role, offset, H, Dh, stride)
    return HeadSlot.indexed(a.role, index)


def layout_plan(slots: tuple[HeadSlot, ...], out_features: int) -> tuple[str, int]:
    """Choose how to cut the heads out of the projection output: 'blocks', 'interleaved' or 'indexed'."""
    if any(s.rows is not None for s in slots):
        if any(s.offset + s.span > out_features for s in slots):
            raise UnsupportedLayoutError(f"head slots {[s.to_dict() for s in slots]} exceed {out_features} features")
        return "indexed", 0
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
    if mode == "indexed":  # an index map: gather each role's head vectors, transform, put them back
        for s in slots:
            idx = s.index().to(y.device)
            heads = y.index_select(-1, idx.flatten()).unflatten(-1, tuple(idx.shape))  # (…, H, Dh)
            y = y.index_copy(y.dim() - 1, idx.flatten(), fns[s.role](heads).flatten(-2))
        return y
    if mode == "blocks":  # heads of a role are contiguous: (…, H*Dh) -> (…, H, Dh)
        bounds: list[Piece] = [(s.offset, s.num_heads * s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
        return apply_segments(y, width, segment_pieces(bounds, width))
    # interleaved: (…, H*S) -> (…, H, S); each role is a Dh-wide column block of S
    lead = y.shape[:-1]
    y3 = y.reshape(*lead, width // stride, stride)  # (…, H, S)
    bounds = [(s.offset, s.head_dim, (s.head_dim, fns[s.role])) for s in slots]
    return apply_segments(y3, stride, segment_pieces(bounds, stride)).reshape(*lead, width)
