"""Pictures of the learned KHA matrices: one row per attention site, one column per matrix.

Example::

    from kha_compile.viz import kha_matrices, plot_kha
    plot_kha(model, "kha.png", delta=True)
"""
from __future__ import annotations

import os
import pathlib
from typing import Optional, Union

import torch
from torch import nn

from .errors import MissingDependencyError, NoKHATransformsError
from .modules import transforms_of
from .passes.handlers import handler_of
from .passes.insert import kha_modules
from .transforms import kind_of

__all__ = ["kha_matrices", "short_labels", "plot_kha", "COLUMN_ORDER"]

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
    return [kept_prefix + ".".join(p[pre:len(p) - post]) for p in parts]


def plot_kha(model: nn.Module, path: Union[str, "os.PathLike[str]"], delta: bool = False,
             title: Optional[str] = None) -> pathlib.Path:
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
        raise MissingDependencyError("viz needs matplotlib: pip install 'kha-compile[viz]'") from e

    sites = kha_matrices(model)
    if not sites:
        raise NoKHATransformsError(f"{type(model).__name__} carries no KHA transforms to plot; apply KHA or "
                                   "load a KHA checkpoint first (kha-compile viz MODEL --kha DIR).")
    present = {c for _, mats in sites for c in mats}
    columns = [c for c in COLUMN_ORDER if c in present] + sorted(present - set(COLUMN_ORDER))
    labels = short_labels([s for s, _ in sites])
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
            arr = a.numpy()
            lim = float(abs(arr).max()) or 1.0
            im = ax.imshow(arr, cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(col + (" − init" if delta else ""), fontsize=11)
            if j == 0:
                ax.set_ylabel(label, fontsize=10)
            cb = fig.colorbar(im, ax=ax, shrink=0.85, pad=0.02)
            cb.ax.tick_params(labelsize=7)
    fig.suptitle(title or f"{type(model).__name__}: KHA matrices per attention site", fontsize=12)
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
