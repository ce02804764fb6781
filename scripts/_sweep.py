"""What the sweep scripts share: cases run in forked children, results kept in JSON, the docs table.

``scripts/sweep_transformers.py``, ``scripts/sweep_timm.py`` and ``scripts/sweep_diffusers.py`` each
name their models and how one is run (``tests/sweep_cases.py`` holds the checks); :func:`main` runs
them with a time limit per model and a progress bar, resumes from ``--json``, and writes the docs
page through the script's ``table``.

Example::

    sys.exit(main(Sweep(name="timm", doc=DOC, names=archs, run=run_one, table=table, meta=meta), argv))
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

CONFIGS = ("linear_qkv", "mlp_v")  # tests/sweep_cases.py KHA_CONFIGS, without importing torch here

# what every docs page says about the checks (tests/sweep_cases.py) and the cells of its table
CHECKS = (
    "For each KHA config (`linear_qkv`: q, k, v linear; `mlp_v`: v MLP-value) a case checks "
    "(`tests/sweep_cases.py`): no exception but a `KHAError`; the attention calls of one plain forward, counted "
    "independently by a TorchFunctionMode, each a site of the report (matched, or skipped with its reason); "
    "{output} identical at init; perturbed KHA weights move {it}; the linear config folds (within 1e-4)"
)
REFERENCE = (
    "and where every attention call runs in {modules} (counted per module), the perturbed output matches a "
    "per-head reference written by hand with hooks on an untouched copy (`tests/reference.py`, within 1e-4 "
    "relative): `pass, per head`"
)


def checks(output: str, it: str, modules: str = "") -> str:
    """The sentence on the checks of a docs page; ``modules`` names where the per-head reference applies."""
    text = CHECKS.format(output=output, it=it)
    return f"{text}; {REFERENCE.format(modules=modules)}." if modules else f"{text}."


LEGEND = (
    "`skipped`: kha_compile found the attention and declined every site, saying why (the reason is in the "
    "note); the model is left unchanged. `pass (m/n)`: m of n sites matched, the rest skipped with a reason."
)


def isolated(fn, args: tuple, timeout: float) -> dict:
    """``fn(*args)`` (a JSON-able dict) in a forked child; a timeout or a crash is a result too."""
    r, w = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            with contextlib.redirect_stdout(sys.stderr):
                payload = json.dumps(fn(*args), default=str).encode()
        except BaseException as exc:
            payload = json.dumps({"status": "fail", "category": "sweep error", "error": repr(exc)[:300]}).encode()
        with os.fdopen(w, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(w)
    os.set_blocking(r, False)
    chunks: list[bytes] = []
    while True:
        with contextlib.suppress(BlockingIOError):
            while data := os.read(r, 1 << 16):
                chunks.append(data)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            with contextlib.suppress(BlockingIOError):
                while data := os.read(r, 1 << 16):
                    chunks.append(data)
            break
        if time.perf_counter() - start > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            return {"status": "fail", "category": "timeout", "error": f"no result in {timeout:.0f} s"}
        time.sleep(0.05)
    os.close(r)
    if chunks:
        return json.loads(b"".join(chunks))
    return {"status": "fail", "category": "child crashed", "error": f"exit status {status}"}


# ----------------------------------------------------------------------------------------------
# the docs table
# ----------------------------------------------------------------------------------------------
_CELL = {"pass": "pass", "skipped": "skipped", "no_attention": "no attention", "fail": "**fail**"}


def cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    status = rec.get("status", "?")
    text = _CELL.get(status, status)
    if status == "pass" and rec.get("skipped"):
        text += f" ({rec['matched']}/{rec['matched'] + rec['skipped']})"
    if status == "pass" and rec.get("reference_rel_err") is not None:
        text += ", per head"
    if status == "fail":
        text += f": {rec.get('category', '')}"
    return text


def note(recs: list[dict]) -> str:
    for rec in recs:
        if rec.get("status") == "fail":
            return (rec.get("error") or rec.get("category", ""))[:160]
    for rec in recs:
        if rec.get("status") in ("skipped", "no_attention"):  # no attention: why the forward has none, if known
            return rec.get("reason", "")[:160]
        skipped = [s for s in rec.get("sites", []) if s[1] != "matched"]
        if skipped:
            return f"skipped {skipped[0][0]}: {skipped[0][2][:120]}"
    kept = next((rec["fold_kept"] for rec in recs if rec.get("fold_kept")), None)
    if kept:
        return f"k = v: T^K, T^V on the attention arguments, not foldable; fold keeps them ({len(kept)} modules)"
    path = recs[0].get("trace_path", "") if recs else ""
    return f"traced {path}" if path and not path.startswith(("one block", "whole model")) else ""


def _one_line(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def page(
    data: dict,
    *,
    title: str,
    intro: list[str],
    unit: str,
    ci: tuple[str, ...],
    not_counted: str,
    extra: Callable[[dict], str] | None = None,
    extra_head: str = "",
) -> str:
    """The docs page: ``intro`` paragraphs, totals, one row per model, then the models not counted.

    ``extra(rec)`` adds a column (``extra_head``) after the class, read from the first record.
    """
    cases = data["cases"]
    by_name: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for rec in cases.values():
        by_name[rec["model_type"]][rec["config"]] = rec
    built = {t: c for t, c in by_name.items() if not any(r.get("status") == "not_counted" for r in c.values())}
    statuses = collections.Counter(r.get("status") for c in built.values() for r in c.values())
    counted = sum(statuses.values()) - statuses["no_attention"]
    ok = statuses["pass"] + statuses["skipped"]
    per_head = sum(1 for c in built.values() for r in c.values() if r.get("reference_rel_err") is not None)
    names_ok = sum(
        1 for c in built.values() if all(r.get("status") in ("pass", "skipped", "no_attention") for r in c.values())
    )
    meta = data.get("meta", {})
    minutes = meta.get("seconds", 0) / 60
    units = unit + ("es" if unit.endswith("s") else "s")
    lines = [f"# {title}", "", *[p for para in intro for p in (para, "")]]
    if minutes:
        lines += [f"The run took {minutes:.0f} minutes (one core, `nice`, `OMP_NUM_THREADS=1`).", ""]
    lines += [
        f"The test suite runs the {len(ci)} {units} marked **CI** (marked slow); the others run only through the script.",
        "",
        "## Totals",
        "",
        f"- {units}: **{len(by_name)}**; built: **{len(built)}** (not counted: {len(by_name) - len(built)})",
        f"- cases with attention: **{counted}**: pass **{statuses['pass']}**, skipped with a reason "
        f"**{statuses['skipped']}**, fail **{statuses['fail']}** ({100 * ok / max(counted, 1):.1f}% pass or skip "
        f"with a reason; {100 * statuses['pass'] / max(counted, 1):.1f}% pass)",
        *([f"- passing cases also checked against a per-head reference: **{per_head}**"] if per_head else []),
        f"- no attention in the forward (apply says so): {statuses['no_attention']} cases",
        f"- {units} whose every case passes or is skipped with a reason: **{names_ok}** of {len(built)}",
        "",
        f"## {units[0].upper()}{units[1:]}",
        "",
    ]
    head = f" {extra_head} |" if extra else ""
    lines += [f"| {unit} | class |{head} {' | '.join(CONFIGS)} | CI | note |"]
    lines += ["|---|---|" + ("---|" if extra else "") + "---|" * len(CONFIGS) + "---|---|"]
    for t in sorted(built):
        recs = [built[t].get(c) for c in CONFIGS]
        first = next(r for r in recs if r)
        cells = " | ".join(cell(r) for r in recs)
        more = f" {_one_line(extra(first))} |" if extra else ""
        row_note = _one_line(note([r for r in recs if r]))
        lines.append(f"| {t} | {first.get('cls', '')} |{more} {cells} | {'**CI**' if t in ci else ''} | {row_note} |")
    lines += ["", f"## Not counted ({not_counted})", "", f"| {unit} | class | error |", "|---|---|---|"]
    for t in sorted(set(by_name) - set(built)):
        rec = next(r for r in by_name[t].values() if r.get("status") == "not_counted")
        lines.append(f"| {t} | {rec.get('cls', '')} | {_one_line(rec.get('error', '')[:160])} |")
    pending = [t for t in meta.get("names", []) if t not in by_name]
    if pending:
        lines += ["", f"## Not run yet ({len(pending)}; `run --json` resumes where a run stopped)", ""]
        lines += [", ".join(pending)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# the command line
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Sweep:
    """One sweep: its name, docs page, how to list its models and run one, its table and versions."""

    name: str
    doc: Path
    names: Callable[[], list[str]]  # every model the sweep runs (called in the parent)
    run: Callable[[str], dict]  # config -> record, for one model (called in a forked child)
    table: Callable[[dict], str]
    meta: Callable[[], dict]  # library versions


def main(sweep: Sweep, argv: list[str] | None = None, doc: str | None = None) -> int:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0] if doc else f"the {sweep.name} sweep")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the cases and write the table")
    run.add_argument("--types", default="", help="comma-separated models (default: all)")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    run.add_argument("--json", default="", help="also keep the results here (and resume from them)")
    run.add_argument("--doc", default=str(sweep.doc))
    tab = sub.add_parser("table", help="write the table from saved results")
    tab.add_argument("--json", required=True)
    tab.add_argument("--doc", default=str(sweep.doc))
    a = ap.parse_args(argv)
    if a.cmd == "table":
        Path(a.doc).write_text(sweep.table(json.loads(Path(a.json).read_text())))
        return 0

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    data: dict = {"meta": {}, "cases": {}}
    if a.json and Path(a.json).is_file():
        data = json.loads(Path(a.json).read_text())
    names = [t for t in a.types.split(",") if t] or data["meta"].get("names") or sweep.names()
    if not a.types:
        data["meta"]["names"] = names  # a resumed run keeps its list of models
    data["meta"] = {**data["meta"], **sweep.meta(), "date": time.strftime("%Y-%m-%d")}
    data["meta"].setdefault("seconds", 0.0)
    todo = [t for t in names if not all(f"{t}/{cfg}" in data["cases"] for cfg in CONFIGS)]
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        task = progress.add_task(sweep.name, total=len(todo))
        for t in todo:
            progress.update(task, description=f"{sweep.name}: {t}")
            start = time.perf_counter()
            got = isolated(sweep.run, (t,), a.timeout * len(CONFIGS))
            data["meta"]["seconds"] += time.perf_counter() - start
            for cfg in CONFIGS:
                rec = dict(got.get(cfg) or got)  # a timeout or crash: one record for the model
                rec.setdefault("model_type", t)
                rec["config"] = cfg
                data["cases"][f"{t}/{cfg}"] = rec
                status = f"{rec.get('status', '')} {rec.get('category', '')}".strip()
                progress.console.print(f"{t}/{cfg}: {status}", highlight=False)
            progress.advance(task)
            if a.json:
                Path(a.json).write_text(json.dumps(data, indent=1, default=str))
    Path(a.doc).write_text(sweep.table(data))
    print(f"wrote {a.doc}")
    return 0
