#!/usr/bin/env python
"""Plant deliberate bugs in a copy of the repository, one at a time, and see whether the tests catch them.

Each bug is a small textual patch to one library file: the kind of mistake that leaves a model
silently wrong (a transposed fold, a wrong head axis, a checkpoint that drops a role, a stale
cache). For each bug this script copies the working tree (tracked and untracked, not ignored files)
to a temporary directory, applies the patch there (never to the working tree), checks that the
patched file still compiles, and runs each group of tests that test the code it breaks
(``pytest -x -q -p no:cacheprovider``). A group *catches* the bug when a test fails; a bug is caught
when every one of its groups catches it. The score table goes to ``docs/planted_bugs.md``.

    python scripts/plant_bugs.py                 # every bug; writes docs/planted_bugs.md
    python scripts/plant_bugs.py --list          # the bugs and their test groups
    python scripts/plant_bugs.py --only fold_t_not_transposed stale_fold_cache --no-write
    python scripts/plant_bugs.py --before 16f21c5     # and a column: the same groups with older tests/

Exit status: 0 when every bug run is caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import py_compile
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "planted_bugs.md"


@dataclasses.dataclass(frozen=True)
class Bug:
    """One deliberate bug: replace ``old`` (found exactly once) by ``new`` in ``file``."""

    name: str
    file: str
    old: str
    new: str
    what: str  # what goes wrong, in a line
    groups: dict[str, tuple[str, ...]]  # group name -> test files (or node ids) that test the broken code


FOLD = ("tests/passes/test_fold.py",)
BACKEND_FOLD = ("tests/backend/test_fold_linear.py", "tests/backend/test_deploy.py")
APPLY = ("tests/passes/test_apply.py",)
STRATEGY = ("tests/model/test_strategy.py",)
CHECKPOINT = ("tests/passes/test_checkpoint.py", "tests/integrations/test_hf_checkpoint.py")
OPS = ("tests/ops/test_mlp_value.py",)
WEIGHT_CHANGES = ("tests/model/test_weight_changes.py",)
TRAINER = ("tests/integrations/test_trainer_eval.py",)
ARCHITECTURES = ("tests/test_more_architectures.py", "tests/test_third_party_models.py")
ONNX_PAST = ("tests/exporters/test_onnx_past.py",)
AOTI_GENERATION = ("tests/exporters/test_aoti_generation.py",)
GENERATE = ("tests/exporters/test_generate.py",)
COMPLETENESS = ("tests/analysis/test_completeness.py",)
SUBMODULES = ("tests/analysis/test_submodules.py",)
MHA = ("tests/model/test_mha.py",)
FUSE = ("tests/backend/test_fuse_mlp_value.py",)
BACKEND_FOLD_LINEAR = ("tests/backend/test_fold_linear.py",)
DEPLOY = ("tests/backend/test_deploy.py",)
FORMS_MORE = ("tests/integrations/test_attention_forms_more.py",)

BUGS: list[Bug] = [
    Bug(
        "fold_t_not_transposed",
        "kha_compile/model/rows.py",
        "w = torch.bmm(t32.t().expand(H, Dh, Dh), w.reshape(H, Dh, -1)).reshape(w.shape)",
        "w = torch.bmm(t32.expand(H, Dh, Dh), w.reshape(H, Dh, -1)).reshape(w.shape)",
        "fold_rows folds W' = T W instead of T^T W into (out, in) weights (nn.Linear)",
        {"fold": FOLD, "backend fold/deploy": BACKEND_FOLD, "strategy": STRATEGY},
    ),
    Bug(
        "fold_t_not_transposed_conv1d",
        "kha_compile/model/rows.py",
        "w_new = (w.index_select(1, idx).reshape(w.shape[0], H, Dh) @ t32)",
        "w_new = (w.index_select(1, idx).reshape(w.shape[0], H, Dh) @ t32.t())",
        "fold_rows folds W T^T instead of W T into (in, out) weights (GPT-2's Conv1D)",
        {"fold": FOLD, "backend fold/deploy": BACKEND_FOLD},
    ),
    Bug(
        "fold_bias_untouched",
        "kha_compile/model/rows.py",
        "b_new = (b_role.reshape(H, Dh) @ t32).reshape(-1)",
        "b_new = b_role.reshape(H, Dh).reshape(-1)",
        "fold_rows leaves the bias as it was (b instead of b T)",
        {"fold": FOLD, "backend fold/deploy": BACKEND_FOLD},
    ),
    Bug(
        "head_axis_token_side",
        "kha_compile/model/slots.py",
        "seg = fn(seg.reshape(*lead, length // head_dim, head_dim)).reshape(*lead, length)",
        "seg = fn(seg.reshape(*lead, head_dim, length // head_dim).transpose(-1, -2)).transpose(-1, -2)"
        ".reshape(*lead, length)",
        "token-side transforms read each head vector across heads (feature h + H*j, not h*Dh + j)",
        {"apply (identity, wired)": APPLY, "other architectures": ARCHITECTURES},
    ),
    Bug(
        "head_slot_index_axis",
        "kha_compile/model/slots.py",
        "return self.offset + h + torch.arange(self.head_dim)",
        "return (self.offset + h + torch.arange(self.head_dim)).t().reshape(self.num_heads, self.head_dim)",
        "HeadSlot.index() lists features dim-major: folds into fused [Q|K|V] / interleaved weights mix heads",
        {"fold": FOLD, "backend fold/deploy": BACKEND_FOLD, "apply (identity, wired)": APPLY},
    ),
    Bug(
        "loader_drops_k",
        "kha_compile/passes/checkpoint.py",
        "                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))",
        '                if ".kha.k." not in f".{k}":\n'
        "                    params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))",
        "load_pretrained skips every k tensor (the key transforms stay at identity)",
        {"checkpoint round trips": CHECKPOINT},
    ),
    Bug(
        "save_transposed",
        "kha_compile/store/format.py",
        "save_file(tensors, str(directory / WEIGHTS_NAME), metadata=meta)",
        "save_file({k: v.t().contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS_NAME), metadata=meta)",
        "save_pretrained writes every (square) KHA tensor transposed",
        {"checkpoint round trips": CHECKPOINT},
    ),
    Bug(
        "mlp_backward_without_gate",
        "kha_compile/ops/mlp_value.py",
        "grad_v = grad_a @ w_up.t() + grad_g @ w_gate.t()",
        "grad_v = grad_a @ w_up.t()",
        "the MLP-value backward drops the gate term of grad_v (exact while w_gate = 0)",
        {"model gradients (apply, wired)": APPLY, "op": OPS},
    ),
    Bug(
        "mlp_forward_down_transposed",
        "kha_compile/ops/mlp_value.py",
        "return ((v @ w_up) * (2.0 * torch.sigmoid(v @ w_gate))) @ w_down",
        "return ((v @ w_up) * (2.0 * torch.sigmoid(v @ w_gate))) @ w_down.t()",
        "the MLP-value forward multiplies by W_down^T (exact at identity init)",
        {"apply (identity, wired)": APPLY, "op": OPS},
    ),
    Bug(
        "stale_fold_cache",
        "kha_compile/model/carrier.py",
        "        params = self.kha_fold(folded, detach=False)\n",
        "        if torch.is_grad_enabled():\n"
        "            params = self.kha_fold(folded, detach=False)\n"
        "        else:  # planted: a no_grad cache of the fold keyed on the version counters\n"
        "            key = tuple((id(t), t._version) for t in self._kha_sources(folded))\n"
        '            cached = self.__dict__.get("_kha_planted_cache")\n'
        "            if cached is None or cached[0] != key:\n"
        '                cached = self.__dict__["_kha_planted_cache"] = (key, self.kha_fold(folded))\n'
        "            params = cached[1]\n",
        "weight-side inference caches the fold keyed on param._version (fused optimizers do not bump it)",
        {"weight changes": WEIGHT_CHANGES, "Trainer eval": TRAINER, "strategy": STRATEGY},
    ),
    Bug(
        "weight_side_transforms_twice",
        "kha_compile/model/carrier.py",
        "        return self._kha_output(y, folded)",
        "        return self._kha_output(y, ())",
        "weight-side calls also apply the folded transforms to the output (T twice; only above d_model tokens)",
        {"strategy": STRATEGY, "apply (identity, wired)": APPLY},
    ),
    Bug(
        "weight_side_detached",
        "kha_compile/model/carrier.py",
        "        params = self.kha_fold(folded, detach=False)\n",
        "        params = self.kha_fold(folded, detach=True)\n",
        "weight-side training folds detached: W and T get no gradient through the fold",
        {"strategy": STRATEGY, "model gradients (apply, wired)": APPLY},
    ),
    Bug(
        "mha_fold_rows_q_v_swapped",
        "kha_compile/model/mha.py",
        "w, bias = fold_rows(w, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)",
        "w, bias = fold_rows(w, bias, HeadSlot(r, (2 - i) * E, H, Dh, Dh), t, 0, detach=detach)",
        "nn.MultiheadAttention folds T^Q into the value rows of in_proj_weight and T^V into the query rows",
        {"fold": FOLD, "apply (identity, wired)": APPLY},
    ),
    Bug(
        "past_keys_values_swapped",
        "kha_compile/exporters/onnx_past.py",
        "(past[2 * i], past[2 * i + 1]) for i in",
        "(past[2 * i + 1], past[2 * i]) for i in",
        "the with-past ONNX file reads past_key_values.N.value as the keys and .key as the values",
        {"ONNX with past": ONNX_PAST},
    ),
    Bug(
        "static_cache_writes_at_zero",
        "kha_compile/exporters/aoti_generation.py",
        "layer.cumulative_length = cache_position[0].clone()",
        "layer.cumulative_length = cache_position[0].clone() * 0",
        "the generation package writes every call's keys and values at cache position 0",
        {"AOTI generation": AOTI_GENERATION},
    ),
    Bug(
        "greedy_position_off_by_one",
        "kha_compile/exporters/generate.py",
        "        start = tokens.shape[1]\n",
        "        start = tokens.shape[1] + 1\n",
        "the greedy loops feed each new token one position too far (RoPE position and cache slot)",
        {"greedy loops": GENERATE, "ONNX with past": ONNX_PAST},
    ),
    # the blind spots an independent audit found (issue 22, section 5), each with a test of its own now
    Bug(
        "completeness_skips_3d_scores",
        "kha_compile/analysis/completeness.py",
        "if shape is None or len(shape) < 3 or dim is None",
        "if shape is None or len(shape) < 4 or dim is None",
        "a softmax over (B*H, S, S) scores no rule claims is dropped from the report (no site, no reason)",
        {"completeness": COMPLETENESS},
    ),
    Bug(
        "submodule_blocks_first_copy_only",
        "kha_compile/analysis/submodules.py",
        'groups.update({f"{path}.{k}": v for k, v in cap.groups.items()})',
        "pass  # planted: the repeated blocks inside a traced part are forgotten",
        "per-submodule tracing gives KHA only to the first copy of repeated blocks inside a traced part",
        {"submodules": SUBMODULES},
    ),
    Bug(
        "mha_kdim_bias_into_query_slice",
        "kha_compile/model/mha.py",
        "_, bias = fold_rows(rows, bias, HeadSlot(r, i * E, H, Dh, Dh), t, 0, detach=detach)",
        "_, bias = fold_rows(rows, bias, HeadSlot(r, 0, H, Dh, Dh), t, 0, detach=detach)",
        "nn.MultiheadAttention with kdim/vdim folds every role's T into the query slice of in_proj_bias",
        {"nn.MultiheadAttention": MHA, "fold": FOLD},
    ),
    Bug(
        "fuse_mlp_gate_input_unchecked",
        "kha_compile/backend/rules/fuse_mlp_value.py",
        " or a.args[0] is not g.args[0]:",
        ":",
        "the backend fuses 2 * ((x @ W_up) * sigmoid(y @ W_gate)) @ W_down as if y were x",
        {"backend fuse": FUSE},
    ),
    Bug(
        "fold_linear_ignores_other_readers",
        "kha_compile/backend/rules/fold_linear.py",
        "            if (mask & folded).any():",
        "            if False and (mask & folded).any():",
        "the backend folds T into a projection whose raw output another op also reads",
        {"backend fold": BACKEND_FOLD_LINEAR},
    ),
    Bug(
        "deploy_folds_while_training",
        "kha_compile/backend/rules/deploy.py",
        "            ctx.grad_enabled and (w.requires_grad or (b is not None and b.requires_grad))",
        "            False and ctx.grad_enabled and (w.requires_grad or (b is not None and b.requires_grad))",
        "deploy mode folds the checkpoint's transforms (detached) into a weight that requires grad while training",
        {"deploy": DEPLOY},
    ),
    # the forms of issue 22
    Bug(
        "heads_as_modules_not_grouped",
        "kha_compile/analysis/match.py",
        "    sites = group_heads(g, sites)  # heads written as separate modules: one site, one transform per role",
        "    pass",
        "heads written as separate modules each get a T of their own (no KHA between them)",
        {"attention forms (issue 22)": FORMS_MORE},
    ),
    Bug(
        "kv_cache_write_not_followed",
        "kha_compile/analysis/graph.py",
        "                nexts = self.writes.get(node, [])",
        "                nexts = []",
        "the walk stops at a KV cache written in place (slice assignment into a buffer)",
        {"attention forms (issue 22)": FORMS_MORE},
    ),
    Bug(
        "shared_kv_value_on_key_argument",
        "kha_compile/analysis/attention_calls.py",
        'position = "qkv".index(role) if family == "sdpa"',
        'position = 1 if family == "sdpa"',
        "k = v: T^V is applied to the key argument of scaled_dot_product_attention(q, kv, kv)",
        {"attention forms (issue 22)": FORMS_MORE},
    ),
    Bug(
        "index_map_read_as_affine",
        "kha_compile/model/slots.py",
        "        if self.rows is not None:\n            return torch.tensor(self.rows",
        "        if False:\n            return torch.tensor(self.rows",
        "a head layout given as an index map (fused wqkv per kv group) is cut as if it were affine",
        {"attention forms (issue 22)": FORMS_MORE},
    ),
]


@dataclasses.dataclass
class GroupResult:
    group: str
    outcome: str  # "caught" | "survived" | "error"
    by: str  # the first failing test, or why it errored
    seconds: float


def _files(root: pathlib.Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def snapshot(dst: pathlib.Path, tests_from: str | None = None) -> pathlib.Path:
    """Copy the working tree (tracked and untracked, not ignored) to ``dst``, taken once per run.

    ``tests_from``: a git revision whose ``tests/`` replaces the working tree's (to score older tests).
    """
    for rel in _files(ROOT):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    if tests_from:
        shutil.rmtree(dst / "tests")
        archive = subprocess.run(["git", "archive", tests_from, "tests"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(dst)], input=archive.stdout, check=True)
    return dst


def planted(bug: Bug, text: str) -> str:
    """``text`` (of ``bug.file``) with the bug in; a ValueError when its patch does not apply exactly once."""
    count = text.count(bug.old)
    if count != 1:
        raise ValueError(f"{bug.name}: the text to patch occurs {count} times in {bug.file}; update the bug")
    return text.replace(bug.old, bug.new)


def _plant(bug: Bug, tree: pathlib.Path) -> None:
    path = tree / bug.file
    path.write_text(planted(bug, path.read_text()))
    py_compile.compile(str(path), doraise=True)


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return ""


def _run_group(tree: pathlib.Path, group: str, tests: tuple[str, ...], timeout: int) -> GroupResult:
    missing = [t for t in tests if not (tree / t.split("::")[0]).is_file()]
    if missing:
        return GroupResult(group, "n/a", f"no {', '.join(missing)} in these tests", 0.0)
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    start = time.monotonic()
    try:
        res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return GroupResult(group, "error", f"timed out after {timeout} s", time.monotonic() - start)
    seconds = time.monotonic() - start
    output = res.stdout + res.stderr
    if res.returncode == 0:
        return GroupResult(group, "survived", "", seconds)
    first = _first_failure(output)
    if res.returncode == 1 and first:
        return GroupResult(group, "caught", first, seconds)
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    return GroupResult(group, "error", f"pytest exit {res.returncode}: {tail}", seconds)


def run_bug(bug: Bug, base: pathlib.Path, timeout: int, keep: bool) -> list[GroupResult]:
    """Copy the snapshot ``base``, plant ``bug``, run each of its groups; the copy is removed unless ``keep``."""
    tree = pathlib.Path(tempfile.mkdtemp(prefix=f"kha_bug_{bug.name}_"))
    try:
        shutil.copytree(base, tree, dirs_exist_ok=True)
        _plant(bug, tree)
        return [_run_group(tree, g, tests, timeout) for g, tests in bug.groups.items()]
    finally:
        if keep:
            print(f"  kept {tree}", file=sys.stderr)
        else:
            shutil.rmtree(tree, ignore_errors=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def write_doc(
    results: dict[str, list[GroupResult]],
    elapsed: float,
    before: dict[str, list[GroupResult]] | None = None,
    before_rev: str = "",
) -> None:
    caught = sum(all(r.outcome == "caught" for r in rs) for rs in results.values())
    lines = [
        "# Planted bugs: does the suite catch them?",
        "",
        "Written by `python scripts/plant_bugs.py` (run it again after changing the library or the tests).",
        "Each bug is a small patch to one library file, applied to a temporary copy of the repository",
        "(never to the working tree). For each, the tests of the code it breaks run in groups",
        "(`pytest -x -q -p no:cacheprovider`); a group catches the bug when one of its tests fails.",
        "A bug counts as caught when every one of its groups catches it.",
        "",
        f"**Score: {caught} of {len(results)} bugs caught** "
        f"({datetime.date.today().isoformat()}, {elapsed / 60:.0f} min on {os.cpu_count()} cores).",
    ]
    if before is not None:
        old = sum(all(r.outcome == "caught" for r in rs) for rs in before.values())
        lines += [
            "",
            f"The column *tests of {before_rev}* runs the same groups with the `tests/` of commit `{before_rev}`",
            f"(before the per-head reference): {old} of {len(before)} caught there; *n/a*: the group's test",
            "files did not exist yet.",
        ]
    extra = f" tests of {before_rev} |" if before is not None else ""
    lines += [
        "",
        f"| bug | file | what goes wrong | test group | result | first failing test |{extra}",
        "|---|---|---|---|---|---|" + ("---|" if before is not None else ""),
    ]
    by_name = {b.name: b for b in BUGS}
    for name, rs in results.items():
        bug = by_name[name]
        for i, r in enumerate(rs):
            head = f"`{name}` | `{bug.file}` | {_cell(bug.what)}" if i == 0 else " | | "
            tests = ", ".join(f"`{t}`" for t in bug.groups[r.group])
            by = f"`{_cell(r.by)}`" if r.outcome == "caught" else _cell(r.by)
            row = f"| {head} | {r.group} ({tests}) | {r.outcome} ({r.seconds:.0f} s) | {by} |"
            if before is not None:
                b = before[name][i]
                row += f" {b.outcome} |"
            lines.append(row)
    lines += [
        "",
        "The patches themselves are the `BUGS` list in `scripts/plant_bugs.py`.",
        "",
    ]
    DOC.write_text("\n".join(lines))


def _score(bugs: list[Bug], base: pathlib.Path, timeout: int, keep: bool, label: str) -> dict[str, list[GroupResult]]:
    results: dict[str, list[GroupResult]] = {}
    for b in bugs:
        print(f"{b.name}{label}: {b.what}", file=sys.stderr)
        results[b.name] = run_bug(b, base, timeout, keep)
        for r in results[b.name]:
            print(f"  {r.group}: {r.outcome} ({r.seconds:.0f} s) {r.by}", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these bugs")
    parser.add_argument("--list", action="store_true", help="list the bugs and their test groups")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per test group (default 1800)")
    parser.add_argument("--no-write", action="store_true", help=f"do not write {DOC.relative_to(ROOT)}")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    parser.add_argument("--tests-from", metavar="REV", help="score the tests/ of git revision REV instead")
    parser.add_argument("--before", metavar="REV", help="also score the tests/ of REV, as a column of the table")
    args = parser.parse_args(argv)
    bugs = BUGS
    if args.only:
        unknown = set(args.only) - {b.name for b in BUGS}
        if unknown:
            parser.error(f"unknown bugs {sorted(unknown)}; known: {', '.join(b.name for b in BUGS)}")
        bugs = [b for b in BUGS if b.name in args.only]
    if args.list:
        for b in bugs:
            print(f"{b.name}  ({b.file}): {b.what}")
            for g, tests in b.groups.items():
                print(f"    {g}: {' '.join(tests)}")
        return 0
    start = time.monotonic()
    before = None
    with tempfile.TemporaryDirectory(prefix="kha_bug_base_") as tmp:
        base = snapshot(pathlib.Path(tmp) / "now", args.tests_from)
        old = snapshot(pathlib.Path(tmp) / "before", args.before) if args.before else None
        results = _score(bugs, base, args.timeout, args.keep, "")
        elapsed = time.monotonic() - start
        if old is not None:
            before = _score(bugs, old, args.timeout, args.keep, f" (tests of {args.before})")
    caught = [n for n, rs in results.items() if all(r.outcome == "caught" for r in rs)]
    print(f"{len(caught)} of {len(results)} bugs caught in {elapsed / 60:.1f} min", file=sys.stderr)
    if before is not None:
        old_caught = sum(all(r.outcome == "caught" for r in rs) for rs in before.values())
        print(f"with the tests of {args.before}: {old_caught} of {len(before)} caught", file=sys.stderr)
    if not args.no_write and not args.only and not args.tests_from:
        write_doc(results, elapsed, before, args.before or "")
        print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0 if len(caught) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
