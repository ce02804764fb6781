"""KHA checkpoints of sharded models (FSDP2, DTensor tensor parallel): gather, and write on rank 0.

``kc.save_pretrained`` gathers the KHA tensors of a sharded model with :func:`gather_for_save` (a
collective: every rank calls it) and only global rank 0 writes; :func:`telling_other_ranks` and
:func:`rank0_wrote` share rank 0's outcome, so every rank returns or raises together.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from ..core.errors import CheckpointError
from ..core.optional import is_dtensor

__all__ = ["gather_for_save", "rank0_wrote", "telling_other_ranks"]

log = logging.getLogger(__name__)


def gather_for_save(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool, bool]:
    """Full CPU copies of ``state`` (DTensors gathered), whether this rank writes, and whether it was sharded.

    A collective when any value is a DTensor: every rank must call it, in the same order, and only
    global rank 0 writes. An unsharded state (single process, DDP) is written by whoever calls.
    """
    sharded = any(is_dtensor(v) for v in state.values())
    gathered = {}
    for k, v in state.items():
        if is_dtensor(v):
            v = v.full_tensor()  # type: ignore[attr-defined]
        gathered[k] = v.detach().to("cpu").contiguous()
    write = not sharded or torch.distributed.get_rank() == 0
    return gathered, write, sharded


def rank0_wrote(error: BaseException | None = None) -> None:
    """Share rank 0's outcome of a sharded save with every rank (a collective); raise where it failed."""
    box: list[str | None] = [None if error is None else f"{type(error).__name__}: {error}"]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None and torch.distributed.get_rank() != 0:
        raise CheckpointError(f"rank 0 could not write the KHA checkpoint ({box[0]}); nothing was saved.")


@contextlib.contextmanager
def telling_other_ranks(sharded: bool) -> Iterator[None]:
    """Rank 0's write of a sharded save: the other ranks wait in :func:`rank0_wrote` and learn the outcome."""
    if not sharded:
        yield
        return
    try:
        yield
    except BaseException as exc:
        rank0_wrote(exc)
        raise
    rank0_wrote()
