"""kha_compile: knocking-heads attention (arXiv 2510.23052) as a compiler pass for PyTorch models.

Example::

    import kha_compile as kc
    kc.apply(model, kc.KHAConfig(v="mlp"))
    print(kc.inspect(model))
"""

from __future__ import annotations

import logging

# ops registers torch.ops.kha.*; backend registers the torch.compile backend "kha" (lazily), kc.backend(...)
from . import backend, ops  # noqa: F401
from .api import apply, inspect, remove
from .checkpoint import load_pretrained, save_pretrained
from .config import KHAConfig
from .errors import KHAError
from .exporters import export_onnx, export_tensorrt
from .parallel import parallelize
from .passes.fold import fold
from .passes.handlers.adapter import mark_trainable
from .passes.rules.external import register_attention_op
from .report import AttentionSite, Report

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "AttentionSite",
    "KHAConfig",
    "KHAError",
    "Report",
    "__version__",
    "apply",
    "backend",
    "export_onnx",
    "export_tensorrt",
    "fold",
    "inspect",
    "load_pretrained",
    "mark_trainable",
    "parallelize",
    "register_attention_op",
    "remove",
    "save_pretrained",
]
