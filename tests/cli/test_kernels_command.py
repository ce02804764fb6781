"""kha_compile.cli.commands.kernels: `kernels --arch ... --json`, with compile_variants stood in for."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import pytest
from cli_cases import run


@dataclasses.dataclass
class FakeRecord:
    kernel: str
    arch: str
    dtype: str
    head_dim: int
    config: dict[str, Any]
    ok: bool
    registers: int | None
    spills: int | None
    shared_bytes: int | None
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _fake_aot(monkeypatch, fail_on: str = "") -> list[list[str]]:
    """Install a stand-in ``kha_compile.kernels.aot`` module; returns the list of the archs it was called with."""
    calls: list[list[str]] = []

    def compile_variants(archs: list[str]) -> list[FakeRecord]:
        calls.append(archs)
        out = []
        for arch in archs:
            for dtype in ("fp16", "bf16"):
                ok = arch != fail_on
                out.append(
                    FakeRecord(
                        "mlp_value_fwd",
                        arch,
                        dtype,
                        64,
                        {"BLOCK_M": 64, "num_warps": 4},
                        ok,
                        96 if ok else None,
                        0 if ok else None,
                        24576 if ok else None,
                        "" if ok else "out of shared memory",
                    )
                )
            out.append(FakeRecord("mlp_value_bwd", arch, "fp16", 128, {"BLOCK_M": 32}, True, 168, 8, 49152))
        return out

    monkeypatch.setattr("kha_compile.cli.commands.kernels.compile_variants", compile_variants)
    return calls


def test_kernels_renders_each_kernel_and_writes_json(capsys, monkeypatch, tmp_path):
    calls = _fake_aot(monkeypatch)
    path = tmp_path / "out" / "kernels.json"
    code, out, _ = run(capsys, "kernels", "--arch", "sm_80, sm_90", "--json", str(path))
    assert code == 0
    assert calls == [["sm_80", "sm_90"]]
    assert "mlp_value_fwd: 4 variant(s), 0 failed" in out and "mlp_value_bwd: 2 variant(s), 0 failed" in out
    assert "BLOCK_M=64, num_warps=4" in out and "24576" in out and "49152" in out
    records = json.loads(path.read_text())
    assert len(records) == 6 and records[0] == {
        "kernel": "mlp_value_fwd",
        "arch": "sm_80",
        "dtype": "fp16",
        "head_dim": 64,
        "config": {"BLOCK_M": 64, "num_warps": 4},
        "ok": True,
        "registers": 96,
        "spills": 0,
        "shared_bytes": 24576,
        "reason": "",
    }
    assert f"wrote 6 record(s) to {path}" in out


def test_a_failed_variant_shows_its_reason_and_exits_1(capsys, monkeypatch):
    _fake_aot(monkeypatch, fail_on="sm_75")
    code, out, _ = run(capsys, "kernels", "--arch", "sm_75")
    assert code == 1
    assert "mlp_value_fwd: 2 variant(s), 2 failed" in out and "out of shared memory" in out


@pytest.mark.parametrize("value", ["80", "sm_80,gfx90a", ",", "sm80"])
def test_bad_arch_is_a_usage_error_of_kernels(capsys, monkeypatch, value):
    calls = _fake_aot(monkeypatch)
    code, _, err = run(capsys, "kernels", "--arch", value)
    assert code == 2 and err.startswith("usage: kha-compile kernels")
    assert "is not a GPU architecture" in err and "sm_80,sm_90" in err
    assert calls == []


def test_missing_triton_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails with ModuleNotFoundError
    code, out, err = run(capsys, "kernels", "--arch", "sm_90")
    assert code == 2
    assert "triton" in err and "pip install" in err and "Traceback" not in err + out
