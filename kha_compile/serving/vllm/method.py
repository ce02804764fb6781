"""The linear methods kha_compile's quantization method hands to vLLM's layers (needs vLLM).

:class:`KHAQKVMethod` runs a fused ``QKVParallelLinear`` (Llama's, Qwen's ``qkv_proj``) as vLLM's
own unquantized method does, with the KHA transforms on the head slices of its output: inside the
fused projection, so before rotary embedding and QK-norm, and the KV cache holds transformed keys and
values. Linear transforms are folded into the rows of the projection's weight and bias when the
weights are loaded (``W_h <- T^T W_h``, docs/method.md; zero cost at run time); other kinds (MLP-value)
run on the output's head slices, written back in place. Under tensor parallelism each rank holds its
own heads' rows (``num_heads``, ``num_kv_heads`` of the layer are per rank), and the transforms, which
every head of a role shares, are replicated. :class:`CheckedLinearMethod` (every other linear layer)
is vLLM's own method plus the check that every attention's KHA found its layer.

The KHA parameters sit in a ``kha`` child of the layer, named as the checkpoint names them after
vLLM's stacked-parameter mapping (``...v_proj.kha.v.up`` -> ``...qkv_proj.kha.v.up``), so vLLM's
weight loading finds them; the values come from kha_compile's own reader (:mod:`.served`), and each
copy vLLM feeds must equal them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from ...core.errors import CheckpointError, ServingError
from ...model.rows import fold_rows
from ...model.slots import HeadSlot
from ...model.transforms import TransformKind, get_transform
from .served import ServedAttention

__all__ = [
    "CheckedLinearMethod",
    "KHAQKVMethod",
    "PlacementCheck",
    "add_kha",
    "check_bias_first",
    "kha_params",
    "transform_heads",
]

log = logging.getLogger(__name__)


class PlacementCheck(Protocol):
    """What the methods need of their quantization config: the check that every KHA was placed."""

    def check_placed(self) -> None: ...


class CheckedLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear method; after loading, it checks (once) that every KHA found its layer.

    Example::

        layer.quant_method = CheckedLinearMethod(config)     # what get_quant_method returns for o_proj, MLPs
    """

    def __init__(self, config: PlacementCheck) -> None:
        super().__init__()
        self._placement = config

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self._placement.check_placed()  # the model is built: every get_quant_method call has been made
        super().process_weights_after_loading(layer)


def _slots(layer: Any) -> dict[str, HeadSlot]:
    """This rank's head slots of a QKVParallelLinear's output: [q heads | k heads | v heads]."""
    nq, nkv, d = int(layer.num_heads), int(layer.num_kv_heads), int(layer.head_size)
    dv = int(getattr(layer, "v_head_size", d))
    return {
        "q": HeadSlot("q", 0, nq, d, d),
        "k": HeadSlot("k", nq * d, nkv, d, d),
        "v": HeadSlot("v", (nq + nkv) * d, nkv, dv, dv),
    }


class KHAQKVMethod(CheckedLinearMethod):
    """A fused QKV projection with its attention's KHA transforms on the head slices of its output.

    Example::

        layer.quant_method = KHAQKVMethod(config, served.attentions["model.layers.0.self_attn"])
    """

    def __init__(self, config: PlacementCheck, attention: ServedAttention) -> None:
        super().__init__(config)
        self.attention = attention
        self.kinds: dict[str, TransformKind] = {r: get_transform(k) for r, k in attention.kinds.items()}
        self.slots: dict[str, HeadSlot] = {}
        self.running: list[str] = []  # roles applied at run time (the others are folded at load)

    def create_weights(
        self,
        layer: Any,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        super().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        )
        self.slots = add_kha(layer, self.attention, self.kinds, params_dtype)
        self.running = [r for r, k in self.kinds.items() if not k.foldable]
        check_bias_first(layer, self.attention, self.running)

    def process_weights_after_loading(self, layer: Any) -> None:  # a vLLM QKVParallelLinear
        folded = [r for r in self.kinds if r not in self.running]
        if folded:
            with torch.no_grad():
                weight, bias = layer.weight.data, getattr(layer, "bias", None)
                b = None if bias is None else bias.data
                for role in folded:
                    kind = self.kinds[role]
                    t = kind.fold_matrix_of(*self._params(layer, role))
                    weight, b = fold_rows(weight, b, self.slots[role], t, axis=0)
                layer.weight.data.copy_(weight)
                if bias is not None and b is not None:
                    bias.data.copy_(b)
            log.debug("%s: folded linear KHA on %s into the QKV weight", self.attention.prefix, ", ".join(folded))
        super().process_weights_after_loading(layer)  # vLLM's own (CPU: packs the weight for its GEMM)

    def apply(self, layer: nn.Module, x: Tensor, bias: Tensor | None = None) -> Tensor:
        y = super().apply(layer, x, bias)  # (T, q + k + v) of this rank
        return transform_heads(layer, y, self.running, self.kinds, self.slots)

    def _params(self, layer: nn.Module, role: str) -> list[Tensor]:
        return kha_params(layer, role, self.kinds[role])


def add_kha(
    layer: Any, attention: ServedAttention, kinds: dict[str, TransformKind], params_dtype: torch.dtype
) -> dict[str, HeadSlot]:
    """Give a fused QKV layer a ``kha`` child holding ``attention``'s KHA parameters; its head slots per role."""
    slots = _slots(layer)
    kha = nn.Module()
    for role, kind in kinds.items():
        slot, values = slots[role], attention.tensors[role]
        if any(tuple(t.shape) != (slot.head_dim, slot.head_dim) for t in values):
            raise CheckpointError(
                f"{attention.prefix}: the KHA tensors of role {role} have shapes "
                f"{[tuple(t.shape) for t in values]}, but vLLM's layer has head size {slot.head_dim}."
            )
        holder = nn.Module()
        for name, value in zip(kind.param_names, values):
            param = nn.Parameter(value.detach().to(params_dtype).clone(), requires_grad=False)
            param.weight_loader = _same_as_read(f"{attention.prefix}.{role}_proj.kha.{role}.{name}")  # type: ignore[attr-defined]
            holder.register_parameter(name, param)
        kha.add_module(role, holder)
    layer.add_module("kha", kha)
    return slots


def check_bias_first(layer: Any, attention: ServedAttention, running: list[str]) -> None:
    """Refuse a layer whose bias vLLM adds after it when transforms run on its output."""
    if running and getattr(layer, "skip_bias_add", False) and getattr(layer, "bias", None) is not None:
        raise ServingError(
            f"{attention.prefix}: vLLM adds this QKV projection's bias after it (skip_bias_add), so a "
            f"KHA transform that does not fold ({', '.join(running)}) cannot follow the bias there."
        )


def kha_params(layer: nn.Module, role: str, kind: TransformKind) -> list[Tensor]:
    """The KHA parameters of ``role`` that :func:`add_kha` gave ``layer``, in the kind's order."""
    holder = getattr(layer.kha, role)
    return [getattr(holder, p) for p in kind.param_names]


def transform_heads(
    layer: nn.Module, y: Tensor, roles: list[str], kinds: dict[str, TransformKind], slots: dict[str, HeadSlot]
) -> Tensor:
    """Run the KHA of ``roles`` on the head slices of a fused QKV output ``y`` (T, q + k + v), in place."""
    for role in roles:
        slot, kind = slots[role], kinds[role]
        width = slot.num_heads * slot.head_dim
        seg = y[..., slot.offset : slot.offset + width]
        heads = seg.reshape(*seg.shape[:-1], slot.num_heads, slot.head_dim)  # (T, H, Dh)
        y[..., slot.offset : slot.offset + width] = kind.functional(heads, *kha_params(layer, role, kind)).reshape(
            seg.shape
        )
    return y


def _same_as_read(name: str) -> Callable[..., None]:
    """A weight loader for a KHA parameter: what vLLM feeds must equal what kha_compile read."""

    def load(param: Tensor, loaded: Tensor, *shard: Any) -> None:
        if not torch.equal(param.data, loaded.to(device=param.device, dtype=param.dtype)):
            raise CheckpointError(
                f"{name}: the directory holds two different values of this KHA tensor (vLLM read one from the "
                "model's weight files, kha_compile another from its KHA files); they come from different saves. "
                "Save the model and its KHA again (model.save_pretrained and kc.save_pretrained)."
            )

    return load
