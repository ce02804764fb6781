"""scripts/_venv.sh, the set-up both README commands source, run as CI runs it: ``set -euo pipefail``.

``python3 -m venv`` and the venvs' ``python`` are stubs that log their arguments, so the test runs in well
under a second and checks the script's own logic: the dependencies go into an environment shared by every
clone (built once; a second clone only installs kha_compile into its own thin .venv and gets the shared
console scripts), or, with ``KHA_SHARED_DEPS=0``, into .venv itself; a second run installs nothing, and an
extra not yet installed triggers an install; torch is tried from PyTorch's CPU index first (briefly) and
comes from the registry where that index cannot be reached.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_STUB_PYTHON = """#!/usr/bin/env bash
echo "python $*" >> "$KHA_TEST_LOG"
"""

_STUB_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv [--without-pip] DIR: make DIR/bin/python, a stub that logs its arguments; anything else (the
# script reading pyproject.toml): the real python
if [ "$1" != "-m" ]; then exec "$KHA_REAL_PYTHON" "$@"; fi
echo "python3 $*" >> "$KHA_TEST_LOG"
dir="${@: -1}"
mkdir -p "$dir/bin"
cp "$KHA_TEST_STUB" "$dir/bin/python"
chmod +x "$dir/bin/python"
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _source(tmp_path: Path, extras: str, **more_env: str) -> list[str]:
    log = tmp_path / "log"
    log.write_text("")
    env = {
        **{k: v for k, v in os.environ.items() if k != "KHA_TORCH_INDEX"},  # the script's default index
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "KHA_VENV": str(tmp_path / "venv"),
        "KHA_EXTRAS": extras,
        "KHA_TEST_LOG": str(log),
        "KHA_TEST_STUB": str(tmp_path / "stub_python"),
        "KHA_REAL_PYTHON": sys.executable,
        "KHA_CACHE": str(tmp_path / "cache"),
        "KHA_SHARED_DEPS": "0",  # everything in .venv; the shared environment: test_shared_dependencies_...
        **more_env,
    }
    script = f'set -euo pipefail; source "{ROOT / "scripts" / "_venv.sh"}"; echo sourced'
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"_venv.sh failed under set -e:\n{done.stderr}"
    assert done.stdout.strip().endswith("sourced")
    return log.read_text().splitlines()


def test_fresh_venv_is_created_and_installed_then_reused(tmp_path):
    (tmp_path / "bin").mkdir()
    _executable(tmp_path / "stub_python", _STUB_PYTHON)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)

    first = _source(tmp_path, "test")  # no .venv, no stamp: the state of a fresh clone
    assert first[0] == f"python3 -m venv {tmp_path / 'venv'}"
    installs = [line for line in first if " install " in line]
    assert len(installs) == 4
    # torch first, pinned: the CPU build from PyTorch's index, tried briefly (seconds where it cannot be reached)
    assert f"--index-url {CPU_INDEX}" in installs[0] and installs[0].endswith(" torch==2.13.0")
    assert "--no-deps" in installs[0] and "--timeout 5" in installs[0] and "--retries 0" in installs[0]
    assert "torch==2.13.0" in installs[1] and "constraints.txt" in installs[1]  # its dependencies, registry
    assert installs[2].endswith(f"-e {ROOT}[test]")
    assert "--no-deps" in installs[3] and installs[3].endswith(" timm")  # never torchvision from the registry

    assert _source(tmp_path, "test") == []  # same hashes, same extras: nothing to do
    again = _source(tmp_path, "demo")  # an extra not installed yet
    assert any(line.endswith(f"-e {ROOT}[demo]") for line in again)
    assert _source(tmp_path, "test,demo") == []  # the stamp keeps the union of what was installed


_STUB_PYTHON_NO_TIMM = """#!/usr/bin/env bash
echo "python $*" >> "$KHA_TEST_LOG"
case "$*" in *--no-deps*) exit 1 ;; esac
"""


def test_a_timm_that_cannot_install_does_not_stop_the_set_up(tmp_path):
    (tmp_path / "bin").mkdir()
    _executable(tmp_path / "stub_python", _STUB_PYTHON_NO_TIMM)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)

    log = _source(tmp_path, "test")  # _source asserts the script went on under set -e
    assert any("--no-deps" in line for line in log)
    assert _source(tmp_path, "test") == []  # the stamp was written: nothing to do next time


_STUB_PYTHON_NO_INDEX = """#!/usr/bin/env bash
echo "python $*" >> "$KHA_TEST_LOG"
case "$*" in *--index-url*) exit 1 ;; esac
"""


def test_an_unreachable_torch_index_falls_back_to_the_registry(tmp_path):
    (tmp_path / "bin").mkdir()
    _executable(tmp_path / "stub_python", _STUB_PYTHON_NO_INDEX)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)

    installs = [line for line in _source(tmp_path, "test") if " install " in line]
    assert "--index-url" in installs[0]  # tried, failed: the set-up goes on under set -e
    assert "--index-url" not in installs[1] and installs[1].endswith(" torch==2.13.0")  # the registry's torch
    assert _source(tmp_path, "test") == []  # the stamp was written


def test_an_empty_torch_index_asks_the_registry_only(tmp_path):
    (tmp_path / "bin").mkdir()
    _executable(tmp_path / "stub_python", _STUB_PYTHON)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)

    installs = [line for line in _source(tmp_path, "test", KHA_TORCH_INDEX="") if " install " in line]
    assert len(installs) == 3 and not any("--index-url" in line for line in installs)


_STUB_PYTHON_SITE = """#!/usr/bin/env bash
echo "python $*" >> "$KHA_TEST_LOG"
case "$*" in *sysconfig*) site="$(cd "$(dirname "$0")/.." && pwd)/site"; mkdir -p "$site"; echo "$site" ;; esac
"""


def test_shared_dependencies_are_built_once_and_a_second_clone_installs_only_itself(tmp_path):
    (tmp_path / "bin").mkdir()
    _executable(tmp_path / "stub_python", _STUB_PYTHON_SITE)
    _executable(tmp_path / "bin" / "python3", _STUB_PYTHON3)
    shared = {"KHA_SHARED_DEPS": "1"}

    first = _source(tmp_path, "test", **shared, KHA_VENV=str(tmp_path / "clone1"))
    (deps,) = (tmp_path / "cache").glob("deps-*[!k]")  # (not the .lock beside it)
    assert first[0] == f"python3 -m venv {deps}"
    installs = [line for line in first if " install " in line]
    assert len(installs) == 5
    assert f"--index-url {CPU_INDEX}" in installs[0] and installs[0].endswith(" torch==2.13.0")
    assert installs[1].endswith(" torch==2.13.0")
    # the requirements of every extra test takes in, not kha_compile itself: no clone's path in the shared one
    reqs = installs[2].split()
    assert {"pytest", "mkdocs>=1.6,<2", "transformers>=4.51.0", "onnxruntime", "bitsandbytes"} <= set(reqs)
    assert not any("kha-compile" in r or (str(ROOT) in r and not r.endswith("constraints.txt")) for r in reqs)
    assert installs[3].endswith(" timm")
    assert f"python3 -m venv --without-pip {tmp_path / 'clone1'}" in first
    assert installs[4].endswith(f"--no-build-isolation -e {ROOT}") and installs[4].startswith(
        "python -m pip --disable-pip-version-check -q install --no-compile --no-deps"
    )
    pth = (tmp_path / "clone1" / "site" / "_kha_shared_deps.pth").read_text()
    assert pth.strip() == f"import site; site.addsitedir('{deps / 'site'}')"

    # what the dependencies brought: a Python console script and a program
    _executable(deps / "bin" / "pytest", f"#!{deps}/bin/python\nimport sys\nfrom pytest import console_main\n")
    _executable(deps / "bin" / "ruff", "\x7fELF (a program)")
    second = _source(tmp_path, "test", **shared, KHA_VENV=str(tmp_path / "clone2"))
    assert second[0] == f"python3 -m venv --without-pip {tmp_path / 'clone2'}"  # no shared install again
    assert [line for line in second if " install " in line] == [installs[4]]
    script = (tmp_path / "clone2" / "bin" / "pytest").read_text().splitlines()
    assert script[0] == f"#!{tmp_path / 'clone2'}/bin/python" and script[2] == "from pytest import console_main"
    assert (tmp_path / "clone2" / "bin" / "ruff").resolve() == deps / "bin" / "ruff"

    assert _source(tmp_path, "test", **shared, KHA_VENV=str(tmp_path / "clone2")) == []  # nothing to do
    assert _source(tmp_path, "demo,test", **shared, KHA_VENV=str(tmp_path / "clone2")) == []  # demo: within test
    more = _source(tmp_path, "vllm", **shared, KHA_VENV=str(tmp_path / "clone2"))  # beyond what it holds
    assert [line for line in more if " install " in line][2].endswith(" vllm>=0.32")
    assert installs[4] not in more  # kha_compile itself is not installed again
