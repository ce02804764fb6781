"""Tiny models with random weights, one per attention family, for the tests.

Each factory returns a :class:`ZooCase`: the model (eval mode), one valid call of it, and what the
attention matcher should find. Sizes are chosen so that every head has ``head_dim == 16``
(4 heads at hidden 64), with 2 layers, intermediate 128 and a vocabulary of 128.

Example::

    case = zoo.make("llama")
    out = case.model(*case.args, **case.kwargs)
    assert case.num_sites == 2 and case.kinds == {"gqa": 2}
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kha_compile.analysis.inputs import example_inputs
from kha_compile.cli import tiny

__all__ = ["HF_NAMES", "TORCH_NAMES", "ZOO_NAMES", "ZooCase", "inputs", "make"]

SEED = 0
HIDDEN, HEADS, LAYERS, INTER, VOCAB, MAX_POS = (
    tiny.HIDDEN,
    tiny.HEADS,
    tiny.LAYERS,
    tiny.INTER,
    tiny.VOCAB,
    tiny.MAX_POS,
)
HEAD_DIM = tiny.HEAD_DIM  # 16
BATCH, SEQ = 2, 8


@dataclasses.dataclass
class ZooCase:
    """One tiny model, one valid call of it, and what the matcher should find in it."""

    name: str
    model: nn.Module
    args: tuple
    kwargs: dict[str, Any]
    kinds: dict[str, int]  # expected sites per kind, e.g. {"mha": 4, "cross": 2} for t5
    num_heads: int  # query heads per site
    num_kv_heads: int  # key/value heads per site (1 for MQA)
    causal_lm: bool  # has generate() (a transformers causal LM or seq2seq LM)
    hf: bool  # a transformers PreTrainedModel

    @property
    def num_sites(self) -> int:
        """Expected number of attention sites: self per layer, plus cross per decoder layer."""
        return sum(self.kinds.values())

    @property
    def example(self) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of one valid call."""
        return self.args, self.kwargs

    def __call__(self) -> Any:
        """Run the model on its example inputs."""
        return self.model(*self.args, **self.kwargs)


# --------------------------------------------------------------------------------------------
# transformers models (random weights from tiny configs)
# --------------------------------------------------------------------------------------------


_hf, _DECODER = tiny.hf_model, tiny.DECODER
# the CLI's tiny models are the zoo's llama, qwen3 (q_norm / k_norm before rope), gpt2 (fused Conv1D
# c_attn, [Q|K|V] split) and bert
_llama, _qwen3, _gpt2, _bert = (tiny.TINY_MODELS[f"tiny-{n}"] for n in ("llama", "qwen3", "gpt2", "bert"))


def _mistral() -> nn.Module:  # MQA: one key/value head
    return _hf(
        "MistralForCausalLM", "MistralConfig", **_DECODER, num_key_value_heads=1, head_dim=HEAD_DIM, sliding_window=None
    )


def _gpt_neox() -> nn.Module:  # fused query_key_value, interleaved per head [H, 3, Dh]; rope on half
    return _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_DECODER, rotary_pct=0.5)


def _t5() -> nn.Module:  # encoder-decoder: self attention in both, cross attention in the decoder
    return _hf(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HEAD_DIM,
        d_ff=INTER,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS,
        num_heads=HEADS,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )


def _gemma2() -> nn.Module:  # eager attention: matmul, tanh soft-capping, softmax, matmul
    return _hf(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        attn="eager",
        **_DECODER,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=16,
    )


def _phi() -> nn.Module:  # partial rotary (half of each head)
    return _hf(
        "PhiForCausalLM",
        "PhiConfig",
        **_DECODER,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )


def _falcon() -> nn.Module:  # MQA with a fused query_key_value of (H + 2) * Dh outputs
    return _hf(
        "FalconForCausalLM",
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        ffn_hidden_size=INTER,
        multi_query=True,
        new_decoder_architecture=False,
        alibi=False,
        max_position_embeddings=MAX_POS,
    )


def _deepseek_v3() -> nn.Module:  # MLA (low-rank q and kv, split nope/rope); layer 1 is MoE
    return _hf(
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        **_DECODER,
        num_key_value_heads=HEADS,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )


def _vit() -> nn.Module:
    return _hf(
        "ViTModel",
        "ViTConfig",
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        image_size=32,
        patch_size=8,
        num_channels=3,
    )


# --------------------------------------------------------------------------------------------
# plain torch models
# --------------------------------------------------------------------------------------------


def _torch_encoder() -> nn.Module:  # nn.MultiheadAttention: fused in_proj_weight, no Linear for q/k/v
    layer = nn.TransformerEncoderLayer(
        d_model=HIDDEN, nhead=HEADS, dim_feedforward=INTER, dropout=0.0, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused c_attn Linear(d, 3d), split, SDPA, c_proj."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, INTER), nn.GELU(), nn.Linear(INTER, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """A nanoGPT-style causal LM: token + position embeddings, blocks, tied LM head."""

    def __init__(
        self,
        vocab: int = VOCAB,
        block_size: int = MAX_POS,
        n_embd: int = HIDDEN,
        n_head: int = HEADS,
        n_layer: int = LAYERS,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2 init, scaled residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, T = idx.size()  # (B, T)
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    build: Callable[[], nn.Module]
    kinds: dict[str, int]
    num_heads: int = HEADS
    num_kv_heads: int = HEADS
    causal_lm: bool = False
    hf: bool = True
    example: Callable[[torch.device, torch.dtype, int, int], tuple[tuple, dict]] | None = None  # torch models
    decoder_short: int = 0  # encoder-decoder: the decoder this many tokens shorter than the encoder


def _ids(device: torch.device, dtype: torch.dtype, batch: int, seq: int) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randint(0, VOCAB, (batch, seq), generator=g).to(device),), {}


def _hidden(device: torch.device, dtype: torch.dtype, batch: int, seq: int) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch, seq, HIDDEN, generator=g).to(device=device, dtype=dtype),), {}


_SPECS: dict[str, _Spec] = {
    "llama": _Spec(_llama, {"gqa": LAYERS}, num_kv_heads=2, causal_lm=True),
    "qwen3": _Spec(_qwen3, {"gqa": LAYERS}, num_kv_heads=2, causal_lm=True),
    "mistral": _Spec(_mistral, {"mqa": LAYERS}, num_kv_heads=1, causal_lm=True),
    "gpt2": _Spec(_gpt2, {"mha": LAYERS}, causal_lm=True),
    "gpt_neox": _Spec(_gpt_neox, {"mha": LAYERS}, causal_lm=True),
    "bert": _Spec(_bert, {"mha": LAYERS}),
    "t5": _Spec(_t5, {"mha": 2 * LAYERS, "cross": LAYERS}, causal_lm=True, decoder_short=3),
    "gemma2": _Spec(_gemma2, {"gqa": LAYERS}, num_kv_heads=2, causal_lm=True),
    "phi": _Spec(_phi, {"mha": LAYERS}, causal_lm=True),
    "falcon": _Spec(_falcon, {"mqa": LAYERS}, num_kv_heads=1, causal_lm=True),
    "deepseek_v3": _Spec(_deepseek_v3, {"mla": LAYERS}, causal_lm=True),
    "vit": _Spec(_vit, {"mha": LAYERS}),
    "torch_encoder": _Spec(_torch_encoder, {"mha": LAYERS}, hf=False, example=_hidden),
    "nanogpt": _Spec(NanoGPT, {"mha": LAYERS}, hf=False, example=_ids),
}

ZOO_NAMES: tuple[str, ...] = tuple(_SPECS)
HF_NAMES: tuple[str, ...] = tuple(n for n, s in _SPECS.items() if s.hf)
TORCH_NAMES: tuple[str, ...] = tuple(n for n, s in _SPECS.items() if not s.hf)


def make(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    batch: int = BATCH,
    seq: int = SEQ,
) -> ZooCase:
    """Build the tiny model ``name`` (seeded, eval mode) on ``device`` in ``dtype``, with its inputs.

    ``device="meta"`` gives a model with no storage and meta inputs, for tracing only. ``batch`` and
    ``seq`` size the example inputs (:func:`inputs` builds more of them for the same model).

    Example::

        case = make("gpt2")
        logits = case().logits    # (2, 8, 128)
    """
    if name not in _SPECS:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO_NAMES)}")
    spec = _SPECS[name]
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):  # seeded weights, global RNG left as it was
        torch.manual_seed(SEED)
        model = spec.build()
    model = model.to(dtype=dtype).to(device).eval()
    args, kwargs = inputs(name, model, batch=batch, seq=seq)
    return ZooCase(
        name=name,
        model=model,
        args=args,
        kwargs=kwargs,
        kinds=dict(spec.kinds),
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        causal_lm=spec.causal_lm,
        hf=spec.hf,
    )


def inputs(name: str, model: nn.Module, *, batch: int = BATCH, seq: int = SEQ) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one call of zoo model ``name`` (``model``, on its device and dtype), sized ``batch`` x ``seq``.

    Example::

        case = zoo.make("llama")
        args, kwargs = zoo.inputs("llama", case.model, batch=4, seq=24)     # 96 tokens > hidden 64
    """
    spec = _SPECS[name]
    p = next(model.parameters())
    if spec.example is not None:
        return spec.example(p.device, p.dtype, batch, seq)
    args, kwargs = example_inputs(model, batch_size=batch, seq_len=seq)
    if spec.decoder_short:  # cross attention then has Tq != Tk, as in real use
        kwargs["decoder_input_ids"] = kwargs["decoder_input_ids"][:, : seq - spec.decoder_short]
    return args, kwargs
