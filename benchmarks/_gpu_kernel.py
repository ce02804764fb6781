"""The GPU suite's part (a): the kha::mlp_value kernels against the unfused formula and torch.compile of it.

For each head size d and dtype, on V of (M, d) rows: errors of the kernels and of the compiled formula
against an fp32 formula; then, timed in turns, the forward (kernel / eager formula / compiled formula),
the op's backward alone (kernel / compiled backward formula: the two paths the op can take) and forward
+ backward (kernel forward and backward, as the op's autograd runs them / autograd of the eager formula
/ autograd through the compiled formula). Bytes: the fewest a fused pass must move (read V, write y;
the backward reads V and the output gradient and writes grad_v; weights once); FLOPs: 6 M d^2 forward,
16 M d^2 backward (the op's recompute), 12 M d^2 for autograd of the formula (it saves a and g).
"""

from __future__ import annotations

import torch

from kha_compile.kernels import mlp_value_triton_backward, mlp_value_triton_forward
from kha_compile.ops.mlp_value import mlp_value_backward_reference, mlp_value_reference
from kha_compile.ops.mlp_value_path import recorded_key

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}  # max |got - fp32 formula| / max |fp32 formula|
FASTER_BY = 1.03  # the compiled formula is recorded as the op's path only if this much faster (noise)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def copy_bandwidth(run, nbytes: int) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (bytes read + written), the measured memory ceiling."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=run.device).normal_()
    dst = torch.empty_like(src)
    ms = run.times_ms({"copy": lambda: dst.copy_(src)}, repeats=5, inner=5)["copy"]
    return 2 * nbytes / (ms * 1e-3) / 1e9


def run_kernel_part(run, rec: dict, M: int, dims: list[int], dtypes: list[str], peaks: tuple, repeats: int, inner: int):
    """Measure each (d, dtype) case into ``rec["cases"]``; the op's dispatch choices into ``rec["dispatch"]``."""
    peak_gbs, peak_tflops, _ = peaks
    if run.device.type == "cuda":
        rec["copy_gbs"] = copy_bandwidth(run, 2 << 30)
        run.say(f"device-to-device copy: {rec['copy_gbs']:.0f} GB/s (read + written)")
    compile_ = lambda fn: torch.compile(fn, dynamic=True, backend=run.compile_backend)  # noqa: E731
    fwd_c, bwd_c = compile_(mlp_value_reference), compile_(mlp_value_backward_reference)  # the op's settings
    rec["cases"], rec["dispatch"] = [], []
    for d in dims:
        for dname in dtypes:
            if run.left() < 0:
                run.say(f"kernel d={d} {dname}: skipped (time cap)")
                rec["cases"].append({"d": d, "dtype": dname, "skipped": "time cap"})
                continue
            case = {"d": d, "dtype": dname, "M": M}
            rec["cases"].append(case)
            _one_case(run, case, M, d, DTYPES[dname], fwd_c, bwd_c, peak_gbs, peak_tflops, repeats, inner)
            if "times_ms" in case:
                rec["dispatch"] += _dispatch(run, case, d, DTYPES[dname])
            run.write()


def _one_case(run, case, M, d, dtype, fwd_c, bwd_c, peak_gbs, peak_tflops, repeats, inner) -> None:
    dev = run.device
    gen = torch.Generator(device=dev).manual_seed(d)
    v = torch.randn(M, d, device=dev, dtype=dtype, generator=gen)
    ws = [(torch.randn(d, d, device=dev, generator=gen) / d**0.5).to(dtype) for _ in range(3)]
    g = torch.randn(M, d, device=dev, dtype=dtype, generator=gen)
    run.say(f"kernel d={d} {case['dtype']}: checking (and autotuning) ...")
    # correctness against the fp32 formula (autograd for the gradients)
    leaves = [t.float().requires_grad_() for t in (v, *ws)]
    y32 = mlp_value_reference(*leaves)
    want = (y32.detach(), *torch.autograd.grad(y32, leaves, g.float()))
    del y32, leaves
    got = {
        "kernel forward": mlp_value_triton_forward(v, *ws),
        "compiled forward": fwd_c(v, *ws),
    }
    grads = mlp_value_triton_backward(g, v, *ws)
    cgrads = bwd_c(g, v, *ws)
    errs = {k: rel_err(y, want[0]) for k, y in got.items()}
    for name, x, cx, w in zip(("grad_v", "grad_w_up", "grad_w_gate", "grad_w_down"), grads, cgrads, want[1:]):
        errs[f"kernel {name}"] = rel_err(x, w)
        errs[f"compiled {name}"] = rel_err(cx, w)
    del got, grads, cgrads, want
    case["errors"] = errs
    case["errors_ok"] = all(e < TOL[dtype] for e in errs.values())
    run.say(f"  max error vs the fp32 formula: {max(errs.values()):.1e} (tolerance {TOL[dtype]:.0e})")
    if not case["errors_ok"]:
        run.say(f"  MISMATCH: {errs}")

    v_req = v.detach().requires_grad_()
    w_req = [w.detach().requires_grad_() for w in ws]
    inputs = (v_req, *w_req)

    def kernel_fwd_bwd():  # what the op's autograd runs: the forward kernel, then the backward kernel
        mlp_value_triton_forward(v, *ws)
        return mlp_value_triton_backward(g, v, *ws)

    def autograd(fn):
        return lambda: torch.autograd.grad(fn(*inputs), inputs, g)

    groups = {
        "forward": {
            "kernel": lambda: mlp_value_triton_forward(v, *ws),
            "eager": lambda: mlp_value_reference(v, *ws),
            "compiled": lambda: fwd_c(v, *ws),
        },
        "backward": {
            "kernel": lambda: mlp_value_triton_backward(g, v, *ws),
            "compiled": lambda: bwd_c(g, v, *ws),
        },
        "forward+backward": {
            "kernel": kernel_fwd_bwd,
            "eager": autograd(mlp_value_reference),
            "compiled": autograd(fwd_c),
        },
    }
    e = v.element_size()
    w_bytes = 3 * d * d * e
    nbytes = {
        "forward": 2 * M * d * e + w_bytes,
        "backward": 3 * M * d * e + 2 * w_bytes,
        "forward+backward": 5 * M * d * e + 3 * w_bytes,
    }
    flops = {"forward": 6 * M * d * d, "backward": 16 * M * d * d, "forward+backward": 22 * M * d * d}
    case["times_ms"], case["gbs"], case["frac_peak_bw"], case["ratios"] = {}, {}, {}, {}
    for group, fns in groups.items():
        with torch.no_grad() if group != "forward+backward" else torch.enable_grad():
            ms = run.times_ms(fns, repeats, inner)
        case["times_ms"][group] = ms
        case["gbs"][group] = {k: nbytes[group] / (t * 1e-3) / 1e9 for k, t in ms.items()}
        if peak_gbs:
            case["frac_peak_bw"][group] = {k: x / peak_gbs for k, x in case["gbs"][group].items()}
        case["ratios"][group] = {f"{k} / kernel": t / ms["kernel"] for k, t in ms.items() if k != "kernel"}
        roof = max(
            nbytes[group] / (peak_gbs * 1e9) if peak_gbs else 0,
            flops[group] / (peak_tflops * 1e12) if peak_tflops else 0,
        )
        case.setdefault("roofline_ms", {})[group] = roof * 1e3
        row = "  ".join(
            f"{k} {t:8.3f} ms {case['gbs'][group][k]:6.0f} GB/s"
            + (f" {100 * case['frac_peak_bw'][group][k]:5.1f}%" if peak_gbs else "")
            for k, t in ms.items()
        )
        speed = ", ".join(f"{k.split(' /')[0]}/kernel {r:.2f}x" for k, r in case["ratios"][group].items())
        run.say(f"  {group:16s} {row}  | {speed} | roofline {roof * 1e3:.3f} ms")


def _dispatch(run, case, d: int, dtype: torch.dtype) -> list[dict]:
    """The op's path per direction: the compiled formula where it beat the kernel by FASTER_BY, else the kernel."""
    name = torch.cuda.get_device_name(run.device) if run.device.type == "cuda" else "cpu (smoke)"
    out = []
    for direction, group in (("forward", "forward"), ("backward", "backward")):
        ms = case["times_ms"][group]
        path = "compiled" if ms["compiled"] * FASTER_BY < ms["kernel"] else "kernel"
        entry = {
            "direction": direction,
            "d": d,
            "dtype": str(dtype).removeprefix("torch."),
            "path": path,
            "kernel_ms": ms["kernel"],
            "compiled_ms": ms["compiled"],
            "recorded_key": list(recorded_key(direction, name, d, dtype)),
        }
        out.append(entry)
        run.say(
            f"  dispatch {direction} d={d} {entry['dtype']}: {path} "
            f"(kernel {ms['kernel']:.3f} ms, compiled formula {ms['compiled']:.3f} ms)"
        )
    return out
