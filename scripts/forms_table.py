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
        r"tests/passes/test_match.py::test_generic_attention",
        "yes (parity)",
        "CPU and GPU",
        drawn=True,
    ),
    Form(
        "`softmax(q @ k^T ...) @ v` (matmul/bmm/baddbmm, masks, ALiBi, soft-capping)",
        "manual_softmax",
        r"tests/passes/test_match.py::test_generic_attention",
        "yes (parity)",
        "CPU and GPU",
        drawn=True,
    ),
    Form(
        "`einsum` scores and values (einops style, x-transformers)",
        "einsum_softmax",
        r"tests/passes/rules/test_einsum_softmax.py::test_einsum_attention",
        "yes (parity)",
        "CPU and GPU",
    ),
    Form(
        "`flex_attention` (score_mod, BlockMask argument, enable_gqa)",
        "flex_attention",
        r"tests/passes/rules/test_flex_attention.py::test_flex_(with|random)",
        "no (ExportError)",
        "GPU (torch has no flex backward on CPU)",
        drawn=True,
    ),
    Form(
        'transformers `attn_implementation="flex_attention"` (Llama, BERT)',
        "flex_attention",
        r"tests/passes/rules/test_flex_attention.py::test_transformers_flex",
        "no (ExportError)",
        "GPU (torch has no flex backward on CPU)",
    ),
    Form(
        "your own op (`torch.library.custom_op`, (B, S, H, D) or (B, H, S, D), GQA) via `kc.register_attention_op`",
        "external",
        r"tests/passes/rules/test_external.py::test_registered",
        "no, unless the op has an ONNX translation",
        "CPU and GPU (the op's own backward)",
    ),
    Form(
        "rotary helpers returning `(q, k)` with `type_as`/`to`; complex RoPE (`view_as_complex`)",
        "sdpa",
        r"tests/passes/test_trace_robustness.py::test_rotary_helpers",
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
        "fair-esm ESM-2 (separate q/k/v, rotary, `bmm` + softmax, key padding mask)",
        "manual_softmax",
        r"tests/test_third_party_models.py::test_apply_identity_perturb_fold\[esm2",
        "-",
        "CPU and GPU",
    ),
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
