"""What an exported ONNX file records about KHA: ``metadata_props`` under ``kha_compile.`` keys.

The entries are those of :mod:`kha_compile.exporters.metadata` (version, kha, config, sites,
folded); :func:`read_kha_metadata` reads them back from a file.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..core.errors import ExportError
from ..ops.mlp_value_onnx import import_onnx
from .metadata import JSON_KEYS, METADATA_KEYS, METADATA_PREFIX, kha_metadata

__all__ = ["METADATA_KEYS", "METADATA_PREFIX", "kha_metadata", "read_kha_metadata"]

log = logging.getLogger(__name__)


def read_kha_metadata(path_or_model: Any) -> dict[str, Any]:
    """The KHA metadata of an ONNX file written by :func:`kha_compile.export_onnx`, parsed.

    Takes a path or a loaded ``onnx.ModelProto``. Returns ``{"version": str, "kha": "none" |
    "applied", "config": dict | None, "sites": list[dict] | None, "folded": bool}`` (keys without
    the ``kha_compile.`` prefix); ``{}`` for a file that carries no ``kha_compile.`` metadata.
    Raises :class:`~kha_compile.core.errors.ExportError` when an entry is not valid JSON.

    Example::

        meta = read_kha_metadata("model.onnx")
        meta["config"], [s["name"] for s in meta["sites"]]     # {'v': 'mlp', ...}, ['model.layers.0...']
    """

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
        if key in JSON_KEYS:
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
