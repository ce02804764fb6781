"""lm-evaluation-harness on a KHA model: its HFLM evaluates the trained model as an instance before saving,
and the saved directory by path (from_pretrained through kha_compile's quantizer), with equal scores.

lm-evaluation-harness's tasks download their data, so the task here is a YAML task over a JSON-lines
file shipped next to this test (lm_eval_task/), read offline by datasets' json builder.
"""

from __future__ import annotations

import pathlib

import pytest

from kha_dirs import MLP, save, tokenizer, trained

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
import yaml
from lm_eval import simple_evaluate
from lm_eval.__main__ import cli_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

TASK = pathlib.Path(__file__).parent / "lm_eval_task"
NAME = "kha_tiny_choice"


def _task() -> dict:
    cfg = yaml.safe_load((TASK / f"{NAME}.yaml").read_text())
    cfg["dataset_kwargs"]["data_files"]["test"] = str(TASK / f"{NAME}.jsonl")  # absolute: any working directory
    return cfg


def _evaluate(lm) -> tuple[dict, list]:
    """(scores, every choice's log-likelihood per document) of ``lm`` on the local task."""
    out = simple_evaluate(
        model=lm, tasks=[_task()], task_manager=TaskManager(include_defaults=False), bootstrap_iters=0, log_samples=True
    )
    assert out is not None
    scores = {k: v for k, v in out["results"][NAME].items() if k.startswith("acc")}
    samples = sorted(out["samples"][NAME], key=lambda s: s["doc_id"])
    return scores, [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_hflm_scores_a_kha_model_as_an_instance_and_by_path_alike(tmp_path):
    model = trained("qwen3", MLP)
    before = _evaluate(HFLM(pretrained=model, tokenizer=tokenizer(), batch_size=1))  # before saving
    scores, lls = before
    assert len(lls) == 8 and all(len(choices) == 3 for choices in lls) and set(scores) >= {"acc,none", "acc_norm,none"}
    d = save(model, tmp_path / "kha")
    by_path = _evaluate(HFLM(pretrained=str(d), device="cpu", batch_size=1))
    assert by_path == before


def test_the_checkpoints_page_lm_eval_command_runs_with_the_task_it_names(tmp_path, monkeypatch, capsys):
    """docs/guides/checkpoints.md's `lm_eval` command, as written, from the repository root (its task ships)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    page = (root / "docs" / "guides" / "checkpoints.md").read_text()
    args = "--model hf --model_args pretrained=trained --tasks my_task --include_path examples/lm_eval_task/"
    assert args in page
    d = save(trained("qwen3", MLP), tmp_path / "trained")
    monkeypatch.chdir(root)  # the task's data file is relative to the repository root, as the page says
    argv = ["lm_eval", *args.replace("pretrained=trained", f"pretrained={d}").split(), "--device", "cpu"]
    monkeypatch.setattr("sys.argv", argv)
    cli_evaluate()
    table = capsys.readouterr().out
    assert "my_task" in table and "acc" in table
