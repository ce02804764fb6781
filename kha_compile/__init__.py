"""kha_compile: knocking-heads attention (arXiv 2510.23052) as a compiler pass for PyTorch models."""
from __future__ import annotations

import logging

from .config import KHAConfig
from .errors import KHAError
from . import ops  # registers torch.ops.kha.*

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["KHAConfig", "KHAError", "__version__"]
