"""The command lines of the README and docs/: each ``kha-compile`` line parses, each script exists.

A flag that the CLI does not take (``--v mlp`` for ``--mlp``) is a usage error of its parser, found
here without running the command. Scripts named by ``bash``, ``python`` or ``torchrun`` lines must
exist in the repository.
"""

from __future__ import annotations

import shlex

import pytest

import doc_snippets as ds
from kha_compile.cli.parser import build_parser, parse

BLOCKS = ds.shell_blocks()


def _commands(block: ds.Block) -> list[list[str]]:
    """Each line of the block as tokens, without its prompt, comments and environment variables."""
    out = []
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.strip().removeprefix("$ ")
        if not line or line.startswith("#"):
            continue
        tokens = shlex.split(line, comments=True)
        while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
            tokens = tokens[1:]  # VAR=value before the command
        if tokens:
            out.append(tokens)
    return out


def _script(tokens: list[str]) -> str | None:
    """The repository file a ``bash``/``python``/``torchrun`` line runs, if it names one."""
    if tokens[0] not in ("bash", "python", "python3", "torchrun"):
        return None
    files = [t for t in tokens[1:] if t.endswith((".py", ".sh")) and not t.startswith("-")]
    return files[0] if files else None


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_command_lines_parse_and_name_files_that_exist(block):
    parser = build_parser()
    for tokens in _commands(block):
        if tokens[0] == "kha-compile":
            try:
                parse(parser, tokens[1:])
            except SystemExit as err:
                pytest.fail(f"{block.id}: `{shlex.join(tokens)}` is refused by the CLI (exit {err.code})")
        script = _script(tokens)
        if script is not None and "<" not in script:
            assert (ds.ROOT / script).is_file(), f"{block.id}: `{shlex.join(tokens)}` names {script}, which is missing"
