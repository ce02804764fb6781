"""The demo's export step: ONNX for the folded model and for an MLP-value model, checked in onnxruntime."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from ..exporters.onnx import export_onnx, onnx_summary
from ..model.config import KHAConfig
from ..passes.apply import apply
from .models import export_target, load_minilm
from .ort import ONNX_TOL, max_diff, ort_run
from .ui import UI, fmt_diff, ok_mark

__all__ = ["DEMO_SENTENCES", "Check", "demo_export", "encode", "features"]

DEMO_SENTENCES = [
    "Knocking-heads attention lets attention heads share a small transform.",
    "The weather is lovely today.",
    "A folded model has exactly the original architecture.",
    "ONNX Runtime runs the exported graph.",
]
_OTHER = ["One more sentence, of another length, to exercise the dynamic axes."]  # another shape


def features(st: Any, texts: Sequence[str]) -> dict:
    prep = getattr(st, "preprocess", None) or st.tokenize
    return prep(list(texts))


def encode(st: Any, texts: Sequence[str]) -> torch.Tensor:
    with torch.no_grad():
        return st.encode(list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=len(texts))


def _st_embed_from_tokens(st: Any, feats: dict, token_embeddings: torch.Tensor) -> torch.Tensor:
    """Run the SentenceTransformer's modules after the transformer (pooling, normalize) on given tokens."""
    out = dict(feats, token_embeddings=token_embeddings)
    with torch.no_grad():
        for module in list(st)[1:]:
            out = module(out)
    return out["sentence_embedding"]


@dataclasses.dataclass
class Check:
    what: str
    result: str
    ok: bool | None  # None: a measurement, not a pass/fail check


def demo_export(st: Any, out_dir: pathlib.Path, ui: UI) -> tuple[list[Check], dict[str, float]]:

    checks = []
    out_dir.mkdir(parents=True, exist_ok=True)
    feats = features(st, DEMO_SENTENCES)
    tokens = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor) and k != "token_embeddings"}
    other = features(st, _OTHER)
    other_tokens = {k: v for k, v in other.items() if isinstance(v, torch.Tensor)}

    # 1. the folded (vanilla) transformer
    batches = [(DEMO_SENTENCES, feats, tokens), (_OTHER, other, other_tokens)]

    def export_and_compare(model, path, what, how):
        with ui.step(f"export {what} to {path}"):
            export_onnx(export_target(model), path, example_kwargs=tokens)
        with ui.step(f"run it in onnxruntime{how} and compare with torch"):
            return onnx_summary(path), _ort_parity_embeddings(model, path, batches)

    path = out_dir / "minilm_kha_folded.onnx"
    s, d = export_and_compare(st, path, "the folded transformer", "")
    checks.append(
        Check(
            "ONNX, linear KHA folded",
            f"onnxruntime vs torch max |Δ| = {fmt_diff(d)}; "
            f"{s.num_nodes} nodes, {s.num_custom_nodes} custom; "
            f"{path.stat().st_size / 2**20:.1f} MiB",
            d < ONNX_TOL,
        )
    )
    ui.out.print(
        f"{path.name}: {s.num_nodes} nodes, {s.num_custom_nodes} custom nodes, inputs "
        f"{', '.join(str(i) for i in s.inputs)}; onnxruntime vs torch: max |Δ| = {fmt_diff(d)} "
        f"{ok_mark(d < ONNX_TOL)}"
    )

    # 2. MLP-value KHA on a fresh model: not foldable, ships as one custom node per attention
    with ui.step("fresh model: apply KHAConfig(v='mlp')"):
        st2 = load_minilm()
        apply(st2, KHAConfig(v="mlp"))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # stand-in for training, so the check exercises the MLP: seeded noise
            for n, p in st2.named_parameters():
                if ".kha." in n:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
    path2 = out_dir / "minilm_kha_mlp.onnx"
    s2, d2 = export_and_compare(st2, path2, "the MLP-value model", " (the kha::MLPValue function body)")
    ok2 = d2 < ONNX_TOL and s2.num_custom_nodes == 6
    checks.append(
        Check(
            "ONNX, MLP-value KHA",
            f"{s2.num_custom_nodes} kha::MLPValue nodes (6 expected); onnxruntime vs torch max |Δ| = {fmt_diff(d2)}",
            ok2,
        )
    )
    ui.out.print(
        f"{path2.name}: {s2.num_nodes} nodes, [bold]{s2.num_custom_nodes} kha::MLPValue[/] custom nodes, "
        f"functions {', '.join('::'.join(f) for f in s2.functions)}; onnxruntime vs torch "
        f"(KHA weights perturbed with seeded noise): max |Δ| = {fmt_diff(d2)} {ok_mark(ok2)}"
    )
    return checks, {"onnx_folded_vs_torch": d, "onnx_mlp_value_vs_torch": d2}


def _ort_parity_embeddings(st: Any, path: pathlib.Path, batches: list) -> float:
    """Max |onnxruntime - torch| over sentence embeddings: ONNX hidden states, then st's pooling."""
    worst = 0.0
    for texts, feats, tokens in batches:
        (hidden, *_) = ort_run(path, (), tokens)
        got = _st_embed_from_tokens(st, feats, torch.from_numpy(hidden))
        worst = max(worst, max_diff(got, encode(st, texts)))
    return worst
