"""A QLoRA training step with KHA against the same step without, on CPU: bitsandbytes 4-bit base, LoRA, AdamW.

A Llama (hidden 512, 2 layers, 4 q / 2 kv heads of 128) with random weights is saved once and loaded
twice in 4-bit (bitsandbytes nf4, its CPU backend); one copy gets KHA-MLP on v (``kc.apply``), both get
PEFT's ``prepare_model_for_kbit_training`` and LoRA r=8 on q_proj and v_proj (``kc.mark_trainable`` for
KHA), and one step is forward, backward and the fused AdamW step (the Trainer's default optimizer) on the
trainable tensors. The two steps are timed in turns in one process (medians), so the ratio is side by
side. The load average is printed: the machine is shared.

    python benchmarks/qlora_step.py [--repeats 8] [--seq 256] [--batch 2] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch
from _common import add_threads_arg, apply_threads, interleaved_times, llama, llama_config, write_json

import kha_compile as kc

CFG = kc.KHAConfig(v="mlp")


def qlora(path: str, kha: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=qc)
    if kha:
        kc.apply(model, CFG)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    tuned = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    if kha:
        kc.mark_trainable(tuned)
    return tuned.train()


def step_fn(model: torch.nn.Module, ids: torch.Tensor):
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def step():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    cfg = llama_config(512, 1376, 2, 4, 2, vocab=8192)
    with tempfile.TemporaryDirectory() as tmp:
        llama(cfg).save_pretrained(tmp)
        variants = {"qlora": qlora(tmp, kha=False), "qlora+kha-mlp": qlora(tmp, kha=True)}
    trainable = {k: sum(p.numel() for p in m.parameters() if p.requires_grad) for k, m in variants.items()}
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    load_before = os.getloadavg()[0]
    times = interleaved_times({k: step_fn(m, ids) for k, m in variants.items()}, args.repeats)
    load_after = os.getloadavg()[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"QLoRA step (bitsandbytes nf4, LoRA r=8 on q_proj/v_proj, fused AdamW), Llama hidden 512, 2 layers, "
        f"4 q / 2 kv heads of 128, seq {args.seq} x batch {args.batch}; {torch.get_num_threads()} threads; "
        f"{args.repeats} steps each, in turns; load average {load_before:.2f} -> {load_after:.2f}"
    )
    print(
        f"  {'variant':14s} {'median ms':>10s} {'min ms':>9s} {'time ratio':>11s} {'min ratio':>10s} {'trainable':>10s}"
    )
    record: dict = {"seq": args.seq, "batch": args.batch, "load_avg": [load_before, load_after]}
    for name, m_s in med.items():
        ratio, low = m_s / med["qlora"], min(times[name]) / min(times["qlora"])
        print(
            f"  {name:14s} {m_s * 1e3:10.1f} {min(times[name]) * 1e3:9.1f} {ratio:11.4f} {low:10.4f} {trainable[name]:10d}"
        )
        record[name] = {
            "median_s": m_s,
            "min_s": min(times[name]),
            "time_ratio": ratio,
            "min_ratio": low,
            "trainable": trainable[name],
        }
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
