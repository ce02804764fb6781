"""``kha-compile export``: a model (optionally with KHA) to ONNX, checked against onnxruntime.

The output's directory is created when it does not exist, and the command says so (a line on
stdout and an INFO log record); a path whose parent is a file is refused.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
from typing import Any

import torch

import kha_compile as kc

from ...analysis.inputs import example_inputs
from ...core.errors import CommandError
from ...exporters.onnx import export_onnx, onnx_summary
from ..models import MODEL_HELP, export_target, kha_param_count, load_with_kha
from ..ort import ONNX_TOL, first_tensor, max_diff, ort_run
from ..ui import UI, fmt_diff, kv_table, ok_mark

__all__ = ["NAME", "prepare_output", "register", "run"]

log = logging.getLogger(__name__)

NAME = "export"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="export to ONNX (MLP-value as a custom node)",
        description="Export MODEL to ONNX (linear KHA folded in a copy, MLP-value KHA as one kha::MLPValue "
        "node per attention) and compare onnxruntime with torch on example inputs.",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "output",
        metavar="OUT.onnx",
        help="the ONNX file to write; its directory is created (and reported) if it does not exist",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mlp", action="store_true", help="apply MLP-value KHA (identity) before export")
    g.add_argument("--linear", action="store_true", help="apply linear q/k/v KHA (identity) before export")
    g.add_argument("--kha", metavar="DIR", help="load this KHA checkpoint before export")
    p.add_argument("--no-fold", action="store_true", help="keep linear KHA as ops (default: folded in a copy)")
    p.add_argument("--static", action="store_true", help="fixed shapes (default: dynamic batch and sequence)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    p.set_defaults(func=run)
    return p


def prepare_output(out: pathlib.Path, ui: UI) -> None:
    """Create the directory of ``out`` when it is missing, and say so; refuse a parent that is a file."""
    parent = out.parent
    for d in (parent, *parent.parents):
        if d.exists() and not d.is_dir():
            raise CommandError(f"cannot write {out}: {d} exists and is not a directory.")
    if not parent.exists():
        parent.mkdir(parents=True)
        log.info("export: created the output directory %s", parent)
        ui.out.print(f"created the output directory {parent}")


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile export``."""

    out = pathlib.Path(args.output)
    model, name = load_with_kha(args.model, args.kha, ui)
    cfg = (
        kc.KHAConfig(v="mlp") if args.mlp else kc.KHAConfig(q="linear", k="linear", v="linear") if args.linear else None
    )
    if cfg is not None:
        with ui.step(f"apply {cfg}"):
            kc.apply(model, cfg)
    target = export_target(model)
    prepare_output(out, ui)
    with ui.step(f"export {type(target).__name__} to {out} (dynamic={not args.static}, fold={not args.no_fold})"):
        export_onnx(target, out, dynamic=not args.static, fold=not args.no_fold)
    s = onnx_summary(out)
    rows = [
        ("file", f"{out} ({out.stat().st_size / 2**20:.2f} MiB)"),
        ("KHA parameters exported", f"{kha_param_count(target):,}"),
        ("opset", str(s.opset)),
        ("nodes", str(s.num_nodes)),
        ("kha::MLPValue nodes", str(s.num_custom_nodes)),
        ("functions", ", ".join("::".join(f) for f in s.functions) or "none"),
    ]
    rows += [(f"input {i.name}", f"{i.dtype}{list(i.dims)}") for i in s.inputs]
    rows += [(f"output {o.name}", f"{o.dtype}{list(o.dims)}") for o in s.outputs]
    status = 0
    if not args.no_check:  # against the model as loaded: with its trained KHA, unfolded
        ex_args, ex_kwargs = example_inputs(target)
        with ui.step("compare onnxruntime with torch on the example inputs"):
            with torch.no_grad():
                want = first_tensor(target(*ex_args, **ex_kwargs))
            got = torch.from_numpy(ort_run(out, ex_args, ex_kwargs)[0])
            d = max_diff(got, want)
        ok = d < ONNX_TOL * max(1.0, float(want.abs().max()))
        rows.append(("onnxruntime vs torch", f"max |Δ| = {fmt_diff(d)} {ok_mark(ok)}"))
        status = 0 if ok else 1
    ui.out.print(kv_table(f"{name}: ONNX export", rows))
    return status
