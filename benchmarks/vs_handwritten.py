"""KHA made by the pass (``kc.apply``) against KHA written by hand into the attention code, and both against no KHA.

A Llama-style model (RMSNorm, rotary embeddings, GQA, SwiGLU MLP; PyTorch only) in three versions
with the same weights:

- ``none``: no KHA;
- ``hand``: KHA written into its attention as the spec writes it, token-side after the head split
  (``q = q @ T_q`` ... on the (B, L, H, Dh) head vectors; MLP-value ``v = 2 ((v W_up) * sigmoid(v W_gate)) W_down``);
- ``pass``: the ``none`` model with ``kc.apply(model, cfg)``, its KHA weights set to the hand model's.

Two KHA configurations: ``linear`` (q, k, v; strategy auto, which goes weight-side when a call has more
tokens than d_model) and ``mlp`` (MLP-value on v, the paper's best). The outputs of ``hand`` and
``pass`` are checked equal before timing. Timed in turns in one process (a, b, c, a, b, c, ...) on the
same batches; each cell gives the median of the per-turn ratios and its spread (half the interquartile
range of the per-turn ratios, and a 95% interval of the median from the order statistics):

- ``eager-train``: train step (forward, cross-entropy, backward, fused AdamW);
- ``eager-train-bf16``: the same under ``torch.autocast("cpu", torch.bfloat16)`` (fp32 master weights);
- ``trainer-step``: a step as transformers' Trainer runs it (fused AdamW, gradient clipping at norm
  1.0, a linear learning-rate schedule, ``zero_grad(set_to_none=True)``);
- ``eager-infer``: inference (forward under no_grad);
- ``compile-train`` / ``compile-infer``: ``torch.compile`` with the pass-made model on backend ``"kha"``
  and ``"inductor"``, the hand-written and the no-KHA model on ``"inductor"``.

Shapes (``--shapes``): ``base`` (hidden 512, 8 q / 4 kv heads of 64, batch 4 x seq 256 = 1024 tokens)
and ``large`` (hidden 1024, 16 q / 4 kv heads of 64, batch 4 x seq 512 = 2048 tokens).

Prints pass-made / hand-written and hand-written / no-KHA. Goal: every eager pass / hand ratio <= 1.00
(must hold: <= 1.02) on a quiet machine, i.e. the pass costs nothing over writing KHA by hand. The load
average is printed: the machine is shared.

    python benchmarks/vs_handwritten.py [--repeats 5] [--modes eager-train,eager-infer,...] [--shapes base,large]
                                        [--threads 2] [--json benchmarks/results/vs_handwritten.json]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _common import add_threads_arg, apply_threads, interleaved_times, write_json
from torch import nn

import kha_compile as kc

SHAPES = {
    "base": dict(hidden=512, inter=1376, layers=2, heads=8, kv_heads=4, head_dim=64, vocab=1024, batch=4, seq=256),
    "large": dict(hidden=1024, inter=2752, layers=2, heads=16, kv_heads=4, head_dim=64, vocab=1024, batch=4, seq=512),
}
SHAPE = SHAPES["base"]
CONFIGS = {
    "linear": kc.KHAConfig(q="linear", k="linear", v="linear"),
    "mlp": kc.KHAConfig(v="mlp"),
}
MODES = ("eager-train", "eager-train-bf16", "trainer-step", "eager-infer", "compile-train", "compile-infer")
EAGER_MODES = ("eager-train", "eager-train-bf16", "trainer-step", "eager-infer")
GOAL, MUST = 1.00, 1.02


# --------------------------------------------------------------------------------------------
# The model: Llama-style, with optional hand-written KHA in its attention
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, H, L, Dh), halves rotated (Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    """GQA self-attention; ``kha`` = None | "linear" (q, k, v) | "mlp" (v): KHA written by hand."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, kha: str | None) -> None:
        super().__init__()
        self.h, self.hkv, self.dh, self.kha = heads, kv_heads, head_dim, kha
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        eye = torch.eye(head_dim)
        if kha == "linear":  # one matrix per role, shared by every head of that role
            self.t_q, self.t_k, self.t_v = (nn.Parameter(eye.clone()) for _ in range(3))
        elif kha == "mlp":
            self.w_up, self.w_gate, self.w_down = (nn.Parameter(w) for w in (eye.clone(), 0 * eye, eye.clone()))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.h, self.dh)  # (B, L, H, Dh)
        k = self.k_proj(x).view(B, L, self.hkv, self.dh)  # (B, L, Hkv, Dh)
        v = self.v_proj(x).view(B, L, self.hkv, self.dh)  # (B, L, Hkv, Dh)
        if self.kha == "linear":  # token-side, after the head split (docs/method.md: Q~ = Q T^Q, ...)
            q, k, v = q @ self.t_q, k @ self.t_k, v @ self.t_v
        elif self.kha == "mlp":  # V~ = 2 ((V W_up) * sigmoid(V W_gate)) W_down
            v = (2.0 * (v @ self.w_up) * torch.sigmoid(v @ self.w_gate)) @ self.w_down
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H or Hkv, L, Dh)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.h // self.hkv  # repeat_kv: (B, Hkv, L, Dh) -> (B, H, L, Dh)
        k = k[:, :, None].expand(B, self.hkv, rep, L, self.dh).reshape(B, self.h, L, self.dh)
        v = v[:, :, None].expand(B, self.hkv, rep, L, self.dh).reshape(B, self.h, L, self.dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, Dh)
        return self.o_proj(y.transpose(1, 2).reshape(B, L, self.h * self.dh))  # (B, L, hidden)


class Block(nn.Module):
    def __init__(self, s: dict, kha: str | None) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(s["hidden"]), RMSNorm(s["hidden"])
        self.attn = Attention(s["hidden"], s["heads"], s["kv_heads"], s["head_dim"], kha)
        self.gate = nn.Linear(s["hidden"], s["inter"], bias=False)
        self.up = nn.Linear(s["hidden"], s["inter"], bias=False)
        self.down = nn.Linear(s["inter"], s["hidden"], bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Token ids (B, L) -> logits (B, L, vocab)."""

    def __init__(self, s: dict, kha: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(s["vocab"], s["hidden"])
        self.blocks = nn.ModuleList(Block(s, kha) for _ in range(s["layers"]))
        self.norm = RMSNorm(s["hidden"])
        self.lm_head = nn.Linear(s["hidden"], s["vocab"], bias=False)
        inv = 1.0 / (10000.0 ** (torch.arange(0, s["head_dim"], 2).float() / s["head_dim"]))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).float()
        freqs = torch.outer(pos, self.inv_freq)  # (L, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, Dh)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# The three versions with the same weights
# --------------------------------------------------------------------------------------------


def build(kind: str, base: Llama, ids: torch.Tensor, shape: dict | None = None) -> dict[str, nn.Module]:
    """``hand`` and ``pass`` versions of ``base`` with KHA ``kind``, KHA weights off identity and equal."""
    hand = Llama(shape or SHAPE, kha=kind)
    missing, unexpected = hand.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(n.split(".")[-1].startswith(("t_", "w_")) for n in missing), missing
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained-like KHA weights
        for n in missing:
            p = hand.get_parameter(n)
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    made = copy.deepcopy(base)
    kc.apply(made, CONFIGS[kind], example_args=(ids[:, :16],))
    with torch.no_grad():
        for i, block in enumerate(made.blocks):
            src = hand.blocks[i].attn
            for name, p in block.attn.named_parameters():
                if ".kha." in f".{name}":
                    p.copy_(_hand_weight(src, name))
    with torch.no_grad():
        diff = (made(ids) - hand(ids)).abs().max().item()
    assert diff < 1e-4, f"pass-made and hand-written {kind} KHA differ by {diff}"
    return {"hand": hand, "pass": made}


def _hand_weight(attn: Attention, name: str) -> torch.Tensor:
    """The hand model's weight that the pass-made parameter ``name`` (``v_proj.kha.v.up``, ...) holds."""
    role, leaf = name.split(".kha.")[1].split(".")[:2]  # "v", "up" | "weight"
    if attn.kha == "linear":
        return getattr(attn, f"t_{role}")
    return getattr(attn, f"w_{leaf}")


# --------------------------------------------------------------------------------------------
# Timed work
# --------------------------------------------------------------------------------------------


def train_step(model: nn.Module, ids: torch.Tensor, *, amp: torch.dtype | None = None, trainer: bool = False):
    """fwd + cross-entropy + bwd + fused AdamW on ``model`` (which may be a compiled wrapper).

    ``amp``: under ``torch.autocast("cpu", amp)``. ``trainer``: as transformers' Trainer steps (gradient
    clipping at norm 1.0, a linear learning-rate schedule, ``zero_grad(set_to_none=True)`` after the step).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.0, 1.0 - i / 1e6)) if trainer else None
    target = ids.roll(-1, dims=1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            logits = model(ids)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), target.view(-1))
        loss.backward()
        if sched is not None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if sched is not None:
            sched.step()

    return step


def infer(model: nn.Module, ids: torch.Tensor):
    def call() -> None:
        with torch.no_grad():
            model(ids)

    return call


def step_of(mode: str, model: nn.Module, ids: torch.Tensor):
    """The timed call of ``mode`` on ``model``."""
    if mode.endswith("infer"):
        return infer(model, ids)
    return train_step(model, ids, amp=torch.bfloat16 if mode.endswith("bf16") else None, trainer=mode == "trainer-step")


def compiled(model: nn.Module, backend: str) -> nn.Module:
    return torch.compile(model, backend=backend, fullgraph=True)  # type: ignore[return-value]


def contenders(mode: str, kind: str, models: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """The variants a mode times: name -> module (compiled for the compile modes)."""
    if mode in EAGER_MODES:
        return {"none": models["none"], "hand": models["hand"], "pass": models["pass"]}
    return {
        "none": compiled(models["none"], "inductor"),
        "hand": compiled(models["hand"], "inductor"),
        "pass-kha": compiled(models["pass"], "kha"),
        "pass-inductor": compiled(models["pass"], "inductor"),
    }


def _iqr(xs: list[float]) -> float:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return q[2] - q[0]


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A 95% confidence interval of the median from order statistics (distribution-free)."""
    ys, n = sorted(xs), len(xs)
    half = 1.96 * math.sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return ys[lo], ys[hi]


def run_cell(mode: str, kind: str, models: dict[str, nn.Module], ids: torch.Tensor, repeats: int) -> dict:
    mods = contenders(mode, kind, models)
    start = time.perf_counter()
    fns = {name: step_of(mode, m, ids) for name, m in mods.items()}
    for fn in fns.values():  # the first call compiles: keep it out of the timings
        fn()
    warm_s = time.perf_counter() - start
    times = interleaved_times(fns, repeats, warmup=1)
    med = {k: statistics.median(v) for k, v in times.items()}
    rec: dict = {"warmup_s": warm_s, "median_ms": {k: v * 1e3 for k, v in med.items()}}
    pairs = [(p, "hand") for p in mods if p.startswith("pass")] + [("hand", "none")]
    for a, b in pairs:
        per_turn = [x / y for x, y in zip(times[a], times[b])]
        lo, hi = median_interval(per_turn)
        rec[f"{a}/{b}"] = {"ratio": statistics.median(per_turn), "iqr": _iqr(per_turn), "ci95": [lo, hi]}
    return rec


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--shapes", default="base", help=f"comma-separated, of {', '.join(SHAPES)}")
    add_threads_arg(ap)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    apply_threads(args)
    torch._dynamo.config.recompile_limit = 64  # many variants of one forward share its code object
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never a silent fall-back to eager
    modes, kinds = args.modes.split(","), args.configs.split(",")
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    record: dict = {"repeats": args.repeats, "shapes": {}, "cells": {}}
    worst_eager = 0.0
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        torch.manual_seed(0)
        base = Llama(shape)
        ids = torch.randint(
            0, shape["vocab"], (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(2)
        )
        tokens = shape["batch"] * shape["seq"]
        record["shapes"][shape_name] = shape
        print(
            f"[{shape_name}] Llama-style: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']} q / "
            f"{shape['kv_heads']} kv heads of {shape['head_dim']}, vocab {shape['vocab']}; batch {shape['batch']} x seq "
            f"{shape['seq']} = {tokens} tokens per step; {torch.get_num_threads()} threads; {args.repeats} turns per cell"
        )
        print(
            f"  {'mode':17s} {'KHA':7s} {'first s':>8s} {'none ms':>9s} {'hand ms':>9s}  {'hand / none':14s} pass / hand"
        )
        for kind in kinds:
            models = {"none": base, **build(kind, base, ids, shape)}
            for mode in modes:
                for m in models.values():
                    m.train(not mode.endswith("infer"))
                try:
                    rec = run_cell(mode, kind, models, ids, args.repeats)
                except Exception as e:  # e.g. an older kha_compile that cannot run the mode
                    print(f"  {mode:17s} {kind:7s} failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    record["cells"][f"{shape_name}/{mode}/{kind}"] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                record["cells"][f"{shape_name}/{mode}/{kind}"] = rec
                ms = rec["median_ms"]
                pass_cells = []
                for key in sorted(k for k in rec if k.startswith("pass")):
                    r = rec[key]
                    if mode in EAGER_MODES:
                        worst_eager = max(worst_eager, r["ratio"])
                    label = key.split("/")[0].replace("pass-", "").replace("pass", "eager")
                    lo, hi = r["ci95"]
                    pass_cells.append(f"{label} {r['ratio']:.3f}±{r['iqr'] / 2:.3f} [{lo:.3f}, {hi:.3f}]")
                hn = rec["hand/none"]
                print(
                    f"  {mode:17s} {kind:7s} {rec['warmup_s']:8.1f} {ms['none']:9.1f} {ms['hand']:9.1f}  "
                    f"{hn['ratio']:.3f}±{hn['iqr'] / 2:.3f}    {' | '.join(pass_cells)}",
                    flush=True,
                )
    load_after = os.getloadavg()[0]
    elapsed = time.perf_counter() - t0
    verdict = "goal met" if worst_eager <= GOAL else ("must-hold met" if worst_eager <= MUST else "MISSED")
    if not any(m in EAGER_MODES for m in modes):
        verdict = "no eager cells run"
    print(
        f"worst eager pass / hand ratio {worst_eager if verdict != 'no eager cells run' else float('nan'):.3f} (goal <= {GOAL:.2f}, must hold <= {MUST:.2f}: {verdict}); "
        f"±: half the interquartile range of the per-turn ratios, [..]: 95% interval of their median; "
        f"load average {load_before:.2f} -> {load_after:.2f}; {elapsed:.0f} s"
    )
    record.update(
        {"load_avg": [load_before, load_after], "elapsed_s": elapsed, "worst_eager_pass_over_hand": worst_eager}
    )
    write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
