"""kha_compile.backend.registration: "kha" registered lazily, and the entry point's target."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import kha_compile as kc


def test_registered_lazily_under_kha():
    code = (
        "import sys, kha_compile\n"
        "assert 'torch._dynamo' not in sys.modules, 'importing kha_compile imported dynamo'\n"
        "import torch._dynamo\n"
        "assert 'kha' in torch._dynamo.list_backends()\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "assert lookup_backend('kha') is kha_compile.backend.kha\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entry_point_target_is_the_registered_function():
    """pyproject's ``torch_dynamo_backends`` entry point names ``kha_compile.backend:kha``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    pyproject = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    target = tomllib.loads(pyproject.read_text())["project"]["entry-points"]["torch_dynamo_backends"]["kha"]
    module, _, attr = target.partition(":")
    assert module == "kha_compile.backend"
    assert getattr(kc.backend, attr) is kc.backend.compiler.kha
