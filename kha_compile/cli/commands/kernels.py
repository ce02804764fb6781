"""``kha-compile kernels``: compile every Triton kernel variant ahead of time for GPU architectures.

Works without a GPU. Prints one table per kernel, a row per variant (architecture, dtype, head
dim, launch config) with registers, spills and shared memory, or the reason a variant failed;
``--json PATH`` writes the records. Exit status 1 when any variant failed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
from typing import Any

from ...core.optional import require_backend
from ...kernels.aot import compile_variants
from ..ui import UI, ok_mark

__all__ = ["NAME", "parse_archs", "register", "run"]

NAME = "kernels"

_ARCH = re.compile(r"^sm_\d{2,3}[a-z]?$")


def parse_archs(value: str) -> list[str]:
    """An argparse type: ``sm_80,sm_90`` -> ``["sm_80", "sm_90"]`` (each ``sm_`` and a number)."""
    archs = [a.strip() for a in value.split(",") if a.strip()]
    bad = [a for a in archs if not _ARCH.match(a)]
    if not archs or bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(map(repr, bad)) or repr(value)} is not a GPU architecture; give a comma-separated "
            "list such as sm_80,sm_90"
        )
    return list(dict.fromkeys(archs))


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kernels`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="compile the Triton kernel variants ahead of time for GPU architectures (no GPU needed)",
        description="Compile every Triton kernel variant ahead of time for the given GPU architectures and "
        "report registers, spills and shared memory per variant. Needs triton, not a GPU. "
        "Exit status 1 when any variant fails to compile.",
    )
    p.add_argument(
        "--arch",
        required=True,
        type=parse_archs,
        metavar="SM[,SM...]",
        help="comma-separated GPU architectures, e.g. sm_80,sm_90",
    )
    p.add_argument("--json", metavar="PATH", help="also write the records as JSON to PATH")
    p.set_defaults(func=run)
    return p


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile kernels --arch ... [--json PATH]``; exit 1 when a variant the op launches fails to compile."""
    from rich.markup import escape
    from rich.table import Table

    require_backend(
        "triton",
        hint="kha-compile kernels needs Triton to compile the kernels: pip install 'kha-compile[triton]' (no GPU is needed)",
    )
    with ui.step(f"compile the kernel variants for {', '.join(args.arch)}"):
        records = list(compile_variants(list(args.arch)))
    by_kernel: dict[str, list[Any]] = {}
    for r in records:
        by_kernel.setdefault(str(r.kernel), []).append(r)
    for kernel, rows in by_kernel.items():
        failed = sum(_failed(r) for r in rows)
        skipped = sum(not r.ok and not _failed(r) for r in rows)
        table = Table(
            title=f"{kernel}: {len(rows)} variant(s), {failed} failed, {skipped} left to the composite formula",
            title_justify="left",
        )
        for col in ("arch", "dtype", "head dim", "config", "ok", "registers", "spills", "shared bytes", "reason"):
            table.add_column(
                col,
                justify="right" if col in ("head dim", "registers", "spills", "shared bytes") else "left",
                overflow="fold",
            )
        for r in rows:
            table.add_row(
                _cell(r.arch),
                _cell(r.dtype),
                _cell(r.head_dim),
                escape(_cell(r.config)),
                ok_mark(bool(r.ok)),
                _cell(r.registers),
                _cell(r.spills),
                _cell(r.shared_bytes),
                escape(_cell(r.reason)) if r.reason else "",
                style=None if r.ok else "yellow",
            )
        ui.out.print(table)
    if not records:
        ui.out.print("no kernel variants were compiled")
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([r.to_dict() for r in records], indent=2) + "\n")
        ui.out.print(f"wrote {len(records)} record(s) to {path}")
    return 1 if any(_failed(r) for r in records) else 0


def _failed(record: Any) -> bool:
    """A variant that was compiled and failed; variants the op never launches (no config) are not failures."""
    return not record.ok and bool(record.config)
