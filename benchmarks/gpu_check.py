"""GPU check: MLP-value KHA through ONNX into a TensorRT engine, compared with onnxruntime.

Builds a tiny transformers Llama with MLP-value KHA (``kha_compile.apply``, weights moved off the
identity init so the check can fail), exports it
with ``kc.export_onnx`` (dynamic batch and sequence), builds a TensorRT engine per precision with
the ``kha::MLPValue`` plugin, and runs engine and onnxruntime on the example shape and on another
batch and sequence length. Prints the max differences.

Run on a machine with an NVIDIA GPU, TensorRT >= 10.7 and onnxruntime, from the repository root::

    python benchmarks/gpu_check.py                      # fp32 and fp16
    python benchmarks/gpu_check.py --precision fp32 --out /tmp/kha_gpu_check -v

Exit status: 0 all within tolerance, 1 a mismatch or a failed step, 2 no GPU / TensorRT here.
"""

import argparse
import logging
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import kha_compile
from kha_compile.core.errors import BackendUnavailableError, KHAError

log = logging.getLogger("gpu_check")

# max |engine - onnxruntime| / max |onnxruntime| per precision
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 8e-2}
SHAPES = [(2, 8), (3, 21)]  # (batch, seq): the example's, and another one
DIM_RANGES = {"batch": (1, 2, 4), "sequence": (1, 8, 64)}


def build_model():
    """(model, inputs(batch, seq) -> {name: tensor}, description): a tiny Llama with MLP-value KHA."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    kha_compile.apply(model, kha_compile.KHAConfig(v="mlp"))
    with torch.no_grad():  # move off the identity init, so the check can fail
        for name, p in model.named_parameters():
            if "kha" in name:
                p.add_(0.2 * torch.randn_like(p))

    def inputs(batch, seq):
        gen = torch.Generator().manual_seed(batch * 1000 + seq)
        return {
            "input_ids": torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen),  # (B, L)
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
        }  # (B, L)

    return model, inputs, "tiny Llama + kha_compile.apply(v='mlp')"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32,fp16", help="comma-separated engine precisions (fp32, fp16, bf16)")
    parser.add_argument(
        "--out", type=pathlib.Path, default=None, help="directory for the .onnx and .engine files (default: a temp dir)"
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )

    from kha_compile.exporters.onnx import export_onnx, onnx_summary
    from kha_compile.exporters.tensorrt import export_tensorrt, register_mlp_value_plugin, run_engine

    try:
        register_mlp_value_plugin()  # checks for tensorrt and a GPU first
    except BackendUnavailableError as e:
        print(f"gpu_check cannot run here: {e}")
        return 2
    import onnxruntime as ort

    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="kha_gpu_check_"))
    out.mkdir(parents=True, exist_ok=True)
    model, make_inputs, what = build_model()
    print(f"model: {what}; torch {torch.__version__}, GPU {torch.cuda.get_device_name()}")

    example = make_inputs(*SHAPES[0])
    onnx_path = export_onnx(model, out / "model.onnx", example_kwargs=example)
    summary = onnx_summary(onnx_path)
    print(summary)
    if summary.num_custom_nodes == 0:
        print("FAIL: the ONNX file has no kha::MLPValue node")
        return 1
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])

    failed = False
    for precision in [p.strip() for p in args.precision.split(",") if p.strip()]:
        try:
            t0 = time.perf_counter()
            engine = export_tensorrt(
                onnx_path, out / f"model_{precision}.engine", precision=precision, dim_ranges=DIM_RANGES
            )
            print(f"[{precision}] engine built in {time.perf_counter() - t0:.1f} s: {engine}")
        except KHAError as e:
            print(f"[{precision}] FAIL: {type(e).__name__}: {e}")
            failed = True
            continue
        for batch, seq in SHAPES:
            feed = make_inputs(batch, seq)
            want = session.run(None, {k: v.numpy() for k, v in feed.items()})[0]
            got = next(iter(run_engine(engine, feed).values())).float().numpy()
            diff = float(abs(got - want).max())
            rel = diff / max(float(abs(want).max()), 1e-12)
            ok = got.shape == want.shape and rel <= TOLERANCE[precision]
            failed |= not ok
            print(
                f"[{precision}] batch={batch} seq={seq}: max |TensorRT - onnxruntime| = "
                f"{diff:.3e} (relative {rel:.3e}, tolerance {TOLERANCE[precision]:.0e}) "
                f"{'ok' if ok else 'FAIL'}"
            )
    print("gpu_check:", "FAIL" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
