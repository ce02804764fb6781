"""``kha-compile inspect`` (list the attention sites) and ``kha-compile apply`` (insert KHA, save it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
from collections.abc import Callable
from typing import Any

import kha_compile as kc

from ...core.errors import CommandError
from ...serving.vllm import VLLMAdvice, vllm_advice
from ..models import MODEL_HELP, config_from, kha_param_count, load_with_kha, recorded_kha
from ..ui import UI, report_table

__all__ = ["NAME", "kind_choice", "register", "run_apply", "run_inspect"]

NAME = "inspect, apply"


def kind_choice(allowed: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: a transform kind spelled as the CLI takes it (``none`` for no transform).

    Example::

        p.add_argument("--v", type=kind_choice(("none", "linear", "mlp")))
    """

    def parse(value: str) -> str:
        v = value.lower()
        if v not in allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not allowed; use one of {', '.join(allowed)}")
        return v

    parse.__name__ = "KIND"
    return parse


def register(sub: Any, common: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Add the ``inspect`` and ``apply`` subcommands to ``sub``."""
    what = "list the attention sites of a model (of a saved directory: also whether and how vLLM serves it)"
    p = sub.add_parser("inspect", parents=[common], allow_abbrev=False, help=what)
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", metavar="DIR", help="load this KHA checkpoint first")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_inspect)
    inspect_parser = p

    p = sub.add_parser(
        "apply",
        parents=[common],
        allow_abbrev=False,
        help="insert KHA and save the KHA checkpoint",
        description="Insert KHA (identity at init) and save its checkpoint with save_pretrained. "
        "Without --q/--k/--v: the paper's best, --v mlp.",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--q", metavar="KIND", type=kind_choice(("none", "linear")), help="query transform: none, linear")
    p.add_argument("--k", metavar="KIND", type=kind_choice(("none", "linear")), help="key transform: none, linear")
    p.add_argument(
        "--v", metavar="KIND", type=kind_choice(("none", "linear", "mlp")), help="value transform: none, linear, mlp"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory (created if missing)")
    p.add_argument(
        "--no-check",
        dest="check",
        action="store_false",
        help="skip apply's check of its own rewrite (outputs unchanged, each operand with its own transform)",
    )
    p.set_defaults(func=run_apply)
    return [inspect_parser, p]


def run_inspect(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile inspect``."""

    model, name = load_with_kha(args.model, args.kha, ui)
    with ui.step("trace and match"):
        report = kc.inspect(model)
    advice = _serving(args.model)
    if args.json:
        data = report.to_dict()
        if advice is not None:
            data["vllm"] = dataclasses.asdict(advice)
        ui.out.print(json.dumps(data, indent=2), soft_wrap=True, markup=False, highlight=False)
        return 0
    ui.out.print(
        report_table(
            report,
            title=f"{name} ({report.model}): {len(report.matched)} attention "
            f"sites matched, {len(report.skipped)} skipped",
        )
    )
    if advice is not None:
        ui.out.print(f"serving in vLLM: {'yes' if advice.servable else 'no'}", markup=False)
        for line in advice.lines:
            ui.out.print(f"  - {line}", markup=False)
    return 0


def _serving(model: str) -> VLLMAdvice | None:
    """Whether vLLM can serve MODEL, when it is a saved transformers directory (config.json)."""
    path = pathlib.Path(model)
    return vllm_advice(path) if (path / "config.json").is_file() else None


def run_apply(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile apply``."""

    cfg = config_from(args.q, args.k, args.v)  # validate before loading anything
    if recorded_kha(args.model) is not None:
        raise CommandError(
            f"{args.model!r} already records trained KHA (the 'kha_compile' entry of its config.json); apply "
            "inserts KHA once. Inspect, export or fold it as it is, or start from the model without KHA."
        )
    model, name = load_with_kha(args.model, None, ui)
    with ui.step(f"apply {cfg}"):
        kc.apply(model, cfg, check=getattr(args, "check", True))
    report = kc.inspect(model)
    ui.out.print(
        report_table(
            report, title=f"{name}: KHA at {len(report.matched)} sites, {kha_param_count(model):,} KHA parameters"
        )
    )
    with ui.step(f"save the KHA checkpoint to {args.out}"):
        path = kc.save_pretrained(model, args.out)
    ui.out.print(f"KHA checkpoint (weights + config only): {path}")
    return 0
