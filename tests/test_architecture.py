"""The package's structure, read from its source: layers, one-way imports, sizes, no frame tricks.

``lint-imports`` (run by ``scripts/test.sh``, contracts in ``pyproject.toml``) checks the layers;
these tests check what it does not: no import cycle at all, counting imports inside functions; no
lazy import of the package's own modules (lazy imports are for optional third-party packages);
no module over 500 lines; no reading of the caller's stack frame; and KHA state written into
modules only by the code that lives in the model (``kha_compile/model``).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "kha_compile"
MAX_LINES = 500


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        is_pkg = path.name == "__init__.py"
        out[name[: -len(".__init__")] if is_pkg else name] = (path, is_pkg)
    return out


MODULES = _modules()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported kha_compile module, line, inside a function) for every import in module ``name``."""
    path, is_pkg = MODULES[name]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    base = name if is_pkg else name.rpartition(".")[0]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    in_function.add(inner.lineno)
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                root = ".".join(parts[: len(parts) - node.level + 1])
                mod = f"{root}.{node.module}" if node.module else root
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
        for t in targets:
            while t and t not in MODULES and "." in t:
                t = t.rpartition(".")[0]
            if t in MODULES and t != name:
                out.append((t, node.lineno, node.lineno in in_function))
    return out


def _cycles() -> list[list[str]]:
    graph = {m: {t for t, _, _ in _imports(m)} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for m in MODULES:
        if m not in index:
            visit(m)
    return found


def test_no_import_cycle_counting_imports_inside_functions():
    assert _cycles() == []


def test_no_lazy_import_of_the_packages_own_modules():
    lazy = [
        f"{MODULES[m][0].relative_to(PKG.parent)}:{line} imports {t}"
        for m in MODULES
        for t, line, inside in _imports(m)
        if inside
    ]
    assert lazy == [], "lazy imports are for optional third-party packages only:\n" + "\n".join(lazy)


def test_no_module_over_the_size_limit():
    big = {
        str(p.relative_to(PKG.parent)): n
        for p, _ in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}


@pytest.mark.parametrize("trick", ["sys._getframe", "inspect.currentframe", "inspect.stack(", "f_back", "f_globals"])
def test_no_stack_frame_inspection(trick):
    users = [str(p.relative_to(PKG.parent)) for p, _ in MODULES.values() if trick in p.read_text()]
    assert users == []


def test_kha_state_is_written_into_modules_only_by_the_models_runtime():
    """``module.__dict__["_kha_..."] = ...`` and friends happen in ``kha_compile/model`` only."""
    writers = []
    for path, _ in MODULES.values():
        rel = path.relative_to(PKG)
        if rel.parts[0] == "model":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                text = ast.unparse(t)
                if ("__dict__[" in text and "_kha" in text) or (
                    isinstance(t, ast.Attribute) and t.attr.startswith("_kha")
                ):
                    writers.append(f"{rel}:{node.lineno}: {text}")
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func).endswith(("__dict__.setdefault", "setattr"))
                and any(isinstance(a, ast.Constant) and str(a.value).startswith("_kha") for a in node.args)
            ):
                writers.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert writers == []
