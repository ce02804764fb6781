"""Every training regime LLM users run, pass-made KHA against KHA written by hand (tests/handwritten.py).

Both sides start from the same perturbed weights, train on the same batches with the same optimizer,
and must give the same per-step losses, no_grad eval losses between steps, no_grad logits afterwards
and greedy ``generate`` tokens (tests/regimes.py). fp32 within 1e-5 relative; bf16 and fp16 within
a bound measured in the same test by training the hand-written model again with its sums in
another order. Regimes: fused, foreach and for-loop AdamW; gradient accumulation with no_grad
evaluation between steps; gradient checkpointing (transformers' and ``torch.utils.checkpoint``
around blocks); autocast bf16 and fp16 (with GradScaler); torch.compile with Inductor and with
``"kha"``. FSDP2 with mixed precision and DDP are in tests/parallel/test_regimes_distributed.py,
``Trainer(bf16=True)`` in tests/integrations/test_trainer_bf16.py.

Each configuration runs on a GQA model with QK-norm (qwen3) and one without (llama), for linear
KHA on q, k, v and for MLP-value. The comparisons can fail: leaving one role out of the
hand-written model makes each kind of check fail (``test_a_role_left_out_is_caught``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kha_compile as kc
from regimes import KINDS, Bound, Regime, compare, noise_bound, pair, train

ARCHS = ("llama", "qwen3")
EAGER = (
    Regime("adamw-fused", optim="fused"),
    Regime("adamw-foreach", optim="foreach"),
    Regime("adamw-forloop", optim="forloop"),
    Regime("accumulate-eval", accum=2),
    Regime("checkpointing-hf", checkpoint="hf"),
    Regime("checkpointing-torch", checkpoint="torch"),
    Regime("autocast-bf16", amp=torch.bfloat16),
    Regime("autocast-fp16-scaler", amp=torch.float16, scaler=True),
    Regime("bf16-weights", cast=torch.bfloat16),  # model.to(torch.bfloat16), no autocast
)
# each kind with each backend once, each architecture with both kinds and both backends
COMPILED = (
    ("llama", "linear", "kha"),
    ("qwen3", "linear", "inductor"),
    ("qwen3", "mlp", "kha"),
    ("llama", "mlp", "inductor"),
)


def _run(arch: str, kind: str, regime: Regime, drop: tuple[str, ...] = ()):
    made, hand, _ = pair(arch, KINDS[kind], drop=drop)
    got, want = train(made, regime), train(hand.model, regime)
    return got, want, noise_bound(want, regime, arch, KINDS[kind], drop=drop)


@pytest.mark.parametrize("regime", EAGER, ids=lambda r: r.name)
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("arch", ARCHS)
def test_regime_equals_kha_written_by_hand(arch, kind, regime):
    got, want, bound = _run(arch, kind, regime)
    compare(got, want, bound, f"{arch}, {kind} KHA, {regime.name}")


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize(("arch", "kind", "backend"), COMPILED)
def test_compiled_training_equals_kha_written_by_hand(arch, kind, backend):
    """torch.compile'd training (and no_grad evaluation) of the pass-made model against the eager hand model."""
    torch._dynamo.reset()
    made, hand, _ = pair(arch, KINDS[kind])
    got = train(made, Regime(backend, compile=backend))
    want = train(hand.model, Regime("eager"))
    compare(got, want, Bound.fp32(), f"{arch}, {kind} KHA, torch.compile backend {backend!r}")
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("kind", "drop", "regime"),
    [
        ("linear", ("q",), EAGER[0]),
        ("linear", ("k",), EAGER[6]),
        ("linear", ("v",), EAGER[7]),
        ("mlp", ("v",), EAGER[0]),
        ("mlp", ("v",), EAGER[6]),
    ],
    ids=lambda x: x.name if isinstance(x, Regime) else str(x),
)
def test_a_role_left_out_is_caught(kind, drop, regime):
    """The hand-written model without one role's KHA: the comparison fails, in fp32 and under autocast."""
    got, want, bound = _run("qwen3", kind, regime, drop=drop)
    with pytest.raises(AssertionError, match=r"apart|greedy tokens differ"):
        compare(got, want, bound, f"{kind} KHA without {drop} in the reference, {regime.name}")


@pytest.mark.parametrize("amp", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("arch", ARCHS)
def test_identity_at_init_is_exact_under_autocast_and_checkpointing(arch, kind, amp):
    """Right after apply, loss and gradients of every original weight equal the untouched model's exactly."""
    made, _, untouched = pair(arch, KINDS[kind], seed=None)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (made, untouched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with torch.autocast("cpu", dtype=amp or torch.bfloat16, enabled=amp is not None):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".kha." not in f".{n}"}
        outs.append((out.logits, grads))
    (a, ga), (b, gb) = outs
    assert a.dtype == (amp or torch.float32)
    assert torch.equal(a, b)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA autocast, GradScaler, Triton)")
@pytest.mark.parametrize(
    "regime",
    [Regime("cuda-autocast-bf16", amp=torch.bfloat16), Regime("cuda-fp16-gradscaler", amp=torch.float16, scaler=True)],
    ids=lambda r: r.name,
)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cuda_mixed_precision_equals_kha_written_by_hand(kind, regime):
    """On CUDA (MLP-value through the fused Triton kernels), bf16 autocast and fp16 with GradScaler."""
    made, hand, _ = pair("qwen3", KINDS[kind], device="cuda")
    got, want = train(made, regime), train(hand.model, regime)
    compare(got, want, noise_bound(want, regime, "qwen3", KINDS[kind]), f"cuda, {kind} KHA, {regime.name}")
    made, hand, _ = pair("qwen3", KINDS[kind], device="cuda", drop=("v",))
    got, want = train(made, regime), train(hand.model, regime)
    with pytest.raises(AssertionError, match=r"apart|greedy tokens differ"):
        compare(got, want, noise_bound(want, regime, "qwen3", KINDS[kind], drop=("v",)))


def test_kha_carriers_are_what_the_hand_model_is_compared_with():
    """The pass-made side really carries kha_compile's KHA (and the hand side none of it)."""
    made, hand, _ = pair("qwen3", KINDS["mlp"])
    assert len(kc.inspect(made).sites) == 2
    assert not any(".kha." in f".{n}" for n, _ in hand.model.named_parameters())
    assert sum(".hand_kha." in n for n, _ in hand.model.named_parameters()) == 2 * 3
