"""Head layouts of the linear-attention layers of transformers' hybrid LLMs, for :class:`reference.Reference`.

Written from the modeling code of transformers 5.24, with head counts read from each layer's own
attributes (set from its config). A projection output is cut into groups, each group into blocks
``(role, heads, head dim)`` in output order; a block of role ``None`` (Qwen3-Next's output gate z)
is left alone:

* Qwen3-Next ``in_proj_qkvz``: one group per key head, ``[q | k | v (Hv/Hk heads) | z]``;
* Qwen3.5 / LaraMini ``in_proj_qkv``: ``[q (Hk heads) | k (Hk heads) | v (Hv heads)]``;
* OLMo hybrid, Kimi's and Bailing's delta attention: separate ``q_proj``, ``k_proj``, ``v_proj``;
* MiniMax's lightning attention ``qkv_proj``: one group per head, ``[q | k | v]``;
* full attention: ``q_proj``, ``k_proj``, ``v_proj`` of the config's heads and kv heads (Qwen3-Next's and
  Qwen3.5's ``q_proj`` per head ``[q | output gate]``); MLA (Kimi, Bailing): ``q_proj`` or ``q_b_proj`` per
  head ``[nope | rope]``, ``kv_b_proj`` per head ``[k nope | v]`` (T^K on the no-RoPE part, as the spec says).

Example::

    ref = Reference(untouched, hybrid_layout)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from reference import Fn, Proj

__all__ = ["hybrid_layout"]

Block = tuple[str | None, int, int]  # (role, heads, head dim)


def _grouped(groups: int, blocks: list[Block]) -> Any:
    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        width = sum(n * d for _, n, d in blocks)
        assert y.shape[-1] == groups * width, f"{y.shape[-1]} features, the layout says {groups} x {blocks}"
        parts = y.unflatten(-1, (groups, width)).split([n * d for _, n, d in blocks], dim=-1)
        out = [p if r is None else fns[r](p.unflatten(-1, (n, d))).flatten(-2) for (r, n, d), p in zip(blocks, parts)]
        return torch.cat(out, dim=-1).flatten(-2)

    return split


def _layer(path: str, m: nn.Module, cfg: Any) -> list[Proj]:
    name = type(m).__name__
    if name.endswith("GatedDeltaNet"):
        hk, hv, dk, dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
        if hasattr(m, "in_proj_qkvz"):
            r = hv // hk
            blocks: list[Block] = [("q", 1, dk), ("k", 1, dk), ("v", r, dv), (None, r, dv)]
            return [Proj(f"{path}.in_proj_qkvz", ("q", "k", "v"), _grouped(hk, blocks))]
        if hasattr(m, "in_proj_qkv"):
            blocks = [("q", hk, dk), ("k", hk, dk), ("v", hv, dv)]
            return [Proj(f"{path}.in_proj_qkv", ("q", "k", "v"), _grouped(1, blocks))]
        heads = {"q": (hk, dk), "k": (hk, dk), "v": (hv, dv)}
    elif name.endswith("DeltaAttention"):  # Kimi's and Bailing's delta attention
        heads = dict.fromkeys("qkv", (m.num_heads, m.head_dim))
    elif name.endswith("LightningAttention"):
        n, d = m.num_attention_heads, m.head_dim
        return [Proj(f"{path}.qkv_proj", ("q", "k", "v"), _grouped(n, [("q", 1, d), ("k", 1, d), ("v", 1, d)]))]
    elif hasattr(m, "kv_b_proj"):  # MLA: q (H, nope + rope); kv_b_proj per head [k nope | v], T^K on the nope part
        n, nope, rope, dv = cfg.num_attention_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q = "q_proj" if getattr(m, "q_proj", None) is not None else "q_b_proj"
        return [
            Proj(f"{path}.{q}", ("q",), _grouped(1, [("q", n, nope + rope)])),
            Proj(f"{path}.kv_b_proj", ("k", "v"), _grouped(n, [("k", 1, nope), ("v", 1, dv)])),
        ]
    elif name.endswith("Attention") and all(hasattr(m, f"{r}_proj") for r in "qkv"):  # full attention
        n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        d = getattr(m, "head_dim", None) or cfg.hidden_size // n
        heads = {"q": (n, d), "k": (kv, d), "v": (kv, d)}
        if m.q_proj.out_features == 2 * n * d:  # Qwen3-Next, Qwen3.5: per head [q | output gate]
            q = Proj(f"{path}.q_proj", ("q",), _grouped(n, [("q", 1, d), (None, 1, d)]))
            return [q, *(Proj(f"{path}.{r}_proj", (r,), _grouped(1, [(r, *heads[r])])) for r in "kv")]
    else:
        return []
    return [Proj(f"{path}.{r}_proj", (r,), _grouped(1, [(r, *heads[r])])) for r in "qkv"]


def hybrid_layout(model: nn.Module, cfg: Any) -> list[Proj]:
    """Every q, k, v projection of a hybrid model: its linear-attention layers and its full attention."""
    return [p for path, m in model.named_modules() for p in _layer(path, m, cfg)]
