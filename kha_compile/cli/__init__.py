"""The ``kha-compile`` command: demo, inspect, apply, fold, export, bench, viz, kernels.

The library never prints; this package renders its results with rich (tables for reports, a
status line for long steps) and sets up logging (``-v`` shows the library's INFO records, ``-vv``
DEBUG). Every :class:`~kha_compile.KHAError` ends the command with a one-line red message and exit
status 2 (the traceback too with ``-v``); a usage error prints the usage of the command it was
given to.

Modules: ``parser`` (argparse), ``commands/`` (one module per command or group, listed in
``commands.COMMANDS``), ``models`` (MODEL on the command line), ``ort`` (onnxruntime and
comparison helpers), ``ui`` (rendering and logging). The pictures live in :mod:`kha_compile.viz`.

Example::

    kha-compile demo                                   # real weights: apply, train, fold, ONNX
    kha-compile inspect tiny-llama
    kha-compile apply tiny-llama --v mlp --out kha_ckpt
    kha-compile fold tiny-llama --kha kha_ckpt --out folded
    kha-compile export minilm minilm.onnx --mlp
    kha-compile viz minilm --kha kha_demo_out/kha_checkpoint --out kha.png
    kha-compile bench                                  # lists the benchmarks
    kha-compile kernels --arch sm_80,sm_90 --json kernels.json
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import KHAError
from .advice import for_command
from .commands.bench import list_benchmarks
from .models import load_model
from .parser import build_parser, parse
from .ui import UI, command_logging

__all__ = ["build_parser", "list_benchmarks", "load_model", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kha-compile`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    0 success, 1 a check failed (a parity above tolerance), 2 bad input (a KHAError or bad usage).

    Example::

        from kha_compile.cli import main
        main(["inspect", "tiny-llama"])
    """
    parser = build_parser()
    try:
        args = parse(parser, argv)
    except SystemExit as e:  # --help, --version, usage errors (argparse exits 2)
        return e.code if isinstance(e.code, int) else 0
    args.verbose = getattr(args, "verbose", 0)  # -v before or after the command (default SUPPRESS: no clash)
    ui = UI(args.verbose)

    with command_logging(args.verbose, ui):
        try:
            return int(args.func(args, ui) or 0)
        except KHAError as e:
            ui.error(e, for_command(e, getattr(args, "command", None)))  # the flag to use, not the Python argument
            return 2
        except KeyboardInterrupt:
            ui.err.print("[red]interrupted[/]")
            return 130
