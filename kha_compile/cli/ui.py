"""Rendering and logging for the command line: rich consoles, tables, the log handler."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

    from ..core.report import Report

__all__ = ["UI", "command_logging", "fmt_diff", "kv_table", "ok_mark", "quiet_transformers", "report_table"]


class UI:
    """Two rich consoles (results on stdout, progress and errors on stderr)."""

    def __init__(self, verbose: int = 0) -> None:
        from rich.console import Console

        self.verbose = verbose
        self.out = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)
        for console in (self.out, self.err):
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console.width = 160  # piped or captured: do not squeeze tables into 80 columns
        self.steps = self.err  # where finished steps are reported; the demo tells its story on stdout

    @contextlib.contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Show a spinner while the block runs, then a ✓ line with the time it took."""
        t0 = time.perf_counter()
        with self.err.status(f"{message} ..."):
            yield
        self.steps.print(f"[green]✓[/] {message} [dim]({time.perf_counter() - t0:.1f}s)[/]")

    def error(self, exc: BaseException, message: str | None = None) -> None:
        """One red line, ``message`` or the exception's own (and the traceback with -v)."""
        from rich.markup import escape

        if self.verbose:
            self.err.print_exception(show_locals=False)
        self.err.print(f"[bold red]error:[/] [red]{escape(str(exc) if message is None else message)}[/]")


_QUIET: dict[str, Any] = {"verbose": 0, "restore": None}


@contextlib.contextmanager
def command_logging(verbose: int, ui: UI) -> Iterator[None]:
    """Route the ``kha_compile`` loggers to a RichHandler for the command; restore them afterwards."""
    from rich.logging import RichHandler

    logger = logging.getLogger("kha_compile")
    saved = logger.level
    handler = RichHandler(console=ui.err, show_time=False, show_path=verbose >= 2, markup=False, rich_tracebacks=True)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    _QUIET["verbose"] = verbose
    onnx_logger = logging.getLogger("torch.onnx")  # "torchvision is not installed ..." on every export
    onnx_saved = onnx_logger.level
    with warnings.catch_warnings():
        if not verbose:
            onnx_logger.setLevel(logging.ERROR)
            warnings.simplefilter("ignore", FutureWarning)  # deprecations inside torch / transformers
            warnings.simplefilter("ignore", DeprecationWarning)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(saved)
            onnx_logger.setLevel(onnx_saved)
            _restore_transformers()


def quiet_transformers() -> None:
    """Hide transformers' INFO chatter and weight-loading progress bars unless -v (called on first load)."""
    if _QUIET["verbose"] or _QUIET["restore"] is not None:
        return
    try:
        import transformers
        from transformers.utils import logging as hf_logging

        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # an old or partial transformers: cosmetic only
        return

    def restore() -> None:
        transformers.logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()

    _QUIET["restore"] = restore


def _restore_transformers() -> None:
    restore: Callable[[], None] | None
    restore, _QUIET["restore"] = _QUIET["restore"], None
    if restore is not None:
        restore()


def report_table(report: Report, title: str | None = None) -> Table:
    """A rich Table of a :class:`~kha_compile.Report` (its HEADER and rows())."""
    from rich.table import Table

    table = Table(
        title=title or f"{report.model}: {len(report.matched)} attention sites matched, {len(report.skipped)} skipped",
        caption=f"traced {report.traced_blocks} distinct block(s) in {report.trace_seconds:.2f}s",
        title_justify="left",
        caption_justify="left",
    )
    for col in report.HEADER:
        table.add_column(
            col,
            no_wrap=col in ("site", "kha"),
            overflow="fold",
            justify="right" if col in ("heads", "kv", "dim") else "left",
        )
    for site, row in zip(report.sites, report.rows()):
        style = None if site.matched else "yellow"
        if site.matched and site.transforms:
            row = [*row[:8], f"[bold cyan]{row[8]}[/]", *row[9:]]
        table.add_row(*row, style=style)
    return table


def kv_table(title: str, rows: Sequence[tuple[str, str]]) -> Table:
    """A two-column table of key / value rows."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    return table


def fmt_diff(x: float) -> str:
    return f"{x:.1e}" if x else "0"


def ok_mark(flag: bool) -> str:
    return "[green]✓[/]" if flag else "[bold red]✗[/]"
