"""scripts/plant_bugs.py: every planted bug still applies to the library as it is, and changes it."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("plant_bugs", ROOT / "scripts" / "plant_bugs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


PLANT = _script()


@pytest.mark.parametrize("bug", PLANT.BUGS, ids=[b.name for b in PLANT.BUGS])
def test_bug_applies_once_compiles_and_names_existing_tests(bug):
    text = (ROOT / bug.file).read_text()
    patched = PLANT.planted(bug, text)  # raises when the library moved on: update the bug's text
    assert patched != text
    compile(patched, bug.file, "exec")
    for tests in bug.groups.values():
        for t in tests:
            assert (ROOT / t.split("::")[0]).is_file(), f"{bug.name}: no test file {t}"


def test_at_least_eight_bugs_with_unique_names():
    names = [b.name for b in PLANT.BUGS]
    assert len(names) >= 8 and len(set(names)) == len(names)
