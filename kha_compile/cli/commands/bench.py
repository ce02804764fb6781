"""``kha-compile bench``: list the scripts of ``benchmarks/``, or run one with its arguments."""

from __future__ import annotations

import argparse
import ast
import pathlib
import subprocess
import sys
from typing import Any

from ...core.errors import CommandError
from ..ui import UI

__all__ = ["NAME", "benchmarks_dir", "list_benchmarks", "register", "run"]

NAME = "bench"


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME, parents=[common], allow_abbrev=False, help="run a script of benchmarks/ (lists them without NAME)"
    )
    p.add_argument("name", nargs="?", help="benchmark name, e.g. apply_speed")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    p.set_defaults(func=run)
    return p


def benchmarks_dir() -> pathlib.Path:
    """The repository's ``benchmarks/`` (next to the package), else ``./benchmarks``."""
    here = pathlib.Path(__file__).resolve().parents[3] / "benchmarks"
    return here if here.is_dir() else pathlib.Path.cwd() / "benchmarks"


def list_benchmarks(directory: pathlib.Path | None = None) -> dict[str, str]:
    """``{name: first line of its docstring}`` for every ``benchmarks/*.py`` (not ``_*.py``).

    Example::

        list_benchmarks()["apply_speed"]
    """
    directory = directory or benchmarks_dir()
    found = {}
    for script in sorted(directory.glob("*.py")) if directory.is_dir() else []:
        if script.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        except (SyntaxError, UnicodeDecodeError):
            doc = ""
        found[script.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile bench [NAME [ARGS...]]``."""
    from rich.table import Table

    directory = benchmarks_dir()
    available = list_benchmarks(directory)
    if not args.name:
        table = Table(
            title=f"benchmarks in {directory}",
            title_justify="left",
            caption="run one: kha-compile bench NAME [ARGS...]",
            caption_justify="left",
        )
        table.add_column("name", no_wrap=True)
        table.add_column("what it measures")
        for name, doc in available.items():
            table.add_row(name, doc)
        ui.out.print(table)
        return 0
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in available:
        raise CommandError(f"no benchmark {args.name!r} in {directory}; available: {', '.join(available) or 'none'}.")
    cmd = [sys.executable, str(directory / f"{name}.py"), *args.args]
    ui.err.print(f"[dim]$ {' '.join(cmd)}[/]")
    return subprocess.run(cmd).returncode
