"""The code blocks of the README and of docs/: found, marked, and checked against the library.

A page's Python blocks run in order in one namespace, as a reader pasting them into one session
would run them, in a directory of their own. A block is marked by an HTML comment on the line
before its fence (invisible on the rendered page)::

    <!-- snippet: skip needs an NVIDIA GPU and TensorRT -->
    <!-- snippet: long AOTInductor compiles C++ for 20-60 s -->

``skip`` blocks never run; ``long`` blocks run only with ``KHA_DOCS_LONG=1``. Every block, run or
not, is compiled, and each call of a ``kha_compile`` function in it is bound to that function's
signature (:func:`call_errors`), so a renamed argument fails even in a block that cannot run here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")
_MARK = re.compile(r"^\s*<!--\s*snippet:\s*(?P<kind>skip|long)\s+(?P<reason>.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its code and how it is marked."""

    path: Path  # relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    mark: str | None = None  # "skip" | "long" | None
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def pages() -> list[Path]:
    """The README and every Markdown page of docs/, relative to the repository root."""
    found = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p.relative_to(ROOT) for p in found]


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of one Markdown file (fences indented in list items included)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opened = _FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        indent, fence = len(opened["indent"]), opened["fence"]
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = _MARK.match(before)
        found.append(
            Block(
                path=path,
                line=start + 1,
                lang=opened["lang"].lower(),
                code="\n".join(body) + "\n",
                mark=mark["kind"] if mark else None,
                reason=mark["reason"] if mark else "",
            )
        )
    return found


def python_blocks() -> list[Block]:
    """Every ``python`` block of the README and docs/."""
    return [b for p in pages() for b in blocks(p) if b.lang in ("python", "py")]


def shell_blocks() -> list[Block]:
    """Every ``bash`` / ``sh`` / ``console`` block of the README and docs/."""
    return [b for p in pages() for b in blocks(p) if b.lang in ("bash", "sh", "shell", "console")]


def _dotted(node: ast.expr) -> str | None:
    """``kc.exporters.generate_onnx`` for an attribute chain on a name, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _resolve(dotted: str) -> Any:
    """The object a dotted ``kha_compile...`` path names, or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def call_errors(code: str, aliases: dict[str, str]) -> list[str]:
    """Calls of ``kha_compile`` functions in ``code`` that do not bind to the function's signature.

    ``aliases`` maps the names a page bound so far (``kc`` -> ``kha_compile``); the imports of
    ``code`` are added to it. Returns one line per call that does not bind, naming the call.
    """
    tree = ast.parse(code)
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kha_compile":
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kha_compile":
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None or name.split(".")[0] not in aliases:
            continue
        head, _, rest = name.partition(".")
        target = aliases[head] + (f".{rest}" if rest else "")
        fn = _resolve(target)
        if fn is None:
            problems.append(f"line {node.lineno}: {name} does not exist ({target})")
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        starred = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        if starred:
            continue
        try:
            sig.bind(*[None] * len(node.args), **{k.arg: None for k in node.keywords if k.arg})
        except TypeError as err:
            problems.append(f"line {node.lineno}: {name}(...) does not fit {target}{sig}: {err}")
    return problems
