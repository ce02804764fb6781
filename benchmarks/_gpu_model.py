"""The GPU suite's parts (b) and (c): a Llama-style model's training step and inference, with and without KHA.

(b) A training step (bf16 autocast, fused AdamW, loss on the next token) of the model without KHA, with
linear KHA on q, k, v and with MLP-value KHA on v (trained-like KHA weights), each eager and with each
decoder layer compiled by torch.compile (regional compilation; the embedding, the head and the loss
stay eager), all six timed in turns in one process; eager runs the same compiled modules under
``torch.compiler.set_stance("force_eager")``. Beside each time ratio, the FLOP ratio of the step
counted by ``FlopCounterMode`` on the meta device (kha::mlp_value counts by its registered formula).
The batch halves after an out-of-memory error until it fits.

(c) Inference in bf16 (eager, KV cache) of the model without KHA and with MLP-value: the prefill of
one prompt and the time per generated token after it, in turns; and the logits of the MLP-value model
through the op's default path against the eager formula (``KHA_MLP_VALUE_PATH=formula``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
from _common import llama, llama_config, step_flop_ratios, with_kha
from _gpu import free, is_oom

import kha_compile as kc
from kha_compile.ops.mlp_value_path import ENV

TRAIN_VARIANTS = {
    "none": None,
    "linear-qkv": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "mlp-v": kc.KHAConfig(v="mlp"),
}
KHA_SCALE = 0.05  # KHA weights moved off their identity init by this much noise


def model_config(shape: dict):
    return llama_config(
        shape["hidden"],
        shape["inter"],
        shape["layers"],
        shape["heads"],
        shape["kv_heads"],
        shape["vocab"],
        shape["head_dim"],
    )


def _variants(cfg, names, device):
    base = llama(cfg, device)
    return {n: base if TRAIN_VARIANTS[n] is None else with_kha(base, TRAIN_VARIANTS[n], KHA_SCALE) for n in names}


def run_train_part(run, rec: dict, shape: dict, repeats: int) -> None:
    """Part (b): step times of each variant, eager and compiled, in turns; FLOP ratios beside them."""
    cfg = model_config(shape)
    seq, batch = shape["seq"], shape["batch"]
    flops = step_flop_ratios(cfg, TRAIN_VARIANTS, batch, seq)
    rec["flop_ratio"] = flops
    run.say("FLOP ratio of a step (meta device): " + ", ".join(f"{k} {v:.4f}" for k, v in flops.items()))
    while True:
        try:
            _train(run, rec, cfg, seq, batch, repeats)
            return
        except Exception as e:
            if not is_oom(e) or batch == 1:
                raise
            run.say(f"out of memory at batch {batch}; halving it")
        batch //= 2
        free(run.device)  # after the except block: its traceback held the models


def _train(run, rec, cfg, seq, batch, repeats) -> None:
    dev = run.device
    models = _variants(cfg, list(TRAIN_VARIANTS), dev)
    rec["params"] = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    rec["batch"], rec["seq"], rec["tokens_per_step"] = batch, seq, batch * seq
    run.say(f"model: {rec['params']['none'] / 1e6:.0f}M parameters; batch {batch} x seq {seq}")
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    amp = torch.bfloat16
    steps = {}
    for name, model in models.items():
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

        def step(model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=amp):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()

        steps[name] = step
        for layer in model.model.layers:
            layer.compile(backend=run.compile_backend)

    eager_ctx = lambda: torch.compiler.set_stance("force_eager")  # noqa: E731
    fns = {}
    for name, step in steps.items():
        with eager_ctx():
            step()  # eager first: an OOM shows here, before any compile
        fns[f"{name} eager"] = lambda step=step: _in(eager_ctx(), step)
    run.sync()
    rec["peak_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None
    rec["compile_s"], rec["compile_errors"] = {}, {}
    for name, step in steps.items():
        if run.left() < 0:
            rec["compile_errors"][name] = "skipped: time cap"
            continue
        t = time.perf_counter()
        try:
            step()
            step()
            run.sync()
        except Exception as e:
            if is_oom(e):
                raise
            rec["compile_errors"][name] = f"{type(e).__name__}: {str(e)[:400]}"
            run.say(f"{name} compiled: FAILED ({rec['compile_errors'][name][:200]})")
            continue
        rec["compile_s"][name] = round(time.perf_counter() - t, 1)
        run.say(f"{name}: compiled in {rec['compile_s'][name]} s")
        fns[f"{name} compiled"] = step
    ms = run.times_ms(fns, repeats, inner=1, warmup=1)
    rec["times_ms"] = ms
    rec["time_ratio"] = {}
    for key, t in ms.items():
        name, mode = key.split(" ")
        base = ms.get(f"none {mode}")
        ratio = t / base if base else None
        rec["time_ratio"][key] = ratio
        tok_s = batch * seq / (t * 1e-3)
        run.say(
            f"  {key:20s} {t:9.2f} ms/step {tok_s:10.0f} tok/s"
            + (f"  time ratio {ratio:.4f}  FLOP ratio {flops_of(rec, name):.4f}" if ratio else "")
        )
    del models, steps, fns


def flops_of(rec, name):
    return rec["flop_ratio"].get(name, float("nan"))


def _in(ctx, fn):
    with ctx:
        return fn()


def run_infer_part(run, rec: dict, shape: dict, prompt: int, new_tokens: int, repeats: int) -> None:
    """Part (c): prefill and per-token decode, no KHA against MLP-value, bf16, eager, in turns."""
    dev = run.device
    cfg = model_config(shape)
    models = {n: m.to(torch.bfloat16).eval() for n, m in _variants(cfg, ["none", "mlp-v"], dev).items()}
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), device=dev)
    rec["prompt"], rec["new_tokens"], rec["batch"] = prompt, new_tokens, 1
    with torch.inference_mode():
        got = models["mlp-v"](input_ids=ids).logits.float()
        with _env(ENV, "formula"):
            want = models["mlp-v"](input_ids=ids).logits.float()
        rec["mlp_logits_vs_formula"] = ((got - want).abs().max() / want.abs().max()).item()
        run.say(
            f"MLP-value model, op's path vs the eager formula: max rel. logits difference {rec['mlp_logits_vs_formula']:.1e}"
        )
        del got, want
        prefill = {n: (lambda m=m: m(input_ids=ids, use_cache=True)) for n, m in models.items()}
        rec["prefill_ms"] = run.times_ms(prefill, repeats, inner=1, warmup=1)
        decode = {n: [] for n in models}
        for _ in range(repeats):
            for n, m in models.items():
                decode[n].append(_decode_ms(run, m, ids, new_tokens))
        rec["decode_ms_per_token"] = {n: statistics.median(v) for n, v in decode.items()}
    for what in ("prefill_ms", "decode_ms_per_token"):
        base = rec[what]["none"]
        rec[what.replace("_ms", "_ratio").replace("_per_token", "")] = rec[what]["mlp-v"] / base
        run.say(
            f"  {what:20s} none {base:8.3f}  mlp-v {rec[what]['mlp-v']:8.3f}  ratio {rec[what]['mlp-v'] / base:.4f}"
        )
    del models


def _decode_ms(run, model, ids, new_tokens) -> float:
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    run.sync()
    t = time.perf_counter()
    for _ in range(new_tokens):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    run.sync()
    return (time.perf_counter() - t) / new_tokens * 1e3


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
