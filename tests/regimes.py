"""Training regimes, run the same way on a pass-made KHA model and on KHA written by hand.

:func:`pair` builds the two sides from one tiny transformers model: ``made`` (``kc.apply`` with
perturbed, trained-like KHA weights) and ``hand`` (:class:`handwritten.HandKHA` on an untouched copy,
loaded with the same weights). :func:`train` runs one :class:`Regime` on a model and records what
a user sees: the loss of every micro-batch, the no_grad eval losses between optimizer steps, the
no_grad logits after training and greedy ``generate`` tokens with the KV cache.

:func:`compare` asserts two runs agree: fp32 within 1e-5 relative; bf16 and fp16 within a bound
*measured* in the same test by running the hand-written model a second time with its MLP sums in
another order (:func:`handwritten.permute_mlp_channels`), times :data:`NOISE_FACTOR`. Greedy tokens
must be equal up to the first step where the hand-written model's top-2 logit margin is inside the
logits bound (beyond it the token is not determined at that precision).

Example::

    made, hand, untouched = pair("llama", {"v": "mlp"})
    a, b = train(made, Regime("fused")), train(hand.model, Regime("fused"))
    compare(a, b, bound=None)                     # fp32: 1e-5 relative
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

import kha_compile as kc
import zoo
from handwritten import HandKHA, permute_mlp_channels
from helpers import perturb

__all__ = ["FP32_RTOL", "KINDS", "NOISE_FACTOR", "Bound", "Regime", "Run", "compare", "noise_bound", "pair", "train"]

FP32_RTOL = 1e-5
NOISE_FACTOR = 10.0  # measured: made-vs-hand up to 7.6x one hand-vs-hand spread; a role left out: 20-800x
BATCH, SEQ, STEPS = 2, 48, 4  # 96 tokens per micro-batch > hidden 64: linear KHA runs weight-side in eager
MIN_DECIDED = 16  # greedy tokens that must be clear of the noise, of 32 prompts x 8 new tokens
LR = 1e-3  # small enough that Adam does not amplify rounding into chaos over a few steps
KINDS = {"linear": {"q": "linear", "k": "linear", "v": "linear"}, "mlp": {"v": "mlp"}}


@dataclasses.dataclass(frozen=True)
class Regime:
    """How a model is trained: optimizer, accumulation, precision, checkpointing, compilation."""

    name: str
    optim: str = "fused"  # "fused" | "foreach" | "forloop" AdamW
    accum: int = 1  # micro-batches per optimizer step; a no_grad evaluation after every step
    amp: torch.dtype | None = None  # autocast dtype (CPU or CUDA, the model's device)
    scaler: bool = False  # torch.amp.GradScaler (fp16)
    checkpoint: str | None = None  # "hf": gradient_checkpointing_enable(); "torch": torch.utils.checkpoint per block
    compile: str | None = None  # torch.compile backend of the training forward
    low_precision: bool = False  # computes in bf16/fp16 without autocast (FSDP2 MixedPrecisionPolicy)
    cast: torch.dtype | None = None  # the whole model cast to this dtype before training (model.to(dtype))
    steps: int = STEPS

    @property
    def rounds(self) -> bool:
        """True when the run computes in 16 bits: its bound is measured, not fp32's."""
        return self.amp is not None or self.low_precision or self.cast is not None


@dataclasses.dataclass
class Run:
    losses: list[float]  # every micro-batch's training loss
    evals: list[float]  # no_grad eval loss after every optimizer step
    logits: Tensor  # no_grad logits after training (fp32 weights, no autocast)
    tokens: Tensor  # greedy generate() after training
    margins: Tensor  # top-2 logit margin of every generated token


@functools.cache
def _applied(arch: str, kinds: tuple[tuple[str, str], ...]) -> nn.Module:
    """``zoo.make(arch)`` with KHA applied at identity init: traced once per process, :func:`pair` copies it."""
    made = zoo.make(arch).model.train()
    kc.apply(made, kc.KHAConfig(**dict(kinds)))
    return made


def pair(
    arch: str, kinds: dict[str, str], *, seed: int | None = 1, drop: tuple[str, ...] = (), device: str = "cpu"
) -> tuple[nn.Module, HandKHA, nn.Module]:
    """(pass-made model with perturbed KHA, the hand-written one with the same weights, an untouched copy).

    ``seed=None``: KHA at its identity init (not perturbed). ``device``: where the two models train.
    """
    untouched = zoo.make(arch).model.train()
    made = copy.deepcopy(_applied(arch, tuple(sorted(kinds.items()))))
    base = {k: v for k, v in made.state_dict().items() if ".kha." not in f".{k}"}
    assert base.keys() == untouched.state_dict().keys(), "the cached pass-made model is not of this architecture"
    assert all(torch.equal(v, untouched.state_dict()[k]) for k, v in base.items()), "zoo.make is not seeded"
    if seed is not None:
        perturb(made, seed=seed, scale=0.2)
    hand = HandKHA(copy.deepcopy(untouched), kinds, drop=drop).load(made.state_dict())
    return made.to(device), hand.to(device), untouched


def batches(n: int, seed: int = 0, *, batch: int = BATCH, seq: int = SEQ) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, zoo.VOCAB, (batch, seq), generator=gen) for _ in range(n)]


def optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    """AdamW of that implementation. eps 1e-6: at the default 1e-8 Adam turns a gradient element at
    rounding level (a sum that cancels) into a step of about ``lr`` with the sign of the rounding, so
    two exact implementations drift apart by ~1e-5 within a few steps, whichever they are."""
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "forloop": {"foreach": False, "fused": False}}
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, **flags[kind])


@contextlib.contextmanager
def block_checkpointing(model: nn.Module) -> Iterator[None]:
    """Wrap every decoder layer's forward in ``torch.utils.checkpoint`` (non-reentrant), for the run."""
    layers = model.model.layers  # type: ignore[union-attr]
    for layer in layers:
        plain = layer.forward
        layer.forward = lambda *a, _f=plain, **k: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _amp(model: nn.Module, dtype: torch.dtype | None):
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def train(
    model: nn.Module,
    regime: Regime,
    data: list[Tensor] | None = None,
    *,
    split: int = 1,
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> Run:
    """Run ``regime`` on ``model`` (trained in place) and record what a user sees.

    ``split``: each micro-batch's backward runs as ``split`` equal parts along the batch (the same
    loss and gradient, with the weight gradients' sums over tokens taken in another order).
    ``wrap``: makes the module that trains (``DistributedDataParallel(model)``, or ``fully_shard``,
    which returns the model itself); evaluation and generation use ``model``.
    """
    if regime.cast is not None:
        model.to(regime.cast)
    forward_model = wrap(model) if wrap is not None else model
    device = next(model.parameters()).device
    data = [b.to(device) for b in (data or batches(regime.steps * regime.accum))]
    probe = batches(1, seed=7)[0].to(device)
    opt = optimizer(forward_model, regime.optim)
    scaler = torch.amp.GradScaler(device.type) if regime.scaler else None
    forward = torch.compile(forward_model, backend=regime.compile) if regime.compile else forward_model
    if regime.checkpoint == "hf":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    ckpt = block_checkpointing(model) if regime.checkpoint == "torch" else contextlib.nullcontext()
    losses, evals = [], []
    model.train()
    with ckpt:
        for step in range(regime.steps):
            opt.zero_grad(set_to_none=True)
            for ids in data[step * regime.accum : (step + 1) * regime.accum]:
                parts = []
                for part in ids.chunk(split):
                    with _amp(model, regime.amp):
                        loss = forward(input_ids=part, labels=part).loss
                    parts.append(float(loss.detach()))
                    scaled = loss / (regime.accum * split)
                    (scaler.scale(scaled) if scaler else scaled).backward()
                losses.append(sum(parts) / len(parts))
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            with torch.no_grad(), _amp(model, regime.amp):
                evals.append(float(forward(input_ids=probe, labels=probe).loss))
    if regime.checkpoint == "hf":
        model.gradient_checkpointing_disable()  # type: ignore[operator]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()
        prompt = batches(1, seed=8, batch=32, seq=8)[0].to(device)
        out = model.generate(  # type: ignore[operator]
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=8,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    scores = torch.stack(out.scores, 1).float()  # (B, new, vocab)
    top2 = scores.topk(2, dim=-1).values
    return Run(losses, evals, logits, out.sequences[:, prompt.shape[1] :], top2[..., 0] - top2[..., 1])


@dataclasses.dataclass(frozen=True)
class Bound:
    """Allowed differences: per loss (absolute) and for the logits (relative to their largest value)."""

    loss: float
    logits: float
    measured: str

    @classmethod
    def fp32(cls) -> Bound:
        return cls(loss=FP32_RTOL, logits=FP32_RTOL, measured="fp32: 1e-5 relative")


def _rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _loss_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(a, b))


def noise_bound(
    hand_run: Run,
    regime: Regime,
    arch: str,
    kinds: dict[str, str],
    data: list[Tensor] | None = None,
    *,
    seed: int = 1,
    drop: tuple[str, ...] = (),
    wrap: Callable[[nn.Module], nn.Module] | None = None,
) -> Bound:
    """The hand-written model trained again with its sums in another order: the run's rounding noise.

    The second run takes each backward in two halves of the batch (the weight gradients' sums over
    tokens are split, each half rounded to the autocast dtype before they are added) and runs its
    gated MLPs with their channels permuted (:func:`permute_mlp_channels`). Both change only the
    order of sums, so what differs is the precision's rounding, measured.
    """
    if not regime.rounds:
        return Bound.fp32()
    gap = lgap = 0.0
    for perm, split in ((0, 2), (1, 4)):
        _, hand2, _ = pair(arch, kinds, seed=seed, drop=drop, device=hand_run.logits.device.type)
        assert permute_mlp_channels(hand2.model, perm) > 0, "no gated MLP to permute"
        again = train(hand2.model, regime, data, split=split, wrap=wrap)
        gap = max(gap, _loss_gap(again.losses + again.evals, hand_run.losses + hand_run.evals))
        lgap = max(lgap, _rel(again.logits, hand_run.logits))
    assert gap > 0 and lgap > 0, f"reordering the sums changed nothing under {regime.amp}: no noise measured"
    return Bound(
        loss=NOISE_FACTOR * gap,
        logits=NOISE_FACTOR * lgap,
        measured=f"{regime.amp or '16-bit parameters'}: hand-written run twice, sums reordered: losses {gap:.3g} apart, logits {lgap:.3g}",
    )


def compare(got: Run, want: Run, bound: Bound, what: str = "") -> dict[str, Any]:
    """Assert that ``got`` (pass-made) equals ``want`` (hand-written) within ``bound``; returns the gaps."""
    assert all(math.isfinite(x) for x in got.losses + got.evals), f"{what}: non-finite loss {got.losses}"
    gaps = {
        "loss": _loss_gap(got.losses + got.evals, want.losses + want.evals),
        "logits": _rel(got.logits, want.logits),
    }
    assert gaps["loss"] <= bound.loss, (
        f"{what}: per-step losses {gaps['loss']:.3g} apart (bound {bound.loss:.3g}; {bound.measured})\n"
        f"  made {got.losses} evals {got.evals}\n  hand {want.losses} evals {want.evals}"
    )
    assert gaps["logits"] <= bound.logits, (
        f"{what}: no_grad logits after training {gaps['logits']:.3g} apart (bound {bound.logits:.3g}; {bound.measured})"
    )
    # greedy tokens: equal wherever the hand-written model's choice is clear of the logits' difference
    # (the larger of the two models' measured gap and one hand-vs-hand spread), up to its first near-tie
    tie = 2 * max(gaps["logits"], bound.logits / NOISE_FACTOR) * float(want.logits.abs().max())
    decided = (want.margins > tie).int().cumprod(dim=1).bool()
    assert decided.sum() >= MIN_DECIDED, (
        f"{what}: only {int(decided.sum())} greedy tokens are decided at this precision (margins "
        f"{want.margins.max():.3g} at most, near-tie below {tie:.3g}): the probe cannot tell"
    )
    same = (got.tokens == want.tokens) | ~decided
    assert same.all(), f"{what}: greedy tokens differ\n  made {got.tokens.tolist()}\n  hand {want.tokens.tolist()}"
    gaps["decided"] = int(decided.sum())
    return gaps
