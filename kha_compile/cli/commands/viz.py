"""``kha-compile viz``: heatmaps of the learned KHA matrices (:mod:`kha_compile.viz`)."""
from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from ...errors import MissingDependencyError
from ..models import MODEL_HELP, load_with_kha
from ..ui import UI

__all__ = ["NAME", "register", "run"]

NAME = "viz"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``viz`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, parents=[common], allow_abbrev=False, help="heatmaps of the learned KHA matrices per layer")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", required=True, metavar="DIR", help="KHA checkpoint to plot")
    p.add_argument("--out", default="kha.png", help="PNG file (default kha.png)")
    p.add_argument("--delta", action="store_true", help="plot the change from initialisation")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile viz``."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("viz needs matplotlib: pip install 'kha-compile[viz]'")
    from ...viz import plot_kha

    model, name = load_with_kha(args.model, args.kha, ui)
    with ui.step(f"plot to {args.out}"):
        path = plot_kha(model, args.out, delta=args.delta,
                        title=f"{name}: KHA matrices{' (change from init)' if args.delta else ''} from {args.kha}")
    ui.out.print(f"wrote {path}")
    return 0
