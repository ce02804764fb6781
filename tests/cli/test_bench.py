"""kha_compile.cli.commands.bench: listing and running benchmarks/."""

from __future__ import annotations

import pathlib

from cli_cases import run

from kha_compile.cli import list_benchmarks


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    directory = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
    scripts = sorted(p.stem for p in directory.glob("*.py") if not p.name.startswith("_"))
    assert scripts, "the repository has benchmark scripts"
    code, out, _ = run(capsys, "bench")
    assert code == 0
    assert all(name in out for name in scripts)
    assert "_common" not in out
    assert sorted(list_benchmarks(directory)) == scripts


def test_bench_passes_arguments_through(capfd, tmp_path, monkeypatch):
    (tmp_path / "echo_args.py").write_text(
        '"""Echo the arguments."""\nimport sys\nprint("ARGS", sys.argv[1:])\nsys.exit(3)\n'
    )
    monkeypatch.setattr("kha_compile.cli.commands.bench.benchmarks_dir", lambda: tmp_path)
    code, out, _ = run(capfd, "bench")
    assert code == 0 and "echo_args" in out and "Echo the arguments." in out
    code, out, _ = run(capfd, "bench", "echo_args", "--layers", "2", "x")
    assert code == 3  # the script's own exit status
    assert "ARGS ['--layers', '2', 'x']" in out


def test_bench_unknown_name_lists_what_exists(capsys):
    code, _, err = run(capsys, "bench", "no_such_benchmark")
    assert code == 2 and "no_such_benchmark" in err and "available" in err
