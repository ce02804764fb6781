"""Sharded models (FSDP2, DTensor tensor parallel): detect them, refuse what needs an unsharded one, gather to save.

``kc.apply`` / ``kc.inspect`` trace the model and rewrite its modules, which only works before
``fully_shard`` / ``parallelize_module``; :func:`refuse_sharded` says so before anything is touched.
``kc.save_pretrained`` gathers the KHA tensors of a sharded model with :func:`gather_for_save`
(a collective: every rank calls it) and only global rank 0 writes.

Example::

    from kha_compile.parallel.fsdp import sharded_parts
    sharded_parts(model)            # [] for a plain model, e.g. ['FSDP module model.layers.0'] after fully_shard
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import CheckpointError, ShardedModelError

__all__ = ["gather_for_save", "is_dtensor", "is_sharded", "refuse_sharded", "sharded_parts"]

log = logging.getLogger(__name__)


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (no DTensor exists before that module is imported)."""
    if "torch.distributed.tensor" not in sys.modules:  # keeps `import kha_compile` and kc.apply free of it
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sharded_parts(model: nn.Module, limit: int = 3) -> list[str]:
    """Up to ``limit`` descriptions of what makes ``model`` sharded: FSDP2 modules and DTensor parameters."""
    found: list[str] = []
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no FSDP2 module exists before it is imported
    for name, m in model.named_modules():
        if fsdp is not None and isinstance(m, fsdp.FSDPModule):
            found.append(f"FSDP module {name or '<root>'}")
            if len(found) >= limit:
                return found
    for name, p in model.named_parameters():
        if is_dtensor(p):
            found.append(f"DTensor parameter {name} {tuple(p.placements)}")  # type: ignore[attr-defined]
            if len(found) >= limit:
                break
    return found


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2 modules or DTensor parameters."""
    return bool(sharded_parts(model, limit=1))


def refuse_sharded(model: nn.Module, verb: str) -> None:
    """Raise :class:`ShardedModelError` if ``model`` is sharded; ``verb`` names the refused call."""
    parts = sharded_parts(model)
    if not parts:
        return
    if verb == "fold":
        todo = (
            "Gather first: call kc.save_pretrained(model, d) on every rank (rank 0 writes the KHA weights), "
            "then in one process load the trained base weights into a plain model, kc.load_pretrained(plain, d) "
            "and kc.fold(plain); or gather the full state dict with torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)) into an unsharded "
            "model that carries KHA (kc.apply), and fold that one. Nothing was changed."
        )
    else:
        todo = (
            f"kc.{verb} must run on the unsharded model: call kc.apply(model, ...) first, then "
            "kc.parallelize(model, mesh, plan) for tensor parallel and/or fully_shard(...) for FSDP2. "
            "The model was not touched and still trains as it is."
        )
    raise ShardedModelError(f"{type(model).__name__} is already sharded ({', '.join(parts)}). {todo}")


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
