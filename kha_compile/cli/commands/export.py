"""``kha-compile export``: a model (optionally with KHA) to ONNX or an AOTInductor package, checked.

The format follows the output's extension: ``.onnx`` (checked against onnxruntime) or ``.pt2``
(an AOTInductor package that runs without kha_compile, checked by loading it here); any other is
refused before the model is loaded. The output's directory is created when it does not exist, and
the command says so (a line on stdout and an INFO log record); a path whose parent is a file is refused.

Generation: ``--genai`` writes the ONNX file with a KV cache and ``genai_config.json`` into OUT (a
directory, or a ``.onnx`` path), ``--generation`` a ``.pt2`` package with a static KV cache
(``--max-cache-len``); both are checked by greedy tokens against transformers' ``generate``
(onnxruntime loop, onnxruntime-genai where it is installed, the package).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
from typing import Any

import torch

import kha_compile as kc

from ...analysis.inputs import example_inputs
from ...core.errors import CommandError
from ...exporters.aoti import AOTI_TOL, export_aoti, read_aoti_metadata
from ...exporters.genai import token_ids
from ...exporters.generate import generate_aoti, generate_genai, generate_onnx
from ...exporters.onnx import export_onnx, onnx_summary
from ..models import MODEL_HELP, export_target, kha_param_count, load_with_kha
from ..ort import ONNX_TOL, first_tensor, max_diff, ort_run
from ..ui import UI, fmt_diff, kv_table, ok_mark

__all__ = ["FORMATS", "NAME", "output_format", "prepare_output", "register", "remove_created", "run"]

log = logging.getLogger(__name__)

NAME = "export"
FORMATS = {".onnx": "ONNX", ".pt2": "AOTInductor"}  # extension -> format of the output
GENERATE_TOKENS = 8  # new tokens of the generation check


def output_format(out: pathlib.Path, genai: bool = False, generation: bool = False) -> str:
    """The format that ``out``'s extension asks for ("ONNX" or "AOTInductor"); CommandError for another.

    ``--genai`` takes a directory or a .onnx path (ONNX); ``--generation`` a .pt2 path (AOTInductor).
    """
    if genai and generation:
        raise CommandError("--genai (ONNX with a KV cache) and --generation (.pt2 with a static cache): give one.")
    if genai:
        if out.suffix not in ("", ".onnx") and not out.is_dir():
            raise CommandError(
                f"--genai writes a directory (or a .onnx file) with genai_config.json; got {str(out)!r}."
            )
        return "ONNX"
    if generation and out.suffix != ".pt2":
        raise CommandError(f"--generation writes an AOTInductor package: give OUT ending in .pt2; got {str(out)!r}.")
    fmt = FORMATS.get(out.suffix)
    if fmt is None:
        raise CommandError(
            f"cannot tell the format of {str(out)!r} from its extension: give OUT ending in .onnx (ONNX) "
            f"or .pt2 (AOTInductor package)."
        )
    return fmt


def register(sub: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``sub``."""
    p: argparse.ArgumentParser = sub.add_parser(
        NAME,
        parents=[common],
        allow_abbrev=False,
        help="export to ONNX (.onnx) or an AOTInductor package (.pt2)",
        description="Export MODEL, linear KHA folded in a copy, to the format OUT's extension names: .onnx "
        "(MLP-value KHA as one kha::MLPValue node per attention; compared with torch in onnxruntime) or .pt2 "
        "(an AOTInductor package with MLP-value lowered inside, which runs without kha_compile, from Python "
        "or C++; compared with torch after loading it here).",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument(
        "output",
        metavar="OUT",
        help="the file to write, OUT.onnx or OUT.pt2; its directory is created (and reported) if it does not exist",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mlp", action="store_true", help="apply MLP-value KHA (identity) before export")
    g.add_argument("--linear", action="store_true", help="apply linear q/k/v KHA (identity) before export")
    g.add_argument("--kha", metavar="DIR", help="load this KHA checkpoint before export")
    p.add_argument("--no-fold", action="store_true", help="keep linear KHA as ops (default: folded in a copy)")
    p.add_argument("--static", action="store_true", help="fixed shapes (default: dynamic batch and sequence)")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with torch")
    p.add_argument(
        "--genai",
        action="store_true",
        help="ONNX with a KV cache (past_key_values.N.key/value in, present.N.* out) and genai_config.json: OUT is "
        "a directory (model.onnx inside) or a .onnx path; onnxruntime_genai.Model(OUT) generates",
    )
    p.add_argument(
        "--generation",
        action="store_true",
        help="OUT.pt2 generates: prefill and one-token decode over a static KV cache inside the package",
    )
    p.add_argument(
        "--max-cache-len", type=int, default=None, metavar="N", help="static cache positions of --generation"
    )
    p.set_defaults(func=run)
    return p


def prepare_output(out: pathlib.Path, ui: UI) -> list[pathlib.Path]:
    """Create the directory of ``out`` when it is missing, and say so; refuse a parent that is a file.

    Returns the directories created, deepest first (:func:`remove_created` takes them out again).
    """
    parent = out.parent
    for d in (parent, *parent.parents):
        if d.exists() and not d.is_dir():
            raise CommandError(f"cannot write {out}: {d} exists and is not a directory.")
    created = [d for d in (parent, *parent.parents) if not d.exists()]
    if created:
        parent.mkdir(parents=True)
        log.info("export: created the output directory %s", parent)
        ui.out.print(f"created the output directory {parent}")
    return created


def remove_created(created: list[pathlib.Path], ui: UI) -> None:
    """Remove the directories an export created when it wrote nothing into them (a refused export)."""
    removed = []
    for d in created:  # deepest first
        try:
            d.rmdir()  # only when empty
        except OSError:
            break
        removed.append(d)
    if removed:
        log.info("export: removed the empty output directory %s", removed[-1])
        ui.out.print(f"removed the output directory {removed[-1]} again: nothing was written")


def run(args: argparse.Namespace, ui: UI) -> int:
    """``kha-compile export``."""

    out = pathlib.Path(args.output)
    fmt = output_format(out, args.genai, args.generation)
    if args.max_cache_len is not None and not args.generation:
        raise CommandError("--max-cache-len sizes the static cache of --generation; add --generation.")
    model, name = load_with_kha(args.model, args.kha, ui)
    cfg = (
        kc.KHAConfig(v="mlp") if args.mlp else kc.KHAConfig(q="linear", k="linear", v="linear") if args.linear else None
    )
    if cfg is not None:
        with ui.step(f"apply {cfg}"):
            kc.apply(model, cfg)
    target = export_target(model)
    created = prepare_output(out, ui)  # --genai into a directory: the export creates OUT itself, after its checks
    try:
        _export(target, out, fmt, args, ui)
    except BaseException:
        remove_created(created, ui)  # a refused export writes nothing
        raise
    if args.genai and out.suffix != ".onnx":
        out = out / "model.onnx"
    rows = [
        ("file", f"{out} ({out.stat().st_size / 2**20:.2f} MiB)"),
        ("KHA parameters exported", f"{kha_param_count(target):,}"),
    ]
    rows += _onnx_rows(out) if fmt == "ONNX" else _aoti_rows(out)
    status = 0
    if not args.no_check and (args.genai or args.generation):
        ok, checks = _generation_rows(target, out, args.genai)
        rows += checks
        status = 0 if ok else 1
    elif not args.no_check:  # against the model as loaded: with its trained KHA, unfolded
        ok, checks = _parity_rows(target, out, fmt, ui)
        rows += checks
        status = 0 if ok else 1
    ui.out.print(kv_table(f"{name}: {fmt} export", rows))
    return status


def _export(target: Any, out: pathlib.Path, fmt: str, args: argparse.Namespace, ui: UI) -> None:
    kind = " with a KV cache" if args.genai or args.generation else ""
    with ui.step(
        f"export {type(target).__name__} to {out} ({fmt}{kind}, dynamic={not args.static}, fold={not args.no_fold})"
    ):
        if args.genai:
            export_onnx(target, out, dynamic=not args.static, fold=not args.no_fold, past=True)
        elif fmt == "ONNX":
            export_onnx(target, out, dynamic=not args.static, fold=not args.no_fold)
        elif args.generation:  # checked below, by generated tokens
            export_aoti(
                target, out, fold=not args.no_fold, check=False, generation=True, max_cache_len=args.max_cache_len
            )
        else:
            export_aoti(target, out, dynamic=not args.static, fold=not args.no_fold, check=False)  # checked below


def _parity_rows(target: Any, out: pathlib.Path, fmt: str, ui: UI) -> tuple[bool, list[tuple[str, str]]]:
    """The exported file against the model as loaded (trained KHA, unfolded) on the example inputs."""
    ex_args, ex_kwargs = example_inputs(target)
    with torch.no_grad():
        want = first_tensor(target(*ex_args, **ex_kwargs))
    if fmt == "ONNX":
        with ui.step("compare onnxruntime with torch on the example inputs"):
            d = max_diff(torch.from_numpy(ort_run(out, ex_args, ex_kwargs)[0]), want)
        ok = d < ONNX_TOL * max(1.0, float(want.abs().max()))
        return ok, [("onnxruntime vs torch", f"max |Δ| = {fmt_diff(d)} {ok_mark(ok)}")]
    with ui.step("load the package and compare it with torch on the example inputs"):
        d = max_diff(_aoti_run(out, ex_kwargs), want)
    ok = d < AOTI_TOL * max(1.0, float(want.abs().max()))
    return ok, [("package vs torch", f"max |Δ| = {fmt_diff(d)} {ok_mark(ok)}")]


def _generation_rows(target: Any, out: pathlib.Path, genai: bool) -> tuple[bool, list[tuple[str, str]]]:
    """Greedy tokens of the exported file(s) against transformers' ``generate`` on the example prompt."""
    ex_args, ex_kwargs = example_inputs(target)
    ids = ex_kwargs.get("input_ids", ex_args[0] if ex_args else None)
    if not isinstance(ids, torch.Tensor):
        raise CommandError("the generation check needs input_ids among the model's example inputs.")
    ids = ids[:1]  # one prompt: generation packages hold one sequence by default
    tokens = token_ids(target)
    eos = tokens["eos"] or None
    with torch.no_grad():
        want = target.generate(
            ids, max_new_tokens=GENERATE_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=tokens["pad"]
        )
    runs = {}
    if genai:
        runs["onnxruntime loop"] = lambda: generate_onnx(out, ids, GENERATE_TOKENS, eos_token_id=eos)
        if importlib.util.find_spec("onnxruntime_genai") is not None:
            runs["onnxruntime-genai"] = lambda: generate_genai(out.parent, ids, GENERATE_TOKENS)
    else:
        runs["package"] = lambda: generate_aoti(out, ids, GENERATE_TOKENS, eos_token_id=eos)
    rows, ok = [("transformers generate", " ".join(map(str, want[0].tolist())))], True
    for name, run in runs.items():
        got = run()
        same = got.shape == want.shape and bool((got == want).all())
        ok &= same
        rows.append((f"{name} tokens", f"{'equal' if same else 'differ: ' + str(got[0].tolist())} {ok_mark(same)}"))
    return ok, rows


def _onnx_rows(out: pathlib.Path) -> list[tuple[str, str]]:
    s = onnx_summary(out)
    rows = [
        ("opset", str(s.opset)),
        ("nodes", str(s.num_nodes)),
        ("kha::MLPValue nodes", str(s.num_custom_nodes)),
        ("functions", ", ".join("::".join(f) for f in s.functions) or "none"),
    ]
    rows += [(f"input {i.name}", f"{i.dtype}{list(i.dims)}") for i in s.inputs]
    rows += [(f"output {o.name}", f"{o.dtype}{list(o.dims)}") for o in s.outputs]
    return rows


def _aoti_rows(out: pathlib.Path) -> list[tuple[str, str]]:
    meta = read_aoti_metadata(out)
    ranges = meta.get("dynamic_shapes", {})
    transforms = sorted(
        {f"{role}={kind}" for site in meta.get("sites") or [] for role, kind in site["transforms"].items()}
    )
    rows = [
        ("device", f"{meta['aoti'].get('AOTI_DEVICE_KEY', '?')} ({meta['aoti'].get('AOTI_CPU_ISA', '')})".strip()),
        ("KHA", f"{meta.get('kha')}: {', '.join(transforms) or 'none'}; folded: {meta.get('folded')}"),
        ("sites", str(len(meta.get("sites") or []))),
    ]
    if meta.get("cache"):
        c = meta["cache"]
        rows.append(("static KV cache", f"{c['max_batch']} x {c['max_cache_len']} positions, {c['num_layers']} layers"))
    for name in meta.get("input_names", []):
        axes = ranges.get(name, {})
        dyn = ", ".join(f"{a}: {lo}..{'∞' if hi is None else hi}" for a, (lo, hi) in axes.items()) or "static"
        rows.append((f"input {name}", f"dynamic axes {dyn}"))
    rows += [(f"output {i}", name) for i, name in enumerate(meta.get("output_names", []))]
    return rows


def _aoti_run(out: pathlib.Path, kwargs: dict[str, Any]) -> torch.Tensor:
    """The package's first output on the example inputs (given in the package's input order)."""
    names = read_aoti_metadata(out)["input_names"]
    missing = [n for n in names if not isinstance(kwargs.get(n), torch.Tensor)]
    if missing:
        raise CommandError(f"{out} takes the inputs {', '.join(missing)} that the example inputs do not provide.")
    got = torch._inductor.aoti_load_package(str(out))(*[kwargs[n] for n in names])
    return got if isinstance(got, torch.Tensor) else got[0]
