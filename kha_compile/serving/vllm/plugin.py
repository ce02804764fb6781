"""kha_compile's vLLM plugin: the entry point vLLM calls in each of its processes (needs vLLM).

pyproject.toml registers :func:`register` under vLLM's ``vllm.general_plugins`` entry point, so
installing kha_compile next to vLLM (``pip install 'kha-compile[vllm]'``) is all it takes:
``vllm.LLM(model=dir)`` and ``vllm serve dir`` then run a directory with KHA with its transforms
(:mod:`.quant`). On a vLLM older than :data:`MIN_VLLM` it registers a stand-in that refuses KHA
directories with that reason, and leaves every other model alone.

Example::

    from kha_compile.serving.vllm.plugin import register
    register()          # what vLLM does at start-up; safe to call again
"""

from __future__ import annotations

import logging
import re
from typing import Any

import vllm

from ...core.errors import ServingError

try:  # the quantization API this plugin is written against (vLLM >= MIN_VLLM)
    from .quant import NAME, KHAQuantConfig

    _IMPORT_ERROR: ImportError | None = None
except ImportError as exc:  # an older vLLM: register() explains instead
    KHAQuantConfig, NAME, _IMPORT_ERROR = None, "kha_compile", exc  # type: ignore[assignment,misc]

__all__ = ["MIN_VLLM", "register", "vllm_version"]

log = logging.getLogger(__name__)

MIN_VLLM = (0, 32)  # the oldest vLLM the plugin is tested with (tests/serving/vllm)


def vllm_version() -> tuple[int, int]:
    """(major, minor) of the installed vLLM (``0.32.0+cpu`` -> (0, 32)); (0, 0) when it does not parse."""
    m = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return (int(m[1]), int(m[2])) if m else (0, 0)


def register() -> None:
    """Register the quantization method ``kha_compile`` with vLLM (vLLM calls this in every process)."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    version = vllm_version()
    if version >= MIN_VLLM and KHAQuantConfig is not None:
        register_quantization_config(NAME)(KHAQuantConfig)
        return
    why = (
        f"vLLM {getattr(vllm, '__version__', '?')} is too old for kha_compile's vLLM plugin, which needs vLLM >= "
        f"{'.'.join(map(str, MIN_VLLM))}" + (f" ({_IMPORT_ERROR})" if _IMPORT_ERROR else "")
    )
    log.warning("%s; directories with KHA will be refused, every other model is served as usual", why)
    register_quantization_config(NAME)(_refusal(why))


def _refusal(why: str) -> type:
    """A quantization config that refuses KHA directories with ``why`` (and claims nothing else)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class KHAPluginTooOld(QuantizationConfig):
        @classmethod
        def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: Any, *args: Any, **kw: Any) -> None:
            hint = isinstance(hf_quant_cfg, dict) and str(hf_quant_cfg.get("quant_method", "")).startswith(NAME)
            if hint or user_quant == NAME:
                raise ServingError(f"{why}. Upgrade vLLM, or fold linear KHA (kc.fold) and serve a vanilla model.")

        @classmethod
        def from_config(cls, config: Any) -> Any:
            raise ServingError(why)

        @classmethod
        def get_min_capability(cls) -> int:
            raise ServingError(why)

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        def get_name(self) -> Any:
            raise ServingError(why)

        def get_supported_act_dtypes(self) -> Any:
            raise ServingError(why)

        def get_quant_method(self, layer: Any, prefix: str) -> Any:
            raise ServingError(why)

    return KHAPluginTooOld
