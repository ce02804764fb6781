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
from .analysis.rules.external import register_attention_op
from .core import errors  # kc.errors.FoldError and the other KHAError subclasses
from .core.errors import KHAError
from .core.report import AttentionSite, Report
from .core.version import __version__
from .exporters import export_aoti, export_onnx, export_tensorrt
from .handlers.adapter import mark_trainable
from .integrations import hf_init, hf_quantizer
from .model.config import KHAConfig
from .parallel import parallelize
from .passes.apply import apply, inspect, remove
from .passes.checkpoint import load_pretrained, save_pretrained
from .passes.fold import fold

logging.getLogger(__name__).addHandler(logging.NullHandler())

# transformers' from_pretrained of a KHA directory loads its KHA: registered now, or once transformers'
# quantizer registry is imported (nothing is imported here)
hf_quantizer.install()
# transformers' init_weights / _init_weights (and from_pretrained's init of missing weights) set KHA to identity
hf_init.install()

__all__ = [
    "AttentionSite",
    "KHAConfig",
    "KHAError",
    "Report",
    "__version__",
    "apply",
    "backend",
    "errors",
    "export_aoti",
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
