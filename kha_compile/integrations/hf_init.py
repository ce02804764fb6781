"""transformers' weight initialisation sets KHA transforms to identity (and leaves loaded ones alone).

transformers initialises a model module by module: ``init_weights()``, ``initialize_weights()`` and
``from_pretrained`` (for every weight its checkpoint lacks) call ``model._initialize_weights(module)``
on each module, which calls ``model._init_weights(module)``; a model class overrides only
``_init_weights``. A KHA transform is no module those know, so after ``to_empty`` or a load that
lacks its tensors it would keep uninitialised memory. :func:`install` (run by ``import
kha_compile``) wraps both methods of ``PreTrainedModel`` once: on a KHA transform they set it to
identity (its ``reset_parameters``), on any other module they run transformers' own code.

transformers' flags are honoured as its own initialisers honour them: a module marked
``_is_hf_initialized`` is skipped, and so is a tensor so marked (loaded from the checkpoint); the
module is marked once done, as transformers marks its modules. ``_init_weights`` of a model class
that does not call ``super()._init_weights`` reaches a KHA transform only through
``_initialize_weights`` (every route transformers itself takes).

Example::

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    kc.apply(model, kc.KHAConfig())
    model.to_empty(device="cpu")
    model.init_weights()        # KHA at identity: the outputs are those of the model without KHA
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..core.optional import when_imported
from ..model.transforms import transform_kinds

__all__ = ["MODULE", "init_transform", "install", "is_transform"]

log = logging.getLogger(__name__)

MODULE = "transformers.modeling_utils"  # where PreTrainedModel lives
_FLAG = "_is_hf_initialized"  # transformers' mark on a module or tensor that is initialised (or loaded)
_WRAPPED = "_kha_identity_init"  # our mark on a wrapped method (a second install changes nothing)


def install() -> None:
    """Wrap ``PreTrainedModel``'s per-module initialisation, now or once transformers' modeling_utils is imported.

    Example::

        install()       # import kha_compile runs it; a second call changes nothing
    """
    when_imported(MODULE, _wrap)


def _wrap(modeling_utils: ModuleType) -> None:
    cls = modeling_utils.PreTrainedModel
    for name, mark_module in (("_initialize_weights", True), ("_init_weights", False)):
        original = cls.__dict__.get(name)
        if original is None or getattr(original, _WRAPPED, False):
            continue
        setattr(cls, name, _identity_first(original, mark_module))
    log.debug("transformers' weight initialisation sets KHA transforms to identity")


def _identity_first(original: Callable[..., Any], mark_module: bool) -> Callable[..., Any]:
    """``original(self, module, ...)``, except on a KHA transform: identity (see :func:`init_transform`)."""

    @functools.wraps(original)
    def method(self: Any, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not is_transform(module):
            return original(self, module, *args, **kwargs)
        init_transform(module)
        if mark_module:
            setattr(module, _FLAG, True)
        return None

    setattr(method, _WRAPPED, True)
    return method


def is_transform(module: nn.Module) -> bool:
    """True for a module of a registered KHA transform kind.

    Example::

        is_transform(model.model.layers[0].self_attn.v_proj.kha.v)   # True
    """
    return isinstance(module, tuple(kind.module_cls for kind in transform_kinds().values()))


def init_transform(module: nn.Module) -> None:
    """Set the KHA transform ``module`` to identity, except what transformers marks as initialised or loaded.

    A module marked ``_is_hf_initialized`` is left as it is, and so is each of its tensors so marked
    (the rest are set to their identity values). On the meta device nothing changes (it holds no
    values; leaving it sets identity, see :class:`~kha_compile.model.transforms.base.IdentityInitModule`).

    Example::

        init_transform(model.model.layers[0].self_attn.q_proj.kha.q)     # its T is I again
    """
    if getattr(module, _FLAG, False):
        return
    params = dict(module.named_parameters(recurse=False))
    kept = {name: p.detach().clone() for name, p in params.items() if getattr(p, _FLAG, False)}
    if len(kept) == len(params):
        return
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        return
    reset()
    with torch.no_grad():
        for name, value in kept.items():
            params[name].copy_(value)
