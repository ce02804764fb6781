"""kha_compile.cli.parser: usage errors name the command they belong to."""

from __future__ import annotations

import pytest
from cli_cases import run

import kha_compile as kc
from kha_compile.cli import build_parser, main


def test_usage_error_exits_2(capsys):
    assert main(["apply", "tiny-llama"]) == 2  # --out is required
    err = capsys.readouterr().err
    assert err.startswith("usage: kha-compile apply") and "--out" in err
    assert main([]) == 2  # a command is required
    assert capsys.readouterr().err.startswith("usage: kha-compile [-h]")


@pytest.mark.parametrize(
    "argv, command",
    [
        (["inspect", "tiny-llama", "--v", "mlp"], "inspect"),
        (["fold", "tiny-llama", "--kha", "k", "--out", "o", "--mlp"], "fold"),
        (["viz", "tiny-llama", "--kha", "k", "--bogus"], "viz"),
    ],
)
def test_unknown_flag_shows_the_usage_of_its_command(capsys, argv, command):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"usage: kha-compile {command} ")
    assert (
        f"kha-compile {command}: error: unrecognized arguments: {' '.join(argv[-2:] if command == 'inspect' else argv[-1:])}"
        in err
    )
    assert "COMMAND" not in err  # not the top-level usage


def test_unknown_flag_before_the_command_is_the_top_level_usage(capsys):
    code, _, err = run(capsys, "--bogus", "inspect", "tiny-llama")
    assert code == 2 and err.startswith("usage: kha-compile [-h]")


def test_cli_kinds_are_the_config_values():
    """Every kind the CLI accepts (bar "none") is one KHAConfig accepts, and every role has its flag."""
    parser = build_parser()
    for role, kinds in (("q", ("linear",)), ("k", ("linear",)), ("v", ("linear", "mlp"))):
        args = parser.parse_args(["apply", "m", "--out", "o", f"--{role}", kinds[-1]])
        assert getattr(args, role) == kinds[-1]
        kc.KHAConfig(**{"q": None, "k": None, "v": None, role: kinds[-1]})
    with pytest.raises(kc.KHAError, match="use one of"):
        kc.KHAConfig(q="mlp")  # ... and the CLI refuses it too (test_inspect_apply)


def test_help_lists_every_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in ("demo", "inspect", "apply", "fold", "export", "bench", "viz", "kernels"):
        assert f"    {command} " in out


def test_every_command_has_a_runner():
    import argparse

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == sorted(["demo", "inspect", "apply", "fold", "export", "bench", "viz", "kernels"])
    for name, p in sub.choices.items():
        assert callable(p.get_default("func")), name
        assert p.get_default("command_parser") is p, name
