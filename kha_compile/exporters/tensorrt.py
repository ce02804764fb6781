"""TensorRT export: an engine from the ONNX file, with the ``kha::MLPValue`` node as a plugin.

The plugin (:mod:`kha_compile.exporters.tensorrt_plugin`) is a ``tensorrt.plugin`` plugin with a
JIT implementation (Python, run by TensorRT) and, where TensorRT has ``aot_impl``, an ahead-of-time
one (:mod:`kha_compile.exporters.tensorrt_aot`: the Triton kernel as PTX inside the engine, so the
engine runs in ``trtexec`` and the C++ runtime). TensorRT's ONNX parser maps a node to the plugin
by its ``op_type`` (``MLPValue``) and its ``plugin_namespace`` / ``plugin_version`` attributes
(``kha`` / ``1``), which :func:`kha_compile.export_onnx` writes; :func:`export_tensorrt` adds
``aot=1`` to the nodes the AOT kernel takes. An engine whose plugins run JIT needs Python at run
time: a process that loads it calls :func:`register_mlp_value_plugin` first (:func:`run_engine` does).

Everything here that needs no GPU (the optimization profile, the precision plan) is a plain
function; ``tensorrt`` is imported only by the functions that need it.
"""

import dataclasses
import logging
import os
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from ..core.errors import ExportError
from .common import check_destination
from .onnx import PLUGIN_ID, TensorInfo, onnx_summary
from .tensorrt_aot import mark_aot_nodes
from .tensorrt_plugin import (
    PLUGIN_DTYPE_NAMES,
    aot_registered,
    import_tensorrt,
    mlp_value_output_dtype,
    mlp_value_output_shape,
    register_mlp_value_plugin,
)
from .tensorrt_run import EngineRunner, run_engine, trt_logger

__all__ = [
    "DEFAULT_DIM_RANGES",
    "PRECISIONS",
    "BuildPlan",
    "EngineRunner",
    "build_plan",
    "export_tensorrt",
    "mlp_value_output_dtype",
    "mlp_value_output_shape",
    "onnx_float_dtype",
    "profile_shapes",
    "register_mlp_value_plugin",
    "run_engine",
]

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# (min, opt, max) of the dynamic dims that export_onnx names ("seq" for files written before 0.1.1);
# past_sequence is the cache length of a with-past file (export_onnx(past=True)): 0 on the first call.
# Its attention_mask's total_sequence is sequence + past_sequence unless dim_ranges names it.
DEFAULT_DIM_RANGES: dict[str, tuple[int, int, int]] = {
    "batch": (1, 1, 8),
    "sequence": (1, 128, 1024),
    "seq": (1, 128, 1024),
    "past_sequence": (0, 128, 1024),
}
TOTAL_SEQUENCE = "total_sequence"


# --------------------------------------------------------------------------------------------
# Optimization profile and precision (plain functions)
# --------------------------------------------------------------------------------------------

Shape = tuple[int, ...]


def profile_shapes(
    inputs: Sequence[TensorInfo],
    profile: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]] | None = None,
    dim_ranges: Mapping[str, tuple[int, int, int]] | None = None,
) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape of every input, for one TensorRT optimization profile.

    An input named in ``profile`` takes its shapes from there. Every other input keeps its fixed
    dims, and each dynamic dim takes (min, opt, max) from ``dim_ranges`` by its name (``batch``,
    ``seq``; a name ending in ``_batch`` / ``_seq`` counts as that), over
    :data:`DEFAULT_DIM_RANGES`. In a with-past file (``export_onnx(past=True)``) the past length
    ``past_sequence`` is one more axis of the profile (from 0: the first call has no past), and the
    attention mask's ``total_sequence`` is ``sequence`` + ``past_sequence``, element by element, unless
    ``dim_ranges`` names it. Raises :class:`~kha_compile.core.errors.ExportError` for a dynamic dim
    without a range, or shapes that do not fit the input.

    Example::

        profile_shapes(onnx_summary("m.onnx").inputs, dim_ranges={"sequence": (1, 256, 2048)})
        # {'x': ((1, 1, 64), (1, 256, 64), (8, 2048, 64))}
        profile_shapes(onnx_summary("genai/model.onnx").inputs,
                       dim_ranges={"sequence": (1, 1, 512), "past_sequence": (0, 511, 4095)})
        # {..., 'attention_mask': ((1, 1), (1, 512), (8, 4607)), 'past_key_values.0.key': ((1, 2, 0, 16), ...)}
    """
    ranges = {**DEFAULT_DIM_RANGES, **(dim_ranges or {})}
    if TOTAL_SEQUENCE not in ranges:
        ranges[TOTAL_SEQUENCE] = cast(
            "tuple[int, int, int]", tuple(a + b for a, b in zip(ranges["sequence"], ranges["past_sequence"]))
        )
    profile = dict(profile or {})
    unknown = sorted(set(profile) - {i.name for i in inputs})
    if unknown:
        raise ExportError(
            f"TensorRT profile names inputs the ONNX model does not have: {unknown}; "
            f"its inputs are {[i.name for i in inputs]}."
        )
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
    for info in inputs:
        if info.name in profile:
            lo, opt, hi = (tuple(int(x) for x in s) for s in profile[info.name])
        else:
            bounds: tuple[list[int], list[int], list[int]] = ([], [], [])
            for axis, dim in enumerate(info.dims):
                r: tuple[int, int, int] | None
                if isinstance(dim, int):
                    r = (dim, dim, dim)
                else:
                    r = _dim_range(dim, ranges)
                    if r is None:
                        raise ExportError(
                            f"TensorRT profile: input {info.name!r} axis {axis} is dynamic "
                            f"({dim or 'unnamed'}) and has no range; pass dim_ranges="
                            f"{{{dim or 'name'!r}: (min, opt, max)}} or a profile for "
                            f"{info.name!r}."
                        )
                for lst, x in zip(bounds, r):
                    lst.append(int(x))
            lo, opt, hi = (tuple(b) for b in bounds)
        _check_profile_entry(info, lo, opt, hi)
        shapes[info.name] = (lo, opt, hi)
    return shapes


def _dim_range(name: str | None, ranges: Mapping[str, tuple[int, int, int]]) -> tuple[int, int, int] | None:
    if not name:
        return None
    if name in ranges:
        return cast("tuple[int, int, int]", tuple(ranges[name]))
    for key in ranges:
        if name.endswith(f"_{key}"):
            return cast("tuple[int, int, int]", tuple(ranges[key]))
    return None


def _check_profile_entry(info: TensorInfo, lo: Shape, opt: Shape, hi: Shape) -> None:
    where = f"TensorRT profile for input {info.name!r} (dims {list(info.dims)})"
    if not len(lo) == len(opt) == len(hi) == len(info.dims):
        raise ExportError(f"{where}: min {lo}, opt {opt}, max {hi} must each have {len(info.dims)} dims.")
    for axis, dim in enumerate(info.dims):
        if not 0 <= lo[axis] <= opt[axis] <= hi[axis]:
            raise ExportError(
                f"{where}: axis {axis} needs 0 <= min <= opt <= max; got {lo[axis]}, {opt[axis]}, {hi[axis]}."
            )
        if isinstance(dim, int) and not lo[axis] == opt[axis] == hi[axis] == dim:
            raise ExportError(f"{where}: axis {axis} is fixed at {dim}; got {lo[axis]}, {opt[axis]}, {hi[axis]}.")


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """How to build for a precision: a strongly typed network, or a weakly typed one + a flag."""

    strongly_typed: bool
    builder_flag: str | None  # "FP16" / "BF16" for a weakly typed build (TensorRT 10 only)
    allow_tf32: bool


def build_plan(precision: str, onnx_dtype: str | None, weak_typing_available: bool) -> BuildPlan:
    """Decide how TensorRT builds ``precision`` from an ONNX file whose floats are ``onnx_dtype``.

    The ONNX types decide a strongly typed build (the only kind TensorRT 11 has): an fp16 file
    builds fp16, an fp32 file fp32 (TF32 off, so fp32 means fp32). fp16/bf16 from an fp32 file
    uses TensorRT 10's weak typing (``BuilderFlag.FP16`` / ``BF16``) where it exists; elsewhere
    the model must be exported in that type. Raises :class:`~kha_compile.core.errors.ExportError`.

    Example::

        build_plan("fp16", "float32", weak_typing_available=True)
        # BuildPlan(strongly_typed=False, builder_flag='FP16', allow_tf32=True)
    """
    if precision not in PRECISIONS:
        raise ExportError(f"precision must be one of {', '.join(PRECISIONS)}; got {precision!r}.")
    want = PRECISIONS[precision]
    if onnx_dtype is None or onnx_dtype == want:
        return BuildPlan(strongly_typed=True, builder_flag=None, allow_tf32=precision != "fp32")
    if onnx_dtype == "float32" and precision in ("fp16", "bf16"):
        if weak_typing_available:
            return BuildPlan(strongly_typed=False, builder_flag=precision.upper(), allow_tf32=True)
        raise ExportError(
            f"precision={precision!r} from a float32 ONNX file needs TensorRT's weak typing, which "
            f"this TensorRT no longer has (TensorRT 11 builds strongly typed networks only): export "
            f"the model in {want} (model.to(torch.{want}) before kc.export_onnx), or convert the "
            f"file with NVIDIA ModelOpt AutoCast, then build again."
        )
    raise ExportError(
        f"precision={precision!r} does not fit an ONNX file in {onnx_dtype}: export "
        f"the model in {want}, or pass precision="
        f"{next(k for k, v in PRECISIONS.items() if v == onnx_dtype)!r}."
    )


def onnx_float_dtype(onnx_path: str | os.PathLike) -> str | None:
    """The floating type an ONNX file computes in: that of its float inputs, else of its weights.

    Example::

        onnx_float_dtype("model.onnx")     # 'float32'
    """
    summary = onnx_summary(onnx_path)
    for info in summary.inputs:
        if info.dtype in PLUGIN_DTYPE_NAMES:
            return info.dtype
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = {
        onnx.TensorProto.FLOAT: "float32",
        onnx.TensorProto.FLOAT16: "float16",
        onnx.TensorProto.BFLOAT16: "bfloat16",
    }
    for init in model.graph.initializer:
        if init.data_type in names:
            return names[init.data_type]
    return None


def _progress_monitor(trt: Any) -> Any | None:
    """A ``trt.IProgressMonitor`` that logs the build phases (None where TensorRT has none)."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class _Progress(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._start: dict[str, float] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self._start[phase_name] = time.perf_counter()
            log.debug("TensorRT build: %s (%d steps)", phase_name, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            took = time.perf_counter() - self._start.pop(phase_name, time.perf_counter())
            log.info("TensorRT build: %s done in %.1f s", phase_name, took)

    return _Progress()


# --------------------------------------------------------------------------------------------
# export_tensorrt (run_engine and EngineRunner: tensorrt_run.py)
# --------------------------------------------------------------------------------------------


def export_tensorrt(
    onnx_path: str | os.PathLike,
    engine_path: str | os.PathLike,
    *,
    precision: str = "fp16",
    workspace_gb: float = 4.0,
    profile: Mapping[str, tuple[Sequence[int], Sequence[int], Sequence[int]]] | None = None,
    min_shapes: Mapping[str, Sequence[int]] | None = None,
    opt_shapes: Mapping[str, Sequence[int]] | None = None,
    max_shapes: Mapping[str, Sequence[int]] | None = None,
    dim_ranges: Mapping[str, tuple[int, int, int]] | None = None,
    aot: bool = True,
) -> pathlib.Path:
    """Build a TensorRT engine from an ONNX file of :func:`kc.export_onnx`; MLP-value runs as a plugin.

    ``precision``: "fp16" (default), "bf16" or "fp32" (see :func:`build_plan`). The optimization
    profile covers the dynamic dims: per input from ``profile`` ({name: (min, opt, max)}) or
    ``min_shapes`` / ``opt_shapes`` / ``max_shapes``, else per dim name from ``dim_ranges`` over
    :data:`DEFAULT_DIM_RANGES` (see :func:`profile_shapes`). ``workspace_gb`` caps the builder's
    scratch memory. ``aot`` (default): MLP-value nodes with d <= 128 use the plugin's ahead-of-time
    implementation where TensorRT has one (>= 10.10, and Triton installed), so the engine needs no
    Python to run; the others, and ``aot=False``, the JIT one.
    Needs ``tensorrt`` (>= 10.7) and an NVIDIA GPU, else raises
    :class:`~kha_compile.core.errors.BackendUnavailableError`; a failed step (profile, parse, build,
    save) raises :class:`~kha_compile.core.errors.ExportError`. Returns ``engine_path``.

    Example::

        onnx_path = kc.export_onnx(model, "model.onnx", example_args=(x,))
        kc.export_tensorrt(onnx_path, "model.engine", precision="fp16",
                           dim_ranges={"sequence": (1, 512, 4096)})
    """
    onnx_path = pathlib.Path(onnx_path).expanduser()
    if not onnx_path.is_file():
        raise ExportError(
            f"TensorRT export: the ONNX file {str(onnx_path)!r} does not exist; write it with kc.export_onnx first."
        )
    engine_path = check_destination(engine_path, what="the TensorRT engine")
    summary = onnx_summary(onnx_path)
    shapes = profile_shapes(summary.inputs, _merge_profile(profile, min_shapes, opt_shapes, max_shapes), dim_ranges)
    trt = import_tensorrt()
    plan = build_plan(precision, onnx_float_dtype(onnx_path), hasattr(trt.BuilderFlag, "FP16"))
    register_mlp_value_plugin()

    logger = trt_logger(trt)
    builder = trt.Builder(logger)
    flags = 0
    if plan.strongly_typed and hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    t0 = time.perf_counter()
    if aot and aot_registered():
        import onnx

        model = onnx.load(str(onnx_path), load_external_data=False)
        log.info(
            "%d of %d MLPValue nodes use the AOT plugin implementation", mark_aot_nodes(model), summary.num_custom_nodes
        )
        parsed = parser.parse(model.SerializeToString(), str(onnx_path))  # path: for external data
    else:
        parsed = parser.parse_from_file(str(onnx_path))
    if not parsed:
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(
            f"TensorRT export, step 'parse': TensorRT's ONNX parser rejects "
            f"{str(onnx_path)!r}: {errors or 'no reason given'}"
        )
    num_plugins = _count_plugin_layers(trt, network)
    log.info(
        "parsed %s in %.1f s: %d layers, %d of %d MLPValue nodes as %s plugins",
        onnx_path.name,
        time.perf_counter() - t0,
        network.num_layers,
        num_plugins,
        summary.num_custom_nodes,
        PLUGIN_ID,
    )
    if num_plugins < summary.num_custom_nodes:
        log.warning(
            "%d MLPValue nodes were imported through their ONNX function instead of the plugin",
            summary.num_custom_nodes - num_plugins,
        )

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if plan.builder_flag:
        config.set_flag(getattr(trt.BuilderFlag, plan.builder_flag))
    if not plan.allow_tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    monitor = _progress_monitor(trt)
    if monitor is not None:
        config.progress_monitor = monitor
    trt_profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name in shapes:
            trt_profile.set_shape(name, *shapes[name])
    config.add_optimization_profile(trt_profile)

    log.info(
        "building the TensorRT engine (%s, %s typed, profile %s)",
        precision,
        "strongly" if plan.strongly_typed else "weakly",
        shapes,
    )
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(
            f"TensorRT export, step 'build': TensorRT could not build an engine from "
            f"{str(onnx_path)!r} (its log above, at WARNING/ERROR, says why)."
        )
    try:
        engine_path.write_bytes(bytes(serialized))
    except OSError as e:
        raise ExportError(f"TensorRT export, step 'save': could not write {str(engine_path)!r}: {e}") from e
    log.info("wrote %s (%.1f MB) in %.1f s", engine_path, engine_path.stat().st_size / 1e6, time.perf_counter() - t0)
    return engine_path


def _merge_profile(profile, min_shapes, opt_shapes, max_shapes):
    """One {name: (min, opt, max)} from ``profile`` and the three per-shape dicts."""
    merged = dict(profile or {})
    names = set(min_shapes or {}) | set(opt_shapes or {}) | set(max_shapes or {})
    for name in sorted(names):
        parts = [(d or {}).get(name) for d in (min_shapes, opt_shapes, max_shapes)]
        if any(p is None for p in parts):
            raise ExportError(
                f"TensorRT profile for input {name!r}: give all of min_shapes, "
                f"opt_shapes and max_shapes for it, or none."
            )
        if name in merged:
            raise ExportError(f"TensorRT profile for input {name!r} is given twice (profile and min/opt/max_shapes).")
        merged[name] = tuple(parts)
    return merged


def _count_plugin_layers(trt: Any, network: Any) -> int:
    kind = getattr(trt.LayerType, "PLUGIN_V3", None)
    return sum(1 for i in range(network.num_layers) if network.get_layer(i).type == kind)
