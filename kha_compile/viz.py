"""Pictures and numbers of the learned KHA matrices: heatmaps per site, diagonal mass, loss curves.

Example::

    from kha_compile.viz import diagonal_summary, kha_matrices, plot_kha
    plot_kha(model, "kha.png", with_delta=True)
    rows = diagonal_summary(model)       # diagonal vs off-diagonal mass per layer and role
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .core.errors import MissingDependencyError, NoKHATransformsError
from .handlers import handler_of
from .model.carrier import kha_modules, transforms_of
from .model.transforms import kind_of

__all__ = [
    "COLUMN_ORDER",
    "LOSS_CURVES_FILE",
    "DiagonalRow",
    "diagonal_mass",
    "diagonal_summary",
    "effective_matrices",
    "kha_matrices",
    "load_loss_curves",
    "plot_diagonal",
    "plot_kha",
    "plot_loss_curves",
    "short_labels",
]

COLUMN_ORDER = ["T^Q", "T^K", "T^V", "V up", "V gate", "V down"]


def kha_matrices(model: nn.Module) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """The KHA matrices of ``model`` per attention site: ``[(site path, {"T^Q": T, "V up": W, ...})]``.

    Example::

        sites = kha_matrices(model)
        sites[0][1]["T^Q"].shape          # (head_dim, head_dim)
    """
    sites: dict[str, dict[str, torch.Tensor]] = {}
    for name, m in kha_modules(model):
        site = name if handler_of(m).param_space else (name.rpartition(".")[0] or name)  # MHA: the module is the site
        mats = sites.setdefault(site, {})
        for role, t in transforms_of(m).items():
            for part, mat in kind_of(t).matrices(t).items():  # linear: {"T"}; mlp: {"up", "gate", "down"}
                mats[f"T^{role.upper()}" if part == "T" else f"{role.upper()} {part}"] = mat
    return list(sites.items())


def short_labels(paths: list[str]) -> list[str]:
    """Drop the path components that every site shares at the start and the end.

    Example::

        short_labels(["transformer.h.0.attn", "transformer.h.1.attn"])   # ["h 0", "h 1"]
    """
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
    return [kept_prefix + ".".join(p[pre : len(p) - post]) for p in parts]


def _figure(figsize: tuple[float, float]) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError("viz needs matplotlib: pip install 'kha-compile[viz]'") from e
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | os.PathLike[str]) -> pathlib.Path:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def _sites_or_raise(model: nn.Module) -> list[tuple[str, dict[str, torch.Tensor]]]:
    sites = kha_matrices(model)
    if not sites:
        raise NoKHATransformsError(
            f"{type(model).__name__} carries no KHA transforms to plot; apply KHA or "
            "load a KHA checkpoint first (kha-compile viz MODEL --kha DIR)."
        )
    return sites


def plot_kha(
    model: nn.Module,
    path: str | os.PathLike[str],
    delta: bool = False,
    title: str | None = None,
    with_delta: bool = False,
) -> pathlib.Path:
    """Heatmaps of the KHA matrices of ``model``: one row per attention site, one column per matrix.

    Like the paper's Figure 3: each panel shows the learned matrix itself (T, or W^up, W^gate,
    W^down for MLP-value) on a diverging colour scale centred at 0 and fitted to the panel's own
    range (±max|entry|), with a colour bar per panel. ``with_delta`` adds, next to each matrix that
    starts at the identity, a panel of its change ``T - I`` (again on its own range), where small
    learned structure that the unit diagonal would drown shows up. ``delta`` plots only the change
    from initialisation (T - I; for MLP-value up - I, gate, down - I).

    Example::

        plot_kha(model, "kha.png", with_delta=True)
    """
    sites = _sites_or_raise(model)
    present = {c for _, mats in sites for c in mats}
    base_cols = [c for c in COLUMN_ORDER if c in present] + sorted(present - set(COLUMN_ORDER))
    columns: list[tuple[str, bool]] = []  # (matrix, minus identity?)
    for c in base_cols:
        has_eye = "gate" not in c
        if delta:
            columns.append((c, has_eye))
        else:
            columns.append((c, False))
            if with_delta and has_eye:
                columns.append((c, True))
    labels = short_labels([s for s, _ in sites])
    nrows, ncols = len(sites), len(columns)
    cell = 2.2 if nrows <= 12 else 1.3
    fig = _figure((cell * ncols + 1.2, cell * nrows + 0.9))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, ((_, mats), label) in enumerate(zip(sites, labels)):
        for j, (col, minus_eye) in enumerate(columns):
            ax = axes[i][j]
            if col not in mats:
                ax.axis("off")
                continue
            a = mats[col].float().cpu()
            if minus_eye:
                a = a - torch.eye(a.shape[0])
            arr = a.numpy()
            lim = float(abs(arr).max()) or 1.0
            im = ax.imshow(arr, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                name = col.replace("gate", "gate (init 0)") if "gate" in col else col
                ax.set_title(f"{col} − I" if minus_eye else name, fontsize=11)
            if j == 0:
                ax.set_ylabel(label, fontsize=10)
            cb = fig.colorbar(im, ax=ax, shrink=0.85, pad=0.02)
            cb.ax.tick_params(labelsize=7)
    fig.suptitle(
        title or f"{type(model).__name__}: KHA matrices per attention site (colour range fitted per panel)", fontsize=12
    )
    return _save(fig, path)


def diagonal_mass(a: torch.Tensor) -> float:
    """Share of the squared Frobenius norm on the diagonal: ``||diag(a)||^2 / ||a||_F^2`` (nan if a = 0).

    1 for any diagonal matrix (the identity at KHA's init), 1/d on average for a random dense d x d
    matrix; the off-diagonal mass is ``1 - diagonal_mass(a)``.

    Example::

        diagonal_mass(torch.eye(4))                  # 1.0
        diagonal_mass(torch.ones(4, 4))              # 0.25
    """
    a = a.detach().double()
    total = float(a.square().sum())
    return float(a.diagonal().square().sum()) / total if total > 0 else math.nan


def effective_matrices(model: nn.Module) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Per site, one d x d matrix per role: ``T^Q``, ``T^K``, ``T^V`` as learned; ``V mlp`` for MLP-value.

    For MLP-value (``v~ = 2 ((v W^up) * sigmoid(v W^gate)) W^down``) the matrix is ``W^up @ W^down``:
    the transform's Jacobian at ``v = 0``, where ``2 sigmoid(0) = 1``, i.e. its linear part (the
    identity at init). The gate's own weights are not included.

    Example::

        effective_matrices(model)[0][1]["T^V"].shape     # (head_dim, head_dim)
    """
    out: list[tuple[str, dict[str, torch.Tensor]]] = []
    for site, mats in kha_matrices(model):
        eff = {k: v for k, v in mats.items() if k.startswith("T^")}
        for role in sorted({k.split()[0] for k in mats if " up" in k}):
            eff[f"{role} mlp"] = mats[f"{role} up"].double() @ mats[f"{role} down"].double()
        out.append((site, eff))
    return out


@dataclasses.dataclass(frozen=True)
class DiagonalRow:
    """Diagonal against off-diagonal mass of one role's matrix at one site (see :func:`diagonal_summary`)."""

    site: str
    layer: str
    role: str
    diagonal: float
    off_diagonal: float
    distance_from_identity: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def diagonal_summary(model: nn.Module) -> list[DiagonalRow]:
    """Diagonal vs off-diagonal mass of every KHA matrix, per layer and role (the paper's Figure 3 remark).

    For each matrix M of :func:`effective_matrices` (T itself for linear KHA, ``W^up @ W^down`` for
    MLP-value): ``diagonal = ||diag(M)||^2 / ||M||_F^2``, ``off_diagonal = 1 - diagonal`` (share of
    the squared Frobenius norm off the diagonal; 0 at the identity init, about 1 - 1/d for a dense
    random matrix), and ``distance_from_identity = ||M - I||_F / ||I||_F = ||M - I||_F / sqrt(d)``.

    Example::

        for row in diagonal_summary(model):
            print(row.layer, row.role, round(row.diagonal, 3))
    """
    sites = effective_matrices(model)
    labels = short_labels([s for s, _ in sites])
    rows = []
    for (site, mats), label in zip(sites, labels):
        for role in [c for c in COLUMN_ORDER if c in mats] + sorted(set(mats) - set(COLUMN_ORDER)):
            m = mats[role].detach().double().cpu()
            d = diagonal_mass(m)
            dist = float((m - torch.eye(m.shape[0], dtype=m.dtype)).norm()) / math.sqrt(m.shape[0])
            rows.append(DiagonalRow(site, label, role, d, 1.0 - d, dist))
    return rows


def plot_diagonal(rows: Sequence[DiagonalRow], path: str | os.PathLike[str], title: str | None = None) -> pathlib.Path:
    """Two panels per role over layers: diagonal mass (1 = diagonal, as at init) and ||M - I||_F / sqrt(d).

    Example::

        plot_diagonal(diagonal_summary(model), "diagonal.png")
    """
    if not rows:
        raise NoKHATransformsError("no KHA matrices to summarise; apply KHA or load a KHA checkpoint first.")
    layers = list(dict.fromkeys(r.layer for r in rows))
    roles = list(dict.fromkeys(r.role for r in rows))
    fig = _figure((11.0, 4.0))
    ax_d, ax_i = fig.subplots(1, 2)
    x = list(range(len(layers)))
    for role in roles:
        by_layer = {r.layer: r for r in rows if r.role == role}
        xs = [i for i, lay in enumerate(layers) if lay in by_layer]
        ax_d.plot(xs, [by_layer[layers[i]].diagonal for i in xs], marker="o", label=role)
        ax_i.plot(xs, [by_layer[layers[i]].distance_from_identity for i in xs], marker="o", label=role)
    d0 = min(r.diagonal for r in rows)
    ax_d.set_ylim(max(0.0, d0 - 0.1 * (1 - d0) - 0.02), 1.01)
    ax_d.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax_d.set_title("diagonal mass  ||diag M||² / ||M||²  (off-diagonal = 1 − this)", fontsize=10)
    ax_i.set_title("distance from init  ||M − I||_F / √d", fontsize=10)
    ax_i.set_ylim(bottom=0)
    for ax in (ax_d, ax_i):
        ax.set_xticks(x, layers, rotation=30 if len(layers) > 8 else 0, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "KHA matrices: diagonal vs off-diagonal per layer and role", fontsize=12)
    return _save(fig, path)


LOSS_CURVES_FILE = "loss_curves.json"


def load_loss_curves(directory: str | os.PathLike[str]) -> list[dict[str, Any]] | None:
    """The runs of ``loss_curves.json`` that ``kha-compile demo`` wrote into ``directory`` or its parent.

    ``None`` when there is none (e.g. a checkpoint that the demo did not write).

    Example::

        runs = load_loss_curves("kha_demo_out/kha_checkpoint")   # [{"name": "baseline", "train": ...}, ...]
    """
    d = pathlib.Path(directory)
    for cand in (d / LOSS_CURVES_FILE, d.parent / LOSS_CURVES_FILE):
        if cand.is_file():
            runs: list[dict[str, Any]] = json.loads(cand.read_text())["runs"]
            return runs
    return None


def plot_loss_curves(
    runs: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], title: str | None = None
) -> pathlib.Path:
    """Training (running mean over a tenth of the steps) and validation loss of each run, side by side.

    ``runs`` as in ``loss_curves.json``: ``[{"name": ..., "order_seed": ..., "train": [[step, loss], ...],
    "val": [...]}]``. One colour per name, one line style per data order.

    Example::

        plot_loss_curves(load_loss_curves("kha_demo_out"), "loss.png")
    """
    fig = _figure((11.0, 4.0))
    ax_t, ax_v = fig.subplots(1, 2)
    names = list(dict.fromkeys(str(run["name"]) for run in runs))
    orders = list(dict.fromkeys(run.get("order_seed") for run in runs))
    for run in runs:
        color = f"C{names.index(str(run['name']))}"
        style = ["-", "--", ":", "-."][orders.index(run.get("order_seed")) % 4]
        label = run["name"] if len(orders) < 2 else f"{run['name']}, data order {run.get('order_seed')}"
        steps = [s for s, _ in run["train"]]
        loss = [v for _, v in run["train"]]
        w = max(1, len(loss) // 10)
        mean = [sum(loss[max(0, i - w + 1) : i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(loss))]
        ax_t.plot(steps, mean, color=color, ls=style, label=label)
        ax_v.plot(
            [s for s, _ in run["val"]],
            [v for _, v in run["val"]],
            color=color,
            ls=style,
            marker="o",
            label=f"{label}: {run['val'][-1][1]:.4f}",
        )
    ax_t.set_title(f"training loss per step (running mean of {w} steps)" if runs else "training loss", fontsize=10)
    ax_v.set_title("validation loss", fontsize=10)
    for ax in (ax_t, ax_v):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or "loss curves", fontsize=12)
    return _save(fig, path)
