"""GPU suite: the MLP-value kernel at the roofline, and what KHA costs a training step and inference, in one run.

Three parts, each with a time cap (a share of ``--budget``), progress printed as it goes; an
out-of-memory error, a failed compile or the cap ends that part only, and the JSON and text records
are rewritten after every part:

(a) ``kernel``: ``kha::mlp_value``'s Triton kernels for d in {64, 128}, bf16 and fp16, at M = 1,048,576
    rows, against the unfused formula (eager) and torch.compile of it, side by side: ms, GB/s, % of
    the datasheet's peak bandwidth (and a measured device-to-device copy), ratios, errors against an
    fp32 formula; and which path the op should take per direction (``kha_compile.ops.mlp_value_path``:
    the compiled formula where it beat the kernel, printed as the RECORDED entries to add).
(b) ``train``: a Llama-style model (12 layers, hidden 2048, 16 q / 4 kv heads of 128, 0.67B
    parameters, random weights), seq 2048, bf16 autocast, fused AdamW: step time without KHA, with
    linear KHA on q, k, v and with MLP-value on v, eager and torch.compile (per decoder layer), in
    turns, with the FLOP ratio beside each time ratio.
(c) ``infer``: the same model in bf16, prefill of a 2048-token prompt and per-token decode, MLP-value
    against no KHA.

Run on a machine with an NVIDIA GPU, from the repository root (about 7 minutes on an H100/H200)::

    python benchmarks/gpu_suite.py --out-dir benchmarks/results
    python benchmarks/gpu_suite.py --parts kernel --dims 128 --dtypes bf16

``--smoke`` runs the whole flow on the CPU in seconds (tiny shapes, the kernels under
TRITON_INTERPRET=1, torch.compile with the "eager" backend): it checks the script, its timings mean
nothing. Writes ``gpu_suite_<device>.json`` and ``.txt`` into ``--out-dir``. Exit status: 0 all parts
ran and every result matched its reference, 1 a mismatch, 2 no GPU here (without ``--smoke``), 3 a
part failed or hit its time cap.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kha_compile  # noqa: F401  (registers torch.ops.kha.*)

from _gpu import Run, device_peaks, slug, versions  # isort: skip
from _gpu_kernel import run_kernel_part  # isort: skip
from _gpu_model import run_infer_part, run_train_part  # isort: skip

MODEL = dict(hidden=2048, inter=5632, layers=12, heads=16, kv_heads=4, head_dim=128, vocab=32000, seq=2048, batch=4)
SMOKE_MODEL = dict(hidden=64, inter=128, layers=1, heads=4, kv_heads=2, head_dim=16, vocab=128, seq=24, batch=2)
SHARES = {"kernel": 0.40, "train": 0.45, "infer": 0.15}  # of --budget
GOALS = {"forward % of peak bandwidth": 0.70, "forward eager/kernel": 3.0, "forward+backward eager/kernel": 1.5}
TRAIN_GOAL = 1.01


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="the whole flow on the CPU with tiny shapes (checks the script)"
    )
    p.add_argument("--parts", default="kernel,train,infer", help="comma-separated, of kernel, train, infer")
    p.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
    p.add_argument("--budget", type=float, default=None, help="seconds for all parts (default 420; smoke 60)")
    p.add_argument("--m", type=int, default=None, help="rows of V in the kernel part (default 1,048,576)")
    p.add_argument("--dims", default=None, help="head sizes of the kernel part, in this order (default 128,64)")
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--batch", type=int, default=None, help="training batch (default 4 x 2048 tokens; halved on OOM)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the model (default 12)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; smoke eager)")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: the table)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_suite: no CUDA GPU is visible to torch; run it on an NVIDIA GPU, or use --smoke.", file=sys.stderr)
        return 2
    with _smoke_env(a.smoke), _dynamo_limits():
        return _main(a)


def _main(a) -> int:
    smoke = a.smoke
    device = torch.device("cpu") if smoke else torch.device("cuda")
    name = "cpu (smoke run)" if smoke else torch.cuda.get_device_name(device)
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_suite_{'smoke' if smoke else slug(name)}"
    run = Run(
        device,
        smoke,
        a.compile_backend or ("eager" if smoke else "inductor"),
        out / f"{stem}.json",
        out / f"{stem}.txt",
    )
    peaks = device_peaks(name)
    if a.peak_gbs:
        peaks = (a.peak_gbs, peaks[1], "--peak-gbs")
    budget = a.budget or (60.0 if smoke else 420.0)
    shape = dict(SMOKE_MODEL if smoke else MODEL)
    shape.update({k: v for k, v in (("batch", a.batch), ("layers", a.layers)) if v})
    run.record.update(
        suite="benchmarks/gpu_suite.py",
        smoke=smoke,
        device=_device_info(device, name),
        versions=versions(),
        peak={"gbs": peaks[0], "tflops_16bit": peaks[1], "source": peaks[2]},
        budget_s=budget,
        compile_backend=run.compile_backend,
        model=shape,
    )
    run.say(f"device: {name}; " + ", ".join(f"{k} {v}" for k, v in run.record["versions"].items()))
    run.say(f"peak memory bandwidth {peaks[0]} GB/s, {peaks[1]} TFLOP/s dense 16-bit ({peaks[2]})")
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    M = a.m or (64 if smoke else 1 << 20)
    dims = [int(x) for x in (a.dims or ("16" if smoke else "128,64")).split(",")]
    reps = (1, 1) if smoke else (10, 10)
    for part in parts:
        cap = budget * SHARES[part] / sum(SHARES[p] for p in parts)  # the budget shared by the parts asked for
        with run.part(part, cap) as rec:
            if part == "kernel":
                run_kernel_part(run, rec, M, dims, a.dtypes.split(","), peaks, repeats=reps[0], inner=reps[1])
            elif part == "train":
                run_train_part(run, rec, shape, repeats=1 if smoke else 8)
            elif part == "infer":
                prompt, new = (shape["seq"], 4) if smoke else (2048, 32)
                run_infer_part(run, rec, shape, prompt, new, repeats=1 if smoke else 5)
    return _summary(run)


def _summary(run) -> int:
    """GOAL lines, the RECORDED entries for the op's dispatch, the exit status."""
    parts = run.record.get("parts", {})
    run.say("== summary")
    goals: dict[str, bool] = {}
    kernel = parts.get("kernel", {})
    for case in kernel.get("cases", []):
        if "times_ms" not in case:
            continue
        tag = f"d={case['d']} {case['dtype']}"
        fwd = case["frac_peak_bw"].get("forward", {}).get("kernel")
        if fwd is not None:
            goals[f"{tag} forward >= 70% of peak bandwidth ({100 * fwd:.0f}%)"] = (
                fwd >= GOALS["forward % of peak bandwidth"]
            )
        for group, goal in (("forward", 3.0), ("forward+backward", 1.5)):
            r = case["ratios"][group]["eager / kernel"]
            goals[f"{tag} {group} >= {goal}x the unfused formula ({r:.2f}x)"] = r >= goal
            c = case["ratios"][group]["compiled / kernel"]
            goals[f"{tag} {group} no slower than the compiled formula ({c:.2f}x)"] = c >= 1.0
    train = parts.get("train", {})
    for key, ratio in (train.get("time_ratio") or {}).items():
        if ratio is not None and not key.startswith("none"):
            goals[f"train {key} time ratio <= {TRAIN_GOAL} ({ratio:.4f})"] = ratio <= TRAIN_GOAL
    for goal, ok in goals.items():
        run.say(f"GOAL {goal}: {'met' if ok else 'MISSED'}")
    run.record["goals"] = goals
    faster = [e for e in kernel.get("dispatch", []) if e["path"] == "compiled"]
    run.say(
        "dispatch (kha_compile/ops/mlp_value_path.py RECORDED): "
        + ("the kernels everywhere measured; nothing to record" if not faster else "add these entries:")
    )
    for e in faster:
        run.say(f'    {tuple(e["recorded_key"])!r}: "compiled",')
    mismatch = any(not c.get("errors_ok", True) for c in kernel.get("cases", []))
    mismatch |= (parts.get("infer", {}).get("mlp_logits_vs_formula") or 0) > 5e-2
    incomplete = any(p.get("status") != "done" for p in parts.values())
    run.write()
    run.say(f"wrote {run.out_json} and {run.out_txt}")
    run.out_txt.write_text("\n".join(run.lines) + "\n")
    return 1 if mismatch else 3 if incomplete else 0


def _device_info(device, name) -> dict:
    if device.type != "cuda":
        return {"name": name}
    props = torch.cuda.get_device_properties(device)
    return {
        "name": name,
        "sms": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "memory_gb": round(props.total_memory / 1e9, 1),
    }


@contextlib.contextmanager
def _smoke_env(smoke: bool):
    """TRITON_INTERPRET=1 for a smoke run (before the kernels are first built), restored after."""
    old = os.environ.get("TRITON_INTERPRET")
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _dynamo_limits():
    """Room for the recompiles of this run (one per dtype, grad mode and model variant)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: 64, "accumulated_cache_size_limit": 1024})


if __name__ == "__main__":
    sys.exit(main())
