"""GPU benchmark: the fused Triton MLP-value kernel against the unfused eager formula.

Times ``y = 2 * ((v @ W_up) * sigmoid(v @ W_gate)) @ W_down`` for v of shape (M, d) (default
M = 1,048,576 rows, d = 128, bf16), forward alone and forward + backward, fused (Triton, through
``kha_compile.kernels`` / ``torch.ops.kha.mlp_value``) and unfused (plain torch ops, autograd).
Prints the time, the achieved memory bandwidth over the bytes a single pass must move (read V and
the weights, write the output; for the backward also read the output gradient, write grad_v and the
weight gradients), its fraction of the device's peak, the model FLOP rate, and the speedups.

Goals checked (forward): fused >= 3x faster than unfused, fused >= 70% of peak memory bandwidth.
At d = 128 the forward does 6 d = 768 FLOP per row for 4 d = 512 bytes (bf16), 192 FLOP/byte: about
the H100/H200 ridge point, so the tensor cores bound the kernel about as much as memory does; the
roofline line printed with the results shows which one binds.

Run on a machine with an NVIDIA GPU and triton, from the repository root::

    python benchmarks/gpu_mlp_value.py
    python benchmarks/gpu_mlp_value.py --m 262144 --dtype fp16 --json /tmp/mlp_value.json
    python benchmarks/gpu_mlp_value.py --peak-gbs 4800 --peak-tflops 989

``--interpret-smoke`` runs the same script on CPU tensors under TRITON_INTERPRET=1 with a small M, to
check the script itself where there is no GPU (its timings mean nothing).

Exit status: 0 measured (goals met or not; see the GOAL lines), 1 the fused result does not match
the formula, 2 no NVIDIA GPU / no triton here.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kha_compile  # noqa: F401  (registers torch.ops.kha.*)
from kha_compile.kernels import mlp_value_triton_backward, mlp_value_triton_forward, triton_available, triton_supports
from kha_compile.ops import mlp_value_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Datasheet peaks: (name fragments that must all occur in the device name, HBM/GDDR GB/s, dense
# 16-bit tensor TFLOP/s). First match wins, so the more specific names come first.
PEAKS = [
    (("GH200",), 4000.0, 989.0),
    (("H200",), 4800.0, 989.0),
    (("H100", "NVL"), 3900.0, 835.0),
    (("H100", "PCIe"), 2000.0, 756.0),
    (("H100",), 3350.0, 989.0),  # SXM5 80 GB (HBM3)
    (("H800",), 3350.0, 989.0),
    (("B200",), 8000.0, 2250.0),
    (("A100", "80GB", "PCIe"), 1935.0, 312.0),
    (("A100", "80GB"), 2039.0, 312.0),
    (("A100",), 1555.0, 312.0),
    (("L40S",), 864.0, 362.0),
    (("L40",), 864.0, 181.0),
    (("L4",), 300.0, 121.0),
    (("A10G",), 600.0, 70.0),
    (("A10",), 600.0, 125.0),
    (("RTX 4090",), 1008.0, 165.0),
    (("RTX 3090",), 936.0, 71.0),
]


def device_peaks(name: str, props) -> tuple[float | None, float | None, str]:
    """(peak GB/s, peak dense 16-bit TFLOP/s, where the numbers came from) for this device."""
    for frags, gbs, tflops in PEAKS:
        if all(f.lower() in name.lower() for f in frags):
            return gbs, tflops, f"datasheet ({' '.join(frags)})"
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate: 2 transfers per clock
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, None, "memory clock x bus width (device properties)"
    return None, None, "unknown (pass --peak-gbs)"


def cuda_time_ms(fn, reps: int, warmup: int) -> tuple[float, list[float]]:
    """Median milliseconds of fn() over reps launches, each timed with CUDA events, after warmup."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def cpu_time_ms(fn, reps: int, warmup: int) -> tuple[float, list[float]]:
    """Like cuda_time_ms, with a wall clock (the --interpret-smoke mode)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), times


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=1 << 20, help="rows of V (default 1,048,576)")
    p.add_argument("--d", type=int, default=128, help="head size (default 128; the kernel takes <= 128)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=30, help="timed launches per case (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: looked up)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak dense 16-bit TFLOP/s (default: looked up)")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    p.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="check this script on CPU under TRITON_INTERPRET=1 (small M; timings meaningless)",
    )
    a = p.parse_args(argv)

    if a.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first built
        a.m = min(a.m, 256)
        a.reps, a.warmup = min(a.reps, 2), min(a.warmup, 1)
    elif not torch.cuda.is_available():
        print(
            "gpu_mlp_value: no CUDA GPU is visible to torch; run this on a machine with an NVIDIA GPU "
            "(and a CUDA build of torch).",
            file=sys.stderr,
        )
        return 2
    if not triton_available():
        print("gpu_mlp_value: triton is not importable: `pip install triton`.", file=sys.stderr)
        return 2
    dtype = DTYPES[a.dtype]
    if not triton_supports(a.d, dtype):
        print(f"gpu_mlp_value: the kernel does not take d={a.d} ({a.dtype}); use d <= 128.", file=sys.stderr)
        return 2

    if a.interpret_smoke:
        dev, timer = torch.device("cpu"), cpu_time_ms
        props = argparse.Namespace(name="cpu (TRITON_INTERPRET=1 smoke run)", multi_processor_count=0)
    else:
        dev, timer = torch.device("cuda"), cuda_time_ms
        props = torch.cuda.get_device_properties(dev)
    peak_gbs, peak_tflops, source = device_peaks(props.name, props)
    if a.peak_gbs:
        peak_gbs, source = a.peak_gbs, "--peak-gbs"
    if a.peak_tflops:
        peak_tflops = a.peak_tflops
    if dtype == torch.float32 and not a.peak_tflops:
        peak_tflops = None  # the 16-bit tensor-core figure does not apply to fp32

    M, d = a.m, a.d
    e = torch.finfo(dtype).bits // 8
    gen = torch.Generator(device=dev).manual_seed(0)
    v = torch.randn(M, d, device=dev, dtype=dtype, generator=gen)
    w_up, w_gate, w_down = ((torch.randn(d, d, device=dev, generator=gen) / d**0.5).to(dtype) for _ in range(3))
    g = torch.randn(M, d, device=dev, dtype=dtype, generator=gen)

    print(
        f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
        f"peak {peak_gbs or float('nan'):.0f} GB/s ({source}), "
        f"{peak_tflops or float('nan'):.0f} TFLOP/s dense 16-bit"
    )
    print(f"shape: V ({M:,}, {d}) {a.dtype}; weights 3 x ({d}, {d})")

    # Correctness first (also runs the autotuner once per launch, outside the timed region).
    print("tuning and checking the fused kernels ...", flush=True)
    y_fused = mlp_value_triton_forward(v, w_up, w_gate, w_down)
    leaves = [t.float().requires_grad_() for t in (v, w_up, w_gate, w_down)]
    y_ref = mlp_value_reference(*leaves)
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]  # fp32 may run as TF32
    errors = {"forward": rel_err(y_fused, y_ref)}
    if not a.no_backward:
        grads = mlp_value_triton_backward(g, v, w_up, w_gate, w_down)
        want = torch.autograd.grad(y_ref, leaves, g.float())
        for name, got, w in zip(("grad_v", "grad_w_up", "grad_w_gate", "grad_w_down"), grads, want):
            errors[name] = rel_err(got, w)
        del grads, want
    del y_fused, y_ref, leaves
    bad = {k: x for k, x in errors.items() if not x < tol}
    print(
        "max error relative to the fp32 formula: "
        + ", ".join(f"{k} {x:.1e}" for k, x in errors.items())
        + f" (tolerance {tol:.0e})"
    )
    if bad:
        print(f"MISMATCH: {bad}", file=sys.stderr)
        return 1

    # What is timed.
    v_req = v.detach().requires_grad_()
    w_req = [w.detach().requires_grad_() for w in (w_up, w_gate, w_down)]

    def fused_fwd():
        return mlp_value_triton_forward(v, w_up, w_gate, w_down)

    def eager_fwd():
        return mlp_value_reference(v, w_up, w_gate, w_down)

    def fused_fwd_bwd():  # through the op: CUDA forward kernel + kha::mlp_value_backward (Triton)
        if a.interpret_smoke:  # on CPU the op runs the composite; call the kernels themselves
            mlp_value_triton_forward(v, w_up, w_gate, w_down)
            return mlp_value_triton_backward(g, v, w_up, w_gate, w_down)
        y = torch.ops.kha.mlp_value(v_req, *w_req)
        return torch.autograd.grad(y, (v_req, *w_req), g)

    def eager_fwd_bwd():
        y = mlp_value_reference(v_req, *w_req)
        return torch.autograd.grad(y, (v_req, *w_req), g)

    cases = {"forward": (fused_fwd, eager_fwd)}
    if not a.no_backward:
        cases["forward+backward"] = (fused_fwd_bwd, eager_fwd_bwd)
    # Bytes a single fused pass must move, and the model FLOPs (3 GEMMs forward, 8 backward
    # with the gate activations recomputed, 2 M d^2 FLOP each).
    fwd_bytes = 2 * M * d * e + 3 * d * d * e
    bwd_bytes = 3 * M * d * e + 6 * d * d * e  # read V, G; write grad_v; read weights, write their grads
    flops = {"forward": 6 * M * d * d, "forward+backward": 22 * M * d * d}
    nbytes = {"forward": fwd_bytes, "forward+backward": fwd_bytes + bwd_bytes}

    record: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "M": M,
        "d": d,
        "dtype": a.dtype,
        "peak_gbs": peak_gbs,
        "peak_tflops": peak_tflops,
        "peak_source": source,
        "errors": errors,
        "cases": {},
    }
    print(f"\n{'case':<18} {'impl':<7} {'ms':>9} {'GB/s':>8} {'%peak':>6} {'TFLOP/s':>8} {'roofline ms':>12}")
    for case, (fused, eager) in cases.items():
        row = {}
        for impl, fn in (("fused", fused), ("unfused", eager)):
            ms, samples = timer(fn, a.reps, a.warmup)
            gbs = nbytes[case] / (ms * 1e-3) / 1e9
            tflops = flops[case] / (ms * 1e-3) / 1e12
            frac = gbs / peak_gbs if peak_gbs else None
            roof_ms = (
                max(
                    nbytes[case] / (peak_gbs * 1e9) if peak_gbs else 0.0,
                    flops[case] / (peak_tflops * 1e12) if peak_tflops else 0.0,
                )
                * 1e3
            )
            row[impl] = {"ms": ms, "ms_samples": samples, "gbs": gbs, "frac_peak_bw": frac, "tflops": tflops}
            print(
                f"{case:<18} {impl:<7} {ms:9.3f} {gbs:8.0f} "
                f"{(f'{100 * frac:5.1f}%' if frac is not None else '    -'):>6} {tflops:8.1f} "
                f"{(f'{roof_ms:.3f}' if roof_ms else '-'):>12}"
            )
        row["speedup"] = row["unfused"]["ms"] / row["fused"]["ms"]
        row["bytes"], row["flops"] = nbytes[case], flops[case]
        record["cases"][case] = row
        print(f"{case:<18} speedup fused vs unfused: {row['speedup']:.2f}x")
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    fwd = record["cases"]["forward"]
    goals = {"forward speedup >= 3x": fwd["speedup"] >= 3.0}
    if fwd["fused"]["frac_peak_bw"] is not None:
        goals["forward >= 70% of peak bandwidth"] = fwd["fused"]["frac_peak_bw"] >= 0.70
    record["goals"] = goals
    print()
    for goal, ok in goals.items():
        print(f"GOAL {goal}: {'met' if ok else 'MISSED'}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(record, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
