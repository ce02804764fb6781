"""kha_compile as a vLLM quantization method: how a KHA directory gets its transforms in vLLM (needs vLLM).

``model.save_pretrained`` of a KHA model records its KHA as ``quantization_config`` in ``config.json``
(``"quant_method": "kha_compile"`` and the KHA entry beside it; earlier versions wrote a sentence
there, which is claimed the same way). vLLM asks every registered quantization method whether it claims that entry
(:meth:`KHAQuantConfig.override_quantization_method`); this one does, so vLLM builds its own model
class with :class:`KHAQuantConfig` as its quantization config: :meth:`~KHAQuantConfig.maybe_update_config`
reads and checks the directory's KHA (:func:`.served.read_served`, :func:`.served.check_servable`)
before any layer exists, and :meth:`~KHAQuantConfig.get_quant_method` gives each fused QKV projection
of an attention with KHA a :class:`.method.KHAQKVMethod`, every other linear layer vLLM's own method.
``LLM(model=dir, quantization="kha_compile")`` also works on a directory whose config.json names no
quantization method (vLLM then reads ``kha_config.json``). On a quantized base (the real method's config
kept under ``"wraps"``), the real method gives every layer its method and kha_compile's wraps them
(:mod:`.composed`).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear
from vllm.model_executor.layers.quantization import get_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.platforms import current_platform

from ...core.errors import ServingError
from ...store.format import CONFIG_NAME
from ...store.hf import is_kha_quantization, wrapped_quantization
from .composed import CheckedMethod, WrappedQKVMethod, wrap
from .method import CheckedLinearMethod, KHAQKVMethod
from .served import CPU_HEAD_SIZES, ServedModel, check_servable, read_served

__all__ = ["NAME", "KHAQuantConfig", "is_kha_hint"]

log = logging.getLogger(__name__)

NAME = "kha_compile"  # the quantization method's name in vLLM


def is_kha_hint(quant_cfg: object) -> bool:
    """True for kha_compile's ``quantization_config``: ``"quant_method": "kha_compile"`` with the KHA entry
    beside it, or the sentence earlier versions wrote there (vLLM lower-cases ``quant_method``)."""
    return isinstance(quant_cfg, dict) and is_kha_quantization(quant_cfg)


def _head_sizes() -> tuple[int, ...] | None:
    """The attention head sizes of this vLLM build on CPU (None on other devices: their backends vary)."""
    if not current_platform.is_cpu():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return CPU_HEAD_SIZES


class KHAQuantConfig(QuantizationConfig):
    """vLLM's quantization config for a directory with KHA: places the transforms in vLLM's own layers.

    Example::

        LLM(model="out")                                  # config.json names quant_method "kha_compile"
        LLM(model="out", quantization="kha_compile")      # or say it; vLLM then reads kha_config.json
    """

    def __init__(self, base: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.served: ServedModel | None = None
        self.claimed: set[str] = set()
        self.checked = False
        self.base = base  # the real quantization method's config, on a quantized base

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        ours = [torch.float32, torch.bfloat16, torch.float16]
        return ours if self.base is None else [d for d in ours if d in self.base.get_supported_act_dtypes()]

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.base is not None:
            self.base.apply_vllm_mapper(hf_to_vllm_mapper)

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # no kernels of its own beyond torch ops: any GPU vLLM runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [CONFIG_NAME]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KHAQuantConfig:
        real = wrapped_quantization(config)  # the KHA itself comes from the directory (maybe_update_config)
        if real is None:
            return cls()
        method = str(real["quant_method"]).lower()
        try:
            real_cls = get_quantization_config(method)
        except ValueError as exc:
            raise ServingError(
                f"this directory's base is quantized with {method!r}, which this vLLM does not know ({exc}); "
                "kha_compile's plugin runs KHA around a quantization method vLLM runs."
            ) from exc
        return cls(real_cls.from_config(real))

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None, **kwargs: Any
    ) -> str | None:
        if not is_kha_hint(hf_quant_cfg):
            return None
        if user_quant not in (None, NAME):
            raise ServingError(
                f"this directory holds KHA (kha_compile's quantization_config hint), so vLLM runs it with "
                f"quantization={NAME!r}; quantization={user_quant!r} cannot be combined with it."
            )
        return NAME

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        directory = pathlib.Path(model_name)
        if not directory.is_dir():
            raise ServingError(
                f"kha_compile's vLLM plugin serves local directories; {model_name!r} is not one. Download it first "
                "(huggingface-cli download ... --local-dir DIR) and serve DIR."
            )
        served = read_served(directory)
        if not served.has_kha:
            raise ServingError(
                f"{model_name!r} records no KHA (no 'kha_compile' entry in config.json, no {CONFIG_NAME}); "
                f"serve it without quantization={NAME!r}."
            )
        check_servable(served, _head_sizes())
        self.served = served
        log.info(
            "kha_compile: serving %s (%s) with KHA %s at %d attentions",
            directory,
            served.architecture,
            served.config,
            len(served.attentions),
        )

    def get_quant_method(self, layer: nn.Module, prefix: str) -> Any:
        real = None
        if self.base is not None:
            self.base.packed_modules_mapping = self.packed_modules_mapping  # the model set it on this config
            real = self.base.get_quant_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return real  # embeddings, attention, MoE experts: vLLM's own methods, or the real method's
        served = self._served()
        attention, _, name = prefix.rpartition(".")
        if isinstance(layer, QKVParallelLinear) and attention in served.attentions:
            self.claimed.add(attention)
            if real is None:
                return KHAQKVMethod(self, served.attentions[attention])
            return wrap(WrappedQKVMethod, self, real, served.attentions[attention])
        if attention in served.attentions and name in {f"{r}_proj" for r in "qkv"}:
            raise ServingError(
                f"vLLM builds {prefix} as {type(layer).__name__}, not a fused QKV projection; kha_compile's plugin "
                f"puts KHA into vLLM's QKVParallelLinear only (architecture {served.architecture})."
            )
        return CheckedLinearMethod(self) if real is None else wrap(CheckedMethod, self, real)

    def check_placed(self) -> None:
        """Raise unless every attention with KHA in the directory got a KHA QKV method (runs once)."""
        if self.checked:
            return
        self.checked = True
        served = self._served()
        missing = sorted(set(served.attentions) - self.claimed)
        if missing and _pipeline_size() == 1:
            raise ServingError(
                f"vLLM's {served.architecture} built no fused QKV projection for {len(missing)} of the "
                f"{len(served.attentions)} attentions with KHA in {str(served.directory)!r} (e.g. {missing[0]}); "
                "serving it would drop their KHA, so kha_compile refuses."
            )

    def _served(self) -> ServedModel:
        if self.served is None:  # vLLM calls maybe_update_config first; a caller that did not: read now
            self.maybe_update_config(get_current_vllm_config().model_config.model)
        assert self.served is not None
        return self.served


def _pipeline_size() -> int:
    try:
        return int(get_pp_group().world_size)
    except (AssertionError, AttributeError):  # no pipeline group (a single process)
        return 1
