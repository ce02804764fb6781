"""Print the table of supported attention forms, built from the tests that cover them.

Each row names a form and the test ids that exercise it; the script collects those tests with
pytest (``--collect-only``, nothing runs) and fills in which KHA configs (``v=linear`` /
``v=mlp``) and checks are covered. A form whose tests are not collected is printed as missing and
the script exits 1, so the table cannot drift from the tests.

Example::

    python scripts/forms_table.py            # markdown table on stdout
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Form:
    name: str  # what the code looks like
    rule: str  # the anchor rule that matches it
    tests: str  # regex over collected test ids (file::name[params])
    onnx: str  # ONNX export status, as the tests assert it
    training: str  # where a training step runs
    drawn: bool = False  # a property test that draws both configs


FORMS = [
    Form(
        "`F.scaled_dot_product_attention` (MHA/GQA/MQA, fused/interleaved qkv, rotary)",
        "sdpa",
        r"tests/analysis/test_match.py::test_generic_attention",
        "yes (parity)",
        "CPU and GPU",
        drawn=True,
    ),
    Form(
        "`softmax(q @ k^T ...) @ v` (matmul/bmm/baddbmm, masks, ALiBi, soft-capping)",
        "manual_softmax",
        r"tests/analysis/test_match.py::test_generic_attention",
        "yes (parity)",
        "CPU and GPU",
        drawn=True,
    ),
    Form(
        "`einsum` scores and values (einops style, x-transformers)",
        "einsum_softmax",
        r"tests/analysis/rules/test_einsum_softmax.py::test_einsum_attention",
        "yes (parity)",
        "CPU and GPU",
    ),
    Form(
        "`flex_attention` (score_mod, BlockMask argument, enable_gqa)",
        "flex_attention",
        r"tests/analysis/rules/test_flex_attention.py::test_flex_(with|random)",
        "no (ExportError)",
        "GPU (torch has no flex backward on CPU)",
        drawn=True,
    ),
    Form(
        'transformers `attn_implementation="flex_attention"` (Llama, BERT)',
        "flex_attention",
        r"tests/analysis/rules/test_flex_attention.py::test_transformers_flex",
        "no (ExportError)",
        "GPU (torch has no flex backward on CPU)",
    ),
    Form(
        "your own op (`torch.library.custom_op`, (B, S, H, D) or (B, H, S, D), GQA) via `kc.register_attention_op`",
        "external",
        r"tests/analysis/rules/test_external.py::test_registered",
        "no, unless the op has an ONNX translation",
        "CPU and GPU (the op's own backward)",
    ),
    Form(
        "rotary helpers returning `(q, k)` with `type_as`/`to`; complex RoPE (`view_as_complex`)",
        "sdpa",
        r"tests/analysis/test_trace_robustness.py::test_rotary_helpers",
        "-",
        "CPU and GPU",
    ),
    Form(
        "x-transformers `TransformerWrapper` (Encoder; Decoder with GQA and rotary)",
        "einsum_softmax",
        r"tests/test_third_party_models.py::test_apply_identity_perturb_fold\[x_transformers",
        "-",
        "CPU and GPU",
    ),
    Form(
        "fair-esm ESM-2 applied directly (`if not padding_mask.any()`: traced per submodule)",
        "manual_softmax",
        r"tests/test_third_party_models.py::test_apply_identity_perturb_fold\[esm2",
        "-",
        "CPU and GPU",
    ),
    *(
        Form(
            name,
            rule,
            rf"tests/integrations/test_attention_forms.py::test_form_matches_a_per_head_reference\[{case}-",
            "yes (parity)" if case == "joint_streams" else "-",
            train,
        )
        for name, rule, case, train in [
            (
                "an attention a repeated-block representative did not run (`zip(attns, resnets[1:])`)",
                "sdpa",
                "zip_of_a_slice",
                "CPU and GPU",
            ),
            (
                "joint streams: per-stream q/k/v concatenated along the sequence, QK-norm, RoPE",
                "sdpa",
                "joint_streams",
                "CPU and GPU",
            ),
            (
                "q and k sums of two projections (linear KHA after each; v sums get no MLP-value)",
                "sdpa",
                "sum_of_projections",
                "CPU and GPU",
            ),
            (
                "merged self- and cross-attention (k, v of both sources on the key axis)",
                "sdpa",
                "self_and_cross",
                "CPU and GPU",
            ),
            (
                "talking heads: (H, H) head mixing before and after the softmax, all einsum",
                "einsum_softmax",
                "talking_heads",
                "CPU and GPU",
            ),
            ("a learned query token (class attention)", "sdpa", "learned_query", "CPU and GPU"),
            (
                "RoPE under `autocast(enabled=False)`, blocks under `no_grad` (wrapping higher-order ops)",
                "sdpa",
                "autocast_and_no_grad_regions",
                "CPU and GPU",
            ),
            (
                "classes whose bases put an ABC first (functional and module projections)",
                "sdpa",
                "abc_first_bases",
                "CPU and GPU",
            ),
            (
                "a model torch.export cannot trace whole (data-dependent `if`, expert loop, router cast): per submodule",
                "sdpa",
                "untraceable_whole",
                "CPU and GPU",
            ),
            (
                "1x1 `nn.Conv1d` projections in (B, C, T), heads merged with the batch",
                "einsum_softmax",
                "conv1d_pointwise",
                "CPU and GPU",
            ),
            (
                "block-local attention plus global tokens (`einsum('...qhd,...khd->...hqk')`)",
                "einsum_softmax",
                "local_and_global_tokens",
                "CPU and GPU",
            ),
            (
                "local and global tokens with their own projections: scores joined, probabilities cut (PEGASUS-X)",
                "einsum_softmax",
                "local_and_global_split_probabilities",
                "CPU and GPU",
            ),
            ("one layer reused in a loop (one site per call)", "sdpa", "layer_reused_in_a_loop", "CPU and GPU"),
            (
                "projection modules returning a tuple (a quantized linear's `(y, scale)`)",
                "sdpa",
                "tuple_returning_projection",
                "CPU and GPU",
            ),
            (
                "ViT: functional fused qkv, bias assembled with `cat`, RoPE on the patch tokens only",
                "sdpa",
                "vit_cat_bias_partial_rope",
                "CPU and GPU",
            ),
            (
                "flex_attention with a BlockMask passed in, fused qkv, complex RoPE",
                "flex_attention",
                "flex_block_mask_input",
                "GPU (torch has no flex backward on CPU)",
            ),
        ]
    ),
]

MORE = "tests/integrations/test_attention_forms_more.py"
FORMS += [
    Form(name, rule, rf"{MORE}::{test}", "-", "CPU and GPU")
    for name, rule, test in [
        (
            "heads as separate modules: a list of per-head q/k(/v) projections, one call each, outputs concatenated",
            "manual_softmax",
            r"test_form_matches_a_per_head_reference\[heads_as_modules_concatenated-",
        ),
        (
            "heads as separate modules, outputs averaged (`stack(...).mean(0)`)",
            "manual_softmax",
            r"test_form_matches_a_per_head_reference\[heads_as_modules_averaged-",
        ),
        (
            "per-head q and k projection lists, one value projection shared by all heads, outputs summed",
            "sdpa",
            r"test_form_matches_a_per_head_reference\[heads_as_modules_shared_value-",
        ),
        (
            "KV cache written in place (slice assignment, `index_put_`, `index_copy_`; buffer or list argument), "
            "prefill and decode",
            "manual_softmax / sdpa",
            r"test_kv_cache_written_in_place_prefill_and_decode",
        ),
        (
            "sparse query selection: top queries gathered with a computed index (Informer's ProbSparse)",
            "manual_softmax",
            r"test_form_matches_a_per_head_reference\[sparse_top_queries-",
        ),
        (
            "sampled keys and values (`index_select` along the sequence with a computed index)",
            "sdpa",
            r"test_form_matches_a_per_head_reference\[sparse_sampled_keys-",
        ),
        (
            "fused wqkv whose query rows are a permutation (per kv group, InternLM2 / torchtitan): an index map",
            "sdpa",
            r"test_form_matches_a_per_head_reference\[fused_qkv_rows_permuted_per_group-",
        ),
        (
            "routed heads: a mixture of attention heads (JetMoE), expert query projections, top-k per token",
            "sdpa",
            r"test_form_matches_a_per_head_reference\[routed_heads_mixture_of_attention-",
        ),
        (
            "message-passing (graph) attention: per-edge scores, a segment softmax from scatter ops",
            "segment_softmax",
            r"test_form_matches_a_per_head_reference\[graph_attention_segment_softmax-",
        ),
        (
            "sliding-window attention as chunked einsums (transformers' Longformer: `as_strided`, band padding)",
            "einsum_softmax",
            r"test_sliding_window_attention_written_as_chunked_einsums",
        ),
        (
            "k = v: one kv projection read as keys and values (DeepSeek-V4); T^K, T^V on the attention "
            "arguments, not foldable",
            "sdpa / manual_softmax",
            r"test_keys_equal_to_values_get_their_transforms_on_the_attention_arguments",
        ),
    ]
]

FORMS += [
    Form(name, rule, rf"tests/analysis/{test}", "-", "CPU and GPU")
    for name, rule, test in [
        (
            "values channels first: `v @ softmax(q^T k)^T` over (B, H, Dh, N), 1x1 convolutions as projections "
            "(LeViT-conv, SHViT)",
            "manual_softmax",
            r"rules/test_manual_softmax.py::test_values_channels_first_match_a_per_head_reference",
        ),
        (
            "RoPE on interleaved pairs unbound and written back into slices of `empty_like` (Wan)",
            "sdpa",
            r"test_layout_ops.py::test_rope_on_unbound_pairs_written_back_matches_a_per_head_reference",
        ),
        (
            "tokens selected at run time (a data-dependent count), joined with a context stream "
            "(HunyuanVideo-Framepack)",
            "sdpa",
            r"test_layout_ops.py::test_data_dependent_token_count_joined_with_a_context_matches_a_per_head_reference",
        ),
        (
            "attention over channels: scores of (Dh, Dh) per head summed over tokens (XCiT and EdgeNeXt "
            "cross-covariance attention, DaViT channel blocks)",
            "manual_softmax",
            r"rules/test_manual_softmax.py::test_attention_over_channels_matches_a_per_head_reference",
        ),
        (
            "RoPE on pairs stacked back or rotated as products over (..., Dh/2, 1, 2), before a joint "
            "stream (Mochi, PRX)",
            "sdpa",
            r"test_layout_ops.py::test_rope_on_pairs_before_a_joint_stream_matches_a_per_head_reference",
        ),
        (
            "context tokens picked per sample by a mask after the head split, attended one sample at a "
            "time and padded back (Mochi)",
            "sdpa",
            r"test_layout_ops.py::test_per_sample_selection_by_a_mask_after_the_head_split_matches_a_per_head_reference",
        ),
    ]
]

SHARED = "tests/integrations/test_attention_forms_shared.py"
FORMS += [
    Form(name, rule, rf"{SHARED}::test_form_matches_a_per_head_reference\[{case}", "-", "CPU and GPU")
    for name, rule, case in [
        (
            "one projection called for two roles: two-way cross-attention with one q/k projection run on both "
            "inputs; T^Q, T^K on the arguments of the attention calls, not foldable",
            "sdpa / einsum_softmax",
            "one_projection_called_for_two_roles",
        ),
        (
            "shared-QK attention, q = k (Reformer's shared query-key space without LSH, self-score masked); T^Q, "
            "T^K on the attention arguments, not foldable",
            "sdpa / einsum_softmax",
            "shared_qk",
        ),
        (
            "tied row attention over an alignment: scores summed over the rows and the head dim (ESM-MSA, AlphaFold)",
            "einsum_softmax",
            "tied_row_attention",
        ),
        (
            "keys and values compressed along the sequence before the head split (Linformer: a Linear over the "
            "token axis, `E @ K`)",
            "sdpa",
            "linformer_sequence_compression",
        ),
        ("heads as separate modules, twelve of them (`heads.0` ... `heads.11`)", "manual_softmax", "twelve_heads"),
        (
            "graph attention with the score written key-first, `(k[src] * q[dst]).sum(-1)`, or query-first",
            "segment_softmax",
            "graph_attention",
        ),
    ]
]

ISSUE34 = "tests/integrations/test_attention_forms_issue34.py"
FORMS += [
    Form(name, rule, rf"{ISSUE34}::test_form_matches_a_per_head_reference\[{case}", "-", "CPU and GPU")
    for name, rule, case in [
        (
            "bidirectional cross-attention, one score matrix read both ways (a softmax over each axis): T^Q and "
            "T^K one transform on both sides, folded into both projections",
            "einsum_softmax / manual_softmax",
            "bidirectional_one_score",
        ),
        (
            "keys and values pooled into a few interests by a learned softmax over the tokens, the scores "
            "normalised over the queries",
            "einsum_softmax / manual_softmax",
            "interests_pooled_scores_over_queries",
        ),
    ]
]

COMPRESS = "tests/integrations/test_attention_forms_compress.py"
FORMS += [
    Form(name, rule, rf"{COMPRESS}::test_form_matches_a_per_head_reference\[{case}", "-", "CPU and GPU")
    for name, rule, case in [
        (
            "compressed, selected and sliding-window branches over one grouped qkv (native sparse attention): keys "
            "and values compressed block by block by a learned MLP; one transform per role after the projection, "
            "which every branch reads",
            "manual_softmax / sdpa",
            "compressed_selected_window_branches",
        ),
        (
            "single-head gated attention unit: q and k from one projection and activation through a scale and an "
            "offset per role, Laplace (erf) or softmax, relative position bias, causal zeroing; the value a Linear "
            "then an activation; T^Q, T^K on the attention arguments, not foldable",
            "linear_attention / einsum_softmax",
            "gated_unit",
        ),
        ("heads as separate modules, eleven of them (`heads.10`: two-digit indices)", "manual_softmax", "eleven_heads"),
    ]
]

LINEAR = "tests/analysis/rules/test_linear_attention.py::test_kha_on_attention_without_softmax_matches_the_per_head_reference"
HYBRID = "tests/integrations/test_hybrid_linear_attention.py"
FAVOR = "tests/analysis/test_random_features.py::test_kha_on_random_feature_attention_matches_the_per_head_reference"
FORMS += [
    Form(name, rule, test, "-", "CPU and GPU")
    for name, rule, test in [
        (
            "linear attention: `phi(q) (phi(k)^T v)` with a feature map (elu + 1) and its normaliser, no softmax",
            "linear_attention",
            rf"{LINEAR}\[linear_attention-",
        ),
        (
            "retention, parallel form: decay-masked `(q k^T * D) v`, one decay per head, no softmax",
            "linear_attention",
            rf"{LINEAR}\[retention-",
        ),
        (
            "retention, recurrent form: a state `gamma S + k_t^T v_t` per token, `q_t S` (one site, not one per token)",
            "linear_attention",
            rf"{LINEAR}\[retention_recurrent-",
        ),
        (
            "ReLU linear attention channels first, `(v @ k^T) @ q` over (B, H, D, N), a row of ones padded onto the "
            "values for the normaliser (Sana)",
            "linear_attention",
            rf"{LINEAR}\[ones_column-",
        ),
        (
            "the same with RoPE on q and k, its tables expanded over the heads (SanaVideo)",
            "linear_attention",
            rf"{LINEAR}\[rotary-",
        ),
        (
            'factorised ("efficient") attention: softmax of k over the tokens, of q over its features, the state '
            "`softmax(k)^T v` first (CoaT, lambda layers)",
            "linear_attention",
            rf"{LINEAR}\[efficient-",
        ),
        (
            "a softmax written as `exp(s - logsumexp(s)) @ v` (Reformer's local attention)",
            "logsumexp_softmax",
            rf"{LINEAR}\[logsumexp_softmax-",
        ),
        (
            "random-feature linear attention (FAVOR+, Performer): q and k through a fixed random projection (a "
            "buffer), then exp with the squared norm and the max subtracted; matmuls, or `'...'` einsums with the projection expanded "
            "over batch and heads and a three-operand output einsum",
            "random_features",
            rf"{FAVOR}\[favor_",
        ),
        (
            "one fused qkv projection whose heads feed two forms: half FAVOR+, half banded softmax attention "
            "(two sites, one transform per role shared by all the projection's heads)",
            "random_features / manual_softmax",
            rf"{FAVOR}\[half_favor_half_local-",
        ),
        (
            "Qwen3-Next's gated delta rule (transformers' `torch_chunk_gated_delta_rule`, fla's "
            "`chunk_gated_delta_rule`): fused interleaved `in_proj_qkvz`, two value heads per key head, a "
            "depthwise short convolution, L2-normalised q and k; cached `generate`",
            "linear_kernel",
            rf"{HYBRID}::test_qwen3_next",
        ),
        (
            "the linear-attention layers of Qwen3.5, LaraMini and OLMo hybrid (gated delta rule), Kimi Linear "
            "and Bailing hybrid (Kimi's delta attention), MiniMax (lightning attention, chunked)",
            "linear_kernel / linear_attention",
            rf"{HYBRID}::test_hybrid_linear_attention",
        ),
        (
            "a linear-attention kernel of flash-linear-attention called by a module-level name (`fla.ops...`)",
            "linear_kernel",
            r"tests/analysis/test_opaque_kernels.py::test_an_fla_kernel",
        ),
        (
            "a submodule whose forward branches on data (`if mask.sum() < n`, Reformer's LSH layer): traced "
            "with real values",
            "sdpa",
            r"tests/analysis/test_submodules_real_values.py::test_a_branch_on_data",
        ),
    ]
]

FILES = sorted({f.tests.split("::")[0] for f in FORMS})


def collected() -> list[str]:
    """Test ids pytest collects from the files the table refers to."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *FILES],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return [line.strip() for line in res.stdout.splitlines() if "::" in line]


def table(ids: list[str]) -> tuple[str, list[str]]:
    rows = ["| form | rule | configs tested | ONNX | training | tests |", "|---|---|---|---|---|---|"]
    missing = []
    for form in FORMS:
        hits = [i for i in ids if re.match(form.tests, i)]
        if not hits:
            missing.append(form.name)
            continue
        configs = {c for i in hits for c in ("linear", "mlp") if re.search(rf"(?<![a-z]){c}(?![a-z])", i)}
        if form.drawn:
            configs |= {"linear", "mlp"}
        shown = ", ".join(f"v={c}" for c in sorted(configs)) or "-"
        if form.drawn:
            shown += " (incl. hypothesis)"
        rows.append(f"| {form.name} | `{form.rule}` | {shown} | {form.onnx} | {form.training} | {len(hits)} |")
    return "\n".join(rows), missing


def main() -> int:
    text, missing = table(collected())
    print(text)
    for name in missing:
        print(f"MISSING: no collected test covers {name}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
