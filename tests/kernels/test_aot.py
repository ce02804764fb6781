"""kha_compile/kernels/aot.py: Triton kernels compiled for NVIDIA targets on this CPU-only machine.

The fast tests compile a few variants for sm_90 and read registers, spills and shared memory back;
the slow test sweeps every variant for sm_90 and holds the goals: no spills at head dim <= 128,
shared memory within the architecture's per-block limit.
"""

from __future__ import annotations

import importlib.util

import pytest

from kha_compile.core.errors import KernelCompileError
from kha_compile.kernels import aot

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not importable (pip install triton)"
)

FIELDS = {"kernel", "arch", "dtype", "head_dim", "config", "ok", "registers", "spills", "shared_bytes", "reason"}


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch):
    # Other kernel tests set TRITON_INTERPRET=1; the AOT compile must not depend on it either way.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_a_few_sm90_variants_compile_with_their_resources():
    records = aot.compile_variants(["sm_90"], dtypes=["bf16"], head_dims=[32], kernels=["fwd", "bwd_fused"])
    from kha_compile.kernels.mlp_value import configs_for

    # one record per config the runtime autotunes over on sm_90
    assert len(records) == len(configs_for("fwd", "16bit", 32, 90)) + len(configs_for("fused", "16bit", 32, 90))
    for r in records:
        assert set(r.to_dict()) >= FIELDS
        assert r.ok, r.reason
        assert (r.arch, r.dtype, r.head_dim) == ("sm_90", "bf16", 32)
        assert 16 < r.registers <= aot.MAX_REGISTERS
        assert r.spills == 0
        assert 0 < r.shared_bytes <= aot.SHARED_LIMITS[90]
    # the fused backward holds more tiles than the forward
    fwd = max(r.registers for r in records if r.kernel == "fwd")
    assert max(r.registers for r in records if r.kernel == "bwd_fused") > fwd


def test_compiled_kernel_is_ptx_for_the_target():
    v = aot.kernel_variants(["fp16"], [64], ["fwd"])[0]
    k = aot.compile_kernel(v, "sm_90")
    assert k.ptx.count(f".entry {k.name}(") == 1
    assert ".target sm_90" in k.ptx
    assert k.num_warps == v.num_warps and k.shared_bytes == k.record.shared_bytes > 0
    assert k.arg_names == ("v_ptr", "wu_ptr", "wg_ptr", "wd_ptr", "y_ptr", "M", "stride_vm", "stride_ym", "M_BUCKET")


def test_a_failed_compile_is_a_record_not_a_crash():
    # BLOCK_M = 24: tl.arange takes powers of two only, so the compiler rejects the kernel
    bad = aot.KernelVariant("fwd", "bf16", 64, 24, None, 4, 2)
    rec, compiled = aot._compile(bad, "sm_90")
    assert compiled is None and not rec.ok and rec.registers is None
    assert rec.reason and "Error" in rec.reason.split(":")[0]


def test_too_much_shared_memory_is_not_ok():
    # the same kernel fits sm_90's 227 KiB but not sm_86's 99 KiB
    v = aot.KernelVariant("fwd", "fp16", 128, 64, None, 4, 2)
    rec90, _ = aot._compile(v, "sm_90")
    assert rec90.ok and rec90.shared_bytes > aot.SHARED_LIMITS[86]
    rec86, _ = aot._compile(v, "sm_86")
    assert not rec86.ok and "shared memory" in rec86.reason and str(aot.SHARED_LIMITS[86]) in rec86.reason


def test_head_dims_above_the_kernels_are_records_with_a_reason():
    records = aot.compile_variants(["sm_90"], dtypes=["fp16"], head_dims=[256])
    assert records and all(not r.ok and r.registers is None and "256" in r.reason for r in records)


@pytest.mark.parametrize("arch, cc", [("sm_80", 80), ("sm_90a", 90), ("90", 90), ("SM_100", 100)])
def test_parse_arch(arch, cc):
    assert aot.parse_arch(arch) == cc


@pytest.mark.parametrize("arch", ["hopper", "sm_9", "compute_90x"])
def test_parse_arch_rejects(arch):
    with pytest.raises(KernelCompileError, match="sm_80"):
        aot.parse_arch(arch)


def test_resource_parsers():
    text = "Resource usage:\n Common:\n  GLOBAL:0\n Function _bwd:\n  REG:168 STACK:24 SHARED:0 LOCAL:0\n"
    assert aot.parse_resource_usage(text, "_bwd") == (168, 24)
    with pytest.raises(KernelCompileError, match="no resource usage for '_fwd'"):
        aot.parse_resource_usage(text, "_fwd")
    log = "ptxas info    : Function properties for _fwd\n    24 bytes stack frame, 20 bytes spill stores, 20 bytes spill loads\n"
    assert aot.parse_spill_stores(log) == 20
    assert aot.parse_spill_stores("0 bytes stack frame, 0 bytes spill stores") == 0


@pytest.mark.slow
def test_full_sm90_sweep_has_no_spills_and_fits(tmp_path):
    """``kha-compile kernels --arch sm_90 --json PATH``, as a user runs it, then its records."""
    import json

    from kha_compile.cli import main

    out = tmp_path / "kernels.json"
    assert main(["kernels", "--arch", "sm_90", "--json", str(out)]) == 0
    records = [aot.KernelRecord(**r) for r in json.loads(out.read_text())]
    compiled = [r for r in records if r.registers is not None]
    assert len(compiled) > 100
    assert all(r.ok for r in compiled), [r.to_dict() for r in compiled if not r.ok]
    spilling = [r.to_dict() for r in compiled if r.head_dim <= 128 and r.spills]
    assert not spilling
    assert max(r.shared_bytes for r in compiled) <= aot.SHARED_LIMITS[90]
    # every (dtype, head dim) the op sends to the kernels has a compiled forward and backward
    import torch

    from kha_compile.kernels.mlp_value import triton_supports

    torch_dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    for dtype in aot.DTYPES:
        for d in (d for d in (32, 64, 96, 128) if triton_supports(d, torch_dtypes[dtype])):
            kinds = {r.kernel for r in compiled if (r.dtype, r.head_dim) == (dtype, d)}
            assert "fwd" in kinds and kinds & {"bwd_fused", "bwd_dv"}, (dtype, d, kinds)
