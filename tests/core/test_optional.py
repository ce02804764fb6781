"""kha_compile.core.optional.when_imported: a hook run after a module's import, without importing it."""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import uuid

import pytest

from kha_compile.core.optional import when_imported


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """The name of a package (with a submodule ``auto``) that exists on disk and is not imported yet."""
    name = f"kha_probe_{uuid.uuid4().hex[:8]}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("from .auto import VALUE\n")  # imported through its package
    (tmp_path / name / "auto.py").write_text("VALUE = 42\nREGISTRY = {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_the_callback_runs_right_after_the_import_with_the_loaded_module(probe):
    seen = []
    finders = len(sys.meta_path)
    when_imported(f"{probe}.auto", lambda auto: seen.append(dict(auto.REGISTRY, value=auto.VALUE)))
    assert seen == [] and f"{probe}.auto" not in sys.modules  # nothing imported to find out
    package = importlib.import_module(probe)
    assert seen == [{"value": 42}] and package.VALUE == 42
    auto = sys.modules[f"{probe}.auto"]
    assert isinstance(auto.__loader__, importlib.machinery.SourceFileLoader)  # the module's own loader
    assert auto.__spec__.loader is auto.__loader__
    assert len(sys.meta_path) == finders  # the hook took itself off
    importlib.reload(auto)
    assert len(seen) == 1  # once


def test_a_module_already_imported_gets_the_callback_at_once(probe):
    importlib.import_module(probe)
    seen = []
    when_imported(f"{probe}.auto", lambda auto: seen.append(auto.VALUE))
    assert seen == [42]


def test_a_failing_callback_is_logged_and_never_breaks_the_import(probe, caplog):
    def broken(auto):
        raise RuntimeError("registry changed")

    when_imported(f"{probe}.auto", broken)
    with caplog.at_level(logging.WARNING, logger="kha_compile"):
        assert importlib.import_module(probe).VALUE == 42
    assert "registry changed" in caplog.text and f"{probe}.auto" in caplog.text
