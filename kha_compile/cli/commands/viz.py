"""``kha-compile viz``: pictures of the learned KHA matrices (:mod:`kha_compile.viz`).

Writes ``--out`` (the matrices per layer and role, and their change from the identity),
``<stem>_diagonal.png`` (diagonal against off-diagonal mass per layer and role) and, when the
demo wrote ``loss_curves.json`` next to the checkpoint (or ``--curves`` names one),
``<stem>_loss.png``; prints the diagonal summary as a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from ...core.errors import CommandError, MissingDependencyError
from ...viz import diagonal_summary, load_loss_curves, plot_diagonal, plot_kha, plot_loss_curves
from ..models import MODEL_HELP, load_with_kha
from ..ui import UI

__all__ = ["NAME", "diagonal_table", "register", "run"]

NAME = "viz"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``viz`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="heatmaps of the learned KHA matrices, their diagonal mass per layer, the demo's loss curves",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", required=True, metavar="DIR", help="KHA checkpoint to plot")
    p.add_argument(
        "--out",
        default="kha.png",
        help="PNG of the matrices (default kha.png); the diagonal summary and the loss curves go "
        "next to it as <stem>_diagonal.png and <stem>_loss.png",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="plot only the change from initialisation (default: the matrices and T - I)",
    )
    p.add_argument(
        "--curves",
        metavar="FILE",
        default=None,
        help="loss_curves.json to plot (default: the one `demo` wrote next to --kha, if any)",
    )
    p.set_defaults(func=run)
    return p


def diagonal_table(rows: Sequence[Any], title: str | None = None) -> Any:
    """A rich table of :func:`kha_compile.viz.diagonal_summary` rows: one line per layer, two columns per role."""
    from rich.table import Table

    roles = list(dict.fromkeys(r.role for r in rows))
    layers = list(dict.fromkeys(r.layer for r in rows))
    table = Table(
        title=title or "KHA matrices: diagonal mass ||diag M||²/||M||_F² (off-diagonal = 1 − it) and ||M − I||_F/√d",
        title_justify="left",
    )
    table.add_column("layer")
    for role in roles:
        table.add_column(f"{role} diag", justify="right")
        table.add_column(f"{role} ‖M−I‖/√d", justify="right")
    by_key = {(r.layer, r.role): r for r in rows}
    for layer in layers:
        cells = []
        for role in roles:
            r = by_key.get((layer, role))
            cells += ["" if r is None else f"{r.diagonal:.3f}", "" if r is None else f"{r.distance_from_identity:.3f}"]
        table.add_row(layer, *cells)
    return table


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile viz``."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("viz needs matplotlib: pip install 'kha-compile[viz]'")

    curves = None
    if args.curves:
        path = pathlib.Path(args.curves)
        if not path.is_file():
            raise CommandError(
                f"--curves {args.curves}: no such file; give the loss_curves.json that "
                "`kha-compile demo` wrote into its --out directory."
            )
        curves = json.loads(path.read_text())["runs"]
    else:
        curves = load_loss_curves(args.kha)
    model, name = load_with_kha(args.model, args.kha, ui)
    out = pathlib.Path(args.out)
    rows = diagonal_summary(model)
    written = []
    with ui.step(f"plot to {out}"):
        written.append(
            plot_kha(
                model,
                out,
                delta=args.delta,
                with_delta=not args.delta,
                title=f"{name}: KHA matrices{' (change from init)' if args.delta else ''} "
                f"from {args.kha} (colour range fitted per panel)",
            )
        )
        written.append(
            plot_diagonal(
                rows,
                out.with_name(f"{out.stem}_diagonal.png"),
                title=f"{name}: diagonal vs off-diagonal mass of the KHA matrices",
            )
        )
        if curves:
            written.append(
                plot_loss_curves(
                    curves, out.with_name(f"{out.stem}_loss.png"), title=f"{name}: loss curves written by the demo"
                )
            )
    ui.out.print(diagonal_table(rows))
    ui.out.print("wrote " + ", ".join(str(p) for p in written))
    return 0
