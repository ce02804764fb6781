"""``Trainer(bf16=True)``: training under autocast bf16 and ``evaluate()`` during training, both KHA kinds.

The pass-made model and KHA written by hand (tests/handwritten.py) train in two Trainers with the
same arguments (the default fused AdamW, evaluation every two steps). Their logged training losses
and evaluation losses must agree within 10x the spread measured between the hand-written model and
itself trained again with its sums in another order (half the batch per device, two accumulation
steps, MLP channels permuted). A hook checks that the projections really ran in bf16.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments

from handwritten import permute_mlp_channels
from regimes import KINDS, NOISE_FACTOR, pair

SEQ, TRAIN, EVAL, BATCH = 24, 16, 8, 4  # 4 x 24 = 96 tokens per batch > hidden 64: weight-side linear KHA


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


def _train(model, out, *, batch=BATCH, accum=1) -> tuple[list[float], list[float], set[torch.dtype]]:
    seen: set[torch.dtype] = set()
    hook = model.model.layers[0].self_attn.v_proj.register_forward_hook(lambda m, i, y: seen.add(y.dtype))
    args = TrainingArguments(
        str(out),
        bf16=True,
        use_cpu=True,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        per_device_eval_batch_size=BATCH,
        learning_rate=1e-3,
        adam_epsilon=1e-6,  # see tests/regimes.py: optimizer()
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
    )
    assert args.optim == "adamw_torch_fused"
    trainer = Trainer(model=model, args=args, train_dataset=_data(TRAIN, 0), eval_dataset=_data(EVAL, 1))
    trainer.train()
    hook.remove()
    logs = trainer.state.log_history
    return [x["loss"] for x in logs if "loss" in x], [x["eval_loss"] for x in logs if "eval_loss" in x], seen


def _gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_trainer_bf16_trains_and_evaluates_like_kha_written_by_hand(tmp_path, kind):
    made, hand, _ = pair("llama", KINDS[kind])
    train_made, eval_made, dtypes = _train(made, tmp_path / "made")
    assert dtypes == {torch.bfloat16}, f"the projections ran in {dtypes}: Trainer(bf16=True) did not autocast"
    train_hand, eval_hand, _ = _train(hand.model, tmp_path / "hand")

    _, again, _ = pair("llama", KINDS[kind])
    assert permute_mlp_channels(again.model) > 0
    train_again, eval_again, _ = _train(again.model, tmp_path / "again", batch=BATCH // 2, accum=2)
    noise = max(_gap(train_again, train_hand), _gap(eval_again, eval_hand))
    assert noise > 0, "the hand-written model gave the same losses with its sums reordered: no noise measured"

    assert len(eval_made) == 2 and len(train_made) == 4
    gap = max(_gap(train_made, train_hand), _gap(eval_made, eval_hand))
    assert gap <= NOISE_FACTOR * noise, (
        f"{kind} KHA under Trainer(bf16=True): losses {gap:.3g} apart, the hand-written model's own spread "
        f"{noise:.3g}\n  made  {train_made} {eval_made}\n  hand  {train_hand} {eval_hand}"
    )


def test_trainer_bf16_catches_a_missing_role(tmp_path):
    made, hand, _ = pair("llama", KINDS["mlp"], drop=("v",))
    train_made, eval_made, _ = _train(made, tmp_path / "made")
    train_hand, eval_hand, _ = _train(hand.model, tmp_path / "hand")
    _, again, _ = pair("llama", KINDS["mlp"], drop=("v",))
    permute_mlp_channels(again.model)
    train_again, eval_again, _ = _train(again.model, tmp_path / "again", batch=BATCH // 2, accum=2)
    noise = max(_gap(train_again, train_hand), _gap(eval_again, eval_hand))
    assert max(_gap(train_made, train_hand), _gap(eval_made, eval_hand)) > NOISE_FACTOR * noise
