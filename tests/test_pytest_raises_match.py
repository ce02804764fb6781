"""Every ``pytest.raises`` in the suite names what it expects (``match=``), so no check passes on any error of its type."""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).parent

# (file relative to tests/, line) -> why a bare pytest.raises is unavoidable there. Empty: none is.
ALLOWED: dict[tuple[str, int], str] = {}


def _raises_without_match(tree: ast.AST) -> list[int]:
    """Line numbers of ``pytest.raises(...)`` / ``raises(...)`` calls without a ``match=`` keyword."""
    bare_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "pytest"
        for alias in node.names
        if alias.name == "raises"
    }
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        is_raises = (isinstance(f, ast.Attribute) and f.attr == "raises" and isinstance(f.value, ast.Name)) and (
            f.value.id == "pytest"
        )
        is_raises = is_raises or (isinstance(f, ast.Name) and f.id in bare_names)
        if is_raises and not any(k.arg == "match" for k in node.keywords):
            lines.append(node.lineno)
    return lines


def test_every_pytest_raises_has_match():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        for line in _raises_without_match(ast.parse(path.read_text(), str(path))):
            if (rel, line) not in ALLOWED:
                found.append(f"tests/{rel}:{line}")
    assert not found, "pytest.raises without match= (say what the error must say): " + ", ".join(found)


def test_the_scan_sees_a_bare_raises():
    src = "import pytest\nfrom pytest import raises as r\nwith pytest.raises(E): f()\nwith r(E): g()\nwith pytest.raises(E, match='x'): h()\n"
    assert _raises_without_match(ast.parse(src)) == [3, 4]
