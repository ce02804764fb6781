"""kha_compile: knocking-heads attention (arXiv 2510.23052) as a compiler pass for PyTorch models.

Example::

    import kha_compile as kc
    kc.apply(model, kc.KHAConfig(v="mlp"))
    print(kc.inspect(model))
"""
from __future__ import annotations

import logging

from .config import KHAConfig
from .errors import KHAError
from . import ops  # registers torch.ops.kha.*
from .api import apply, inspect, remove
from .checkpoint import load_pretrained, save_pretrained
from .passes.fold import fold
from .passes.rules.external import register_attention_op
from .passes.handlers.adapter import mark_trainable
from .parallel import parallelize
from .exporters import export_onnx, export_tensorrt
from .report import AttentionSite, Report
from . import backend  # registers the torch.compile backend "kha" (lazily); kc.backend(...) is callable

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["KHAConfig", "KHAError", "apply", "inspect", "fold", "remove", "parallelize", "save_pretrained", "load_pretrained", "mark_trainable",
           "export_onnx", "export_tensorrt", "register_attention_op", "AttentionSite", "Report", "backend", "__version__"]
