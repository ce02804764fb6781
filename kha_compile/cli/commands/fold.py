"""``kha-compile fold``: fold a linear KHA checkpoint into a vanilla model and save it."""

from __future__ import annotations

import argparse
import logging
import pathlib
from typing import Any

import torch

import kha_compile as kc

from ...analysis.inputs import example_inputs
from ...core.errors import CommandError, FoldError
from ...store.hf import CONFIG_KEY
from ..models import MODEL_HELP, kha_leftovers, load_with_kha, recorded_kha
from ..ort import FOLD_TOL, first_tensor, max_diff
from ..ui import UI, fmt_diff, kv_table

__all__ = ["NAME", "register", "run"]

log = logging.getLogger(__name__)

NAME = "fold"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``fold`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="fold a linear KHA checkpoint into a vanilla model",
        description="Load MODEL and its KHA (the checkpoint --kha, or the KHA its directory records), fold "
        "every linear transform into the weights and save the vanilla model with save_pretrained.",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "--kha",
        metavar="DIR",
        help="KHA checkpoint (from apply / kc.save_pretrained); not needed when MODEL is a directory that records "
        "its KHA (model.save_pretrained after kc.apply)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile fold``."""

    if not args.kha and recorded_kha(args.model) is None:
        raise CommandError(
            f"nothing to fold: {args.model!r} records no KHA (no {CONFIG_KEY!r} entry in a config.json) and "
            "--kha is not given. Pass the KHA checkpoint with --kha DIR, or a directory written by "
            "model.save_pretrained after kc.apply."
        )
    model, name = load_with_kha(args.model, args.kha, ui)
    ex_args, ex_kwargs = example_inputs(model)
    with torch.no_grad():
        before = first_tensor(model(*ex_args, **ex_kwargs))
    with ui.step("fold the linear KHA into the projection weights"):
        kc.fold(model)
    with torch.no_grad():
        after = first_tensor(model(*ex_args, **ex_kwargs))
    d = max_diff(after, before)
    left = kha_leftovers(model)
    if left:  # fold() is strict, so this would be a library bug
        raise FoldError(f"fold left KHA modules behind: {left[:3]}; please report this with the model name.")
    out = pathlib.Path(args.out)
    with ui.step(f"save the vanilla model to {out}"):
        save = getattr(model, "save_pretrained", None)
        if not callable(save):
            raise CommandError(
                f"{type(model).__name__} has no save_pretrained; only transformers and "
                "sentence-transformers models are saved by this command."
            )
        save(str(out))
        _copy_tokenizer(args.model, out)
    ui.out.print(
        kv_table(
            f"{name}: folded",
            [
                ("output", str(out)),
                ("max |folded - KHA| on example inputs", fmt_diff(d)),
                ("KHA modules left", "0"),
                ("loads with", "plain transformers: from_pretrained, no kha_compile"),
            ],
        )
    )
    return 0 if d < FOLD_TOL * max(1.0, float(before.abs().max())) else 1


def _copy_tokenizer(spec: str, out: pathlib.Path) -> None:
    path = pathlib.Path(spec)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(out))
    except Exception as e:  # a model without a tokenizer is fine
        log.debug("no tokenizer copied from %s: %s", path, e)
