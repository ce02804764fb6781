"""Which model a KHA checkpoint belongs to: its architecture and its KHA sites, recorded at save, checked at load.

KHA transforms are trained on one architecture's attention; a checkpoint of another architecture
whose tensors happen to have the same names and shapes (a Qwen3 checkpoint and a Llama of the same
sizes) would load without a word and compute something else. So every save records, next to the KHA
config (``kha_config.json``, and the ``kha_compile`` entry and ``quantization_config`` of a transformers
``config.json``):

- ``architecture``: the class of the transformers model (the model itself, or the one inside a wrapper
  such as a ``PeftModel`` or a ``SentenceTransformer``), else of the model;
- ``model_type``: that transformers model's type (``"qwen3"``), None for other models;
- ``sites``: how many KHA transforms of each role, kind and head layout the model carries,
  e.g. ``{"q:linear 4x16": 2, "v:mlp 2x16": 2}`` (4 heads of 16 for q, 2 of 16 for v).

Loading compares them with the model (:func:`identity_mismatch`): the model types when both have one
(so a causal LM's checkpoint still loads into its base model), else the class names; then the sites.
Checkpoints saved before these entries existed record none and are not checked.

Example::

    recorded = identity_of(qwen3_model)   # {"architecture": "Qwen3ForCausalLM", "model_type": "qwen3", "sites": {...}}
    identity_mismatch(recorded, identity_of(llama_model))   # "saved from Qwen3ForCausalLM (qwen3), ..."
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn

from ..core.optional import loaded
from ..model.adapter import unwrap_model
from .plan import kha_plan

__all__ = ["IDENTITY_KEYS", "identity_mismatch", "identity_of", "recorded_identity", "sites_of"]

IDENTITY_KEYS = ("architecture", "model_type", "sites")


def _transformers_model(model: nn.Module) -> nn.Module | None:
    """The first transformers ``PreTrainedModel`` in ``model`` (the model itself first), or None."""
    transformers = loaded("transformers")
    if transformers is None:
        return None
    base = getattr(transformers, "PreTrainedModel", None)
    if base is None:
        return None
    return next((m for m in model.modules() if isinstance(m, base)), None)


def sites_of(plan: list[dict[str, Any]]) -> dict[str, int]:
    """How many KHA transforms of each ``role:kind heads x head_dim`` an insertion plan places.

    Example::

        sites_of(kha_plan(model))       # {"q:linear 4x16": 2, "v:mlp 2x16": 2}
    """
    counts: Counter[str] = Counter()
    for entry in plan:
        slots = {s.get("role"): s for s in entry.get("slots") or [] if isinstance(s, dict)}
        for role, kind in sorted((entry.get("kinds") or {}).items()):
            slot = slots.get(role)
            layout = f" {slot.get('num_heads')}x{slot.get('head_dim')}" if slot else ""
            counts[f"{role}:{kind}{layout}"] += 1
    return dict(sorted(counts.items()))


def identity_of(model: nn.Module) -> dict[str, Any]:
    """The architecture, model type and KHA sites of ``model`` as a checkpoint records them (module docs).

    Example::

        identity_of(model)      # {"architecture": "LlamaForCausalLM", "model_type": "llama", "sites": {...}}
    """
    hf = _transformers_model(model)
    if hf is not None:
        config_cls = getattr(type(hf), "config_class", None)
        model_type = getattr(config_cls, "model_type", "") or getattr(getattr(hf, "config", None), "model_type", "")
        architecture, kind = type(hf).__name__, str(model_type) or None
    else:
        architecture, kind = type(unwrap_model(model)).__name__, None
    return {"architecture": architecture, "model_type": kind, "sites": sites_of(kha_plan(model))}


def recorded_identity(entry: object) -> dict[str, Any]:
    """The identity fields a checkpoint's KHA entry records (empty for checkpoints saved before them).

    Example::

        recorded_identity(json.loads(pathlib.Path("d/kha_config.json").read_text()))
    """
    if not isinstance(entry, dict):
        return {}
    return {k: entry[k] for k in IDENTITY_KEYS if entry.get(k) is not None}


def _named(identity: dict[str, Any]) -> str:
    kind = identity.get("model_type")
    return f"{identity.get('architecture')}" + (f" (model type {kind!r})" if kind else "")


def _sites(sites: dict[str, int]) -> str:
    return ", ".join(f"{n} x {layout}" for layout, n in sites.items()) or "none"


def identity_mismatch(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """What differs between the identity a checkpoint records and the model's ('' when nothing does).

    Example::

        identity_mismatch({"architecture": "Qwen3ForCausalLM", "model_type": "qwen3"},
                          {"architecture": "LlamaForCausalLM", "model_type": "llama", "sites": {}})
        # "it was saved from Qwen3ForCausalLM (model type 'qwen3'), this model is LlamaForCausalLM (model type 'llama')"
    """
    parts = []
    old, new = recorded.get("model_type"), current.get("model_type")
    if old and new:
        differ = old != new
    else:  # a model without a transformers model inside: the class names say it
        differ = not old and not new and recorded.get("architecture") not in (None, current.get("architecture"))
    if differ:
        parts.append(f"it was saved from {_named(recorded)}, this model is {_named(current)}")
    sites = recorded.get("sites")
    if isinstance(sites, dict) and sites != current.get("sites"):
        parts.append(f"its KHA sites are {_sites(sites)}, while this model's are {_sites(current.get('sites') or {})}")
    return "; ".join(parts)
