"""``kha-compile demo``: the whole pipeline on a real model (the embedded all-MiniLM-L6-v2).

inspect -> apply linear KHA (q, k, v) -> identity check -> train KHA only -> fold -> ONNX ->
MLP-value; a summary table of the checks at the end.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import pathlib
import time
from typing import Any, Sequence

import torch
from torch import nn

from ...errors import CommandError
from ..models import export_target, kha_leftovers, kha_param_count, load_minilm
from ..ort import FOLD_TOL, ONNX_TOL, max_diff, ort_run
from ..ui import UI, fmt_diff, ok_mark, report_table

__all__ = ["NAME", "register", "run", "DEMO_PAIRS", "DEMO_SENTENCES"]

NAME = "demo"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, parents=[common], allow_abbrev=False, help="apply, train, fold and export KHA on all-MiniLM-L6-v2",
        description="The whole pipeline on a real model (embedded all-MiniLM-L6-v2), in about "
                    "a minute on two CPU cores.")
    p.add_argument("--steps", type=int, default=20, help="training steps of the KHA parameters (default 20)")
    p.add_argument("--out", default="./kha_demo_out", help="output directory (default ./kha_demo_out)")
    p.add_argument("--no-export", action="store_true", help="skip the ONNX exports")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the demo's batches are tiny, and more threads than free "
                        "cores make it several times slower on a busy machine)")
    p.set_defaults(func=run)
    return p


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


# The demo's contrastive objective: anchor i should be closest to positive i among all positives.
# Each pair has a role-reversed twin (who did what to whom), a hard negative for mean-pooled
# embeddings, so the loss of the pretrained model is far from zero.
DEMO_PAIRS = [
    ("The dog chased the cat.", "The cat was chased by the dog."),
    ("The cat chased the dog.", "The dog was chased by the cat."),
    ("Alice paid Bob for the car.", "Bob got money from Alice for the car."),
    ("Bob paid Alice for the car.", "Alice got money from Bob for the car."),
    ("The teacher thanked the student.", "The student was thanked by the teacher."),
    ("The student thanked the teacher.", "The teacher was thanked by the student."),
    ("The company bought the startup.", "The startup was acquired by the company."),
    ("The startup bought the company.", "The company was acquired by the startup."),
]
DEMO_SENTENCES = [
    "Knocking-heads attention lets attention heads share a small transform.",
    "The weather is lovely today.",
    "A folded model has exactly the original architecture.",
    "ONNX Runtime runs the exported graph.",
]
_OTHER = ["One more sentence, of another length, to exercise the dynamic axes."]  # another shape



def _features(st: Any, texts: Sequence[str]) -> dict:
    prep = getattr(st, "preprocess", None) or st.tokenize
    return prep(list(texts))


def _encode(st: Any, texts: Sequence[str]) -> torch.Tensor:
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
class _Check:
    what: str
    result: str
    ok: bool


def _train_kha(st: Any, steps: int, ui: UI, lr: float = 1e-3, temperature: float = 0.05) -> list[float]:
    """Train only the KHA parameters on an in-batch contrastive loss over DEMO_PAIRS; returns the losses."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    for name, p in st.named_parameters():
        p.requires_grad_("kha" in name)  # base weights frozen
    params = [p for p in st.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    n = len(DEMO_PAIRS)
    batch = _features(st, [a for a, _ in DEMO_PAIRS] + [b for _, b in DEMO_PAIRS])  # anchors, then positives
    labels = torch.arange(n)
    losses: list[float] = []
    progress = Progress(TextColumn("training KHA"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=ui.err, transient=True, disable=not ui.err.is_terminal)
    with progress:
        task = progress.add_task("train", total=steps, loss="-")
        for _ in range(steps):
            emb = nn.functional.normalize(st(batch)["sentence_embedding"], dim=-1)  # (2N, D)
            logits = emb[:n] @ emb[n:].T / temperature                              # (N, N)
            loss = (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
    for p in st.parameters():
        p.requires_grad_(False)
    return losses


def _loss_table(losses: list[float]) -> Any:
    from rich.table import Table

    n = len(losses)
    shown = sorted({0, n - 1, *range(0, n, max(1, n // 5))})
    table = Table(title="training loss (KHA only, base frozen)", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("")
    top = max(losses) or 1.0
    for i in shown:
        table.add_row(str(i + 1), f"{losses[i]:.4f}", "█" * max(1, round(30 * losses[i] / top)))
    return table


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile demo``."""
    if args.steps < 1:
        raise CommandError(f"--steps must be at least 1, got {args.steps}.")
    if args.threads < 1:
        raise CommandError(f"--threads must be at least 1, got {args.threads}.")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _demo(args, ui)
    finally:
        torch.set_num_threads(saved)


def _demo(args: argparse.Namespace, ui: UI) -> int:
    import kha_compile as kc
    from rich.panel import Panel

    t_start = time.perf_counter()
    ui.steps = ui.out
    out_dir = pathlib.Path(args.out)
    checks: list[_Check] = []
    ui.out.print(Panel.fit(
        "Knocking-heads attention (arXiv 2510.23052) on a real model: all-MiniLM-L6-v2 (22.7M params).\n"
        "inspect → apply linear KHA (q, k, v) → identity check → train KHA only → fold → ONNX → MLP-value",
        title="kha-compile demo"))

    with ui.step("load all-MiniLM-L6-v2 (embedded weights) with sentence-transformers"):
        st = load_minilm()
        torch.manual_seed(0)
    with ui.step(f"encode {len(DEMO_SENTENCES)} sentences (reference embeddings)"):
        e_base = _encode(st, DEMO_SENTENCES)
    keys_before = list(st.state_dict())

    with ui.step("inspect: trace one block, find the attention sites"):
        report = kc.inspect(st)
    ui.out.print(report_table(report))

    cfg = kc.KHAConfig(q="linear", k="linear", v="linear")
    with ui.step(f"apply {cfg}"):
        kc.apply(st, cfg)
    n_kha = kha_param_count(st)
    ui.out.print(report_table(kc.inspect(st), title=f"after apply: {n_kha:,} KHA parameters "
                              f"({len(report.matched)} sites × 3 roles × head_dim²)"))
    d_init = max_diff(_encode(st, DEMO_SENTENCES), e_base)
    checks.append(_Check("identity at init", f"max |Δ embedding| = {fmt_diff(d_init)}", d_init == 0.0))
    ui.out.print(f"embeddings right after apply: max |Δ| = {fmt_diff(d_init)} {ok_mark(d_init == 0.0)}")

    t0 = time.perf_counter()  # no ui.step: the training shows its own progress bar
    losses = _train_kha(st, args.steps, ui)
    ui.steps.print(f"[green]✓[/] train the KHA parameters for {args.steps} steps on {len(DEMO_PAIRS)} "
                   f"paraphrase pairs with role-reversed twins [dim]({time.perf_counter() - t0:.1f}s)[/]")
    ui.out.print(_loss_table(losses))
    improved = len(losses) < 2 or losses[-1] < losses[0]
    checks.append(_Check("training", f"loss {losses[0]:.4f} → {losses[-1]:.4f} ({len(losses)} steps, "
                                     f"{n_kha:,} params)", improved))
    e_kha = _encode(st, DEMO_SENTENCES)
    ui.out.print(f"embeddings moved by training: max |Δ| = {fmt_diff(max_diff(e_kha, e_base))}")

    with ui.step(f"save the KHA checkpoint to {out_dir / 'kha_checkpoint'}"):
        kc.save_pretrained(st, out_dir / "kha_checkpoint")
    png = out_dir / "kha_matrices.png"
    if _importable("matplotlib"):
        with ui.step(f"plot the learned matrices to {png}"):
            from ...viz import plot_kha

            plot_kha(st, png, delta=True, title=f"all-MiniLM-L6-v2: change of the KHA matrices in "
                                                f"{args.steps} training steps (T - I)")
    else:
        ui.out.print("[dim]matplotlib not installed: no heatmap (pip install 'kha-compile\\[viz]')[/]")

    with ui.step("fold the linear KHA into the query/key/value weights"):
        kc.fold(st)
    e_fold = _encode(st, DEMO_SENTENCES)
    d_fold = max_diff(e_fold, e_kha)
    left = kha_leftovers(st)
    same_keys = list(st.state_dict()) == keys_before
    fold_ok = d_fold < FOLD_TOL and not left and same_keys
    checks.append(_Check("fold", f"max |Δ| vs trained KHA = {fmt_diff(d_fold)}; KHA modules left: {len(left)}; "
                                 f"state_dict keys = original: {same_keys}", fold_ok))
    ui.out.print(f"folded vs trained KHA embeddings: max |Δ| = {fmt_diff(d_fold)}, KHA modules left: "
                 f"{len(left)}, original state_dict keys: {same_keys} {ok_mark(fold_ok)}")

    if not args.no_export:
        checks.extend(_demo_export(st, out_dir, ui))

    ui.out.print(_summary_table(checks, time.perf_counter() - t_start))
    return 0 if all(c.ok for c in checks) else 1


def _demo_export(st: Any, out_dir: pathlib.Path, ui: UI) -> list[_Check]:
    import kha_compile as kc
    from ...exporters.onnx import export_onnx, onnx_summary

    checks = []
    out_dir.mkdir(parents=True, exist_ok=True)
    feats = _features(st, DEMO_SENTENCES)
    tokens = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor) and k != "token_embeddings"}
    other = _features(st, _OTHER)
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
    checks.append(_Check("ONNX, linear KHA folded", f"onnxruntime vs torch max |Δ| = {fmt_diff(d)}; "
                                                    f"{s.num_nodes} nodes, {s.num_custom_nodes} custom; "
                                                    f"{path.stat().st_size / 2**20:.1f} MiB", d < ONNX_TOL))
    ui.out.print(f"{path.name}: {s.num_nodes} nodes, {s.num_custom_nodes} custom nodes, inputs "
                 f"{', '.join(str(i) for i in s.inputs)}; onnxruntime vs torch: max |Δ| = {fmt_diff(d)} "
                 f"{ok_mark(d < ONNX_TOL)}")

    # 2. MLP-value KHA on a fresh model: not foldable, ships as one custom node per attention
    with ui.step("fresh model: apply KHAConfig(v='mlp')"):
        st2 = load_minilm()
        kc.apply(st2, kc.KHAConfig(v="mlp"))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # stand-in for training, so the check exercises the MLP: seeded noise
            for n, p in st2.named_parameters():
                if ".kha." in n:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
    path2 = out_dir / "minilm_kha_mlp.onnx"
    s2, d2 = export_and_compare(st2, path2, "the MLP-value model", " (the kha::MLPValue function body)")
    ok2 = d2 < ONNX_TOL and s2.num_custom_nodes == 6
    checks.append(_Check("ONNX, MLP-value KHA", f"{s2.num_custom_nodes} kha::MLPValue nodes (6 expected); "
                                                f"onnxruntime vs torch max |Δ| = {fmt_diff(d2)}", ok2))
    ui.out.print(f"{path2.name}: {s2.num_nodes} nodes, [bold]{s2.num_custom_nodes} kha::MLPValue[/] custom nodes, "
                 f"functions {', '.join('::'.join(f) for f in s2.functions)}; onnxruntime vs torch "
                 f"(KHA weights perturbed with seeded noise): max |Δ| = {fmt_diff(d2)} {ok_mark(ok2)}")
    return checks


def _ort_parity_embeddings(st: Any, path: pathlib.Path, batches: list) -> float:
    """Max |onnxruntime - torch| over sentence embeddings: ONNX hidden states, then st's pooling."""
    worst = 0.0
    for texts, feats, tokens in batches:
        (hidden, *_) = ort_run(path, (), tokens)
        got = _st_embed_from_tokens(st, feats, torch.from_numpy(hidden))
        worst = max(worst, max_diff(got, _encode(st, texts)))
    return worst


def _summary_table(checks: list[_Check], seconds: float) -> Any:
    from rich.table import Table

    table = Table(title="summary", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("ok", justify="center")
    for c in checks:
        table.add_row(c.what, c.result, ok_mark(c.ok))
    table.caption = f"total {seconds:.1f}s"
    table.caption_justify = "left"
    return table


