"""transformers' Trainer with its default optimizer and evaluation during training reports true eval losses.

The Trainer's default optimizer on this torch is ``adamw_torch_fused``, which updates parameters
without bumping ``param._version``; its evaluation runs under no_grad with more tokens per batch
than the model's width, the weight-side path. A callback keeps the weights at every evaluation; the
eval loss the Trainer reports must equal the eval loss of a fresh model loaded with those weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kha_compile as kc
from kha_compile.cli import tiny

transformers = pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments

SEQ, TRAIN, EVAL, BATCH = 24, 16, 8, 4  # 4 x 24 = 96 tokens per batch > hidden 64


class KeepWeights(TrainerCallback):
    """At each evaluation: (step, reported eval_loss, the model's state dict)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, dict[str, torch.Tensor]]] = []

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.seen.append((state.global_step, metrics["eval_loss"], state_dict))


def _data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, tiny.VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": x, "labels": x} for x in ids]


@pytest.mark.parametrize("v", ["linear", "mlp"])
def test_eval_loss_during_training_equals_a_fresh_model_with_the_same_weights(tmp_path, v):
    pristine = tiny.make("tiny-llama")
    kc.apply(pristine, kc.KHAConfig(q="linear", k="linear", v=v))
    model = copy.deepcopy(pristine).train()
    args = TrainingArguments(
        str(tmp_path),
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        learning_rate=5e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
    )
    assert args.optim == "adamw_torch_fused"  # the default optimizer, the one that does not bump _version
    keep = KeepWeights()
    train, evals = _data(TRAIN, 0), _data(EVAL, 1)
    Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, callbacks=[keep]).train()

    assert [step for step, _, _ in keep.seen] == [2, 4]
    first = keep.seen[0][2]
    assert any(not torch.equal(first[k], keep.seen[1][2][k]) for k in first if ".kha." in k)  # KHA trained
    for step, reported, state_dict in keep.seen:
        fresh = copy.deepcopy(pristine).eval()  # never run
        fresh.load_state_dict(state_dict)
        with torch.no_grad():
            losses = [
                fresh(
                    input_ids=torch.stack([e["input_ids"] for e in evals[i : i + BATCH]]),
                    labels=torch.stack([e["labels"] for e in evals[i : i + BATCH]]),
                ).loss
                for i in range(0, EVAL, BATCH)
            ]
        want = float(torch.stack(losses).mean())
        assert abs(reported - want) <= 1e-6 * max(1.0, abs(want)), f"step {step}: reported {reported}, true {want}"
