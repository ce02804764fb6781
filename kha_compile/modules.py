"""The modules KHA inserts: the shared transforms and the projection that carries them.

A projection keeps its own object, parameters and ``state_dict`` keys. :func:`attach` turns it
into a KHA projection by switching its class to a subclass defined here (``KHALinear`` for
``nn.Linear``, ``KHAConv1D`` for transformers' ``Conv1D``, ...) and adding a ``kha`` child that
holds one transform per role. :func:`detach` switches the class back, so the original module
object, class and keys return (that is how :func:`kha_compile.fold` restores a vanilla model).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .errors import UnsupportedLayoutError, UnsupportedModelError
from .kinds import Role
from .mixins import mixin_class, module_class_named
from .strategy import cached_fold, check_strategy, needs_grad, swapped_params, use_weight_side
from .transforms import get_transform, kind_of
from .transforms.linear import KHALinearTransform
from .transforms.mlp import KHAMLPValue

__all__ = [
    "HeadSlot",
    "KHALinearTransform",
    "KHAMLPValue",
    "KHAMultiheadAttention",
    "KHAProjection",
    "KHATransforms",
    "apply_segments",
    "attach",
    "attach_mha",
    "carries_kha",
    "detach",
    "detach_mha",
    "is_kha_projection",
    "kha_class_for",
    "layout_plan",
    "make_transform",
    "segment_pieces",
    "set_strategy",
    "transforms_of",
]


class KHATransforms(nn.ModuleDict):
    """The ``kha`` child of a KHA projection: one shared transform per role ("q", "k", "v")."""


def make_transform(
    kind: str, head_dim: int, *, dtype: torch.dtype | None = None, device: torch.device | None = None
) -> nn.Module:
    """Build the transform of registered ``kind`` ("linear" | "mlp" | ...) at identity, in the given dtype and device."""
    return get_transform(kind).create(head_dim, dtype=dtype, device=device)


@dataclasses.dataclass(frozen=True)
class HeadSlot:
    """Where one role's heads sit in a projection's output features.

    Feature of head ``h``, dim ``j`` = ``offset + h * head_stride + j``. Separate projections
    (``head_stride == head_dim``), fused [Q|K|V] blocks and interleaved [H, 3, Dh] layouts are
    all of this form.
    """

    role: Role
    offset: int
    num_heads: int
    head_dim: int
    head_stride: int

    @property
    def span(self) -> int:
        return (self.num_heads - 1) * self.head_stride + self.head_dim

    def index(self) -> Tensor:  # (H, Dh) feature indices
        h = torch.arange(self.num_heads).unsqueeze(1) * self.head_stride
        return self.offset + h + torch.arange(self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def layout_plan(slots: tuple[HeadSlot, ...], out_features: int) -> tuple[str, int]:
    """Choose how to cut the heads out of the projection output: 'blocks' or 'interleaved'."""
    if all(s.head_stride == s.head_dim for s in slots):
        spans = sorted((s.offset, s.offset + s.num_heads * s.head_dim) for s in slots)
        if all(a[1] <= b[0] for a, b in itertools.pairwise(spans)) and spans[-1][1] <= out_features:
            return "blocks", 0
    strides = {s.head_stride for s in slots}
    heads = {s.num_heads for s in slots}
    if len(strides) == 1 and len(heads) == 1:
        stride = strides.pop()
        if stride * heads.pop() == out_features and all(s.offset + s.head_dim <= stride for s in slots):
            return "interleaved", stride
    raise UnsupportedLayoutError(
        f"head layout {[s.to_dict() for s in slots]} over {out_features} features is neither "
        "separate/fused blocks nor an interleaved [H, roles, Dh] layout; kha_compile cannot "
        "insert transforms into this projection."
    )


def apply_segments(y: Tensor, width: int, pieces: list[tuple[int, int, tuple[int, nn.Module] | None]]) -> Tensor:
    """Rebuild the last axis of ``y`` (…, width) from pieces (start, length, (head_dim, transform) | None)."""
    out = []
    for start, length, tf in pieces:
        seg = y.narrow(-1, start, length)
        if tf is not None:
            head_dim, module = tf
            lead = seg.shape[:-1]
            seg = module(seg.reshape(*lead, length // head_dim, head_dim)).reshape(*lead, length)
        out.append(seg)
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def segment_pieces(
    bounds: Sequence[tuple[int, int, tuple[int, nn.Module] | None]], width: int
) -> list[tuple[int, int, tuple[int, nn.Module] | None]]:
    """Fill the gaps between transformed segments with untouched ones, in order."""
    pieces: list[tuple[int, int, tuple[int, nn.Module] | None]] = []
    pos = 0
    for start, length, tf in sorted(bounds, key=lambda b: b[0]):
        if start > pos:
            pieces.append((pos, start - pos, None))
        pieces.append((start, length, tf))
        pos = start + length
    if pos < width:
        pieces.append((pos, width - pos, None))
    return pieces


class KHAProjection(nn.Module):
    """Mixin for a projection module that applies shared KHA transforms to its head slices.

    Not instantiated directly: :func:`attach` gives an existing projection a subclass of this
    mixin and its own class, so it keeps its parameters and ``state_dict`` keys.
    """

    kha: KHATransforms
    _kha_slots: tuple[HeadSlot, ...]
    _kha_out_features: int
    kha_strategy: str = "auto"  # linear KHA execution: "auto" | "weight" | "token" (kha_compile.strategy)

    def forward(self, *args, **kwargs):
        folded = self._kha_weight_side_roles(args, kwargs)
        if not folded:  # token-side: transform the projection output
            return self.kha_transform(super().forward(*args, **kwargs))
        params = self._kha_folded_params(folded)
        if params is None:
            return self.kha_transform(super().forward(*args, **kwargs))
        with swapped_params(self, params):  # weight-side: the base forward with W' = T^T W per head slot
            y = super().forward(*args, **kwargs)
        return self.kha_transform(y, skip=folded)

    def _kha_sources(self, roles: tuple[str, ...]) -> list[Tensor]:
        """The tensors a fold of ``roles`` reads: weight, bias, and each role's transform parameters."""
        out: list[Tensor] = [t for t in (self._parameters.get("weight"), self._parameters.get("bias")) if t is not None]
        for r in roles:
            out.extend(kind_of(self.kha[r]).params(self.kha[r]))
        return out

    def _kha_weight_side_roles(self, args: tuple, kwargs: dict) -> tuple[str, ...]:
        """The foldable roles this call runs weight-side (empty: all token-side), per ``kha_strategy``."""
        roles = tuple(r for r in self.kha if kind_of(self.kha[r]).foldable)
        w = self._parameters.get("weight")
        x = args[0] if args else next(iter(kwargs.values()), None)
        if not roles or not isinstance(w, Tensor) or w.dim() != 2 or not isinstance(x, Tensor) or x.dim() == 0:
            return ()
        tokens = x.numel() // max(x.shape[-1], 1)
        return roles if use_weight_side(self.kha_strategy, self._kha_sources(roles), tokens, x.shape[-1]) else ()

    def _kha_folded_params(self, roles: tuple[str, ...]) -> list[tuple[str, Tensor]] | None:
        """Weight and bias with ``roles`` folded in by this module's handler (cached while no grad is needed)."""
        from .passes.handlers import handler_of  # passes import this module

        handler = handler_of(self)
        params = cached_fold(self, roles, self._kha_sources(roles), lambda: handler.weight_side(self, roles) or [])
        return params or None

    def _kha_layout(self, skip: tuple[str, ...] = ()) -> tuple[tuple[HeadSlot, ...], str, int]:
        """(active slots, plan, stride) of the roles not in ``skip``, computed once per set of roles."""
        roles = tuple(r for r in self.kha if r not in skip)
        cache = self.__dict__.get("_kha_cached_layout")
        if not isinstance(cache, dict):  # none yet (or a pickle from before strategies)
            cache = self.__dict__["_kha_cached_layout"] = {}
        cached = cache.get(roles)
        if cached is None:
            slots = tuple(s for s in self._kha_slots if s.role in roles)
            plan = layout_plan(slots, self._kha_out_features) if slots else ("none", 0)
            cached = cache[roles] = (slots, *plan)
        return cached

    def kha_transform(self, y: Tensor, skip: tuple[str, ...] = ()) -> Tensor:
        """Apply each role's transform (except those in ``skip``) to its head slices of ``y`` (..., out)."""
        slots, mode, stride = self._kha_layout(skip)
        if not slots:
            return y
        width = y.shape[-1]
        if mode == "blocks":  # heads of a role are contiguous: (…, H*Dh) -> (…, H, Dh)
            bounds = [(s.offset, s.num_heads * s.head_dim, (s.head_dim, self.kha[s.role])) for s in slots]
            return apply_segments(y, width, segment_pieces(bounds, width))
        # interleaved: (…, H*S) -> (…, H, S); each role is a Dh-wide column block of S
        lead = y.shape[:-1]
        heads = width // stride
        y3 = y.reshape(*lead, heads, stride)  # (…, H, S)
        bounds = [(s.offset, s.head_dim, (s.head_dim, self.kha[s.role])) for s in slots]
        return apply_segments(y3, stride, segment_pieces(bounds, stride)).reshape(*lead, width)

    def kha_extra(self) -> str:
        return ", ".join(
            f"{s.role}:{type(self.kha[s.role]).__name__}[{s.num_heads}x{s.head_dim}]"
            for s in self._kha_slots
            if s.role in self.kha
        )


def kha_class_for(base_cls: type) -> type:
    """The KHA subclass of a projection class (created once, named ``KHA<Base>``)."""
    if issubclass(base_cls, KHAProjection):
        return base_cls
    return mixin_class(KHAProjection, base_cls, f"KHA{base_cls.__name__}", __name__, _kha_base_class=base_cls)


def is_kha_projection(module: nn.Module) -> bool:
    return isinstance(module, KHAProjection)


def carries_kha(module: nn.Module) -> bool:
    """True when ``module`` holds KHA transforms (a ``kha`` child), whichever handler attached them."""
    return isinstance(module._modules.get("kha"), KHATransforms)


def transforms_of(module: nn.Module) -> KHATransforms:
    """The ``kha`` child of a module that carries KHA (an empty one for a module that does not)."""
    kha = module._modules.get("kha")
    return kha if isinstance(kha, KHATransforms) else KHATransforms()


def attach(module: nn.Module, slots: tuple[HeadSlot, ...], kinds: dict[str, str], out_features: int) -> nn.Module:
    """Turn ``module`` into a KHA projection in place; transforms match its weight's dtype and device."""
    ref = next(iter(module.parameters(recurse=False)), None)
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else None
    device = ref.device if ref is not None else None
    transforms = KHATransforms()
    for s in slots:
        if s.role in kinds and s.role not in transforms:
            transforms[s.role] = make_transform(kinds[s.role], s.head_dim, dtype=dtype, device=device)
    layout_plan(tuple(s for s in slots if s.role in transforms), out_features)  # refuse odd layouts up front
    module.__class__ = kha_class_for(type(module))
    module.kha = transforms
    module.__dict__["_kha_slots"] = tuple(slots)  # plain attributes (not parameters or modules)
    module.__dict__["_kha_out_features"] = out_features
    return module


def detach(module: nn.Module) -> nn.Module:
    """Undo :func:`attach`: the module gets back its original class; its ``kha`` child is removed."""
    if not isinstance(module, KHAProjection):
        return module
    del module.kha
    for attr in (
        "_kha_slots",
        "_kha_out_features",
        "_kha_cached_layout",
        "_kha_handler",
        "kha_strategy",
        "_kha_fold_cache",
        "_kha_weight_axis",
    ):
        module.__dict__.pop(attr, None)
    module.__class__ = type(module)._kha_base_class  # type: ignore[attr-defined]
    return module


class KHAMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with KHA transforms on its per-head q, k, v.

    The projections of ``nn.MultiheadAttention`` are parameters used functionally
    (``in_proj_weight``), not modules, so the whole module gets this class (same object,
    parameters and keys); :func:`detach_mha` gives it its class back.

    Linear transforms run weight-side (see :mod:`kha_compile.strategy`) by calling
    ``nn.MultiheadAttention.forward`` itself with the folded in-projection, so torch's fused
    inference path runs when it would without KHA. ``nn.TransformerEncoderLayer``'s fast path reads
    ``self_attn.in_proj_weight`` / ``in_proj_bias`` without calling this module: while no gradient
    is needed (and ``kha_strategy`` is not ``"token"``), reads of those attributes from
    ``torch.nn.modules.transformer`` (only there) give the effective (folded, cached) tensors;
    every other reader gets the parameters themselves.
    Otherwise the forward follows ``F.multi_head_attention_forward`` step by step with the
    transforms right after the in-projection (token-side), and a no-op forward hook keeps the
    encoder layer's fast path (which would skip them) switched off: that is the case for
    MLP-value and for ``kha_strategy = "token"``.
    """

    kha: KHATransforms

    @property
    def kha_strategy(self) -> str:
        """How linear KHA runs here: "auto" | "weight" | "token"; setting it updates the fast-path hook."""
        return str(self.__dict__.get("_kha_strategy", "auto"))

    @kha_strategy.setter
    def kha_strategy(self, value: str) -> None:
        self.__dict__["_kha_strategy"] = check_strategy(value, "kha_strategy")
        _sync_fast_path_hook(self)

    def _kha_roles(self) -> tuple[str, ...]:
        return tuple(r for r in ("q", "k", "v") if r in self.kha and kind_of(self.kha[r]).foldable)

    def _kha_sources(self, roles: tuple[str, ...]) -> list[Tensor]:
        names = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight")
        out: list[Tensor] = [t for t in (self._parameters.get(n) for n in names) if t is not None]
        for r in roles:
            out.extend(kind_of(self.kha[r]).params(self.kha[r]))
        return out

    def _kha_folded(self, roles: tuple[str, ...]) -> list[tuple[str, Tensor]]:
        from .passes.handlers import handler_of  # passes import this module

        handler = handler_of(self)
        return cached_fold(self, roles, self._kha_sources(roles), lambda: handler.weight_side(self, roles) or [])

    def __getattr__(self, name: str):
        """The effective in-projection for ``nn.TransformerEncoderLayer``'s fast path; the parameter otherwise."""
        if (
            name in _MHA_WEIGHTS
            and "_kha_swapped" not in self.__dict__
            and not torch.compiler.is_compiling()
            and sys._getframe(1).f_globals.get("__name__") == _FAST_PATH_READER
        ):
            eff = _effective_in_proj(self, name)
            if eff is not None:
                return eff
        return super().__getattr__(name)

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
        roles = self._kha_roles()
        tokens = query.numel() // max(query.shape[-1], 1)
        # torch's positional order: query, key, value, key_padding_mask, need_weights, attn_mask, ...
        args = (query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal)
        if roles and use_weight_side(self.kha_strategy, self._kha_sources(roles), tokens, self.embed_dim):
            with swapped_params(self, self._kha_folded(roles)):
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


def _no_fast_path_hook(module, args, output):
    return None


# only torch's transformer module reads the folded view (its encoder-layer fast path bypasses our forward);
# every other reader, kc.fold's commit included, gets the parameter itself
_FAST_PATH_READER = "torch.nn.modules.transformer"
_MHA_WEIGHTS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _token_side_only(module: nn.Module) -> bool:
    """True when the encoder layer's fast path would miss transforms: a non-foldable one, or strategy "token"."""
    kha = module.__dict__.get("_modules", {}).get("kha")
    if not isinstance(kha, KHATransforms):
        return False
    return getattr(module, "kha_strategy", "auto") == "token" or any(not kind_of(t).foldable for t in kha.values())


def _sync_fast_path_hook(module: nn.Module) -> None:
    """Keep the no-op hook (it switches the encoder layer's fast path off) exactly when it is needed."""
    hook = module.__dict__.get("_kha_hook")
    if _token_side_only(module):
        if hook is None:
            module.__dict__["_kha_hook"] = module.register_forward_hook(_no_fast_path_hook)
    elif hook is not None:
        hook.remove()
        del module.__dict__["_kha_hook"]


def _effective_in_proj(module: KHAMultiheadAttention, name: str) -> Tensor | None:
    """The folded ``name`` (cached) while no gradient is needed and every transform folds, else None."""
    kha = module._modules.get("kha")
    if not isinstance(kha, KHATransforms) or _token_side_only(module) or torch.compiler.is_compiling():
        return None
    roles = module._kha_roles()
    if not roles or len(roles) != len(kha):
        return None
    sources = module._kha_sources(roles)
    if needs_grad(sources) or torch.overrides.has_torch_function(tuple(sources)):
        return None
    return dict(module._kha_folded(roles)).get(name)


def set_strategy(module: nn.Module, strategy: str) -> None:
    """Set how a KHA module runs linear KHA: "auto" | "weight" | "token" (its ``kha_strategy``).

    Example::

        set_strategy(model.model.layers[0].self_attn.q_proj, "token")
    """
    check_strategy(strategy, "kha_strategy")
    if isinstance(module, KHAMultiheadAttention):
        module.kha_strategy = strategy  # the property also updates the fast-path hook
    else:
        module.__dict__["kha_strategy"] = strategy


def attach_mha(module: nn.MultiheadAttention, kinds: dict[str, str]) -> nn.MultiheadAttention:
    """Give an ``nn.MultiheadAttention`` its KHA transforms in place."""
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
    _sync_fast_path_hook(module)
    return module


def detach_mha(module: nn.Module) -> nn.Module:
    if isinstance(module, KHAMultiheadAttention):
        hook = module.__dict__.pop("_kha_hook", None)
        if hook is not None:
            hook.remove()
        del module.kha
        for attr in ("_kha_handler", "_kha_strategy", "_kha_fold_cache"):
            module.__dict__.pop(attr, None)
        module.__class__ = nn.MultiheadAttention  # type: ignore[assignment]
    return module


def __getattr__(name: str) -> type:
    """Recreate ``KHA<Base>`` classes on demand, so a pickled model with KHA loads in a new process."""
    base = module_class_named(name[3:], KHAProjection) if name.startswith("KHA") and len(name) > 3 else None
    if base is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return kha_class_for(base)
