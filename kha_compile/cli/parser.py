"""The argparse parser of ``kha-compile``: one subparser per command, errors shown with that command's usage."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from .commands import COMMANDS

__all__ = ["build_parser", "parse"]


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``kha-compile`` (one subparser per command).

    Example::

        args = build_parser().parse_args(["inspect", "tiny-llama"])
    """

    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=argparse.SUPPRESS,
        help="show the library's log (-vv: debug) and tracebacks",
    )
    parser = argparse.ArgumentParser(
        prog="kha-compile",
        parents=[common],
        allow_abbrev=False,
        description="Knocking-heads attention (KHA) inserted into PyTorch models by a graph pass.",
    )
    parser.add_argument("--version", action="version", version=f"kha-compile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        made = command.register(sub, common)
        for p in made if isinstance(made, list) else [made]:
            p.set_defaults(command_parser=p)  # a usage error shows this command's usage, not the top level's
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; an argument no command takes is reported with the usage of the command it was given to.

    Exits (``SystemExit``, status 2) on a usage error, like ``parse_args``.
    """
    tokens = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(tokens)
    if extra:
        owner: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        at = tokens.index(args.command) if args.command in tokens else len(tokens)
        if any(t in tokens[:at] for t in extra):  # given before the command: the top level's
            owner = parser
        owner.error(f"unrecognized arguments: {' '.join(extra)}")
    return args
