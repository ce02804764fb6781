"""vLLM serving of a KHA model: time per output token and throughput, MLP-value / no KHA and folded linear / no KHA.

One Llama shape where attention and the projections carry the cost (hidden 1024, 16 query / 4 kv heads of
64, FFN 2816, 6 layers, vocab 8192: 102M parameters, float32, random weights), saved three times with
transformers' ``save_pretrained``: without KHA; with linear q, k, v KHA folded by ``kc.fold`` (a vanilla
model); with MLP-value KHA (served through kha_compile's vLLM plugin). KHA weights are moved off identity
first. vLLM (CPU build, in the environment ``scripts/vllm_env.sh`` builds) holds the three models at once in
one process and runs every workload on them in turns, medians over ``--repeats``:

- time per output token (TPOT): one 512-token prompt, 32 new tokens, minus the prefill of the same prompt
  (both timed in the same turn);
- throughput: 8 prompts of 256 tokens, 32 new tokens each, output tokens per second.

Each ratio is the median over repeats of the variant's figure over the model without KHA's in the same
turn (paired: a burst of load from other processes on a shared machine hits both); the best (minimum)
times are printed too. Goals: MLP-value <= 1.02x the model without KHA (its FLOPs are 1.004x, printed),
folded linear = 1.00x (the same graph as the model without KHA, with other weights: its ratio is the
noise). vLLM runs compiled (its default) unless ``--eager``.

    python benchmarks/serve.py [--repeats 15] [--eager] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch
from _common import with_kha, write_json

import kha_compile as kc

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAPE = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4
)
HEAD_DIM, VOCAB = 64, 8192
DECODE_PROMPT, BATCH, BATCH_PROMPT, NEW = 512, 8, 256, 32
VARIANTS = {
    "no-kha": None,
    "folded-linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "mlp-value": kc.KHAConfig(),
}


def save_models(root: pathlib.Path) -> dict[str, str]:
    """The three variants saved as users save them; name -> directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**SHAPE, head_dim=HEAD_DIM, vocab_size=VOCAB)).eval()
    out = {}
    for name, cfg in VARIANTS.items():
        model = base if cfg is None else with_kha(base, cfg, scale=0.05)
        if cfg is not None and cfg.foldable:
            kc.fold(model)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def flop_ratio() -> float:
    """Multiply-adds per decoded token at the decode context, MLP-value / no KHA (docs/method.md, "Cost")."""
    d, layers, kv, ffn = SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["num_key_value_heads"], 2816
    heads, ctx = SHAPE["num_attention_heads"], DECODE_PROMPT + NEW // 2
    proj = d * (heads * HEAD_DIM) * 2 + d * (kv * HEAD_DIM) * 2 + 3 * d * ffn  # q, o, k, v, FFN
    attn = 2 * heads * HEAD_DIM * ctx  # scores and weighted sum over the context
    base = layers * (proj + attn) + d * VOCAB
    return (base + layers * 3 * kv * HEAD_DIM * HEAD_DIM) / base


def summary(r: dict) -> dict[str, float]:
    """Median and best TPOT (ms) and throughput (output tokens/s) of one variant."""
    return {
        "tpot_ms": statistics.median(r["tpot_s"]) * 1e3,
        "best_tpot_ms": min(r["tpot_s"]) * 1e3,
        "tokens_per_s": statistics.median(r["tokens_per_s"]),
        "best_tokens_per_s": max(r["tokens_per_s"]),
        "start_s": r["start_s"],
    }


def paired(r: dict, base: dict) -> dict[str, float]:
    """Median over repeats of the variant / no-KHA ratio within each turn: TPOT, and time per token at batch 8."""
    return {
        "tpot": statistics.median(a / b for a, b in zip(r["tpot_s"], base["tpot_s"])),
        "throughput": statistics.median(b / a for a, b in zip(r["tokens_per_s"], base["tokens_per_s"])),
    }


def vllm_env() -> tuple[str, str]:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "vllm_env.sh"), "--kha"], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"the vLLM environment could not be built: {done.stderr.strip().splitlines()[-1:]}")
    python, site = done.stdout.strip().splitlines()[-2:]
    return python, site


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    python, site = vllm_env()
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        models = save_models(pathlib.Path(tmp))
        spec = {
            "models": models,
            "eager": args.eager,
            "repeats": args.repeats,
            "new_tokens": NEW,
            "max_model_len": DECODE_PROMPT + NEW + 8,
            "decode_prompt": torch.randint(3, VOCAB, (DECODE_PROMPT,), generator=gen).tolist(),
            "batch_prompts": torch.randint(3, VOCAB, (BATCH, BATCH_PROMPT), generator=gen).tolist(),
        }
        (pathlib.Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
        env.update(PYTHONPATH=site, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cmd = [python, str(ROOT / "benchmarks" / "_serve_vllm.py"), f"{tmp}/spec.json", f"{tmp}/out.json"]
        subprocess.run(cmd, check=True, env=env, cwd=tmp, stdout=sys.stderr)  # vLLM's log, not the table
        res = json.loads((pathlib.Path(tmp) / "out.json").read_text())
    record = {
        "shape": {**SHAPE, "head_dim": HEAD_DIM, "vocab": VOCAB},
        "workload": {"decode_prompt": DECODE_PROMPT, "batch": BATCH, "batch_prompt": BATCH_PROMPT, "new": NEW},
        "eager": args.eager,
        "repeats": args.repeats,
        "flop_ratio_mlp": flop_ratio(),
        "variants": {name: summary(r) for name, r in res.items()},
        "ratios": {name: paired(res[name], res["no-kha"]) for name in ("folded-linear", "mlp-value")},
        "raw": res,
    }
    mode = "eager" if args.eager else "compiled"
    print(f"vLLM {mode}; Llama {SHAPE}, head_dim {HEAD_DIM}, vocab {VOCAB}, fp32; {args.repeats} repeats in turns")
    print(
        f"{'variant':14} {'TPOT ms (median, best)':>23} {'tok/s 8x32 (median, best)':>26} {'TPOT ratio':>11} {'time/token ratio':>17}"
    )
    for name, v in record["variants"].items():
        ratio = record["ratios"].get(name, {"tpot": 1.0, "throughput": 1.0})
        print(
            f"{name:14} {v['tpot_ms']:11.2f} {v['best_tpot_ms']:11.2f} {v['tokens_per_s']:13.1f} {v['best_tokens_per_s']:12.1f}"
            f" {ratio['tpot']:11.3f} {ratio['throughput']:17.3f}"
        )
    mlp, folded = record["ratios"]["mlp-value"], record["ratios"]["folded-linear"]
    ok = "OK" if max(mlp.values()) <= 1.02 else "MISSED"
    print(
        f"MLP-value / no KHA: TPOT {mlp['tpot']:.3f}, time per token at batch 8 {mlp['throughput']:.3f} (goal <= 1.02; "
        f"FLOPs {record['flop_ratio_mlp']:.4f}) {ok}. Folded linear / no KHA: TPOT {folded['tpot']:.3f}, "
        f"batch {folded['throughput']:.3f} (goal 1.00: the same graph, so this is the noise)"
    )
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
