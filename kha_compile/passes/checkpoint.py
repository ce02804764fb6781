"""KHA checkpoints as verbs: :func:`save_pretrained` and :func:`load_pretrained` (the format is :mod:`kha_compile.store`).

Both check what a checkpoint records about the model it was saved from (its architecture and KHA
sites, :mod:`kha_compile.store.identity`): :func:`check_identity`, which transformers' loading by path
(:mod:`kha_compile.integrations.hf_quantizer`) runs too.
"""

from __future__ import annotations

import logging
import pathlib
import warnings
from typing import Any

import torch
from torch import nn

from ..core.errors import CheckpointError, NoKHATransformsError
from ..core.kinds import ROLES
from ..model.carrier import kha_modules
from ..model.config import KHAConfig, config_of
from ..model.wrappers import sees_through_wrappers
from ..store.distributed import gather_for_save, rank0_wrote, telling_other_ranks
from ..store.format import checkpoint_misfit, kha_plan, kha_state, read_checkpoint, read_identity, write_checkpoint
from ..store.hf import CONFIG_KEY, record_in_dir
from ..store.identity import identity_mismatch, identity_of
from ..store.names import align_names, canonical_name
from .apply import apply, remove

__all__ = ["check_identity", "load_pretrained", "save_pretrained"]

_STRICT_FALSE = "pass strict=False to kc.load_pretrained to load it anyway"

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
        write_checkpoint(directory, tensors, dict(config_of(model), plan=kha_plan(model), **identity_of(model)))
        entry = getattr(getattr(model, "config", None), CONFIG_KEY, None)  # a transformers model's KHA entry
        if isinstance(entry, dict):  # saved into the model's own directory: its config.json records KHA too
            record_in_dir(directory, entry)
    log.info("saved %d KHA tensors to %s", len(tensors), directory)
    return directory


def check_identity(
    model: nn.Module, directory: object, recorded: dict[str, Any], strict: bool = True, advice: str = _STRICT_FALSE
) -> None:
    """Refuse a checkpoint saved from another architecture, or with other KHA sites, than ``model`` (which
    carries the checkpoint's KHA config); with ``strict=False``, warn and go on.

    ``recorded``: what the checkpoint records (:func:`kha_compile.store.format.read_identity`); a checkpoint
    that records nothing (saved before these entries existed) is not checked. ``advice`` ends the refusal.

    Example::

        check_identity(llama, "qwen3_dir", read_identity("qwen3_dir"))   # CheckpointError naming both
    """
    why = identity_mismatch(recorded, identity_of(model))
    if not why:
        return
    message = (
        f"the KHA checkpoint in {str(directory)!r} was trained for another model than this "
        f"{type(model).__name__}: {why}. Its transforms are tied to the attention they were trained in, so "
        "they would load without an error and compute something else"
    )
    if strict:
        raise CheckpointError(f"{message}. Load it into the model it was saved from, or {advice}.")
    warnings.warn(message + " (loaded anyway: strict=False).", stacklevel=3)
    log.warning("%s (loaded anyway: strict=False)", message)


def _apply_unless_carried(model: nn.Module, cfg: KHAConfig, directory: object, args: Any, kwargs: Any) -> bool:
    """Apply ``cfg`` to ``model`` (True), or leave it when it already carries that KHA (False): a model
    that ``from_pretrained`` of a KHA directory built has its transforms, and is not traced again."""
    if not kha_modules(model):
        apply(model, cfg, args, kwargs)
        return True
    have = config_of(model)
    if any(have[r] != getattr(cfg, r) for r in ROLES):
        carried = {r: have[r] for r in ROLES if have[r]}
        raise CheckpointError(
            f"{type(model).__name__} already carries KHA {carried}, but the checkpoint in {str(directory)!r} "
            f"records {cfg.roles()}; kc.remove(model) first, or load it into a model without KHA."
        )
    log.info("%s already carries the checkpoint's KHA %s: loading its tensors", type(model).__name__, cfg.roles())
    return False


def load_pretrained(
    model: nn.Module,
    directory,
    example_args: Any = (),
    example_kwargs: dict | None = None,
    strict: bool = True,
) -> nn.Module:
    """Re-apply KHA to a fresh ``model`` as saved in ``directory`` and load its weights.

    ``directory`` is one written by :func:`save_pretrained`, or the model's own checkpoint when its
    config records KHA (``model.save_pretrained``, a Trainer checkpoint, a sentence-transformers
    ``st.save``). Names that differ only by the prefix of a wrapper (a ``SentenceTransformer``
    around its transformers model) are mapped. A model that already carries the same KHA (one that
    ``from_pretrained`` of a KHA directory built) only gets the tensors, without a second trace.
    Validates names and shapes, and the architecture and KHA sites the checkpoint records: a
    checkpoint of another architecture (a Qwen3's KHA into a Llama of the same sizes) is refused,
    naming both, unless ``strict=False`` (then it warns and loads). On any refusal the model is left
    exactly as it was.

    Example::

        model = AutoModelForCausalLM.from_pretrained(path)
        kc.load_pretrained(model, "kha_ckpt")
        st = kc.load_pretrained(SentenceTransformer("st_out"), "st_out")      # after st.save("st_out")
    """
    cfg, tensors = read_checkpoint(directory)
    recorded = read_identity(directory)
    applied = _apply_unless_carried(model, cfg, directory, example_args, example_kwargs)
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
        check_identity(model, directory, recorded, strict)
        with torch.no_grad():
            params = {canonical_name(n): p for n, p in model.named_parameters()}
            for k, v in tensors.items():
                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))
    except BaseException:
        if applied:
            remove(model)
        raise
    log.info("loaded %d KHA tensors from %s", len(tensors), directory)
    return model
