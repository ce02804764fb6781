#!/usr/bin/env python
"""Sweep kha_compile over every transformers model type with an LM class and write the docs table.

Every model type of the installed transformers that has a causal-LM, masked-LM or seq2seq-LM class
is built from its default config shrunk to tiny sizes (``tests/sweep_configs.py``); for each KHA
config (``linear_qkv``: q, k, v linear; ``mlp_v``: v MLP-value) one case runs the checks of
``tests/sweep_cases.py`` (independent attention count, apply, identity, perturbation, fold). Each
case runs in a forked child with a time limit, so one hang or crash does not stop the sweep.

The test suite runs a representative chunk (``CI_TYPES``, ``tests/integrations/test_transformers_sweep.py``,
marked slow); this script runs them all (about an hour on 2 cores) and writes
``docs/transformers_sweep.md``.

Usage::

    python scripts/sweep_transformers.py run [--types llama,bert] [--timeout 300] [--json out.json]
    python scripts/sweep_transformers.py table --json out.json      # the table again, from saved results
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DOC = ROOT / "docs" / "transformers_sweep.md"


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


_CELL = {"pass": "pass", "skipped": "skipped", "no_attention": "no attention", "fail": "**fail**"}


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    status = rec.get("status", "?")
    text = _CELL.get(status, status)
    if status == "pass" and rec.get("skipped"):
        text += f" ({rec['matched']}/{rec['matched'] + rec['skipped']})"
    if status == "fail":
        text += f": {rec.get('category', '')}"
    return text


def _note(recs: list[dict]) -> str:
    for rec in recs:
        if rec.get("status") == "fail":
            return (rec.get("error") or rec.get("category", ""))[:160]
    for rec in recs:
        if rec.get("status") == "skipped":
            return rec.get("reason", "")[:160]
        skipped = [s for s in rec.get("sites", []) if s[1] != "matched"]
        if skipped:
            return f"skipped {skipped[0][0]}: {skipped[0][2][:120]}"
    kept = next((rec["fold_kept"] for rec in recs if rec.get("fold_kept")), None)
    if kept:
        return f"k = v: T^K, T^V on the attention arguments, not foldable; fold keeps them ({len(kept)} modules)"
    path = recs[0].get("trace_path", "") if recs else ""
    return f"traced {path}" if path and not path.startswith(("one block", "whole model")) else ""


def table(data: dict) -> str:
    from sweep_cases import CI_TYPES, KHA_CONFIGS

    cases = data["cases"]
    by_type: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for rec in cases.values():
        by_type[rec["model_type"]][rec["config"]] = rec
    configs = list(KHA_CONFIGS)
    built = {t: c for t, c in by_type.items() if not any(r.get("status") == "not_counted" for r in c.values())}
    statuses = collections.Counter(r.get("status") for c in built.values() for r in c.values())
    counted = sum(statuses.values()) - statuses["no_attention"]
    ok = statuses["pass"] + statuses["skipped"]
    types_ok = sum(
        1 for c in built.values() if all(r.get("status") in ("pass", "skipped", "no_attention") for r in c.values())
    )
    meta = data.get("meta", {})
    lines = [
        "# kha_compile on every transformers model type",
        "",
        f"Generated by `python scripts/sweep_transformers.py run` ({meta.get('date', '')}; transformers "
        f"{meta.get('transformers')}, torch {meta.get('torch')}). Each model type of the installed transformers "
        "with a causal-LM, masked-LM or seq2seq-LM class is built from its default config shrunk to tiny sizes "
        "(hidden 64, 4 heads of 16, 2+ layers, random weights, fp32, eval; `tests/sweep_configs.py`). For each "
        "KHA config (`linear_qkv`: q, k, v linear; `mlp_v`: v MLP-value) a case checks "
        "(`tests/sweep_cases.py`): no exception but a `KHAError`; the attention calls of one plain forward, counted "
        "independently by a TorchFunctionMode, each a site of the report (matched, or skipped with its reason); "
        "logits identical at init; perturbed KHA weights move them; the linear config folds (within 1e-4).",
        "",
        "`skipped`: kha_compile found the attention and declined every site, saying why (the reason is in the "
        "note); the model is left unchanged. `pass (m/n)`: m of n sites matched, the rest skipped with a reason.",
        "",
        f"The test suite runs the {len(CI_TYPES)} types marked **CI** "
        "(`tests/integrations/test_transformers_sweep.py`, marked slow, "
        "`KHA_SWEEP=all` runs every type there too); the others run only through this script.",
        "",
        "## Totals",
        "",
        f"- model types: **{len(by_type)}**; built by transformers: **{len(built)}** "
        f"(not counted: {len(by_type) - len(built)})",
        f"- cases with attention: **{counted}**: pass **{statuses['pass']}**, skipped with a reason "
        f"**{statuses['skipped']}**, fail **{statuses['fail']}** ({100 * ok / max(counted, 1):.1f}% pass or skip "
        f"with a reason; {100 * statuses['pass'] / max(counted, 1):.1f}% pass)",
        f"- no attention in the forward (apply says so): {statuses['no_attention']} cases",
        f"- types whose every case passes or is skipped with a reason: **{types_ok}** of {len(built)}",
        "",
        "## Model types",
        "",
        f"| type | class | {' | '.join(configs)} | CI | note |",
        "|---|---|" + "---|" * len(configs) + "---|---|",
    ]
    for t in sorted(built):
        recs = [built[t].get(c) for c in configs]
        cls = next((r.get("cls", "") for r in recs if r), "")
        cells = " | ".join(_cell(r) for r in recs)
        note = _note([r for r in recs if r]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {t} | {cls} | {cells} | {'**CI**' if t in CI_TYPES else ''} | {note} |")
    lines += ["", "## Not counted (transformers cannot build or run the tiny model this way)", ""]
    lines += ["| type | class | error |", "|---|---|---|"]
    for t in sorted(set(by_type) - set(built)):
        rec = next(r for r in by_type[t].values() if r.get("status") == "not_counted")
        lines.append(f"| {t} | {rec.get('cls', '')} | {rec.get('error', '')[:160].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _type_cases(model_type: str) -> dict:
    from sweep_cases import run_type

    return {rec["config"]: rec for rec in run_type(model_type)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run the cases and write the table")
    run.add_argument("--types", default="", help="comma-separated model types (default: all)")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    run.add_argument("--json", default="", help="also keep the results here (and resume from them)")
    run.add_argument("--doc", default=str(DOC))
    tab = sub.add_parser("table", help="write the table from saved results")
    tab.add_argument("--json", required=True)
    tab.add_argument("--doc", default=str(DOC))
    a = ap.parse_args(argv)

    import torch
    import transformers

    from sweep_cases import KHA_CONFIGS
    from sweep_configs import model_types

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    if a.cmd == "table":
        Path(a.doc).write_text(table(json.loads(Path(a.json).read_text())))
        return 0
    data: dict = {"meta": {}, "cases": {}}
    if a.json and Path(a.json).is_file():
        data = json.loads(Path(a.json).read_text())
    data["meta"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    types = [t for t in a.types.split(",") if t] or list(model_types())
    for i, t in enumerate(types):
        if all(f"{t}/{cfg}" in data["cases"] for cfg in KHA_CONFIGS):
            continue
        got = isolated(_type_cases, (t,), a.timeout * len(KHA_CONFIGS))
        for cfg in KHA_CONFIGS:
            rec = dict(got.get(cfg) or got)  # a timeout or crash: one record for the type
            rec.setdefault("model_type", t)
            rec["config"] = cfg
            data["cases"][f"{t}/{cfg}"] = rec
            print(f"[{i + 1}/{len(types)}] {t}/{cfg:30s} {rec.get('status', ''):12s} {rec.get('category', '')[:40]}")
        sys.stdout.flush()
        if a.json:
            Path(a.json).write_text(json.dumps(data, indent=1, default=str))
    Path(a.doc).write_text(table(data))
    print(f"wrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
