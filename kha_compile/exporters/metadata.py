"""What an exported file records about KHA, whatever its format (ONNX ``metadata_props``, .pt2 metadata).

==========================  ==========================================================================
key                         value
==========================  ==========================================================================
``kha_compile.version``     the library version that wrote the file
``kha_compile.kha``         ``"none"`` (the model carries no KHA) or ``"applied"``
``kha_compile.config``      JSON: the KHAConfig that reproduces the model's transforms, or ``null``
``kha_compile.sites``       JSON list, one object per matched site: ``name``, ``kind``, ``num_heads``,
                            ``num_kv_heads``, ``head_dim``, ``v_head_dim``, ``transforms``
``kha_compile.folded``      JSON bool: linear transforms were folded into this file's weights
``kha_compile.cache``       JSON, in files that generate only: the KV cache (``kind`` "dynamic": ONNX
                            with past; "static": AOTInductor package with a static cache), its
                            ``num_layers``, ``num_kv_heads``, ``head_size``, ``dtype`` (and
                            ``max_cache_len``, ``max_batch`` for a static one)
==========================  ==========================================================================

The sites come from the report ``kc.apply`` recorded for the model; only a model that did not get
its KHA in this process (a pickled one) is traced again, with the export's example inputs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from torch import nn

from ..core.errors import KHAError
from ..core.version import __version__
from ..model.carrier import kha_modules
from ..model.config import config_of
from ..model.transforms import get_transform
from ..passes.apply import inspect, recorded_report

__all__ = ["JSON_KEYS", "METADATA_KEYS", "METADATA_PREFIX", "kha_metadata", "parse_metadata"]

log = logging.getLogger(__name__)

METADATA_PREFIX = "kha_compile."
METADATA_KEYS = tuple(METADATA_PREFIX + k for k in ("version", "kha", "config", "sites", "folded"))
JSON_KEYS = ("config", "sites", "folded", "cache")
_SITE_FIELDS = ("name", "kind", "num_heads", "num_kv_heads", "head_dim", "v_head_dim", "transforms")


def kha_metadata(model: nn.Module, args: tuple, kwargs: dict, folded: bool) -> dict[str, str]:
    """The metadata entries for ``model`` (the caller's, before any fold), as strings.

    Example::

        kha_metadata(model, (), {"input_ids": ids}, folded=True)["kha_compile.config"]
    """
    has_kha = bool(kha_modules(model))
    config: dict[str, Any] | None = config_of(model) if has_kha else None
    sites: list[dict[str, Any]] | None = []
    if has_kha:
        report = recorded_report(model)
        try:
            if report is None:  # KHA from another process (a pickle): trace the sites once
                report = inspect(model, args, kwargs)
            sites = [{f: getattr(s, f) for f in _SITE_FIELDS} for s in report.matched]
        except KHAError as e:  # the export itself traced: record that the sites are unknown
            log.warning("the export's metadata has no KHA sites: kc.inspect failed on %s: %s", type(model).__name__, e)
            sites = None
    foldable = bool(config) and any(
        config is not None and config[r] is not None and get_transform(config[r]).foldable for r in "qkv"
    )
    values: dict[str, Any] = {
        "version": __version__,
        "kha": "applied" if has_kha else "none",
        "config": config,
        "sites": sites,
        "folded": bool(folded and foldable),
    }
    return {
        METADATA_PREFIX + k: (json.dumps(v, sort_keys=True) if k in JSON_KEYS else str(v)) for k, v in values.items()
    }


def parse_metadata(entries: dict[str, str]) -> dict[str, Any]:
    """The ``kha_compile.`` entries of ``entries``, parsed (keys without the prefix); JSON errors raise ValueError."""
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if key.startswith(METADATA_PREFIX):
            short = key[len(METADATA_PREFIX) :]
            out[short] = json.loads(value) if short in JSON_KEYS else value
    return out
