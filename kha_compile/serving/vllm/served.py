"""What vLLM is asked to serve: a saved directory read and checked, without vLLM.

:func:`read_served` reads a transformers directory (``config.json`` and weights, written by
``model.save_pretrained``) and the KHA it holds (its ``kha_compile`` entry and ``.kha.`` tensors, or
the ``kha_config.json`` / ``kha_model.safetensors`` that ``kc.save_pretrained`` writes), and checks
that they agree: every attention's KHA tensors are the kinds the config names, for every role it
names, at the head size of the model. :func:`check_servable` says whether the plugin can serve it
(architecture, head size on vLLM's CPU attention). The plugin (:mod:`.plugin`) and
``kha-compile inspect DIR`` (:mod:`.advice`) both rest on these.

Example::

    served = read_served("out")          # after model.save_pretrained("out") of a KHA model
    served.architecture, served.head_dim, sorted(served.attentions)[:1]
    # ("LlamaForCausalLM", 64, ["model.layers.0.self_attn"])
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

from torch import Tensor

from ...core.errors import CheckpointError, ServingError
from ...core.kinds import ROLES
from ...model.config import KHAConfig
from ...model.transforms import get_transform
from ...store.format import CONFIG_NAME, read_checkpoint
from ...store.hf import CONFIG_KEY, HINT_KEY, is_kha_quantization, kha_entry, stored_kha_keys

__all__ = [
    "CPU_HEAD_SIZES",
    "SUPPORTED_ARCHITECTURES",
    "ServedAttention",
    "ServedModel",
    "check_servable",
    "read_served",
]

# vLLM's model classes the plugin is tested with (tests/serving/vllm): a fused QKVParallelLinear named
# qkv_proj, loaded from the checkpoint's separate q_proj/k_proj/v_proj. Name -> what users call it.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "Llama",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "Qwen3MoeForCausalLM": "Qwen3-MoE",
}
# the head sizes of vLLM 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes); the plugin
# asks the installed vLLM, this copy serves `kha-compile inspect` where vLLM is not installed
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# "<attention>.<r>_proj.kha.<r>.<param>": KHA on a separate projection per role
_KEY = re.compile(r"^(?P<attn>.+)\.(?P<proj>[^.]+)\.kha\.(?P<role>[qkv])\.(?P<param>[^.]+)$")


@dataclasses.dataclass(frozen=True)
class ServedAttention:
    """The KHA of one attention: per role its kind and tensors (in the kind's ``param_names`` order)."""

    prefix: str  # the attention module, e.g. "model.layers.0.self_attn"
    kinds: dict[str, str]  # role -> transform kind
    tensors: dict[str, tuple[Tensor, ...]]


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A saved directory as vLLM would serve it: architecture, head size and the KHA per attention.

    ``config`` is None (and ``attentions`` empty) for a directory without KHA: a vanilla or folded model.
    """

    directory: pathlib.Path
    architecture: str | None
    head_dim: int | None
    config: KHAConfig | None
    attentions: dict[str, ServedAttention]

    @property
    def has_kha(self) -> bool:
        return self.config is not None

    @property
    def foldable(self) -> bool:
        """True when every transform is linear (the plugin folds them at load; kc.fold could instead)."""
        return all(get_transform(k).foldable for a in self.attentions.values() for k in a.kinds.values())


def _model_config(directory: pathlib.Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} holds no config.json, so it is not a model directory vLLM can serve. Save the "
            "model with model.save_pretrained(directory) (after kc.apply it records the KHA there), or save the "
            "KHA with kc.save_pretrained(model, directory) into the directory that holds the model's files."
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    text = data.get("text_config")  # a multimodal wrapper keeps the language model's sizes here
    return {**text, **data} if isinstance(text, dict) else data


def _head_dim(cfg: dict) -> int | None:
    if isinstance(cfg.get("head_dim"), int):
        return int(cfg["head_dim"])
    width, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    return width // heads if isinstance(width, int) and isinstance(heads, int) and heads else None


def read_served(directory) -> ServedModel:
    """Read and check a saved model directory and the KHA it holds, before vLLM builds anything.

    Raises :class:`CheckpointError` when the directory is not a model directory, or its config and its
    KHA tensors disagree (KHA tensors without a config saying how to run them, a config naming KHA
    without tensors, other kinds or roles than the config names, another head size), and
    :class:`ServingError` for KHA placed where the plugin cannot put it (not a separate projection per role).

    Example::

        served = read_served("out")
        {p: a.kinds for p, a in served.attentions.items()}   # {"model.layers.0.self_attn": {"v": "mlp"}, ...}
    """
    directory = pathlib.Path(directory)
    cfg = _model_config(directory)
    archs = cfg.get("architectures") or []
    arch = str(archs[0]) if archs else None
    head_dim = _head_dim(cfg)
    hinted = is_kha_quantization(cfg.get(HINT_KEY))  # "kha_compile", or the sentence of earlier versions
    recorded = CONFIG_KEY in cfg or kha_entry(cfg) is not None or (directory / CONFIG_NAME).is_file()
    if not recorded:
        keys = stored_kha_keys(directory)
        if keys or hinted:
            what = f"{len(keys)} KHA tensors (e.g. {keys[0]!r})" if keys else "kha_compile's quantization_config hint"
            raise CheckpointError(
                f"{str(directory)!r} holds {what} but neither a {CONFIG_KEY!r} entry in config.json nor a "
                f"{CONFIG_NAME}, so nothing says how to run its KHA. Save the model again after kc.apply "
                "(model.save_pretrained records the entry), or kc.save_pretrained(model, directory)."
            )
        return ServedModel(directory, arch, head_dim, None, {})
    kha_cfg, tensors = read_checkpoint(directory)
    _refuse_linear_attention(directory, arch, cfg, kha_cfg)
    attentions = _attentions(directory, kha_cfg, tensors, head_dim)
    return ServedModel(directory, arch, head_dim, kha_cfg, attentions)


def _refuse_linear_attention(directory: pathlib.Path, arch: str | None, cfg: dict, kha_cfg: KHAConfig) -> None:
    """A hybrid model with linear-attention layers (Qwen3-Next's gated delta rule, ...) is refused with the reason."""
    types = cfg.get("layer_types") or []
    linear = sum(1 for t in types if t == "linear_attention") if isinstance(types, list) else 0
    if not linear or arch in SUPPORTED_ARCHITECTURES:
        return
    foldable = all(get_transform(k).foldable for k in kha_cfg.roles().values())
    raise ServingError(
        f"{arch!r} ({str(directory)!r}) has KHA and {linear} of its {len(types)} layers are linear_attention "
        "layers (a gated delta rule, linear attention or a state-space layer); kha_compile's vLLM plugin does not "
        "serve it: vLLM runs those layers with its "
        "own fused in-projection, short convolution and recurrent kernel, which have no place for KHA on the q, "
        "k, v heads, and the plugin serves only "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}. Run it with transformers (from_pretrained after `import "
        "kha_compile`, or kc.load_pretrained)"
        + (", or fold it (kc.fold) and serve the vanilla model with vLLM." if foldable else ".")
    )


def _attentions(
    directory: pathlib.Path, cfg: KHAConfig, tensors: dict[str, Tensor], head_dim: int | None
) -> dict[str, ServedAttention]:
    """Group the KHA tensors by attention and check them against the config (see :func:`read_served`)."""
    roles = cfg.roles()
    grouped: dict[str, dict[str, dict[str, Tensor]]] = {}
    for name, value in tensors.items():
        m = _KEY.match(name)
        if m is None or m["proj"] != f"{m['role']}_proj":
            raise ServingError(
                f"the KHA tensor {name!r} in {str(directory)!r} does not sit on a separate q_proj, k_proj or v_proj "
                "projection, where kha_compile's vLLM plugin puts KHA inside vLLM's "
                "fused QKV projection. Fold linear KHA first (kc.fold) to serve a vanilla model."
            )
        grouped.setdefault(m["attn"], {}).setdefault(m["role"], {})[m["param"]] = value
    if not grouped:
        raise CheckpointError(f"{str(directory)!r} records KHA ({cfg}) but holds no KHA tensors.")
    out = {}
    for prefix, by_role in sorted(grouped.items()):
        if set(by_role) != set(roles):
            raise CheckpointError(
                f"{str(directory)!r}: the KHA config says {cfg} (roles {sorted(roles)}), but {prefix} holds KHA "
                f"tensors for roles {sorted(by_role)}; its config and its tensors come from different saves."
            )
        kinds: dict[str, str] = {}
        params: dict[str, tuple[Tensor, ...]] = {}
        for role in (r for r in ROLES if r in roles):
            kind = get_transform(roles[role])
            got = by_role[role]
            if set(got) != set(kind.param_names):
                raise CheckpointError(
                    f"{str(directory)!r}: the KHA config says {role}={kind.name!r} (tensors {list(kind.param_names)}), "
                    f"but {prefix}.{role}_proj.kha.{role} holds {sorted(got)}; its config and its tensors disagree."
                )
            for pname, t in got.items():
                if head_dim is not None and tuple(t.shape) != (head_dim, head_dim):
                    raise CheckpointError(
                        f"{str(directory)!r}: {prefix}.{role}_proj.kha.{role}.{pname} has shape {tuple(t.shape)}, "
                        f"but the model's head size is {head_dim} (config.json); its config and its tensors disagree."
                    )
            kinds[role] = kind.name
            params[role] = tuple(got[p] for p in kind.param_names)
        out[prefix] = ServedAttention(prefix, kinds, params)
    return out


def check_servable(served: ServedModel, head_sizes: tuple[int, ...] | None = CPU_HEAD_SIZES) -> None:
    """Raise :class:`ServingError` unless the plugin can serve ``served`` (its architecture and head size).

    ``head_sizes`` are the attention head sizes of the vLLM build (None: any, a GPU build).

    Example::

        check_servable(read_served("out"))       # ServingError for a GPT-2, or head_dim 16 on CPU
    """
    if served.has_kha and served.architecture not in SUPPORTED_ARCHITECTURES:
        known = ", ".join(f"{a} ({n})" for a, n in SUPPORTED_ARCHITECTURES.items())
        fold = " Fold it first (kc.fold) to serve a vanilla model." if served.foldable else ""
        raise ServingError(
            f"kha_compile's vLLM plugin cannot serve architecture {served.architecture!r} with KHA "
            f"({str(served.directory)!r}); it serves {known}.{fold}"
        )
    if head_sizes is not None and served.head_dim is not None and served.head_dim not in head_sizes:
        raise ServingError(
            f"vLLM's CPU attention does not take head size {served.head_dim} ({str(served.directory)!r}); it takes "
            f"{', '.join(map(str, head_sizes))}. Serve this model on a GPU build of vLLM, or train one with a "
            "supported head size."
        )
