"""Compile every MLP-value Triton kernel variant for NVIDIA targets on this (CPU-only) machine.

Prints a table per variant (ok, registers, spilled bytes, shared memory, reason) and a summary per
arch and kernel; writes the records as JSON. Goals: no spills at head dim <= 128, shared memory
within each architecture's per-block limit.

    python benchmarks/kernels_aot.py [--arch sm_80,sm_90] [--json out.json] [--txt out.txt]
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import time

from kha_compile.kernels.aot import SHARED_LIMITS, compile_variants, parse_arch


def table(records) -> str:
    """A fixed-width text table of the records, then a summary per (arch, kernel)."""
    head = f"{'arch':6} {'kernel':9} {'dtype':5} {'d':>4} {'config':40} {'ok':3} {'regs':>4} {'spill':>5} {'shared':>7}  reason"
    lines = [head, "-" * len(head)]
    for r in records:
        cfg = ",".join(f"{k}={v}" for k, v in r.config.items())
        cfg = cfg.replace("num_warps", "w").replace("num_stages", "s")
        lines.append(
            f"{r.arch:6} {r.kernel:9} {r.dtype:5} {r.head_dim:>4} {cfg:40} {'yes' if r.ok else 'NO':3} "
            f"{_n(r.registers):>4} {_n(r.spills):>5} {_n(r.shared_bytes):>7}  {r.reason}"
        )
    lines += [
        "",
        "Summary (compiled variants, head dim <= 128):",
        f"{'arch':6} {'kernel':9} {'variants':>8} {'max regs':>8} {'spilling':>8} {'max shared':>10} {'limit':>7}",
    ]
    keys = sorted({(r.arch, r.kernel) for r in records if r.registers is not None})
    for arch, kernel in keys:
        rs = [r for r in records if (r.arch, r.kernel) == (arch, kernel) and r.registers is not None]
        limit = SHARED_LIMITS.get(parse_arch(arch), 0)
        lines.append(
            f"{arch:6} {kernel:9} {len(rs):>8} {max(r.registers for r in rs):>8} "
            f"{sum(1 for r in rs if r.spills):>8} {max(r.shared_bytes for r in rs):>10} {limit:>7}"
        )
    bad = [r for r in records if r.registers is not None and (not r.ok or r.spills)]
    lines.append(f"\nproblems (not ok, or spilling) among compiled variants: {len(bad)}")
    return "\n".join(lines)


def _n(x) -> str:
    return "-" if x is None else str(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_80,sm_90", help="comma-separated, e.g. sm_80,sm_90")
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--txt", help="write the table here too")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each compile")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    t0 = time.perf_counter()
    records = compile_variants(args.arch.split(","))
    took = time.perf_counter() - t0
    text = table(records) + f"\n{len(records)} records in {took:.0f} s"
    print(text)
    if args.txt:
        pathlib.Path(args.txt).write_text(text + "\n")
    if args.json:
        import triton

        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "machine": {"triton": triton.__version__, "python": platform.python_version()},
                    "archs": args.arch.split(","),
                    "seconds": round(took, 1),
                    "records": [r.to_dict() for r in records],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
