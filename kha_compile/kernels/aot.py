"""Ahead-of-time compile of the MLP-value Triton kernels for NVIDIA GPUs, on any machine (no GPU needed).

Every variant the runtime can launch (forward; backward fused, or split into grad-v and weight-gradient
launches; fp32/fp16/bf16; each autotune config of :mod:`kha_compile.kernels.mlp_value`) is compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``. Each compile gives a
:class:`KernelRecord`: registers and spills (read from the cubin with ``cuobjdump`` / ``ptxas -v``),
shared memory (Triton's metadata) against the architecture's per-block limit. A failed compile is a
record with ``ok=False`` and the reason, never an exception.

Example::

    from kha_compile.kernels.aot import compile_variants
    records = compile_variants(["sm_80", "sm_90"])            # minutes: about 150 compiles per arch
    bad = [r for r in records if not r.ok or r.spills]

:func:`compile_kernel` returns one variant's PTX and launch facts (the TensorRT AOT plugin uses it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

from ..core.errors import BackendUnavailableError, KernelCompileError
from .mlp_value import config_class, configs_for, launch_supported, padded_d, triton_supports

__all__ = [
    "DTYPES",
    "HEAD_DIMS",
    "KERNELS",
    "SHARED_LIMITS",
    "CompiledKernel",
    "KernelRecord",
    "KernelVariant",
    "compile_kernel",
    "compile_variants",
    "kernel_variants",
    "parse_arch",
]

logger = logging.getLogger(__name__)

HEAD_DIMS = (32, 64, 96, 128, 256)
DTYPES = ("fp32", "fp16", "bf16")
KERNELS = ("fwd", "bwd_fused", "bwd_dv", "bwd_dw")  # the launches of the runtime
# "fwd_plugin": the forward in TensorRT's argument order (kha_compile.exporters.tensorrt_aot); not swept
# Largest dynamic shared memory one block may opt into, per compute capability (CUDA programming
# guide, "Technical Specifications per Compute Capability").
SHARED_LIMITS: dict[int, int] = {
    70: 96 * 1024,
    75: 64 * 1024,
    80: 163 * 1024,
    86: 99 * 1024,
    87: 163 * 1024,
    89: 99 * 1024,
    90: 227 * 1024,
    100: 227 * 1024,
    103: 227 * 1024,
    120: 99 * 1024,
}
MAX_REGISTERS = 255  # per thread; ptxas spills to local memory beyond
_TRITON_DTYPES = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


@dataclasses.dataclass
class KernelRecord:
    """What compiling one kernel variant for one architecture gave (``ok=False``: ``reason`` says why)."""

    kernel: str
    arch: str
    dtype: str
    head_dim: int
    config: dict[str, Any]
    ok: bool
    registers: int | None = None
    spills: int | None = None  # bytes of spill stores (ptxas -v); 0 when none
    shared_bytes: int | None = None  # dynamic shared memory per block (Triton metadata)
    reason: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KernelVariant:
    """One launchable kernel: which launch, operand type, head size, blocks, warps and stages."""

    kernel: str  # one of KERNELS
    dtype: str  # one of DTYPES
    head_dim: int
    block_m: int
    block_n: int | None
    num_warps: int
    num_stages: int
    precision: str = "ieee"  # tl.dot input precision ("ieee" or "tf32" for fp32)

    @property
    def padded_dim(self) -> int:
        """D: the head size padded to a power of two >= 16 (the kernels' tile width)."""
        return max(16, 1 << max(0, (self.head_dim - 1).bit_length()))

    @property
    def config(self) -> dict[str, Any]:
        """The autotune config as a dict (BLOCK_M, BLOCK_N when the launch has one, warps, stages)."""
        cfg: dict[str, Any] = {"BLOCK_M": self.block_m}
        if self.block_n is not None:
            cfg["BLOCK_N"] = self.block_n
        cfg.update(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.precision != "ieee":
            cfg["precision"] = self.precision
        return cfg

    def arg_names(self) -> list[str]:
        """The kernel's runtime arguments, in launch order (constexprs left out)."""
        if self.kernel == "fwd_plugin":  # TensorRT's order: inputs, scalars, outputs
            return ["v_ptr", "wu_ptr", "wg_ptr", "wd_ptr", "M", "y_ptr"]
        if self.kernel == "fwd":
            return ["v_ptr", "wu_ptr", "wg_ptr", "wd_ptr", "y_ptr", "M", "stride_vm", "stride_ym", "M_BUCKET"]
        return [
            "v_ptr",
            "go_ptr",
            "wu_ptr",
            "wg_ptr",
            "wd_ptr",
            "gv_ptr",
            "ws_ptr",
            "M",
            "stride_vm",
            "stride_gm",
            "stride_gvm",
            "M_BUCKET",
        ]

    def signature(self) -> dict[str, str]:
        """Triton signature: argument name -> type ("*bf16", "i32", "constexpr")."""
        t = _TRITON_DTYPES[self.dtype]
        sig = {n: ("*fp32" if n == "ws_ptr" else f"*{t}") if n.endswith("_ptr") else "i32" for n in self.arg_names()}
        for n in self.constexprs():
            sig[n] = "constexpr"
        return sig

    def constexprs(self) -> dict[str, Any]:
        """Compile-time constants of the launch, as the runtime passes them on a GPU."""
        D = self.padded_dim
        c: dict[str, Any] = {"d": self.head_dim, "D": D, "BLOCK_M": self.block_m}
        if self.kernel == "fwd_plugin":
            return {**c, "PRECISION": self.precision}
        if self.kernel != "fwd":
            c["BLOCK_N"] = D if self.kernel in ("bwd_fused", "bwd_dv") else self.block_n
            c["COMPUTE_DV"] = self.kernel in ("bwd_fused", "bwd_dv")
            c["COMPUTE_DW"] = self.kernel in ("bwd_fused", "bwd_dw")
        c["UPCAST"] = False
        c["PRECISION"] = self.precision
        return c

    def attrs(self) -> dict[tuple[int, ...], list[list[Any]]]:
        """Divisibility hints the runtime would specialize on: 16-aligned pointers, strides of d % 16 == 0."""
        names = self.arg_names()
        aligned = [
            i for i, n in enumerate(names) if n.endswith("_ptr") or (n.startswith("stride") and self.head_dim % 16 == 0)
        ]
        return {(i,): [["tt.divisibility", 16]] for i in aligned}


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """One compiled variant: its PTX and what a launcher needs (name, warps, shared memory, arguments)."""

    variant: KernelVariant
    arch: str
    name: str
    ptx: str
    cubin: bytes
    num_warps: int
    shared_bytes: int
    arg_names: tuple[str, ...]
    record: KernelRecord


def parse_arch(arch: str | int) -> int:
    """Compute capability of an architecture name: "sm_90" / "sm_90a" / "90" -> 90.

    Example::

        parse_arch("sm_80")    # 80
    """
    m = re.fullmatch(r"(?:sm_?)?(\d{2,3})a?", str(arch).strip().lower())
    if not m:
        raise KernelCompileError(
            f"unknown GPU architecture {arch!r}: give it as sm_<compute capability>, e.g. sm_80 (A100) "
            "or sm_90 (H100/H200)."
        )
    return int(m.group(1))


def kernel_variants(
    dtypes: Iterable[str] = DTYPES,
    head_dims: Iterable[int] = HEAD_DIMS,
    kernels: Iterable[str] = KERNELS,
    arch: str | int | None = None,
) -> list[KernelVariant]:
    """Every variant the op launches for these dtypes and head sizes (each autotune config it ships).

    With ``arch``, the configs the runtime uses on that architecture; without, all candidates.
    Head sizes the op does not send to the kernels (``triton_supports``: d > 128, fp32 at d > 64)
    get no variants.

    Example::

        kernel_variants(["bf16"], [64], ["fwd"], "sm_90")     # one per ("fwd", "16bit") config
    """
    import torch

    cc = None if arch is None else parse_arch(arch)
    kernels = tuple(kernels)
    out: list[KernelVariant] = []
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise KernelCompileError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}.")
        tdtype = getattr(torch, _TORCH_DTYPES[dtype])
        for d in head_dims:
            if not triton_supports(d, tdtype):
                continue
            D = padded_d(d)
            launches = [("fwd", "fwd")] + (
                [("bwd_fused", "fused")] if D <= 64 else [("bwd_dv", "dv"), ("bwd_dw", "dw")]
            )
            for kernel, kind in launches:
                direction = "forward" if kind == "fwd" else "backward"
                if kernel not in kernels or not launch_supported(direction, d, tdtype, cc):
                    continue
                for bm, bn, warps, stages in configs_for(kind, config_class(kind, D, tdtype), D, cc):
                    out.append(KernelVariant(kernel, dtype, d, bm, bn if kernel == "bwd_dw" else None, warps, stages))
    return out


def compile_variants(
    archs: list[str],
    *,
    dtypes: Iterable[str] = DTYPES,
    head_dims: Iterable[int] = HEAD_DIMS,
    kernels: Iterable[str] = KERNELS,
) -> list[KernelRecord]:
    """Compile every kernel variant for each architecture; one :class:`KernelRecord` per variant and arch.

    What the op does not run on the kernels (d > 128, fp32 at d > 64, a backward with no config
    that fits the arch) gets one ``ok=False`` record per direction saying so, with no registers.
    Raises only for an unknown architecture name or dtype; a failed compile, too much shared
    memory or a missing Triton is a record with ``ok=False`` and its reason.
    Progress is logged at INFO (a full sweep is about 150 compiles per arch, seconds each).

    Example::

        records = compile_variants(["sm_90"], dtypes=["bf16"], head_dims=[64], kernels=["fwd"])
        print(max(r.registers for r in records if r.ok))
    """
    import torch

    head_dims, dtypes, kernels = tuple(head_dims), tuple(dtypes), tuple(kernels)
    ccs = [(arch, parse_arch(arch)) for arch in archs]
    plan = [(arch, v) for arch, _ in ccs for v in kernel_variants(dtypes, head_dims, kernels, arch)]
    records: list[KernelRecord] = []
    logger.info("compiling %d kernel variants for %s", len(plan), ", ".join(a for a, _ in ccs))
    for arch, cc in ccs:  # what the op does not run on the kernels there: one record per direction, saying why
        for dtype in dtypes:
            tdtype = getattr(torch, _TORCH_DTYPES[dtype])
            for d in head_dims:
                for direction, kernel in (("forward", "fwd"), ("backward", "bwd")):
                    if not triton_supports(d, tdtype):
                        why = (
                            f"head dim {d}: kha::mlp_value runs the composite formula (cuBLAS) for {dtype} "
                            f"at this size; the Triton kernels take d <= 128 (fp32: d <= 64)"
                        )
                    elif not launch_supported(direction, d, tdtype, cc):
                        why = (
                            f"no {direction} config fits {arch} at head dim {d} ({dtype}); kha::mlp_value "
                            f"runs the composite formula (cuBLAS) there"
                        )
                    else:
                        continue
                    records.append(KernelRecord(kernel, arch, dtype, d, {}, ok=False, reason=why))
    for i, (arch, v) in enumerate(plan, 1):
        rec = _compile(v, arch)[0]
        records.append(rec)
        logger.info(
            "[%d/%d] %s %s %s d=%d %s: %s", i, len(plan), arch, v.kernel, v.dtype, v.head_dim, v.config, _summary(rec)
        )
    return records


def compile_kernel(variant: KernelVariant, arch: str) -> CompiledKernel:
    """Compile one variant for ``arch``; raises :class:`KernelCompileError` when it does not build or fit.

    Example::

        k = compile_kernel(kernel_variants(["fp16"], [64], ["fwd"])[0], "sm_90")
        k.name, k.num_warps, k.shared_bytes, len(k.ptx)
    """
    rec, compiled = _compile(variant, arch)
    if compiled is None or not rec.ok:
        raise KernelCompileError(
            f"the {variant.kernel} kernel ({variant.dtype}, d={variant.head_dim}, {variant.config}) does not "
            f"build for {arch}: {rec.reason}"
        )
    return compiled


# --------------------------------------------------------------------------------------------------
# One compile
# --------------------------------------------------------------------------------------------------
def _summary(rec: KernelRecord) -> str:
    if not rec.ok and rec.registers is None:
        return f"FAILED ({rec.reason})"
    text = f"{rec.registers} regs, {rec.spills} B spilled, {rec.shared_bytes} B shared, {rec.seconds:.1f} s"
    return text if rec.ok else f"{text}, NOT OK ({rec.reason})"


def _compile(v: KernelVariant, arch: str) -> tuple[KernelRecord, CompiledKernel | None]:
    rec = KernelRecord(v.kernel, arch, v.dtype, v.head_dim, v.config, ok=False)
    t0 = time.perf_counter()
    try:
        cc = parse_arch(arch)
        triton, jit = _jit_module()
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        fn = {"fwd": jit._fwd, "fwd_plugin": jit._fwd_plugin}.get(v.kernel, jit._bwd)
        src = ASTSource(fn=fn, signature=v.signature(), constexprs=v.constexprs(), attrs=v.attrs())
        target = GPUTarget("cuda", cc, 32)
        with contextlib.redirect_stdout(io.StringIO()) as out:  # triton prints ptxas failures
            k = triton.compile(src, target=target, options={"num_warps": v.num_warps, "num_stages": v.num_stages})
    except Exception as e:
        rec.seconds = time.perf_counter() - t0
        first = str(e).strip().splitlines()
        rec.reason = f"{type(e).__name__}: {first[0] if first else ''}"[:500]
        if "out" in locals() and out.getvalue():
            logger.debug("compiler output for %s: %s", v, out.getvalue())
        return rec, None
    rec.seconds = time.perf_counter() - t0
    rec.shared_bytes = int(k.metadata.shared)
    cubin, ptx = k.asm["cubin"], k.asm["ptx"]
    try:
        rec.registers, stack = _resource_usage(cubin, k.metadata.name)
        rec.spills = _spill_bytes(ptx, cc) if stack else 0
    except Exception as e:
        rec.reason = f"compiled, but its resource usage could not be read: {type(e).__name__}: {e}"[:500]
        return rec, None
    limit = SHARED_LIMITS.get(cc)
    problems = []
    if limit is not None and rec.shared_bytes > limit:
        problems.append(f"shared memory {rec.shared_bytes} B > the {limit} B per block of sm_{cc}")
    if getattr(k.metadata, "global_scratch_size", 0):
        problems.append(f"needs {k.metadata.global_scratch_size} B of global scratch")
    rec.ok = not problems
    rec.reason = "; ".join(problems)
    compiled = CompiledKernel(
        v, arch, k.metadata.name, ptx, cubin, int(k.metadata.num_warps), rec.shared_bytes, tuple(v.arg_names()), rec
    )
    return rec, compiled


@functools.lru_cache(maxsize=1)
def _jit_module() -> tuple[Any, Any]:
    """triton and a compiled-mode (never interpreted) copy of the @triton.jit kernels."""
    try:
        import triton
        from triton.runtime.jit import JITFunction
    except Exception as e:
        raise BackendUnavailableError(f"compiling the kernels needs Triton (pip install triton): {e}") from e
    name = f"{__package__}._mlp_value_jit_aot"
    path = os.path.join(os.path.dirname(__file__), "_mlp_value_jit.py")
    knobs = getattr(triton, "knobs", None)
    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        with _interpret_off(knobs):
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            jit = importlib.util.module_from_spec(spec)
            sys.modules[name] = jit
            spec.loader.exec_module(jit)
    finally:
        if old_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old_env
    if not isinstance(jit._fwd, JITFunction):
        raise BackendUnavailableError("Triton built interpreter kernels although TRITON_INTERPRET was off.")
    return triton, jit


@contextlib.contextmanager
def _interpret_off(knobs: Any) -> Iterator[None]:
    """TRITON_INTERPRET off while the kernels' decorators run; the knob and environment restored after."""
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "scope"):
        yield
        return
    with runtime.scope():  # restores triton's runtime knobs and their environment variables
        runtime.interpret = False
        yield


def _nvidia_tool(name: str, cc: int = 90) -> str:
    import triton

    if name == "ptxas":
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(cc).path
    return getattr(triton.knobs.nvidia, name).path


def _resource_usage(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers, stack frame bytes) of kernel ``name`` in ``cubin``, from ``cuobjdump``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run(
            [_nvidia_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    return parse_resource_usage(out, name)


def parse_resource_usage(text: str, name: str) -> tuple[int, int]:
    """(REG, STACK) of function ``name`` in ``cuobjdump --dump-resource-usage`` output.

    Example::

        parse_resource_usage(" Function _fwd:\n  REG:168 STACK:0 SHARED:0", "_fwd")    # (168, 0)
    """
    m = re.search(rf"Function {re.escape(name)}:\s*\n?\s*REG:(\d+)\s+STACK:(\d+)", text)
    if not m:
        raise KernelCompileError(f"no resource usage for {name!r} in cuobjdump's output: {text[:300]!r}")
    return int(m.group(1)), int(m.group(2))


def _spill_bytes(ptx: str, cc: int) -> int:
    """Bytes of spill stores ptxas reports for ``ptx`` (called only when the kernel has a stack frame)."""
    arch = f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [
                _nvidia_tool("ptxas", cc),
                "-v",
                "--regAllocOptLevel=2",
                f"--gpu-name={arch}",
                src,
                "-o",
                os.path.join(tmp, "k.o"),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return parse_spill_stores(res.stderr + res.stdout)


def parse_spill_stores(ptxas_log: str) -> int:
    """Bytes of spill stores in a ``ptxas -v`` log (0 when it reports none).

    Example::

        parse_spill_stores("24 bytes stack frame, 20 bytes spill stores, 20 bytes spill loads")    # 20
    """
    found = [int(x) for x in re.findall(r"(\d+) bytes spill stores", ptxas_log)]
    return max(found, default=0)
