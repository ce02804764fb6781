"""``nn.MultiheadAttention`` with KHA: its projections are parameters used functionally (``in_proj_weight``).

The whole attention module gets the :class:`KHAMultiheadAttention` class (same object, parameters
and keys); :func:`detach_mha` gives it its class back. Its head slots are the rows of the
in-projection, so it folds its own transforms (:meth:`KHAMultiheadAttention.kha_fold`).

Execution (see :mod:`.strategy`): while every transform is linear and no gradient is needed, the
module runs torch's own ``nn.MultiheadAttention.forward`` on the folded in-projection (computed
for the call), so torch's fused inference path runs exactly as it would without KHA; with a
gradient needed, the ``"auto"`` rule decides. Otherwise the forward follows
``F.multi_head_attention_forward`` step by step with the transforms right after the
in-projection (token-side), and a no-op forward hook keeps ``nn.TransformerEncoderLayer``'s fast
path (which would skip them) switched off: that is the case for MLP-value and for
``kha_strategy = "token"``. While every MLP-value transform still holds exactly its identity-init
tensors (checked with ``torch.equal`` on each call without a gradient), it changes nothing, so the
module (and its encoder-layer host, hook paused) runs torch's own forward, fast path included:
identity at init is exact under ``no_grad`` too.

``nn.TransformerEncoderLayer``'s fast path reads ``self_attn.in_proj_weight`` without calling the
attention module. An encoder layer whose attention carries KHA therefore gets a class of its own
(:class:`KHAEncoderLayerHost`, same object and keys): its forward runs the layer with the folded
in-projection in place for that call, whenever the attention would run weight-side.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..core.errors import UnsupportedModelError
from ..core.kinds import ROLES
from ..core.mixins import mixin_class, module_class_named
from ..core.optional import is_dtensor
from .carrier import KHATransforms, make_transform, set_handler
from .rows import fold_rows
from .slots import HeadSlot
from .strategy import check_strategy, needs_grad, swapped_params, use_weight_side
from .transforms import kind_of

__all__ = ["KHAEncoderLayerHost", "KHAMultiheadAttention", "attach_mha", "detach_mha", "release_hosts"]

_MHA_WEIGHTS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight")


class KHAMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with KHA transforms on its per-head q, k, v (see the module doc)."""

    kha: KHATransforms

    @property
    def kha_strategy(self) -> str:
        """How linear KHA runs here: "auto" | "weight" | "token"; setting it updates the fast-path hook."""
        return str(self.__dict__.get("_kha_strategy", "auto"))

    @kha_strategy.setter
    def kha_strategy(self, value: str) -> None:
        self.kha_set_strategy(value)

    def kha_set_strategy(self, value: str) -> None:
        self.__dict__["_kha_strategy"] = check_strategy(value, "kha_strategy")
        _sync_fast_path_hook(self)

    def _kha_roles(self) -> tuple[str, ...]:
        return tuple(r for r in ROLES if r in self.kha and kind_of(self.kha[r]).foldable)

    def _kha_sources(self, roles: Sequence[str]) -> list[Tensor]:
        out: list[Tensor] = [t for t in (self._parameters.get(n) for n in _MHA_WEIGHTS) if t is not None]
        for r in roles:
            out.extend(kind_of(self.kha[r]).params(self.kha[r]))
        return out

    def kha_fold(self, roles: Sequence[str], *, detach: bool = True) -> list[tuple[str, Tensor]]:
        """New in-projection tensors with the linear transforms of ``roles`` folded in (nothing written).

        ``detach=False`` keeps autograd (weight-side execution).
        """
        E, H, Dh = self.embed_dim, self.num_heads, self.head_dim
        todo = [(i, r, kind_of(self.kha[r]).fold_matrix(self.kha[r])) for i, r in enumerate(ROLES) if r in roles]
        if not todo:
            return []
        p = self._parameters  # the parameters themselves
        bias: Tensor | None = p.get("in_proj_bias")
        out: list[tuple[str, Tensor]] = []
        if self._qkv_same_embed_dim:  # packed [Wq; Wk; Wv] rows
            packed = p["in_proj_weight"]
            assert packed is not None
            w: Tensor = packed
            for i, r, t in todo:
                w, bias = fold_rows(w, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)
            out.append(("in_proj_weight", w))
        else:
            for i, r, t in todo:
                wr = p[f"{r}_proj_weight"]
                assert wr is not None
                wf, _ = fold_rows(wr, None, HeadSlot(r, 0, H, Dh, Dh), t, 0, detach=detach)
                out.append((f"{r}_proj_weight", wf))
                if bias is not None:  # the bias stays packed: fold into its [i*E, (i+1)*E) slice
                    rows = torch.empty(bias.shape[0], 1, dtype=bias.dtype, device=bias.device)
                    _, bias = fold_rows(rows, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)
        if bias is not None:
            out.append(("in_proj_bias", bias))
        return out

    def _kha_weight_side(self, tokens: int) -> tuple[str, ...]:
        """The linear roles this call folds into the in-projection (empty: all token-side)."""
        roles = self._kha_roles()
        if not roles:
            return ()
        sources = self._kha_sources(roles)
        if len(roles) == len(self.kha) and self.kha_strategy != "token" and not needs_grad(sources):
            # inference with only linear transforms: torch's own forward on the folded weights, so its
            # kernels (fast path included) run exactly as without KHA
            return roles if use_weight_side("weight", sources, tokens, self.embed_dim) else ()
        return roles if use_weight_side(self.kha_strategy, sources, tokens, self.embed_dim) else ()

    def kha_effective_in_proj(self) -> list[tuple[str, Tensor]] | None:
        """The folded in-projection to run the whole call on (``[]``: the stored one), or None (token-side,
        or a gradient is needed).

        Every transform that cannot fold must be at its identity init (MLP-value before training): then
        torch's own forward, fast path included, runs exactly as it would without KHA.
        """
        if self.kha_strategy == "token" or torch.compiler.is_compiling():
            return None
        roles = self._kha_roles()
        sources = self._kha_sources(tuple(self.kha))  # every transform: training any of them needs its path
        if needs_grad(sources) or any(is_dtensor(t) for t in sources):
            return None
        if len(roles) != len(self.kha) and not self._kha_rest_at_identity(roles):
            return None
        return self.kha_fold(roles, detach=False) if roles else []

    def _kha_rest_at_identity(self, foldable: Sequence[str]) -> bool:
        """True when every transform not in ``foldable`` has exactly its identity-init tensors."""
        cache = self.__dict__.setdefault("_kha_identity", {})
        for r, t in self.kha.items():
            if r in foldable:
                continue
            kind = kind_of(t)
            params = kind.params(t)
            key = (r, kind.name, tuple(p.shape for p in params), params[0].dtype, params[0].device)
            if key not in cache:  # the tensors of a fresh transform of this kind (identity at init)
                cache[key] = kind.params(make_transform(kind.name, params[0].shape[-1], dtype=key[3], device=key[4]))
            if not all(torch.equal(p, i) for p, i in zip(params, cache[key])):
                return False
        return True

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        # torch's positional order: query, key, value, key_padding_mask, need_weights, attn_mask, ...
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if "_kha_swapped" in self.__dict__:  # an encoder-layer host put the folded in-projection in place
            return nn.MultiheadAttention.forward(self, *args)
        if not all(kind_of(t).foldable for t in self.kha.values()):
            params = self.kha_effective_in_proj()  # MLP-value still at identity, no gradient: exactly torch's
            if params is not None:
                with swapped_params(self, params):
                    return nn.MultiheadAttention.forward(self, *args)
        roles = self._kha_weight_side(query.numel() // max(query.shape[-1], 1))
        if roles:
            with swapped_params(self, self.kha_fold(roles, detach=False)):
                if len(roles) == len(self.kha):  # all folded: torch's own forward, fast path included
                    return nn.MultiheadAttention.forward(self, *args)
                return self._kha_forward(*args, skip=roles)
        return self._kha_forward(*args)

    def _kha_forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
        skip: tuple[str, ...] = (),
    ):
        """``F.multi_head_attention_forward`` step by step, transforms (but ``skip``) after the in-projection."""
        F = nn.functional
        is_batched = query.dim() == 3
        # keep `query is key is value` as torch does: it decides between one packed GEMM and three
        if self.batch_first and is_batched:
            query, key, value = _same_map(lambda x: x.transpose(1, 0), query, key, value)
        if not is_batched:
            query, key, value = _same_map(lambda x: x.unsqueeze(1), query, key, value)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape  # (L, B, E)
        src_len = key.shape[0]
        H, Dh = self.num_heads, self.head_dim
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=query.dtype,
                check_other=False,
            )
            if key_padding_mask is not None:
                is_causal = False
        if self._qkv_same_embed_dim:
            q, k, v = F._in_projection_packed(  # type: ignore[attr-defined]
                query, key, value, self.in_proj_weight, self.in_proj_bias
            )
        else:
            b = (None, None, None) if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
            q, k, v = F._in_projection(  # type: ignore[attr-defined]
                query,
                key,
                value,
                self.q_proj_weight,
                self.k_proj_weight,
                self.v_proj_weight,
                *b,
            )
        # KHA: shared transforms over each head vector, right after the in-projection
        q, k, v = (
            self.kha[r](x.unflatten(-1, (H, Dh))).flatten(-2) if r in self.kha and r not in skip else x
            for r, x in zip("qkv", (q, k, v))
        )  # (L, B, H, Dh) -> (L, B, E)
        if attn_mask is not None and attn_mask.dim() == 2:
            attn_mask = attn_mask.unsqueeze(0)
        q = q.view(tgt_len, bsz * H, Dh).transpose(0, 1)  # (B*H, L, Dh)
        k = k.view(k.shape[0], bsz * H, Dh).transpose(0, 1)
        v = v.view(v.shape[0], bsz * H, Dh).transpose(0, 1)
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, H, -1, -1).reshape(bsz * H, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            q_scaled = q * math.sqrt(1.0 / float(Dh))
            if attn_mask is not None:
                weights = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                weights = torch.bmm(q_scaled, k.transpose(-2, -1))
            weights = F.softmax(weights, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v)
            out = out.transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            out = F.linear(out, self.out_proj.weight, self.out_proj.bias).view(tgt_len, bsz, -1)
            weights = weights.view(bsz, H, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                out, weights = out.squeeze(1), weights.squeeze(0)
        else:
            if attn_mask is not None:
                if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                    attn_mask = attn_mask.unsqueeze(0)
                else:
                    attn_mask = attn_mask.view(bsz, H, -1, src_len)
            q = q.view(bsz, H, tgt_len, Dh)  # (B, H, L, Dh)
            k = k.view(bsz, H, src_len, Dh)
            v = v.view(bsz, H, src_len, Dh)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
            out = F.linear(out, self.out_proj.weight, self.out_proj.bias).view(tgt_len, bsz, -1)
            if not is_batched:
                out = out.squeeze(1)
            weights = None
        if self.batch_first and is_batched:
            out = out.transpose(1, 0)
        return out, weights


def _same_map(fn, query, key, value):
    """Apply ``fn`` to q, k, v, keeping identical inputs identical objects."""
    out: dict[int, object] = {}
    return tuple(out.setdefault(id(x), fn(x)) for x in (query, key, value))


def _no_fast_path_hook(module: nn.Module, args: Any, output: Any) -> None:
    return None


def _token_side_only(module: nn.Module) -> bool:
    """True when the encoder layer's fast path would miss transforms: a non-foldable one, or strategy "token"."""
    kha = module.__dict__.get("_modules", {}).get("kha")
    if not isinstance(kha, KHATransforms):
        return False
    return getattr(module, "kha_strategy", "auto") == "token" or any(not kind_of(t).foldable for t in kha.values())


@contextlib.contextmanager
def _hook_paused(module: nn.Module) -> Iterator[None]:
    """Take the no-op hook off for one call (its transforms are at identity: the fast path is exact)."""
    hook = module.__dict__.get("_kha_hook")
    fn = module._forward_hooks.pop(hook.id, None) if hook is not None else None
    try:
        yield
    finally:
        if hook is not None and fn is not None:
            module._forward_hooks[hook.id] = fn


def _sync_fast_path_hook(module: nn.Module) -> None:
    """Keep the no-op hook (it switches the encoder layer's fast path off) exactly when it is needed."""
    hook = module.__dict__.get("_kha_hook")
    if _token_side_only(module):
        if hook is None:
            module.__dict__["_kha_hook"] = module.register_forward_hook(_no_fast_path_hook)
    elif hook is not None:
        hook.remove()
        del module.__dict__["_kha_hook"]


class KHAEncoderLayerHost(nn.Module):
    """Mixin of an ``nn.TransformerEncoderLayer`` whose ``self_attn`` carries KHA.

    Its fast path reads ``self_attn.in_proj_weight`` directly; for each call where the attention
    would run weight-side, the folded in-projection is in place for the layer's whole forward.
    """

    _kha_base_class: ClassVar[type[nn.Module]]
    _kha_prefix: ClassVar[str] = "KHAHost"
    self_attn: nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        attn = self.self_attn
        params = attn.kha_effective_in_proj() if isinstance(attn, KHAMultiheadAttention) else None
        if params is None:
            return super().forward(*args, **kwargs)
        with swapped_params(attn, params), _hook_paused(attn):
            return super().forward(*args, **kwargs)


def _host_class(base_cls: type) -> type:
    if issubclass(base_cls, KHAEncoderLayerHost):
        return base_cls
    name = f"{KHAEncoderLayerHost._kha_prefix}{base_cls.__name__}"
    return mixin_class(KHAEncoderLayerHost, base_cls, name, __name__, _kha_base_class=base_cls)


def attach_mha(
    module: nn.MultiheadAttention,
    kinds: dict[str, str],
    *,
    handler: str | None = None,
    strategy: str = "auto",
    host: nn.Module | None = None,
) -> nn.MultiheadAttention:
    """Give an ``nn.MultiheadAttention`` its KHA transforms in place.

    ``host``: the module holding it as ``self_attn``; an ``nn.TransformerEncoderLayer`` host gets
    :class:`KHAEncoderLayerHost` (its fast path reads the in-projection directly).
    """
    if module.bias_k is not None or module.add_zero_attn:
        raise UnsupportedModelError(
            "nn.MultiheadAttention with add_bias_kv or add_zero_attn is not supported by kha_compile."
        )
    ref = module.out_proj.weight
    transforms = KHATransforms(
        {r: make_transform(k, module.head_dim, dtype=ref.dtype, device=ref.device) for r, k in kinds.items()}
    )
    module.__class__ = KHAMultiheadAttention
    module.kha = transforms
    set_handler(module, handler)
    module.__dict__["_kha_strategy"] = check_strategy(strategy, "kha_strategy")
    _sync_fast_path_hook(module)
    if isinstance(host, nn.TransformerEncoderLayer) and host._modules.get("self_attn") is module:
        host.__class__ = _host_class(type(host))
    return module


def detach_mha(module: nn.Module) -> nn.Module:
    """Undo :func:`attach_mha` (the host keeps its class until :func:`release_hosts`)."""
    if isinstance(module, KHAMultiheadAttention):
        hook = module.__dict__.pop("_kha_hook", None)
        if hook is not None:
            hook.remove()
        del module.kha
        for attr in ("_kha_strategy",):
            module.__dict__.pop(attr, None)
        set_handler(module, None)
        module.__class__ = nn.MultiheadAttention  # type: ignore[assignment]
    return module


def release_hosts(model: nn.Module) -> int:
    """Give every encoder-layer host whose attention no longer carries KHA its class back; returns how many."""
    count = 0
    for m in model.modules():
        if isinstance(m, KHAEncoderLayerHost) and not isinstance(m._modules.get("self_attn"), KHAMultiheadAttention):
            m.__class__ = type(m)._kha_base_class  # type: ignore[assignment]  # back to the original class
            count += 1
    return count


def __getattr__(name: str) -> type:
    """Recreate ``KHAHost<Base>`` classes on demand (unpickling in a new process)."""
    prefix = KHAEncoderLayerHost._kha_prefix
    base = (
        module_class_named(name[len(prefix) :], KHAEncoderLayerHost)
        if name.startswith(prefix) and len(name) > len(prefix)
        else None
    )
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _host_class(base)
