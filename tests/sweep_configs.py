"""Every transformers model type with a causal-LM, masked-LM or seq2seq-LM class, built tiny.

:func:`model_types` lists the types (from the installed transformers' auto mappings, one class per
type: seq2seq first, then masked LM, then causal LM); :func:`build` makes that class from the
type's default config with every size-like field shrunk (:func:`shrink_config`), random weights,
fp32, eval. Used by ``scripts/sweep_transformers.py`` and ``tests/integrations/test_transformers_sweep.py``.

Example::

    model, attn_implementation = build("llama")
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

SEED = 0

# tiny sizes
HIDDEN, HEADS, HEAD_DIM, LAYERS, INTER, VOCAB, MAX_POS = 64, 4, 16, 2, 128, 256, 512
EXPERTS, TOP_K = 4, 2


def model_types() -> dict[str, tuple[str, str]]:
    """model_type -> (class name, head) for every type with a seq2seq-, masked- or causal-LM class.

    One class per type, preferring seq2seq (encoder + decoder + cross attention), then masked LM
    (the canonical head of encoders such as BERT), then causal LM.
    """
    from transformers.models.auto import modeling_auto as ma

    out: dict[str, tuple[str, str]] = {}
    for head, mapping in (
        ("seq2seq", ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        ("masked", ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        ("causal", ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    ):
        for mtype, cls in mapping.items():
            if isinstance(cls, (list, tuple)):
                cls = cls[0]
            out.setdefault(mtype, (cls, head))
    return dict(sorted(out.items()))


# ----------------------------------------------------------------------------------------------
# tiny configs
# ----------------------------------------------------------------------------------------------

_HIDDEN_NAMES = {
    "hidden_size", "d_model", "n_embd", "dim", "hidden_dim", "emb_dim", "d_latents",
    "attention_hidden_size", "lru_width", "word_embed_proj_dim", "out_hidden_size",
    "projector_input_dim", "projector_output_dim", "adapter_in_dim", "adapter_out_dim",
    "vision_output_dim", "cross_attention_hidden_size", "backbone_hidden_size", "hidden_size_global",
    "encoder_hidden_size", "text_hidden_size", "vision_hidden_size", "audio_hidden_size",
    "output_embedding_size", "unit_embed_dim", "input_size", "adapter_input_size",
}  # fmt: skip
_EMBED_NAMES = {"embedding_size", "input_embedding_size", "entity_emb_size", "embedding_dim"}
_HEAD_NAMES = {
    "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
    "decoder_attention_heads", "num_self_attention_heads", "num_cross_attention_heads",
    "attention_heads", "conf_num_attention_heads", "swa_num_attention_heads",
    "num_encoder_attention_heads", "num_decoder_attention_heads", "speech_encoder_attention_heads",
    "t2u_encoder_attention_heads", "t2u_decoder_attention_heads", "index_n_heads",
    "linear_num_heads", "linear_num_value_heads", "heads_per_ngram",
}  # fmt: skip
_KV_HEAD_NAMES = {"num_key_value_heads", "swa_num_key_value_heads", "num_kv_heads", "num_query_groups",
                  "linear_num_key_heads"}  # fmt: skip
_HEAD_DIM_NAMES = {
    "head_dim", "d_kv", "dim_head", "d_head", "attention_head_size", "kv_channels", "swa_head_dim",
    "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim", "mamba_d_head", "mamba_head_dim",
    "mamba_headdim", "index_head_dim", "v_head_dim", "attention_head_dim", "qk_head_dim",
}  # fmt: skip
_LAYER_NAMES = {
    "num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers",
    "num_decoder_layers", "n_layers", "num_encoder_layers", "speech_encoder_layers",
    "t2u_encoder_layers", "t2u_decoder_layers", "conf_num_hidden_layers", "depth",
    "num_self_attends_per_block", "num_global_layers",
}  # fmt: skip
_PRIMARY_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")
_INTER_NAMES = {
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "d_inner",
    "dff", "dim_ff", "moe_intermediate_size", "shared_expert_intermediate_size",
    "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size", "ffn_hidden_size",
    "expert_ffn_hidden_size", "dense_intermediate_size", "intermediate_size_mlp",
    "shared_intermediate_size", "speech_encoder_intermediate_size", "t2u_encoder_ffn_dim",
    "t2u_decoder_ffn_dim", "feed_forward_size", "mlp_dim", "router_hidden_size",
}  # fmt: skip
_EXPERT_NAMES = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_TOPK_NAMES = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"}
_SHARED_EXPERT_NAMES = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
_RANK_NAMES = {
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "laurel_rank": 8, "loop_gate_rank": 8,
    "gated_norm_rank": 8, "hc_lowrank": 8, "embedding_rank": 16, "adapter_rank": 8,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "rotary_dim": 8, "hidden_size_per_layer_input": 16,
    "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "d_state": 8, "time_step_rank": 8,
    "mamba_dt_rank": 8, "mamba_n_heads": 8, "mamba_num_heads": 8, "n_groups": 1, "mamba_n_groups": 1,
    "mamba_d_ssm": 128, "n_group": 2, "num_expert_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "num_dense_layers": 1, "zero_expert_num": 2, "num_latents": 16, "index_topk": 4,
    "num_kv_shared_layers": 0, "intra_bottleneck_size": 32, "true_hidden_size": 32,
    "ple_embed_dim": 64, "conv_output_size": 64, "max_window_layers": LAYERS,
}  # fmt: skip
_POS_NAMES = {"max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len",
              "context_length", "max_encoder_position_embeddings", "max_decoder_position_embeddings",
              "t2u_max_position_embeddings"}  # fmt: skip
_SPECIAL_TOKENS = {
    "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
    "unk_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id",
    "eod_token_id", "document_token_id", "t2u_eos_token_id", "t2u_bos_token_id", "t2u_pad_token_id",
    "t2u_decoder_start_token_id", "mask_index", "unk_index", "blank_token_id",
}  # fmt: skip
_VOCAB_NAMES_SKIP = {"type_vocab_size", "audio_vocab_size", "codebook_size"}

# per-type fields set after the generic rules, for constraints the rules cannot see
OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba2": dict(num_heads=8, head_dim=16),
    "funnel": dict(block_sizes=[1, 1], block_repeats=[1, 1], d_head=16, n_head=4),
    "mobilebert": dict(embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "switch_transformers": dict(encoder_sparse_step=2, decoder_sparse_step=2, num_sparse_encoder_layers=1,
                                num_sparse_decoder_layers=1),
    "reformer": dict(attn_layers=["local", "lsh"], axial_pos_shape=[4, 8], axial_pos_embds_dim=[32, 32],
                     local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2, max_position_embeddings=32,
                     hash_seed=0),  # LSH hashes with random rotations: seeded, two forwards agree
    "longformer": dict(attention_window=4),
    "led": dict(attention_window=4),
    "big_bird": dict(block_size=2, num_random_blocks=1),
    "bigbird_pegasus": dict(block_size=2, num_random_blocks=1),
    "perceiver": dict(num_blocks=1, d_latents=64, num_latents=16, qk_channels=None, v_channels=None),
    "squeezebert": dict(embedding_size=HIDDEN),
    "falcon_h1": dict(mamba_d_head=16),
    "bamba": dict(attn_layer_indices=[1]),  # the default is Mamba-2 only; the type has attention layers too
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0)),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                   hybrid_layer_ids=[1, 2], attention_hidden_size=2 * HIDDEN, attention_head_dim=2 * HIDDEN // HEADS),
    "musicgen": dict(decoder=dict(num_codebooks=2)),
    "musicgen_melody": dict(decoder=dict(num_codebooks=2)),
    "recurrent_gemma": dict(num_hidden_layers=3),  # block_types cycle (recurrent, recurrent, attention)
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
}  # fmt: skip

# size-like fields some default configs leave None although the model code needs them: filled in
_NONE_FILL = {"vocab_size": VOCAB, "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_group": 1,
              "topk_group": 1, "n_shared_experts": 1}  # fmt: skip


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _scale_list_sum(values: list, factor: float) -> list:
    total = max(1, round(sum(values) * factor))
    out = [max(0, int(v * factor)) for v in values]
    out[-1] += total - sum(out)
    return out


def _layer_selection(d: dict, n_orig: int) -> list[int]:
    """Which original layers to keep: the first of each distinct per-layer pattern, at least 2, at most 4."""
    per_layer: list[list] = [[] for _ in range(n_orig)]
    for key, value in d.items():
        if not isinstance(value, (list, tuple)) or not value or isinstance(value[0], dict):
            continue
        if len(value) == n_orig and key not in ("eos_token_id",):
            for i, v in enumerate(value):
                per_layer[i].append(str(v))
        elif (
            any(w in key for w in ("layer", "idx", "index", "ids"))
            and "token" not in key
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_orig for v in value)
        ):
            members = set(value)
            for i in range(n_orig):
                per_layer[i].append(str(i in members))
    plc = d.get("per_layer_config")
    if isinstance(plc, dict):  # gemma4 & co: {"05": {"head_dim": 512}, ...}
        for i in range(n_orig):
            per_layer[i].append(str(plc.get(f"{i:02d}", plc.get(str(i)))))
    first: dict[tuple, int] = {}
    for i, sig in enumerate(per_layer):
        first.setdefault(tuple(sig), i)
    sel = sorted(first.values())[:4]
    i = 0
    while len(sel) < min(LAYERS, n_orig):
        if i not in sel:
            sel.append(i)
        i += 1
    return sorted(sel)


def _shrink_dict(d: dict, sub_keys: set[str]) -> dict:
    """Shrink one config level (a ``to_dict()``); ``sub_keys`` name the nested sub-config dicts."""
    d = dict(d)
    orig = dict(d)
    heads_orig = next((orig[k] for k in ("num_attention_heads", "n_head", "num_heads", "n_heads")
                       if isinstance(orig.get(k), int)), None)  # fmt: skip
    hidden_orig = next(
        (orig[k] for k in ("hidden_size", "d_model", "n_embd", "dim") if isinstance(orig.get(k), int)), None
    )
    head_dim_orig = orig.get("head_dim") if isinstance(orig.get("head_dim"), int) else None
    if head_dim_orig is None and heads_orig and hidden_orig:
        head_dim_orig = hidden_orig // heads_orig

    n_orig = next((orig[k] for k in _PRIMARY_LAYERS if isinstance(orig.get(k), int) and orig[k] > 0), None)
    sel = _layer_selection(orig, n_orig) if n_orig else None

    specials: dict[int, int] = {}

    def special(v):
        if isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
            specials.setdefault(v, VOCAB - 1 - len(specials))
            return specials[v]
        return v

    for key, value in orig.items():
        if key in sub_keys or isinstance(value, bool):
            continue
        if isinstance(value, int):
            if key in _HIDDEN_NAMES and value > HIDDEN:
                d[key] = HIDDEN
            elif key in _EMBED_NAMES and value > 32:
                d[key] = 32
            elif key in _HEAD_NAMES and value > HEADS:
                d[key] = HEADS
            elif key in _KV_HEAD_NAMES:
                d[key] = 1 if value == 1 else (HEADS if heads_orig is not None and value >= heads_orig else 2)
            elif key in _HEAD_DIM_NAMES and value > HEAD_DIM:
                d[key] = HEAD_DIM
            elif key in _LAYER_NAMES and value > LAYERS:
                d[key] = len(sel) if (sel and value == n_orig) else LAYERS
            elif key in _INTER_NAMES and value > INTER:
                d[key] = INTER
            elif key in _EXPERT_NAMES and value > EXPERTS:
                d[key] = EXPERTS
            elif key in _TOPK_NAMES and value > TOP_K:
                d[key] = TOP_K
            elif key in _SHARED_EXPERT_NAMES and value > 1:
                d[key] = 1
            elif key in _RANK_NAMES:
                if value > _RANK_NAMES[key] or key in ("num_kv_shared_layers", "max_window_layers"):
                    d[key] = min(value, _RANK_NAMES[key])
            elif key in _POS_NAMES and value > MAX_POS:
                d[key] = MAX_POS
            elif key.endswith("vocab_size") and key not in _VOCAB_NAMES_SKIP and value > VOCAB:
                d[key] = VOCAB if key != "ngram_vocab_size_base" else 4 * VOCAB
            elif key == "encoder_hash_byte_group_vocab" and value > VOCAB:
                d[key] = 4 * VOCAB
            elif key == "moe_layer_end_index":
                d[key] = (len(sel) if sel else LAYERS) - 1
            elif key.endswith(("_period", "_every_n_layers", "_interval", "sliding_window_pattern", "_sparse_step")):
                d[key] = min(value, 2)
            elif key in ("attention_window", "local_attention", "local_attention_window_len"):
                d[key] = min(value, 4)
        elif isinstance(value, list) and key in _INTER_NAMES:
            d[key] = [INTER] * (len(sel) if sel else len(value))
    for key, fill in _NONE_FILL.items():
        if key in d and d[key] is None:
            d[key] = fill
    if "head_dim" in d and d["head_dim"] is None and (heads_orig or hidden_orig):
        d["head_dim"] = HEAD_DIM
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and heads_orig:
        d["num_key_value_heads"] = d.get("num_attention_heads", HEADS)
    if isinstance(orig.get("qk_rope_head_dim"), int) and orig.get("head_dim") == orig["qk_rope_head_dim"]:
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: head_dim names the rope part
    for key in _SPECIAL_TOKENS:
        value = d.get(key)
        if isinstance(value, list):
            d[key] = [special(v) for v in value]
        elif value is not None:
            d[key] = special(value)

    if sel is not None and n_orig:
        for key, value in orig.items():
            if key in sub_keys or not isinstance(value, (list, tuple)) or not value or key in _INTER_NAMES:
                continue
            if len(value) == n_orig and key != "eos_token_id":
                d[key] = [value[i] for i in sel]
            elif (
                any(w in key for w in ("layer", "idx", "index", "ids"))
                and "token" not in key
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_orig for v in value)
            ):
                d[key] = [new for new, old in enumerate(sel) if old in set(value)]
        plc = orig.get("per_layer_config")
        if isinstance(plc, dict):
            new_plc = {}
            for old_key, value in plc.items():
                with contextlib.suppress(ValueError):
                    if int(old_key) in sel:
                        new = sel.index(int(old_key))
                        width = len(old_key) if old_key.startswith("0") else 1
                        new_plc[f"{new:0{width}d}"] = _shrink_dict(value, set()) if isinstance(value, dict) else value
            d["per_layer_config"] = new_plc
        for key in ("hybrid_override_pattern",):  # nemotron_h: one character per layer ("M-*...")
            if isinstance(orig.get(key), str) and len(orig[key]) == n_orig:
                d[key] = "".join(orig[key][i] for i in sel)

    # rope: mrope sections sum to half the rotary dims, long/short factors have one per rotary pair
    if head_dim_orig:
        factor = HEAD_DIM / head_dim_orig

        def fix_rope(r):
            if isinstance(r, dict):
                r = {k: fix_rope(v) for k, v in r.items()}
                if isinstance(r.get("mrope_section"), list):
                    r["mrope_section"] = _scale_list_sum(r["mrope_section"], factor)
                for k in ("short_factor", "long_factor"):
                    if isinstance(r.get(k), list):
                        r[k] = r[k][: max(1, int(len(r[k]) * factor))]
            return r

        for key in ("rope_parameters", "rope_scaling"):
            if isinstance(d.get(key), dict):
                d[key] = fix_rope(d[key])
    return d


def _config_to_shrunk_dict(cfg) -> dict:
    from transformers import PretrainedConfig

    d = cfg.to_dict()
    subs = {k for k, v in vars(cfg).items() if isinstance(v, PretrainedConfig)}
    shrunk = _shrink_dict(d, subs)
    for k in subs:
        shrunk[k] = _config_to_shrunk_dict(getattr(cfg, k))
    return shrunk


def shrink_config(model_type: str):
    """The default config of ``model_type`` with every size-like field made tiny (see OVERRIDES)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    d = _config_to_shrunk_dict(default)
    d = _merge(d, OVERRIDES.get(model_type, {}))
    d.pop("transformers_version", None)
    d.pop("dtype", None)
    d.pop("torch_dtype", None)
    return config_cls.from_dict(d)


def build(model_type: str):
    """(model, attn_implementation): the type's LM class from its tiny config, random weights, eval, fp32."""
    import transformers

    cls_name, _ = model_types()[model_type]
    cls = getattr(transformers, cls_name)
    cfg = shrink_config(model_type)
    own = getattr(cls, "config_class", None)
    if own is not None and not isinstance(cfg, own):  # e.g. Qwen3_5ForCausalLM takes the text config
        from transformers import PretrainedConfig

        subs = [v for v in vars(cfg).values() if isinstance(v, PretrainedConfig) and isinstance(v, own)]
        if subs:
            cfg = subs[0]
    errors = []
    for impl in ("sdpa", "eager"):
        if impl == "sdpa" and getattr(cls, "_supports_sdpa", False) is False:
            continue
        torch.manual_seed(SEED)
        try:
            model = cls._from_config(cfg, attn_implementation=impl, dtype=torch.float32)
        except (ValueError, ImportError) as e:
            if impl == "sdpa" and ("sdpa" in str(e).lower() or "scaled_dot_product" in str(e).lower()):
                errors.append(e)
                continue
            raise
        model = model.float().eval()
        _randomize_zeros(model)
        if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):  # xmod: adapters per language
            model.set_default_language(cfg.languages[0])
        return model, impl
    raise errors[-1] if errors else RuntimeError(f"{cls_name}: no attention implementation could be set")


def _randomize_zeros(model: torch.nn.Module) -> None:
    """Give weights that init leaves at zero (NeoMME's output projections) small random values, so every
    attention reaches the logits and a perturbed KHA weight shows in them, as after training."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2 and p.is_floating_point() and not bool(p.any()):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
