"""An independent reference for KHA models: the untouched model, with the spec's transforms put in by hooks.

For a model and an untouched deep copy made before ``kc.apply``, :class:`Reference` registers forward
hooks on the copy's q, k, v projection modules. Each hook cuts the projection output into heads the
way the architecture's own modeling code does (written out below per architecture, with the head
counts read from the model's config), applies docs/method.md's transform to every head vector, and puts
the heads back:

- linear: ``h @ T``;
- MLP-value: ``2 * ((h @ up) * sigmoid(h @ gate)) @ down``.

The transforms' tensors are read from the KHA model's state dict by name, as docs/concepts.md names them
(``<projection path>.kha.<role>.<weight | up | gate | down>``). Nothing here imports kha_compile or
uses its layout machinery, so a test that compares a KHA model with this reference compares two
independent computations.

Example::

    untouched = copy.deepcopy(model)
    kc.apply(model, kc.KHAConfig(q="linear", k="linear", v="mlp"))
    perturb(model)
    ref = Reference(untouched)                       # the layout of model.config.model_type
    ref.load(model.state_dict(), expect={"q": "linear", "k": "linear", "v": "mlp"})
    torch.testing.assert_close(model(ids).logits, ref(input_ids=ids).logits)
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LAYOUTS", "Proj", "Reference", "check_against_reference", "main_tensor", "rel_err", "spec_transform"]

Fn = Callable[[Tensor], Tensor]  # one role's transform on head vectors (..., Dh) -> (..., Dh)
ROLES = ("q", "k", "v")


def spec_transform(params: dict[str, Tensor]) -> Fn:
    """docs/method.md's transform from its tensors: ``{"weight": T}`` (linear) or ``{"up", "gate", "down"}`` (MLP)."""
    if set(params) == {"weight"}:
        t = params["weight"]
        return lambda h: h @ t
    if set(params) == {"up", "gate", "down"}:
        up, gate, down = params["up"], params["gate"], params["down"]
        return lambda h: (2 * (h @ up) * torch.sigmoid(h @ gate)) @ down
    raise AssertionError(f"tensors {sorted(params)} are neither linear KHA (weight) nor MLP-value (up, gate, down)")


def kind_of_params(params: dict[str, Tensor]) -> str:
    return "linear" if set(params) == {"weight"} else "mlp"


def _identity(h: Tensor) -> Tensor:
    return h


# ----------------------------------------------------------------------------------------------------
# head layouts, per architecture: a projection output (..., F) -> the same with each role's heads transformed
# ----------------------------------------------------------------------------------------------------
Split = Callable[[Tensor, dict[str, Fn]], Tensor]


@dataclasses.dataclass(frozen=True)
class Proj:
    """One projection of the untouched model: its module path, the roles its output carries, how to cut it."""

    path: str
    roles: tuple[str, ...]
    split: Split
    mha: bool = False  # an nn.MultiheadAttention: its in-projection is a parameter, not a module
    kha: tuple[str, ...] = ()  # where its KHA tensors live when it has none of its own (joint streams share)


def _heads(n: int, dh: int, role: str) -> Split:
    """A separate projection of one role: (..., n*Dh) -> (..., n, Dh) -> transform -> (..., n*Dh)."""

    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        assert y.shape[-1] == n * dh, f"{role} projection has {y.shape[-1]} features, the config says {n} x {dh}"
        return fns[role](y.unflatten(-1, (n, dh))).flatten(-2)

    return split


def _stacked(blocks: tuple[tuple[str, int], ...], dh: int) -> Split:
    """A fused projection [role block | role block | ...] (GPT-2's c_attn, nanoGPT, falcon MQA, bigcode MQA).

    ``blocks``: (role, heads) in output order; each block is (heads, Dh) head-major.
    """

    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        sizes = [n * dh for _, n in blocks]
        assert y.shape[-1] == sum(sizes), f"fused projection has {y.shape[-1]} features, the config says {sizes}"
        parts = y.split(sizes, dim=-1)
        return torch.cat([fns[r](p.unflatten(-1, (n, dh))).flatten(-2) for (r, n), p in zip(blocks, parts)], -1)

    return split


def _interleaved(n: int, dh: int, order: tuple[str, ...] = ROLES) -> Split:
    """A fused projection laid out per head: (..., n, 3, Dh) (GPT-NeoX, BLOOM)."""

    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        y = y.unflatten(-1, (n, len(order), dh))  # (..., H, 3, Dh)
        out = [fns[r](y[..., i, :]) for i, r in enumerate(order)]  # each (..., H, Dh)
        return torch.stack(out, dim=-2).flatten(-3)

    return split


def _codegen(n: int, dh: int, mp: int = 4) -> Split:
    """CodeGen's qkv_proj: (..., mp, 3 * E/mp), each block [query | value | key], heads (n/mp, Dh) inside."""

    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        local = n * dh // mp
        y = y.unflatten(-1, (mp, 3, local))  # (..., mp, 3, local): CodeGenAttention's view + split
        out = []
        for i, r in enumerate(("q", "v", "k")):
            part = y[..., i, :].reshape(*y.shape[:-3], n, dh)  # (..., H, Dh): its reshape(hidden_shape)
            out.append(fns[r](part).reshape(*y.shape[:-3], mp, local))
        return torch.stack(out, dim=-2).flatten(-3)

    return split


def _mla_kv(n: int, nope: int, dv: int) -> Split:
    """DeepSeek's kv_b_proj: (..., H, nope + v); T^K on the per-head no-RoPE key part, T^V on the values."""

    def split(y: Tensor, fns: dict[str, Fn]) -> Tensor:
        y = y.unflatten(-1, (n, nope + dv))  # (..., H, nope + dv)
        k, v = y.split([nope, dv], dim=-1)
        return torch.cat([fns["k"](k), fns["v"](v)], dim=-1).flatten(-2)

    return split


def _named(model: nn.Module, names: dict[str, str], heads: Callable[[str, str], tuple[int, int]]) -> list[Proj]:
    """Separate q, k, v projections found by their attribute name (``{"q": "q_proj", ...}``)."""
    found = []
    for path, _ in model.named_modules():
        last = path.rsplit(".", 1)[-1]
        for role, attr in names.items():
            if last == attr:
                n, dh = heads(path, role)
                found.append(Proj(path, (role,), _heads(n, dh, role)))
    return found


def _paths(model: nn.Module, last: str) -> list[str]:
    return [p for p, _ in model.named_modules() if p.rsplit(".", 1)[-1] == last]


def _decoder_heads(cfg: Any) -> Callable[[str, str], tuple[int, int]]:
    h = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or h
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    return lambda path, role: (h if role == "q" else kv, dh)


QKV_PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}
QUERY_KEY_VALUE = {"q": "query", "k": "key", "v": "value"}


def _llama_like(model: nn.Module, cfg: Any) -> list[Proj]:  # llama, qwen3, mistral, gemma2/3, phi, olmo2, gptj, vit
    return _named(model, QKV_PROJ, _decoder_heads(cfg))


def _bert_like(model: nn.Module, cfg: Any) -> list[Proj]:  # bert, albert: self.query / key / value
    return _named(model, QUERY_KEY_VALUE, _decoder_heads(cfg))


def _t5(model: nn.Module, cfg: Any) -> list[Proj]:  # SelfAttention and EncDecAttention: q, k, v of n_heads x d_kv
    return _named(model, {"q": "q", "k": "k", "v": "v"}, lambda path, role: (cfg.num_heads, cfg.d_kv))


def _bart(model: nn.Module, cfg: Any) -> list[Proj]:  # encoder / decoder heads from their own config fields
    def heads(path: str, role: str) -> tuple[int, int]:
        h = cfg.encoder_attention_heads if path.startswith("encoder.") else cfg.decoder_attention_heads
        return h, cfg.d_model // h

    return _named(model, QKV_PROJ, heads)


def _swin(model: nn.Module, cfg: Any) -> list[Proj]:  # stage i: embed_dim * 2^i features in num_heads[i] heads
    def heads(path: str, role: str) -> tuple[int, int]:
        stage = int(re.search(r"encoder\.layers\.(\d+)\.", path).group(1))  # type: ignore[union-attr]
        h = cfg.num_heads[stage]
        return h, cfg.embed_dim * 2**stage // h

    return _named(model, QKV_PROJ, heads)


def _gpt2(model: nn.Module, cfg: Any) -> list[Proj]:  # c_attn: [Q | K | V], each (H, Dh)
    h = cfg.n_head
    dh = cfg.n_embd // h
    return [Proj(p, ROLES, _stacked((("q", h), ("k", h), ("v", h)), dh)) for p in _paths(model, "c_attn")]


def _gpt_bigcode(model: nn.Module, cfg: Any) -> list[Proj]:  # multi_query c_attn: [Q (H, Dh) | K (Dh) | V (Dh)]
    assert cfg.multi_query, "only the multi-query layout is written out here"
    h = cfg.n_head
    dh = cfg.n_embd // h
    return [Proj(p, ROLES, _stacked((("q", h), ("k", 1), ("v", 1)), dh)) for p in _paths(model, "c_attn")]


def _falcon(model: nn.Module, cfg: Any) -> list[Proj]:  # multi_query, old layout: (H + 2, Dh) = [Q heads, K, V]
    assert cfg.multi_query and not cfg.new_decoder_architecture, "only the old multi-query layout is written out"
    h = cfg.num_attention_heads
    dh = cfg.hidden_size // h
    return [Proj(p, ROLES, _stacked((("q", h), ("k", 1), ("v", 1)), dh)) for p in _paths(model, "query_key_value")]


def _neox_like(model: nn.Module, cfg: Any) -> list[Proj]:  # gpt_neox, bloom: (H, 3, Dh) per head
    h = cfg.num_attention_heads
    dh = cfg.hidden_size // h
    return [Proj(p, ROLES, _interleaved(h, dh)) for p in _paths(model, "query_key_value")]


def _codegen_layout(model: nn.Module, cfg: Any) -> list[Proj]:
    h = cfg.n_head
    return [Proj(p, ROLES, _codegen(h, cfg.n_embd // h)) for p in _paths(model, "qkv_proj")]


def _deepseek_v3(model: nn.Module, cfg: Any) -> list[Proj]:  # MLA: q_b_proj (H, nope + rope), kv_b_proj (H, nope + v)
    h = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = [Proj(p, ("q",), _heads(h, qk, "q")) for p in _paths(model, "q_b_proj")]
    kv = [Proj(p, ("k", "v"), _mla_kv(h, cfg.qk_nope_head_dim, cfg.v_head_dim)) for p in _paths(model, "kv_b_proj")]
    return q + kv


def _torch_mha(model: nn.Module, cfg: Any) -> list[Proj]:  # nn.MultiheadAttention: packed in_proj [Q | K | V]
    found = []
    for path, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            h, dh = m.num_heads, m.embed_dim // m.num_heads
            found.append(Proj(path, ROLES, _stacked((("q", h), ("k", h), ("v", h)), dh), mha=True))
    return found


def _nanogpt(model: nn.Module, cfg: Any) -> list[Proj]:  # c_attn Linear(d, 3d), split [Q | K | V], n_head heads
    found = []
    for path, m in model.named_modules():
        if path.endswith("attn") and hasattr(m, "c_attn"):
            h, dh = m.n_head, m.n_embd // m.n_head
            found.append(Proj(f"{path}.c_attn", ROLES, _stacked((("q", h), ("k", h), ("v", h)), dh)))
    return found


def _x_transformers(model: nn.Module, cfg: Any) -> list[Proj]:  # to_q (heads), to_k / to_v (kv_heads) of dim_head
    heads = {"q": cfg["heads"], "k": cfg.get("kv_heads", cfg["heads"]), "v": cfg.get("kv_heads", cfg["heads"])}
    return _named(model, {"q": "to_q", "k": "to_k", "v": "to_v"}, lambda path, role: (heads[role], cfg["dim_head"]))


def _esm(model: nn.Module, cfg: Any) -> list[Proj]:  # fair-esm MultiheadAttention: q_proj / k_proj / v_proj
    h = cfg["heads"]
    return _named(model, QKV_PROJ, lambda path, role: (h, cfg["dim"] // h))


LAYOUTS: dict[str, Callable[[nn.Module, Any], list[Proj]]] = {
    **dict.fromkeys(("llama", "qwen3", "mistral", "gemma2", "gemma3_text", "phi", "olmo2", "gptj", "vit"), _llama_like),
    "bert": _bert_like,
    "albert": _bert_like,
    "t5": _t5,
    "bart": _bart,
    "swin": _swin,
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt_bigcode,
    "falcon": _falcon,
    "gpt_neox": _neox_like,
    "bloom": _neox_like,
    "codegen": _codegen_layout,
    "deepseek_v3": _deepseek_v3,
    "torch_mha": _torch_mha,
    "nanogpt": _nanogpt,
    "x_transformers": _x_transformers,
    "esm": _esm,
}


# ----------------------------------------------------------------------------------------------------
# nn.MultiheadAttention: no projection module to hook, so its self-attention is written out per head
# ----------------------------------------------------------------------------------------------------
def _mha_forward(mha: nn.MultiheadAttention, split: Split, fns: dict[str, Fn]) -> Callable[..., Any]:
    """``mha``'s self-attention by hand: in-projection, transforms per head, SDPA per head, out-projection."""

    def forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, **kw):
        assert query is key is value, "the reference writes out self-attention only"
        assert key_padding_mask is None and attn_mask is None and mha.dropout == 0.0
        x = query if mha.batch_first else query.transpose(0, 1)  # (B, S, E)
        h, dh = mha.num_heads, mha.embed_dim // mha.num_heads
        qkv = split(F.linear(x, mha.in_proj_weight, mha.in_proj_bias), fns)  # (B, S, 3E) with KHA per head
        q, k, v = (t.unflatten(-1, (h, dh)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))  # (B, H, S, Dh)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(kw.get("is_causal", False)))  # (B, H, S, Dh)
        o = mha.out_proj(o.transpose(1, 2).flatten(-2))  # (B, S, E)
        return (o if mha.batch_first else o.transpose(0, 1)), None

    return forward


# ----------------------------------------------------------------------------------------------------
# the reference
# ----------------------------------------------------------------------------------------------------
class Reference:
    """The untouched model with docs/method.md's transforms applied at its projection outputs by hooks.

    ``arch``: a key of :data:`LAYOUTS` (default: ``model.config.model_type``), or a layout function of
    its own (``(model, cfg) -> [Proj]``); ``cfg``: where the head counts come from (default:
    ``model.config``; a dict for models without a transformers config).
    """

    def __init__(
        self, untouched: nn.Module, arch: str | Callable[[nn.Module, Any], list[Proj]] | None = None, cfg: Any = None
    ) -> None:
        self.model = untouched
        cfg = cfg if cfg is not None else getattr(untouched, "config", None)
        arch = arch or cfg.model_type
        self.projs = arch(untouched, cfg) if callable(arch) else LAYOUTS[arch](untouched, cfg)
        assert self.projs, f"no q/k/v projection of the {arch} layout found in {type(untouched).__name__}"
        self.kha: dict[str, dict[str, Tensor]] = {}  # "<path>.kha.<role>" -> {param: tensor}

    def load(self, state: dict[str, Tensor], expect: dict[str, str] | None = None) -> Reference:
        """Take the KHA model's weights: the model's own into the copy (strict), the KHA tensors by name.

        ``expect``: role -> kind ("linear" | "mlp") that every projection must carry, and nothing else.
        """
        own = {k: v for k, v in state.items() if ".kha." not in f".{k}"}
        self.model.load_state_dict(own, strict=True)
        kha = {k: v for k, v in state.items() if ".kha." in f".{k}"}
        self.kha = {}
        used = set()
        for proj in self.projs:
            for role in proj.roles:
                params: dict[str, Tensor] = {}
                for home in (proj.path, *proj.kha):  # its own tensors, else those of a projection it shares
                    prefix = f"{home}.kha.{role}."
                    params = {k[len(prefix) :]: v for k, v in kha.items() if home and k.startswith(prefix)}
                    if params:
                        break
                if params:
                    self.kha[f"{proj.path}.kha.{role}"] = {
                        p: v.detach().clone().requires_grad_(v.is_floating_point()) for p, v in params.items()
                    }
                    used.update(prefix + p for p in params)
                if expect is not None:
                    want = expect.get(role)
                    got = kind_of_params(params) if params else None
                    assert got == want, f"{proj.path} role {role}: KHA {got!r} in the state dict, expected {want!r}"
        left = sorted(set(kha) - used)
        assert not left, f"KHA tensors at no q/k/v projection of the reference layout: {left[:4]}"
        return self

    def _fns(self, proj: Proj) -> dict[str, Fn]:
        fns: dict[str, Fn] = dict.fromkeys(ROLES, _identity)
        for role in proj.roles:
            params = self.kha.get(f"{proj.path}.kha.{role}")
            if params:
                fns[role] = spec_transform(params)
        return fns

    @contextlib.contextmanager
    def _hooked(self) -> Iterator[None]:
        handles = []
        patched = []
        try:
            for proj in self.projs:
                mod = self.model.get_submodule(proj.path)
                fns = self._fns(proj)
                if proj.mha:
                    assert isinstance(mod, nn.MultiheadAttention)
                    mod.forward = _mha_forward(mod, proj.split, fns)  # type: ignore[method-assign]
                    patched.append(mod)
                else:
                    handles.append(mod.register_forward_hook(lambda m, i, y, s=proj.split, f=fns: s(y, f)))
            yield
        finally:
            for h in handles:
                h.remove()
            for mod in patched:
                del mod.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The reference forward (always with autograd on: torch's fused no-grad fast paths skip the hooks)."""
        with torch.enable_grad(), self._hooked():
            return self.model(*args, **kwargs)

    def no_grad(self, *args: Any, **kwargs: Any) -> Any:
        """The reference forward without autograd, for kernels with no backward here (flex attention on
        CPU); not for nn.MultiheadAttention, whose no-grad fast path skips the hooks."""
        assert not any(p.mha for p in self.projs), "nn.MultiheadAttention's no-grad fast path skips the hooks"
        with torch.no_grad(), self._hooked():
            return self.model(*args, **kwargs)

    def params(self) -> dict[str, Tensor]:
        """Every tensor the reference computes with, under the KHA model's parameter names."""
        out = dict(self.model.named_parameters())
        for prefix, params in self.kha.items():
            out.update({f"{prefix}.{p}": t for p, t in params.items()})
        return out


# ----------------------------------------------------------------------------------------------------
# the check every KHA model passes: perturbed forwards, gradients, and forwards after optimizer steps
# ----------------------------------------------------------------------------------------------------
def main_tensor(out: Any) -> Tensor:
    """The tensor a model's forward is about: logits, last hidden state, or the output itself."""
    for attr in ("logits", "last_hidden_state"):
        value = out.get(attr) if isinstance(out, dict) else getattr(out, attr, None)
        if value is not None:
            return value
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def rel_err(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b|."""
    return float(
        (a.detach().float() - b.detach().float()).abs().max() / b.detach().float().abs().max().clamp_min(1e-12)
    )


def _loss(out: Tensor) -> Tensor:
    """A loss with gradients everywhere (``square().mean()`` is flat after a final LayerNorm)."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
    return (out.float() * w).sum() / out.shape[0]


Example = tuple[tuple, dict]


def check_against_reference(
    model: nn.Module,
    ref: Reference,
    examples: list[Example],
    expect: dict[str, str],
    *,
    steps: int = 3,
    rtol: float = 2e-5,
    grad_rtol: float = 1e-4,
) -> None:
    """``model`` (with KHA, perturbed) against ``ref``: forwards, gradients, and forwards after ``steps`` steps.

    For every example (give one with more tokens than the projections have inputs, so the weight-side
    strategy runs too): the no_grad and the grad-mode outputs equal the reference's within ``rtol`` of
    their largest value. At the last example, every parameter's gradient equals the reference's
    (autograd through the hooks) within ``grad_rtol`` of its largest value. Then ``steps`` steps of
    ``AdamW(fused=True)`` (which does not bump ``param._version``) on every parameter, and the forwards
    again against a reference loaded with the trained weights.
    """

    def forwards(when: str) -> None:
        for i, (args, kwargs) in enumerate(examples):
            want = main_tensor(ref(*args, **kwargs)).detach()
            with torch.no_grad():
                got = main_tensor(model(*args, **kwargs))
            err = rel_err(got, want)
            assert err < rtol, f"{when}, example {i}, no_grad: {err:.3g} off the reference"

    ref.load(model.state_dict(), expect)
    forwards("perturbed")

    args, kwargs = examples[-1]
    model.zero_grad(set_to_none=True)
    out = main_tensor(model(*args, **kwargs))
    _loss(out).backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want_params = ref.params()
    ref.model.zero_grad(set_to_none=True)
    ref_out = main_tensor(ref(*args, **kwargs))
    _loss(ref_out).backward()
    err = rel_err(out, ref_out)
    assert err < rtol, f"perturbed, example {len(examples) - 1}, grad on: {err:.3g} off the reference"
    want = {n: t.grad for n, t in want_params.items() if t.grad is not None}
    assert set(got) == set(want), f"gradients of {sorted(set(got) ^ set(want))[:4]} on one side only"
    assert any(".kha." in n for n in got), "no KHA parameter got a gradient"
    for n in want:
        scale = float(want[n].abs().max())
        err = float((got[n] - want[n]).abs().max())
        assert err <= grad_rtol * scale + 1e-7, f"gradient of {n}: {err:.3g} off the reference (largest {scale:.3g})"
    model.zero_grad(set_to_none=True)

    if steps:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            _loss(main_tensor(model(*args, **kwargs))).backward()
            opt.step()
        model.zero_grad(set_to_none=True)
        ref.load(model.state_dict(), expect)
        forwards(f"after {steps} fused AdamW steps")
