"""What an exported ONNX file records about KHA: ``metadata_props`` under ``kha_compile.`` keys.

==========================  ==========================================================================
key                         value
==========================  ==========================================================================
``kha_compile.version``     the library version that wrote the file
``kha_compile.kha``         ``"none"`` (the model carries no KHA) or ``"applied"``
``kha_compile.config``      JSON: the KHAConfig that reproduces the model's transforms, or ``null``
``kha_compile.sites``       JSON list, one object per matched site: ``name``, ``kind``, ``num_heads``,
                            ``num_kv_heads``, ``head_dim``, ``v_head_dim``, ``transforms``
``kha_compile.folded``      JSON bool: linear transforms were folded into this file's weights
==========================  ==========================================================================
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from torch import nn

from ..errors import ExportError, KHAError

__all__ = ["METADATA_KEYS", "METADATA_PREFIX", "kha_metadata", "read_kha_metadata"]

log = logging.getLogger(__name__)

METADATA_PREFIX = "kha_compile."
METADATA_KEYS = tuple(METADATA_PREFIX + k for k in ("version", "kha", "config", "sites", "folded"))
_SITE_FIELDS = (
    "name",
    "kind",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "v_head_dim",
    "transforms",
)
_JSON_KEYS = ("config", "sites", "folded")


def kha_metadata(model: nn.Module, args: tuple, kwargs: dict, folded: bool) -> dict[str, str]:
    """The ``metadata_props`` entries for ``model`` (the caller's, before any fold).

    The sites come from :func:`kha_compile.inspect` on the export's example inputs; a model
    without KHA is not traced again.
    """
    from .. import __version__
    from ..checkpoint import config_of
    from ..passes.insert import kha_modules

    has_kha = bool(kha_modules(model))
    config: dict[str, Any] | None = config_of(model) if has_kha else None
    sites: list[dict[str, Any]] | None = []
    if has_kha:
        from ..api import inspect as inspect_model

        try:
            report = inspect_model(model, args, kwargs)
            sites = [{f: getattr(s, f) for f in _SITE_FIELDS} for s in report.matched]
        except KHAError as e:  # the export itself traced: record that the sites are unknown
            log.warning(
                "the ONNX metadata has no KHA sites: kc.inspect failed on %s: %s",
                type(model).__name__,
                e,
            )
            sites = None
    values: dict[str, Any] = {
        "version": __version__,
        "kha": "applied" if has_kha else "none",
        "config": config,
        "sites": sites,
        "folded": bool(folded and config and "linear" in (config["q"], config["k"], config["v"])),
    }
    return {
        METADATA_PREFIX + k: (json.dumps(v, sort_keys=True) if k in _JSON_KEYS else str(v)) for k, v in values.items()
    }


def read_kha_metadata(path_or_model: Any) -> dict[str, Any]:
    """The KHA metadata of an ONNX file written by :func:`kha_compile.export_onnx`, parsed.

    Takes a path or a loaded ``onnx.ModelProto``. Returns ``{"version": str, "kha": "none" |
    "applied", "config": dict | None, "sites": list[dict] | None, "folded": bool}`` (keys without
    the ``kha_compile.`` prefix); ``{}`` for a file that carries no ``kha_compile.`` metadata.
    Raises :class:`~kha_compile.errors.ExportError` when an entry is not valid JSON.

    Example::

        meta = read_kha_metadata("model.onnx")
        meta["config"], [s["name"] for s in meta["sites"]]     # {'v': 'mlp', ...}, ['model.layers.0...']
    """
    from .onnx import import_onnx

    onnx = import_onnx()
    if isinstance(path_or_model, (str, os.PathLike)):
        model = onnx.load(str(path_or_model), load_external_data=False)
    else:
        model = path_or_model
    out: dict[str, Any] = {}
    for prop in model.metadata_props:
        if not prop.key.startswith(METADATA_PREFIX):
            continue
        key = prop.key[len(METADATA_PREFIX) :]
        if key in _JSON_KEYS:
            try:
                out[key] = json.loads(prop.value)
            except json.JSONDecodeError as e:
                raise ExportError(
                    f"ONNX metadata {prop.key!r} is not valid JSON ({e}); the file "
                    f"was not written by kha_compile.export_onnx or was edited."
                ) from e
        else:
            out[key] = prop.value
    return out
