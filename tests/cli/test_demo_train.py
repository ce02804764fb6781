"""kha_compile.cli.demo_train: the demo's data, schedule and trainable set."""

from __future__ import annotations

import kha_compile as kc
from kha_compile.cli import tiny
from kha_compile.cli.demo_train import TrainSpec, docstring_pairs, set_trainable


def test_docstring_pairs_are_deterministic_halves_with_a_disjoint_holdout():
    train, val = docstring_pairs()
    assert (train, val) == docstring_pairs()
    assert len(train) > 400 and len(val) > 100 and 3.5 < len(train) / len(val) < 4.5
    assert not set(train) & set(val)
    for a, b in train[:50] + val[:50]:
        assert 8 <= len(a.split()) <= 24 and 8 <= len(b.split()) <= 24


def test_eval_steps_cover_start_and_end():
    assert TrainSpec(steps=50, evals=5).eval_steps() == [0, 10, 20, 30, 40, 50]
    assert TrainSpec(steps=3, evals=5).eval_steps() == [0, 1, 2, 3]
    assert TrainSpec(steps=1, evals=5).eval_steps() == [0, 1]


def test_set_trainable_counts_base_and_kha_parameters():
    spec = TrainSpec(base_params=("attn.c_attn.",))
    plain = tiny.make("tiny-gpt2")
    model = kc.apply(tiny.make("tiny-gpt2"), kc.KHAConfig(q="linear", k="linear", v="linear"))
    base = set_trainable(plain, spec)
    with_kha = set_trainable(model, spec)
    c_attn = sum(p.numel() for n, p in plain.named_parameters() if "attn.c_attn." in n)
    assert base == {"base": c_attn, "kha": 0}
    assert with_kha == {"base": c_attn, "kha": 2 * 3 * 16 * 16}  # 2 layers x (q, k, v) x head_dim^2
    assert all(p.requires_grad == ("c_attn" in n) for n, p in model.named_parameters())
