"""``kha-compile demo``: the whole pipeline on a real model (the embedded all-MiniLM-L6-v2), measured.

inspect -> apply linear KHA (q, k, v) -> identity check -> train with and without KHA in turns (same
initial weights, data order and steps; both again on a second data order, to measure the noise)
-> both validation losses side by side -> pictures -> fold -> ONNX -> MLP-value; a summary table at
the end, and ``summary.json``, ``loss_curves.json``, the KHA checkpoint and PNGs in ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import json
import math
import pathlib
import platform
import shutil
import time
from typing import Any

import torch

import kha_compile as kc

from ...core.errors import CommandError
from ...viz import LOSS_CURVES_FILE, diagonal_summary, plot_diagonal, plot_kha, plot_loss_curves
from ..demo_export import DEMO_SENTENCES, Check, demo_export, encode
from ..demo_train import DemoRun, TrainSpec, docstring_pairs, train_in_turns
from ..models import kha_leftovers, kha_param_count, load_minilm
from ..ort import FOLD_TOL, max_diff
from ..ui import UI, fmt_diff, ok_mark, report_table
from .viz import diagonal_table

__all__ = ["DEMO_SENTENCES", "NAME", "PICTURES", "SUMMARY_FILE", "register", "run"]

NAME = "demo"
SUMMARY_FILE = "summary.json"
# What the demo draws, as files in --out (and copied to --docs with the prefix "demo_").
PICTURES = ("kha_matrices.png", "kha_diagonal.png", "kha_loss.png")
_DEFAULT = TrainSpec()


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="train all-MiniLM-L6-v2 with and without KHA, compare, fold and export",
        description="The whole pipeline on a real model (embedded all-MiniLM-L6-v2): train it with and "
        "without KHA in turns on Python's own docstrings, compare the validation losses "
        "against run-to-run noise, plot the learned matrices, fold, export. A few minutes "
        "on two CPU cores.",
    )
    p.add_argument(
        "--steps", type=int, default=_DEFAULT.steps, help=f"training steps of every run (default {_DEFAULT.steps})"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=_DEFAULT.lr,
        help=f"Adam learning rate of the attention weights, both runs (default {_DEFAULT.lr:g})",
    )
    p.add_argument(
        "--kha-lr",
        type=float,
        default=_DEFAULT.kha_lr,
        help=f"Adam learning rate of the KHA matrices (default {_DEFAULT.kha_lr:g})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="data order of the compared runs; both are repeated on order SEED+1 to measure the noise (default 0)",
    )
    p.add_argument(
        "--evals",
        type=int,
        default=_DEFAULT.evals,
        help=f"validation points per run besides step 0, evenly spaced, the last at the last step "
        f"(default {_DEFAULT.evals})",
    )
    p.add_argument(
        "--val-pairs",
        type=int,
        default=_DEFAULT.val_pairs,
        help=f"held-out pairs each validation embeds (default {_DEFAULT.val_pairs}; fewer is faster and noisier)",
    )
    p.add_argument("--out", default="./kha_demo_out", help="output directory (default ./kha_demo_out)")
    p.add_argument(
        "--docs",
        metavar="DIR",
        default=None,
        help="also copy the pictures to DIR as demo_<name>.png (the pictures of docs/demo.md: --docs docs)",
    )
    p.add_argument("--no-export", action="store_true", help="skip the ONNX exports")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the demo's batches are small, and more threads than free "
        "cores make it several times slower on a busy machine)",
    )
    p.set_defaults(func=run)
    return p


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile demo``."""
    if args.steps < 1:
        raise CommandError(f"--steps must be at least 1, got {args.steps}.")
    for flag in ("threads", "evals", "val_pairs"):
        if getattr(args, flag) < 1:
            raise CommandError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}.")
    for flag in ("lr", "kha_lr"):
        if not getattr(args, flag) > 0:
            raise CommandError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}.")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _demo(args, ui)
    finally:
        torch.set_num_threads(saved)


def _train_runs(runs: list[DemoRun], spec: TrainSpec, ui: UI) -> None:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    train, val = docstring_pairs()
    progress = Progress(
        TextColumn(f"training {len(runs)} runs in turns"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=ui.err,
        transient=True,
        disable=not ui.err.is_terminal,
    )
    t0 = time.perf_counter()
    with progress:
        task = progress.add_task("train", total=spec.steps)
        train_in_turns(runs, train, val, spec, on_step=lambda s: progress.update(task, completed=s))
    ui.steps.print(
        f"[green]✓[/] train {len(runs)} runs in turns for {spec.steps} steps each on "
        f"{len(train)} docstring paragraph pairs, batch {spec.batch_size}; validation on "
        f"{min(spec.val_pairs, len(val))} held-out pairs [dim]({time.perf_counter() - t0:.1f}s)[/]"
    )


def _comparison(runs: list[DemoRun]) -> dict[str, Any]:
    """KHA - baseline per data order, against the run-to-run noise (spread of each method over the orders).

    ``runs`` = [baseline order a, KHA order a, baseline order b, KHA order b]. The difference is called
    larger than the noise only if both paired differences have the same sign and their mean exceeds
    the larger of the two spreads |baseline(a) - baseline(b)| and |KHA(a) - KHA(b)|.
    """
    base, kha, base2, kha2 = runs
    diffs = [kha.val_loss - base.val_loss, kha2.val_loss - base2.val_loss]
    diff = sum(diffs) / 2
    noise = max(abs(base.val_loss - base2.val_loss), abs(kha.val_loss - kha2.val_loss))
    exceeds = abs(diff) > noise and diffs[0] * diffs[1] > 0
    if not exceeds:
        verdict = (
            f"the difference ({diff:+.4f}) is within run-to-run noise ({noise:.4f}, the larger spread of "
            "either method over two data orders): no measurable effect at this budget"
        )
    else:
        verdict = (
            f"KHA is {'better' if diff < 0 else 'worse'} by {abs(diff):.4f} on average, more than the "
            f"run-to-run noise ({noise:.4f}, the larger spread of either method over two data orders; "
            "two orders only, so a ratio under ~2-3 is suggestive, not established)"
        )
    return {
        "val_loss_baseline": base.val_loss,
        "val_loss_kha": kha.val_loss,
        "val_loss_baseline_other_order": base2.val_loss,
        "val_loss_kha_other_order": kha2.val_loss,
        "val_loss_before": base.val_curve[0][1],
        "difference_per_order": diffs,
        "difference_kha_minus_baseline": diff,
        "noise": noise,
        "exceeds_noise": exceeds,
        "verdict": verdict,
    }


def _comparison_table(runs: list[DemoRun], cmp: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title="validation loss (contrastive, held-out docstring pairs; lower is better)", title_justify="left"
    )
    for col in ("run", "data order", "trained params", "val loss before", "val loss after", "train loss, last 10"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in runs:
        tail = [v for _, v in r.train_curve[-10:]]
        table.add_row(
            r.name,
            str(r.order_seed),
            f"{r.trained:,}",
            f"{r.val_curve[0][1]:.4f}",
            f"{r.val_loss:.4f}",
            f"{sum(tail) / len(tail):.4f}",
        )
    d0, d1 = cmp["difference_per_order"]
    table.caption = (
        f"KHA − baseline: {d0:+.4f} and {d1:+.4f} on the two data orders, mean "
        f"{cmp['difference_kha_minus_baseline']:+.4f}; noise = max |run(order a) − run(order b)| = "
        f"{cmp['noise']:.4f}: {cmp['verdict']}"
    )
    table.caption_justify = "left"
    return table


def _pictures(
    st: Any, runs: list[DemoRun], rows: list[Any], out_dir: pathlib.Path, steps: int, ui: UI
) -> list[pathlib.Path]:
    if not _importable("matplotlib"):
        ui.out.print("[dim]matplotlib not installed: no pictures (pip install 'kha-compile\\[viz]')[/]")
        return []

    with ui.step(f"draw {', '.join(PICTURES)} in {out_dir}"):
        return [
            plot_kha(
                st,
                out_dir / PICTURES[0],
                with_delta=True,
                title=f"all-MiniLM-L6-v2 after {steps} steps: learned KHA matrices T and their change "
                "T − I (colour range fitted per panel)",
            ),
            plot_diagonal(
                rows,
                out_dir / PICTURES[1],
                title=f"all-MiniLM-L6-v2 after {steps} steps: how far each KHA matrix left the identity",
            ),
            plot_loss_curves(
                [r.to_json() for r in runs],
                out_dir / PICTURES[2],
                title=f"all-MiniLM-L6-v2: {steps} steps, with and without KHA, in turns",
            ),
        ]


def _demo(args: argparse.Namespace, ui: UI) -> int:
    from rich.panel import Panel

    t_start = time.perf_counter()
    ui.steps = ui.out
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = dataclasses.replace(
        _DEFAULT, steps=args.steps, lr=args.lr, kha_lr=args.kha_lr, evals=args.evals, val_pairs=args.val_pairs
    )
    checks: list[Check] = []
    timings: dict[str, float] = {}
    ui.out.print(
        Panel.fit(
            "Knocking-heads attention (arXiv 2510.23052) on a real model: all-MiniLM-L6-v2 (22.7M params).\n"
            "inspect → apply linear KHA (q, k, v) → identity check → train with and without KHA in turns → "
            "compare → fold → ONNX → MLP-value",
            title="kha-compile demo",
        )
    )

    with ui.step("load all-MiniLM-L6-v2 (embedded weights) with sentence-transformers"):
        st = load_minilm()
        torch.manual_seed(0)
    with ui.step(f"encode {len(DEMO_SENTENCES)} sentences (reference embeddings)"):
        e_base = encode(st, DEMO_SENTENCES)
    keys_before = list(st.state_dict())

    with ui.step("inspect: trace one block, find the attention sites"):
        report = kc.inspect(st)
    ui.out.print(report_table(report))

    baseline, baseline2 = copy.deepcopy(st), copy.deepcopy(st)  # same initial weights, no KHA
    cfg = kc.KHAConfig(q="linear", k="linear", v="linear")
    with ui.step(f"apply {cfg}"):
        kc.apply(st, cfg)
    n_kha = kha_param_count(st)
    ui.out.print(
        report_table(
            kc.inspect(st),
            title=f"after apply: {n_kha:,} KHA parameters ({len(report.matched)} sites × 3 roles × head_dim²)",
        )
    )
    d_init = max_diff(encode(st, DEMO_SENTENCES), e_base)
    checks.append(Check("identity at init", f"max |Δ embedding| = {fmt_diff(d_init)}", d_init == 0.0))
    ui.out.print(f"embeddings right after apply: max |Δ| = {fmt_diff(d_init)} {ok_mark(d_init == 0.0)}")

    kha2 = copy.deepcopy(st)  # KHA at init, the same weights as st
    runs = [
        DemoRun("baseline", baseline, args.seed),
        DemoRun("KHA (q, k, v linear)", st, args.seed),
        DemoRun("baseline", baseline2, args.seed + 1),
        DemoRun("KHA (q, k, v linear)", kha2, args.seed + 1),
    ]
    t0 = time.perf_counter()
    _train_runs(runs, spec, ui)
    timings["train"] = time.perf_counter() - t0
    cmp = _comparison(runs)
    ui.out.print(_comparison_table(runs, cmp))
    finite = all(math.isfinite(v) for r in runs for _, v in r.train_curve + r.val_curve)
    checks.append(
        Check("training", f"{len(runs)} runs × {spec.steps} steps in turns; all losses finite: {finite}", finite)
    )
    checks.append(
        Check(
            "KHA vs baseline",
            f"val loss {cmp['val_loss_kha']:.4f} vs {cmp['val_loss_baseline']:.4f} "
            f"(mean Δ over 2 data orders {cmp['difference_kha_minus_baseline']:+.4f}, "
            f"noise {cmp['noise']:.4f}"
            f"): {'exceeds' if cmp['exceeds_noise'] else 'within'} noise",
            None,
        )
    )
    rows = diagonal_summary(st)
    ui.out.print(
        diagonal_table(
            rows,
            title="learned KHA matrices: diagonal mass ||diag T||²/||T||_F² (off-diagonal = 1 − it) and ||T − I||_F/√d",
        )
    )
    e_kha = encode(st, DEMO_SENTENCES)

    with ui.step(f"save the KHA checkpoint and {LOSS_CURVES_FILE} to {out_dir}"):
        kc.save_pretrained(st, out_dir / "kha_checkpoint")
        (out_dir / LOSS_CURVES_FILE).write_text(json.dumps({"runs": [r.to_json() for r in runs]}, indent=1))
    t0 = time.perf_counter()
    pngs = _pictures(st, runs, rows, out_dir, spec.steps, ui)
    timings["pictures"] = time.perf_counter() - t0
    if args.docs and pngs:
        docs = pathlib.Path(args.docs)
        docs.mkdir(parents=True, exist_ok=True)
        for png in pngs:
            shutil.copyfile(png, docs / f"demo_{png.name}")
        ui.out.print(f"copied {', '.join(f'demo_{p.name}' for p in pngs)} to {docs}")

    t0 = time.perf_counter()
    with ui.step("fold the linear KHA into the query/key/value weights"):
        kc.fold(st)
    e_fold = encode(st, DEMO_SENTENCES)
    d_fold = max_diff(e_fold, e_kha)
    left = kha_leftovers(st)
    same_keys = list(st.state_dict()) == keys_before
    fold_ok = d_fold < FOLD_TOL and not left and same_keys
    checks.append(
        Check(
            "fold",
            f"max |Δ| vs trained KHA = {fmt_diff(d_fold)}; KHA modules left: {len(left)}; "
            f"state_dict keys = original: {same_keys}",
            fold_ok,
        )
    )
    ui.out.print(
        f"folded vs trained KHA embeddings: max |Δ| = {fmt_diff(d_fold)}, KHA modules left: "
        f"{len(left)}, original state_dict keys: {same_keys} {ok_mark(fold_ok)}"
    )
    timings["fold"] = time.perf_counter() - t0

    diffs: dict[str, Any] = {"identity_at_init": d_init, "fold": d_fold}
    if not args.no_export:
        t0 = time.perf_counter()
        export_checks, onnx_diffs = demo_export(st, out_dir, ui)
        checks.extend(export_checks)
        diffs.update(onnx_diffs)
        timings["export"] = time.perf_counter() - t0

    timings["total"] = time.perf_counter() - t_start
    summary = {
        "model": "all-MiniLM-L6-v2",
        "kha_config": {"q": "linear", "k": "linear", "v": "linear"},
        "steps": spec.steps,
        "batch_size": spec.batch_size,
        "lr": spec.lr,
        "kha_lr": spec.kha_lr,
        "temperature": spec.temperature,
        "trained_base_params": list(spec.base_params),
        "kha_params": n_kha,
        "runs": [{"name": r.name, "order_seed": r.order_seed} for r in runs],
        "val_pairs": spec.val_pairs,
        **cmp,
        "diagonal": [r.to_json() for r in rows],
        "diffs": diffs,
        "checks": [dataclasses.asdict(c) for c in checks],
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "run_seconds": [round(r.seconds, 2) for r in runs],
        "threads": args.threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    ui.out.print(_summary_table(checks, timings["total"]))
    ui.out.print(
        f"wrote {out_dir / SUMMARY_FILE}, {out_dir / LOSS_CURVES_FILE}, {out_dir / 'kha_checkpoint'}"
        + "".join(f", {p}" for p in pngs)
    )
    return 0 if all(c.ok is not False for c in checks) else 1


def _summary_table(checks: list[Check], seconds: float) -> Any:
    from rich.table import Table

    table = Table(title="summary", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("ok", justify="center")
    for c in checks:
        table.add_row(c.what, c.result, "·" if c.ok is None else ok_mark(c.ok))
    table.caption = f"total {seconds:.1f}s"
    table.caption_justify = "left"
    return table
