"""A griffe extension for the docs site: the library's reST-flavoured docstrings read as Markdown.

The docstrings follow the project's style (docs/architecture.md): a literal block after
``Example::`` and Sphinx roles such as ``:func:`create```. Markdown would show ``Example::`` and
``:func:`` as text and the block unhighlighted, so before mkdocstrings renders a docstring:

- a paragraph ending in ``::`` followed by an indented block ends in ``:`` (``Example::`` becomes a
  bold **Example**), and the block becomes a fenced code block (Python, or bash for command lines);
- ``:role:`name``` becomes ``name`` in code;
- a reST section title (a line underlined with ``---``) becomes a bold line, not a heading of the page.

mkdocs.yml loads it (``extensions: [scripts/docs_griffe.py]``); the source files are not changed.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

from griffe import Extension, Object

_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const|ref):`~?([^`]+)`")
_TITLES = {"Example", "Examples", "For example", "Usage"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_markdown(text: str) -> str:
    """``text`` with its literal blocks fenced and its Sphinx roles as inline code.

    Example::

        rst_to_markdown("Example::\\n\\n    f(x)\\n")   # '**Example**\\n\\n```python\\nf(x)\\n```\\n'
    """
    text = _ROLE.sub(lambda m: f"``{m[1]}``", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() and i + 1 < len(lines) and re.fullmatch(r"\s*([-=~^])\1{2,}\s*", lines[i + 1]):
            out += [f"{line[: _indent(line)]}**{line.strip()}**", ""]  # a reST section title: bold, not a heading
            i += 2
            continue
        following = next((n for n in lines[i + 1 :] if n.strip()), None)
        if not (line.rstrip().endswith("::") and following is not None and _indent(following) > _indent(line)):
            out.append(line)
            i += 1
            continue
        lead = line[: _indent(line)]
        head = line.rstrip()[:-2].rstrip()
        if head.strip() in _TITLES:
            out.append(f"{lead}**{head.strip()}**")
        elif head.strip():
            out.append(head + ":")
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > len(lead)):
            j += 1
        block = textwrap.dedent("\n".join(lines[i + 1 : j])).strip("\n").splitlines()
        shell = all(b.startswith(("kha-compile ", "$ ", "bash ", "python ", "pip ", "torchrun ")) for b in block if b)
        out += ["", f"{lead}```{'bash' if shell else 'python'}", *(lead + b for b in block), f"{lead}```", ""]
        i = j
    return "\n".join(out)


class RstDocstrings(Extension):
    """Rewrites each docstring with :func:`rst_to_markdown` once the object tree is loaded."""

    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
