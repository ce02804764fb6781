"""KHA checkpoints as verbs: :func:`save_pretrained` and :func:`load_pretrained` (the format is :mod:`kha_compile.store`)."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointError, NoKHATransformsError
from ..model.config import config_of
from ..model.wrappers import sees_through_wrappers
from ..store.distributed import gather_for_save, rank0_wrote, telling_other_ranks
from ..store.format import checkpoint_misfit, kha_plan, kha_state, read_checkpoint, write_checkpoint
from ..store.hf import CONFIG_KEY, record_in_dir
from ..store.names import align_names, canonical_name
from .apply import apply, remove

__all__ = ["load_pretrained", "save_pretrained"]

log = logging.getLogger(__name__)


@sees_through_wrappers
def save_pretrained(model: nn.Module, directory) -> pathlib.Path:
    """Save only the KHA weights (safetensors) and config (JSON with a version) to ``directory``.

    The config also records where the transforms sit (the insertion plan), so deploy mode
    (``kc.backend(from_pretrained=directory)``) needs no analysis of the model. Saved into a
    transformers model's directory (its ``config.json``), it records the KHA there too, as
    ``model.save_pretrained`` would: loaders of that directory (vLLM with kha_compile's plugin)
    then know that it holds KHA.

    Example::

        kc.save_pretrained(model, "kha_ckpt")      # kha_model.safetensors + kha_config.json

    On a sharded model (FSDP2, tensor parallel) every rank calls it: the KHA tensors are gathered,
    global rank 0 writes a complete checkpoint, the other ranks write nothing, and all return together.
    """
    state = kha_state(model)
    if not state:
        raise NoKHATransformsError(
            f"{type(model).__name__} carries no KHA transforms to save; call kc.apply(model) first."
        )
    tensors, write, sharded = gather_for_save(state)  # FSDP2/TP: a collective; only rank 0 writes
    directory = pathlib.Path(directory)
    if not write:
        rank0_wrote()  # raises CheckpointError if rank 0 could not write
        return directory
    with telling_other_ranks(sharded):  # sharded: rank 0 tells every rank whether the write succeeded
        write_checkpoint(directory, tensors, dict(config_of(model), plan=kha_plan(model)))
        entry = getattr(getattr(model, "config", None), CONFIG_KEY, None)  # a transformers model's KHA entry
        if isinstance(entry, dict):  # saved into the model's own directory: its config.json records KHA too
            record_in_dir(directory, entry)
    log.info("saved %d KHA tensors to %s", len(tensors), directory)
    return directory


def load_pretrained(
    model: nn.Module, directory, example_args: Any = (), example_kwargs: dict | None = None
) -> nn.Module:
    """Re-apply KHA to a fresh ``model`` as saved in ``directory`` and load its weights.

    ``directory`` is one written by :func:`save_pretrained`, or the model's own checkpoint when its
    config records KHA (``model.save_pretrained``, a Trainer checkpoint, a sentence-transformers
    ``st.save``). Names that differ only by the prefix of a wrapper (a ``SentenceTransformer``
    around its transformers model) are mapped. Validates names and shapes; on any mismatch the
    model is left exactly as it was.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)
        kc.load_pretrained(model, "kha_ckpt")
        st = kc.load_pretrained(SentenceTransformer("st_out"), "st_out")      # after st.save("st_out")
    """
    cfg, tensors = read_checkpoint(directory)
    apply(model, cfg, example_args, example_kwargs)
    try:
        state = kha_state(model)
        names = align_names(state, tensors)  # a SentenceTransformer and its transformer's own checkpoint
        if names is not None and any(k != v for k, v in names.items()):
            log.info("KHA checkpoint names mapped onto %s, e.g. %s", type(model).__name__, next(iter(names.items())))
            tensors = {names[k]: v for k, v in tensors.items()}
        misfit = checkpoint_misfit(
            {k: tuple(v.shape) for k, v in state.items()}, {k: tuple(v.shape) for k, v in tensors.items()}
        )
        if misfit:
            raise CheckpointError(
                f"the KHA checkpoint in {str(directory)!r} does not fit {type(model).__name__}: "
                f"{misfit}. The model was left unchanged."
            )
        with torch.no_grad():
            params = {canonical_name(n): p for n, p in model.named_parameters()}
            for k, v in tensors.items():
                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
    except BaseException:
        remove(model)
        raise
    log.info("loaded %d KHA tensors from %s", len(tensors), directory)
    return model
