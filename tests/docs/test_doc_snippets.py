"""Every Python block of the README and docs/ runs, on tiny models, as a reader would run it.

The blocks of one page run in order in one namespace and one working directory of their own
(``doc_snippets``); a test runs its page's earlier blocks first when this process has not run
them yet (pytest-xdist may send one page's blocks to two workers). A block marked ``skip`` or
``long`` (GPU, TensorRT, vLLM, torchrun, minutes of compiling) does not run here, but it is
compiled and its calls of ``kha_compile`` functions are bound to their signatures like every
other block's, so an argument renamed in the library fails here either way.
"""

from __future__ import annotations

import linecache
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import doc_snippets as ds
from kha_compile.analysis.rules import RULES
from kha_compile.analysis.rules.external import OPS
from kha_compile.handlers import HANDLERS
from kha_compile.model.transforms.base import KINDS

BLOCKS = ds.python_blocks()
RUN_LONG = os.environ.get("KHA_DOCS_LONG") == "1"

# Pages other engineers write that use a name the reader brings (their own model): what it stands for.
PAGE_SETUP = {
    "docs/attention_forms.md": '''
        import torch

        class Model(torch.nn.Module):
            """A block that calls its own attention kernel, mylib::flash_attn, (B, S, H, D) layout."""

            def __init__(self, d=32, h=4):
                super().__init__()
                self.h, self.q, self.k, self.v = h, *(torch.nn.Linear(d, d) for _ in range(3))
                self.o = torch.nn.Linear(d, d)

            def forward(self, x):
                b, s, d = x.shape
                q, k, v = (p(x).view(b, s, self.h, d // self.h) for p in (self.q, self.k, self.v))
                return self.o(torch.ops.mylib.flash_attn(q, k, v, 0.5).reshape(b, s, d))

        model, x = Model(), torch.randn(2, 8, 32)
    ''',
}


@dataclass
class _Page:
    directory: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__main__"})
    done: int = 0  # blocks of the page run so far, in order
    failed: ds.Block | None = None


_PAGES: dict[Path, _Page] = {}


def _runs(block: ds.Block) -> bool:
    return block.mark is None or (block.mark == "long" and RUN_LONG)


def _exec(page: _Page, code: str, where: str) -> None:
    """Run ``code`` in the page's namespace and folder; what it registers is unregistered after it
    (a block that adds a transform kind, a rule, a handler or an attention op uses it in that block),
    so the other tests of this process see the library's own registries."""
    here, registries = os.getcwd(), (KINDS, RULES, HANDLERS, OPS)
    saved = [r.items() for r in registries]
    linecache.cache[where] = (len(code), None, code.splitlines(True), where)  # tracebacks show the block's lines
    os.chdir(page.directory)
    try:
        exec(compile(code, where, "exec"), page.namespace)
    finally:
        os.chdir(here)
        for registry, items in zip(registries, saved):
            registry.restore(items)


def _page(path: Path, tmp_path_factory) -> _Page:
    if path not in _PAGES:
        page = _PAGES[path] = _Page(tmp_path_factory.mktemp(path.stem))
        setup = PAGE_SETUP.get(str(path))
        if setup:
            _exec(page, textwrap.dedent(setup), f"{path} (the reader's own names)")
    return _PAGES[path]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_calls_fit_the_library(block):
    aliases: dict[str, str] = {}
    for earlier in BLOCKS:  # the page's imports so far give the aliases (kc -> kha_compile)
        if earlier.path == block.path and earlier.line < block.line:
            ds.call_errors(earlier.code, aliases)
    problems = ds.call_errors(block.code, aliases)
    assert not problems, f"{block.id}: calls that do not fit the library:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block, tmp_path_factory):
    if not _runs(block):
        pytest.skip(f"{block.mark}: {block.reason}")
    page = _page(block.path, tmp_path_factory)
    mine = [b for b in BLOCKS if b.path == block.path]
    for earlier in mine[page.done : mine.index(block)]:
        if page.failed is None and _runs(earlier):
            try:
                _exec(page, earlier.code, earlier.id)
            except Exception:
                page.failed = earlier
        page.done += 1
    if page.failed is not None:
        pytest.fail(f"the block at {page.failed.id} failed, and this one builds on it")
    page.done += 1
    try:
        _exec(page, block.code, block.id)
    except Exception:
        page.failed = block
        raise
