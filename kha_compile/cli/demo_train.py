"""The demo's measurement: train the model with and without KHA in turns, on text that ships with Python.

The data are paragraphs of the docstrings of Python's own standard library (no download, nothing
to ship). Each paragraph is cut in two halves; the objective is in-batch contrastive: the first
half of paragraph i should embed closest to the second half of paragraph i among the batch's
second halves (symmetric cross-entropy at temperature 0.05). Halves are cut to 24 words, and
to 32 tokens while training and validating. Every fifth paragraph is held out for validation.

Runs are trained in turns, step by step: at step s every run takes one optimizer step on the
batch that its data order gives for s. Runs that share a data order see the same batches.

Example::

    train, val = docstring_pairs()
    runs = [DemoRun("baseline", model_a, order_seed=0), DemoRun("KHA", model_b, order_seed=0)]
    train_in_turns(runs, train, val, TrainSpec(steps=60))
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "DOC_MODULES",
    "DemoRun",
    "TrainSpec",
    "contrastive_loss",
    "docstring_pairs",
    "evaluate",
    "set_trainable",
    "train_in_turns",
]

# Standard-library modules whose docstrings make the demo's text (import without side effects).
DOC_MODULES = (
    "textwrap",
    "email.message",
    "json",
    "argparse",
    "collections",
    "functools",
    "itertools",
    "pathlib",
    "logging",
    "subprocess",
    "threading",
    "unittest.case",
    "http.client",
    "urllib.parse",
    "csv",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "random",
    "string",
    "shutil",
    "tarfile",
    "zipfile",
    "sqlite3",
    "asyncio.tasks",
    "inspect",
    "dataclasses",
    "enum",
    "typing",
    "heapq",
    "bisect",
    "contextlib",
    "difflib",
    "pprint",
    "calendar",
    "socket",
    "ssl",
    "smtplib",
    "xml.dom.minidom",
    "tempfile",
    "glob",
    "fnmatch",
    "hashlib",
    "hmac",
    "base64",
    "codecs",
    "locale",
    "gettext",
    "optparse",
    "pickle",
    "copy",
    "weakref",
    "abc",
    "numbers",
    "operator",
    "traceback",
    "warnings",
    "doctest",
    "pdb",
    "trace",
    "timeit",
    "cmd",
    "shlex",
    "configparser",
    "mailbox",
    "mimetypes",
    "html.parser",
    "wave",
    "tokenize",
    "ast",
    "dis",
)
_MIN_WORDS = 16
_HALF_WORDS = 24  # each half is cut to at most this many words
_MAX_TOKENS = 32  # and to this many tokens while training (keeps the steps short on CPU)
Pair = tuple[str, str]


def _paragraphs() -> list[str]:
    out: list[str] = []
    seen: set[str] = set()
    for name in DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a Python built without e.g. ssl or sqlite3
            continue
        with warnings.catch_warnings():  # typing.io and typing.re warn when touched
            warnings.simplefilter("ignore", DeprecationWarning)
            objs: list[Any] = [mod] + [
                v
                for k, v in sorted(vars(mod).items())
                if not k.startswith("_")
                and (inspect.isfunction(v) or inspect.isclass(v))
                and getattr(v, "__module__", None) == mod.__name__
            ]
        for obj in objs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                doc = inspect.getdoc(obj) or ""
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(para.split())
                if (
                    len(text.split()) >= _MIN_WORDS
                    and not text.startswith((">>>", "-", "*"))
                    and sum(c.isalpha() for c in text) > 0.7 * len(text)
                    and text not in seen
                ):
                    seen.add(text)
                    out.append(text)
    return out


def docstring_pairs(holdout_every: int = 5) -> tuple[list[Pair], list[Pair]]:
    """(train, validation) pairs (first half, second half) of standard-library docstring paragraphs.

    Paragraph i goes to validation when ``i % holdout_every == 0``. Deterministic for a given Python.

    Example::

        train, val = docstring_pairs()
        len(train), len(val)          # about (700, 180) on Python 3.11
    """
    pairs: list[Pair] = []
    for text in _paragraphs():
        words = text.split()
        mid = len(words) // 2
        pairs.append((" ".join(words[:mid][:_HALF_WORDS]), " ".join(words[mid:][:_HALF_WORDS])))
    val = [p for i, p in enumerate(pairs) if i % holdout_every == 0]
    train = [p for i, p in enumerate(pairs) if i % holdout_every != 0]
    return train, val


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """How the demo trains: steps, batch, learning rates, what is trained and when it evaluates.

    ``lr`` is the Adam learning rate of the base parameters that both runs train (those whose name
    contains one of ``base_params``); ``kha_lr`` that of KHA's own parameters (only the KHA run has them).
    Both rise linearly over the first ``warmup`` steps, in every run alike.
    """

    steps: int = 32  # the default run fits 5 minutes on one thread of a slow (AVX2) CPU
    batch_size: int = 16
    lr: float = 1e-4
    kha_lr: float = 3e-3
    temperature: float = 0.05
    val_pairs: int = 64
    val_batch: int = 32
    evals: int = 4
    warmup: int = 10
    base_params: tuple[str, ...] = ("attention.self.", "attention.output.dense.")

    def eval_steps(self) -> list[int]:
        """Steps after which validation runs (0 = before training, always the last step)."""
        n = max(1, self.evals)
        return sorted({0, self.steps, *(round(self.steps * i / n) for i in range(1, n))})


@dataclasses.dataclass
class DemoRun:
    """One training run: a model, its data order and its loss curves (filled by :func:`train_in_turns`)."""

    name: str
    model: nn.Module
    order_seed: int
    train_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    val_curve: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    trained: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    @property
    def val_loss(self) -> float:
        """The last validation loss."""
        return self.val_curve[-1][1]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "order_seed": self.order_seed,
            "trained_params": self.trained,
            "seconds": round(self.seconds, 2),
            "train": [[s, v] for s, v in self.train_curve],
            "val": [[s, v] for s, v in self.val_curve],
        }


def set_trainable(model: nn.Module, spec: TrainSpec) -> dict[str, int]:
    """Freeze ``model`` except the base parameters of ``spec`` and KHA's; returns the counts per group."""
    counts = {"base": 0, "kha": 0}
    for name, p in model.named_parameters():
        is_kha = "kha" in name
        train = is_kha or any(s in name for s in spec.base_params)
        p.requires_grad_(train)
        if train:
            counts["kha" if is_kha else "base"] += p.numel()
    return counts


def _optimizer(model: nn.Module, spec: TrainSpec) -> torch.optim.Optimizer:
    base = [p for n, p in model.named_parameters() if p.requires_grad and "kha" not in n]
    kha = [p for n, p in model.named_parameters() if p.requires_grad and "kha" in n]
    groups: list[dict[str, Any]] = [{"params": base, "lr": spec.lr}]
    if kha:
        groups.append({"params": kha, "lr": spec.kha_lr})
    return torch.optim.Adam(groups)


def _features(st: Any, texts: Sequence[str]) -> dict:
    prep = getattr(st, "preprocess", None) or st.tokenize
    return prep(list(texts))


def contrastive_loss(st: Any, feats: dict, n: int, temperature: float) -> torch.Tensor:
    """Symmetric in-batch InfoNCE: ``feats`` holds n first halves, then their n second halves."""
    emb = nn.functional.normalize(st(dict(feats))["sentence_embedding"], dim=-1)  # (2n, D)
    logits = emb[:n] @ emb[n:].T / temperature  # (n, n)
    labels = torch.arange(n)
    return (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2


def _batch_feats(st: Any, pairs: Sequence[Pair]) -> dict:
    return _features(st, [a for a, _ in pairs] + [b for _, b in pairs])


def evaluate(st: Any, batches: Sequence[tuple[dict, int]], temperature: float) -> float:
    """Mean contrastive loss over pre-tokenized validation ``batches`` ((features, n) each), no grad."""
    with torch.no_grad():
        return sum(contrastive_loss(st, f, n, temperature).item() for f, n in batches) / len(batches)


def _order(n: int, steps: int, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    idx: list[int] = []
    while len(idx) < steps * batch:
        idx.extend(torch.randperm(n, generator=gen).tolist())
    return [idx[i * batch : (i + 1) * batch] for i in range(steps)]


def train_in_turns(
    runs: Sequence[DemoRun],
    train: Sequence[Pair],
    val: Sequence[Pair],
    spec: TrainSpec,
    on_step: Callable[[int], None] | None = None,
) -> None:
    """Train every run for ``spec.steps`` steps, in turns step by step; fill their curves.

    Each run trains the base parameters of ``spec`` (and KHA's, where it has them) with Adam.
    Validation runs on the first ``spec.val_pairs`` pairs of ``val`` at :meth:`TrainSpec.eval_steps`.

    Example::

        train_in_turns([DemoRun("baseline", a, 0), DemoRun("KHA", b, 0)], train, val, TrainSpec(steps=3))
    """
    st0: Any = runs[0].model  # a SentenceTransformer
    saved_len = st0.max_seq_length
    st0.max_seq_length = _MAX_TOKENS  # the tokenizer of the first run serves every run
    try:
        _train(runs, train, val, spec, on_step)
    finally:
        st0.max_seq_length = saved_len


def _train(
    runs: Sequence[DemoRun],
    train: Sequence[Pair],
    val: Sequence[Pair],
    spec: TrainSpec,
    on_step: Callable[[int], None] | None,
) -> None:
    st0 = runs[0].model
    vp = list(val[: spec.val_pairs])
    val_batches = [
        (_batch_feats(st0, vp[i : i + spec.val_batch]), len(vp[i : i + spec.val_batch]))
        for i in range(0, len(vp), spec.val_batch)
    ]
    orders = {r.order_seed: _order(len(train), spec.steps, spec.batch_size, r.order_seed) for r in runs}
    evals = set(spec.eval_steps())
    warm = max(1, min(spec.warmup, spec.steps))
    for r in runs:
        counts = set_trainable(r.model, spec)
        r.trained = counts["base"] + counts["kha"]
        r.optimizer = _optimizer(r.model, spec)
        r.scheduler = torch.optim.lr_scheduler.LambdaLR(r.optimizer, lambda s: min(1.0, (s + 1) / warm))
        r.model.eval()  # no dropout: the data order is the only difference between runs of one kind
        r.train_curve.clear()
        r.val_curve.clear()
        t0 = time.perf_counter()
        r.val_curve.append((0, evaluate(r.model, val_batches, spec.temperature)))
        r.seconds += time.perf_counter() - t0
    for step in range(1, spec.steps + 1):
        feats = {seed: _batch_feats(st0, [train[i] for i in order[step - 1]]) for seed, order in orders.items()}
        for r in runs:
            t0 = time.perf_counter()
            opt = r.optimizer or _optimizer(r.model, spec)
            loss = contrastive_loss(r.model, feats[r.order_seed], spec.batch_size, spec.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if r.scheduler is not None:
                r.scheduler.step()
            r.train_curve.append((step, loss.item()))
            if step in evals:
                r.val_curve.append((step, evaluate(r.model, val_batches, spec.temperature)))
            r.seconds += time.perf_counter() - t0
        if on_step is not None:
            on_step(step)
    for r in runs:
        for p in r.model.parameters():
            p.requires_grad_(False)
