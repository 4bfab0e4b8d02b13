"""PNG figures of a run: the decomposition, per-sub-domain accuracy, confusion matrices, training curves.

Every function takes plain arrays (or file paths), writes one titled and labelled PNG and returns its path,
so the evaluate stage (:func:`save_run_plots`), sweep reports and notebooks share them. Figures are built
with :class:`matplotlib.figure.Figure` and the Agg canvas, never with ``pyplot``: no global state, no GUI
backend, safe in worker processes and on machines without a display. Notebooks show the returned files with
``IPython.display.Image``.
"""

from __future__ import annotations

import csv
import logging
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from ddcnn.decomposition import Decomposition

log = logging.getLogger(__name__)

__all__ = [
    "PLOTS_DIR",
    "plot_decomposition",
    "plot_subdomains",
    "plot_heatmap",
    "plot_subdomain_accuracy",
    "plot_confusion_matrices",
    "confusion_figure",
    "class_tick_labels",
    "read_metrics_csv",
    "plot_training_curves",
    "plot_series",
    "plot_grid_comparison",
    "plot_accuracy_vs_time",
    "plot_run_confusion",
    "run_curve_files",
    "save_run_plots",
]

PLOTS_DIR = "plots"
DPI = 110
_MAX_LEGEND = 10  # more lines than this get a colour bar note instead of a legend entry each


def _new_figure(ncols: int = 1, nrows: int = 1, panel: tuple[float, float] = (4.2, 3.6)) -> tuple[Figure, np.ndarray]:
    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).reshape(nrows, ncols)
    return fig, axes


def _wrap(text: str, fig: Figure, fontsize: float = 10) -> str:
    """``text`` broken into lines that fit the figure's width (titles of long decompositions)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name first: a reader (a notebook, a report) never sees half a PNG.
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=DPI, format="png")
    tmp.replace(path)
    return path


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().float().numpy()
    return np.asarray(x)


def _display_image(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """``(C, H, W)`` -> what ``imshow`` takes: grey for one channel, RGB for three, else channel 0."""
    if image.shape[0] == 3:
        rgb = np.moveaxis(image, 0, -1).astype(np.float64)
        lo, hi = rgb.min(), rgb.max()
        return (rgb - lo) / (hi - lo) if hi > lo else np.zeros_like(rgb), None
    return image[0], "gray"


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20" if n <= 20 else "turbo"]
    return [cmap(i % cmap.N) if n <= 20 else cmap(i / max(n - 1, 1)) for i in range(n)]


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h", "*", "p", "H", "d", "8")


def method_style(key: str) -> dict[str, Any]:
    """The colour and marker of one method (a ``METHODS`` key), the same in every plot: each method of the table
    differs from every other in colour and marker (the dark hues of tab20 first, then its light ones), so a line is
    told apart from its legend entry even in a plot of the whole family (``cnn_dnn``, a run's own CNN-DNN, is drawn
    as the paper's, on probabilities). Unknown keys get grey."""
    from matplotlib import colormaps

    from ddcnn.report.results import METHODS

    keys = list(METHODS)
    key = "cnn_dnn_probs" if key == "cnn_dnn" else key
    if key not in keys:
        return {"color": "0.5", "marker": "."}
    i = keys.index(key)
    tab20 = colormaps["tab20"]
    hue = 2 * i if i < 10 else 2 * (i - 10) + 1
    return {"color": tab20(hue % tab20.N), "marker": _MARKERS[i % len(_MARKERS)]}


def _draw_boxes(ax, decomposition: Decomposition, indices: Sequence[int], axes: tuple[int, int]) -> None:
    """Rectangles of the sub-domains ``indices`` in the plane of spatial axes ``axes`` (rows, columns).

    Sub-domains with the same box in this plane (3D: neighbours along the other axis) share one rectangle,
    labelled with all their indices.
    """
    colours = _colours(decomposition.num_subdomains)
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for i in indices:
        box = decomposition.box(i)
        rows, cols = box[axes[0]], box[axes[1]]
        groups.setdefault((rows.start, rows.stop, cols.start, cols.stop), []).append(i)
    for (r0, r1, c0, c1), members in groups.items():
        # Pixel centres sit at integer coordinates in imshow, so a pixel's edges are at +-0.5.
        corner, width, height = (c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0
        c = colours[members[0]]
        ax.add_patch(Rectangle(corner, width, height, facecolor=c, alpha=0.1, edgecolor="none"))
        ax.add_patch(Rectangle(corner, width, height, fill=False, edgecolor=c, linewidth=2.0))
        ax.text(
            c0 + 0.3,
            r0 + 0.3,
            ",".join(map(str, members)),
            color="white",
            fontsize=9,
            fontweight="bold",
            va="top",
            ha="left",
            bbox={"boxstyle": "round,pad=0.15", "facecolor": c, "edgecolor": "none", "alpha": 0.9},
        )


def plot_decomposition(
    image: Any,
    decomposition: Decomposition,
    path: str | Path,
    title: str | None = None,
    num_slices: int = 3,
) -> Path:
    """The sub-domains of ``decomposition`` drawn on one image, or on a few slices of one volume.

    Args:
        image: ``(C, *image_shape)`` or ``(*image_shape)``; any value range (shown scaled).
        decomposition: Its ``image_shape`` must be the image's spatial shape.
        path: The PNG to write.
        title: Figure title; default: the decomposition's description.
        num_slices: 3D only: number of slices along the first axis, evenly spaced.

    Returns:
        ``path``.
    """
    img = _as_numpy(image)
    dims = decomposition.spatial_dims
    if img.ndim == dims:
        img = img[None]
    if img.ndim != dims + 1 or tuple(img.shape[1:]) != tuple(decomposition.image_shape):
        raise ValueError(
            f"plot_decomposition: image of shape {tuple(img.shape)} does not fit the decomposition of "
            f"{tuple(decomposition.image_shape)}; pass (C, *{tuple(decomposition.image_shape)})."
        )
    title = title or decomposition.describe()
    n = decomposition.num_subdomains
    if dims == 2:
        fig, axes = _new_figure(panel=(5.0, 5.0))
        ax = axes[0, 0]
        shown, cmap = _display_image(img)
        ax.imshow(shown, cmap=cmap, interpolation="nearest")
        _draw_boxes(ax, decomposition, range(n), (0, 1))
        ax.set_xlabel("W (pixels)")
        ax.set_ylabel("H (pixels)")
        ax.set_title(_wrap(title, fig), fontsize=10)
        return _save(fig, path)
    depth = decomposition.image_shape[0]
    count = max(1, min(int(num_slices), depth))
    slices = sorted({int(round(v)) for v in np.linspace(0, depth - 1, count)})
    fig, axes = _new_figure(ncols=len(slices), panel=(4.0, 4.8))
    for ax, d in zip(axes[0], slices, strict=True):
        shown, cmap = _display_image(img[:, d])
        ax.imshow(shown, cmap=cmap, interpolation="nearest")
        inside = [i for i in range(n) if decomposition.box(i)[0].start <= d < decomposition.box(i)[0].stop]
        _draw_boxes(ax, decomposition, inside, (1, 2))
        ax.set_title(f"slice D={d}: sub-domains {inside}", fontsize=9)
        ax.set_xlabel("W (voxels)")
        ax.set_ylabel("H (voxels)")
    fig.suptitle(_wrap(title, fig), fontsize=10)
    return _save(fig, path)


def plot_subdomains(
    image: Any,
    decomposition: Decomposition,
    path: str | Path,
    title: str | None = None,
) -> Path:
    """What each local net sees: the sub-images of one image, laid out like the grid (3D: their middle slice).

    Args:
        image: ``(C, *image_shape)`` or ``(*image_shape)``.
        decomposition: Its ``image_shape`` must be the image's spatial shape.
        path: The PNG to write.
        title: Figure title; default: the decomposition's description.
    """
    img = torch.as_tensor(_as_numpy(image), dtype=torch.float32)
    dims = decomposition.spatial_dims
    if img.dim() == dims:
        img = img[None]
    if img.dim() != dims + 1 or tuple(img.shape[1:]) != tuple(decomposition.image_shape):
        raise ValueError(
            f"plot_subdomains: image of shape {tuple(img.shape)} does not fit the decomposition of "
            f"{tuple(decomposition.image_shape)}; pass (C, *{tuple(decomposition.image_shape)})."
        )
    parts = decomposition.split(img[None])[0].numpy()  # (N, C, *sub_shape)
    grid = decomposition.grid
    rows, cols = (grid[0], grid[1]) if dims == 2 else (grid[0] * grid[1], grid[2])
    side = max(1.2, min(3.0, 10.0 / max(rows, cols)))
    fig, axes = _new_figure(ncols=cols, nrows=rows, panel=(side, side))
    lo, hi = float(img.min()), float(img.max())  # one colour scale for all parts, as in the full image
    colours = _colours(decomposition.num_subdomains)
    for i in range(decomposition.num_subdomains):
        ax = axes.flat[i]
        part = parts[i] if dims == 2 else parts[i][:, decomposition.sub_shape[0] // 2]
        shown, cmap = _display_image(part)
        ax.imshow(shown, cmap=cmap, vmin=lo if cmap else None, vmax=hi if cmap else None, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_edgecolor(colours[i])
            spine.set_linewidth(2.5)
        ax.set_title(f"{i}: position {decomposition.position(i)}", fontsize=8)
    sub = "x".join(map(str, decomposition.sub_shape))
    where = "" if dims == 2 else ", middle slice of each"
    fig.suptitle(_wrap(title or f"{decomposition.num_subdomains} sub-images of {sub}{where}", fig), fontsize=10)
    return _save(fig, path)


def _heatmap_ax(
    ax,
    values: np.ndarray,
    *,
    vmin: float | None,
    vmax: float | None,
    fmt: str,
    cmap: str,
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
):
    masked = np.ma.masked_invalid(values.astype(np.float64))
    im = ax.imshow(masked, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="auto")
    lo = masked.min() if vmin is None else vmin
    hi = masked.max() if vmax is None else vmax
    middle = (float(lo) + float(hi)) / 2 if masked.count() else 0.0
    small = values.size > 64
    for (r, c), v in np.ndenumerate(values):
        text = "-" if not np.isfinite(v) else fmt.format(v)
        colour = "black" if not np.isfinite(v) or v > middle else "white"
        ax.text(c, r, text, ha="center", va="center", color=colour, fontsize=6 if small else 9)
    ax.set_xticks(range(values.shape[1]), xticklabels if xticklabels is not None else range(values.shape[1]))
    ax.set_yticks(range(values.shape[0]), yticklabels if yticklabels is not None else range(values.shape[0]))
    return im


def plot_heatmap(
    values: Any,
    path: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    colorbar_label: str = "",
    vmin: float | None = None,
    vmax: float | None = None,
    fmt: str = "{:.3f}",
    cmap: str = "viridis",
) -> Path:
    """A 2D array as an annotated heat map (NaN cells shown as ``-``), e.g. accuracy across runs.

    Args:
        values: ``(rows, columns)``.
        path: The PNG to write.
        title, xlabel, ylabel, colorbar_label: Texts.
        xticklabels, yticklabels: One label per column/row (default: indices).
        vmin, vmax: Colour range (default: the data's).
        fmt: Format of the cell annotations.
        cmap: Matplotlib colour map.
    """
    values = _as_numpy(values).astype(np.float64)
    if values.ndim != 2:
        raise ValueError(f"plot_heatmap: values must be 2D (rows, columns), got shape {values.shape}.")
    rows, cols = values.shape
    fig, axes = _new_figure(panel=(max(3.5, 0.7 * cols + 2.0), max(2.8, 0.55 * rows + 1.5)))
    ax = axes[0, 0]
    im = _heatmap_ax(
        ax, values, vmin=vmin, vmax=vmax, fmt=fmt, cmap=cmap, xticklabels=xticklabels, yticklabels=yticklabels
    )
    fig.colorbar(im, ax=ax, label=colorbar_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(_wrap(title, fig), fontsize=10)
    return _save(fig, path)


def plot_subdomain_accuracy(
    accuracy: Sequence[float] | Any,
    grid: Sequence[int],
    path: str | Path,
    title: str = "Test accuracy of each local net",
    reference: Mapping[str, float | None] | None = None,
) -> Path:
    """Per-sub-domain values laid out like the grid (row-major, last axis fastest); 3D: one panel per layer.

    Args:
        accuracy: One value per sub-domain, in sub-domain order.
        grid: The decomposition grid, e.g. ``(2, 2)`` or ``(2, 2, 2)``.
        path: The PNG to write.
        title: Figure title.
        reference: Optional accuracies named in the title (e.g. ``{"CNN-DNN": 0.97, "global": 0.98}``).
    """
    grid = tuple(int(g) for g in grid)
    values = _as_numpy(accuracy).astype(np.float64).ravel()
    if values.size != math.prod(grid):
        raise ValueError(f"plot_subdomain_accuracy: {values.size} values for a grid {grid} of {math.prod(grid)}.")
    if len(grid) == 2:
        layers = [values.reshape(grid)]
        names = [""]
    elif len(grid) == 3:
        cube = values.reshape(grid)
        layers = [cube[a] for a in range(grid[0])]
        names = [
            f"depth layer {a} (sub-domains {a * grid[1] * grid[2]}..{(a + 1) * grid[1] * grid[2] - 1})"
            for a in range(grid[0])
        ]
    else:
        raise ValueError(f"plot_subdomain_accuracy: grid must have 2 or 3 axes, got {grid}.")
    rows, cols = layers[0].shape
    panel = (max(3.2, 0.8 * cols + 1.6), max(2.8, 0.7 * rows + 1.4))
    fig, axes = _new_figure(ncols=len(layers), panel=panel)
    finite = values[np.isfinite(values)]
    vmin = float(min(finite.min(), 0.9)) if finite.size else 0.0
    im = None
    for ax, layer, name in zip(axes[0], layers, names, strict=True):
        im = _heatmap_ax(ax, layer, vmin=vmin, vmax=1.0, fmt="{:.3f}", cmap="viridis")
        ax.set_xlabel("grid column (last axis)")
        ax.set_ylabel("grid row")
        if name:
            ax.set_title(name, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label="test accuracy")
    extra = ""
    if reference:
        extra = "\n" + ", ".join(f"{k}: {v:.3f}" for k, v in reference.items() if v is not None)
    fig.suptitle(_wrap(f"{title} (grid {'x'.join(map(str, grid))}){extra}", fig), fontsize=10)
    return _save(fig, path)


# Class names up to this long are the tick labels of a confusion matrix; longer ones, or more than _NAMED_CLASSES
# classes, are numbered on the axes and named in an index legend below (a 40-character name under every column of a
# 12-class matrix ran into its neighbours and off the figure).
_TICK_NAME_CHARS = 14
_NAMED_CLASSES = 30
_LEGEND_NAME_CHARS = 48  # a name in the index legend is cut to this many characters (an ellipsis in the middle)
_MAX_TICKS = 60  # beyond this many classes every n-th class is ticked, so that the numbers stay apart


def _shorten(name: str, chars: int) -> str:
    """``name`` cut to ``chars`` characters in the middle: names that share a long start differ at their end."""
    if len(name) <= chars:
        return name
    tail = chars // 3
    return name[: chars - 1 - tail].rstrip() + "…" + name[-tail:].lstrip()


def class_tick_labels(class_names: Sequence[str]) -> tuple[list[str], list[str]]:
    """The tick labels of a confusion matrix's classes and its index legend: the names themselves when they are few
    and short, else the class indices, with ``"i: name"`` lines (names cut to :data:`_LEGEND_NAME_CHARS`)."""
    names = [str(c) for c in class_names]
    if len(names) <= _NAMED_CLASSES and max((len(n) for n in names), default=0) <= _TICK_NAME_CHARS:
        return names, []
    return [str(i) for i in range(len(names))], [f"{i}: {_shorten(n, _LEGEND_NAME_CHARS)}" for i, n in enumerate(names)]


def confusion_figure(
    predictions: Mapping[str, tuple[Any, Any]], class_names: Sequence[str], title: str = "Confusion matrices"
) -> Figure:
    """The figure of :func:`plot_confusion_matrices`, drawn but not saved (tests measure its labels).

    Each panel grows with the class count; long or many class names become numbers with an index legend below the
    panels (:func:`class_tick_labels`), named ticks are slanted so that neighbours do not run into each other.
    """
    if not predictions:
        raise ValueError("plot_confusion_matrices: no predictions given.")
    k = len(class_names)
    ticks, legend = class_tick_labels(class_names)
    fontsize = 9 if k <= 10 else 7 if k <= _MAX_TICKS else 6
    # a cell holds its count up to 20 classes (0.35 in), else a tick number (0.2 in); beyond 12 in a panel the ticks
    # thin out instead (_MAX_TICKS)
    side = min(max(3.6, (0.35 if k <= 20 else 0.2) * k + 1.4), 12.0)
    m = len(predictions)
    width = side * m + 1.2  # the colour bar
    legend_cols = legend_rows = 0
    legend_h = 0.0
    if legend:
        # about 0.55 em a character in the default sans font, and 4 characters between columns; the colour bar's
        # width is not theirs
        column_in = (max(len(line) for line in legend) + 4) * 0.62 * fontsize / 72
        legend_cols = max(1, min(len(legend), int((width - 1.2) // column_in)))
        legend_rows = math.ceil(len(legend) / legend_cols)
        legend_cols = math.ceil(len(legend) / legend_rows)  # no empty column
        legend_h = legend_rows * 1.35 * fontsize / 72 + 0.3
    fig = Figure(figsize=(width, side + legend_h), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2 if legend else 1, m, height_ratios=[side, legend_h] if legend else None)
    axes = [fig.add_subplot(grid[0, j]) for j in range(m)]
    step = math.ceil(k / _MAX_TICKS)
    shown = list(range(0, k, step))
    im = None
    for ax, (name, (labels, predicted)) in zip(axes, predictions.items(), strict=True):
        y, p = _as_numpy(labels).astype(np.int64).ravel(), _as_numpy(predicted).astype(np.int64).ravel()
        if y.shape != p.shape:
            raise ValueError(f"plot_confusion_matrices: {name}: {y.size} labels but {p.size} predictions.")
        counts = np.zeros((k, k), dtype=np.int64)
        np.add.at(counts, (y, p), 1)
        share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        im = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
        if k <= 20:
            for (r, c), v in np.ndenumerate(counts):
                if v:
                    colour = "white" if share[r, c] > 0.5 else "black"
                    ax.text(c, r, str(v), ha="center", va="center", fontsize=7 if k > 10 else 9, color=colour)
        named = not legend
        if named and (k > 6 or max(len(t) for t in ticks) > 4):
            ax.set_xticks(shown, [ticks[i] for i in shown], rotation=45, ha="right", rotation_mode="anchor")
        else:
            ax.set_xticks(shown, [ticks[i] for i in shown], rotation=90 if k > 20 else 0)
        ax.set_yticks(shown, [ticks[i] for i in shown])
        ax.tick_params(labelsize=fontsize)
        numbered = " (numbers: the classes below)" if legend else ""
        ax.set_xlabel("predicted class" + numbered, fontsize=fontsize + 1)
        ax.set_ylabel("true class", fontsize=fontsize + 1)
        acc = float((y == p).mean()) if y.size else float("nan")
        ax.set_title(f"{name}: accuracy {acc:.3f} (n={y.size})", fontsize=9)
    fig.colorbar(im, ax=axes, label="share of the true class", shrink=0.8)
    if legend:
        key = fig.add_subplot(grid[1, :])
        key.axis("off")
        for col in range(legend_cols):
            lines = legend[col * legend_rows : (col + 1) * legend_rows]
            key.text(col / legend_cols, 1.0, "\n".join(lines), transform=key.transAxes, va="top", ha="left",
                     fontsize=fontsize, linespacing=1.2)  # fmt: skip
    fig.suptitle(_wrap(title, fig), fontsize=10)
    return fig


def plot_confusion_matrices(
    predictions: Mapping[str, tuple[Any, Any]],
    class_names: Sequence[str],
    path: str | Path,
    title: str = "Confusion matrices (test split)",
) -> Path:
    """Confusion matrices side by side, one per method: counts annotated, colour = share of the true class; long or
    many class names numbered on the axes and named in an index legend (:func:`confusion_figure`).

    Args:
        predictions: ``{method: (labels, predicted_classes)}``; integer arrays of equal length.
        class_names: Names of the classes, in label order.
        path: The PNG to write.
        title: Figure title.
    """
    return _save(confusion_figure(predictions, class_names, title), path)


def read_metrics_csv(path: str | Path) -> dict[str, np.ndarray]:
    """Per-epoch metrics from a Lightning ``CSVLogger`` file (``metrics.csv``).

    Lightning writes training and validation values of one epoch on separate rows, leaving the other
    columns empty; rows are merged per epoch (mean of the values present).

    Returns:
        ``{"epoch": epochs, column: values per epoch (NaN where absent), ...}``.
    """
    rows: dict[int, dict[str, list[float]]] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c for c in (reader.fieldnames or []) if c not in ("epoch", "step")]
        for row in reader:
            if not row.get("epoch"):
                continue
            epoch = int(float(row["epoch"]))
            slot = rows.setdefault(epoch, {})
            for c in columns:
                if row.get(c):
                    slot.setdefault(c, []).append(float(row[c]))
    epochs = sorted(rows)
    out = {"epoch": np.asarray(epochs, dtype=np.int64)}
    for c in columns:
        out[c] = np.asarray([np.mean(rows[e][c]) if c in rows[e] else np.nan for e in epochs], dtype=np.float64)
    return out


def plot_training_curves(
    curves: Mapping[str, str | Path | Mapping[str, Any]],
    path: str | Path,
    title: str = "Training curves",
) -> Path:
    """Loss and accuracy per epoch (validation solid, training dashed) of several trainings.

    Args:
        curves: ``{label: metrics.csv path or read_metrics_csv(...) dict}``, e.g. ``{"global": ..., "local 0": ...}``.
            Missing files are skipped.
        path: The PNG to write.
        title: Figure title.
    """
    series: dict[str, Mapping[str, Any]] = {}
    for label, source in curves.items():
        if isinstance(source, Mapping):
            series[label] = source
        elif Path(source).is_file():
            series[label] = read_metrics_csv(source)
    fig, axes = _new_figure(ncols=2, panel=(5.0, 3.8))
    colours = _colours(len(series))
    legend = len(series) <= _MAX_LEGEND
    for (label, m), colour in zip(series.items(), colours, strict=True):
        epochs = np.asarray(m.get("epoch", []))
        for ax, metric in zip(axes[0], ("loss", "acc"), strict=True):
            for split, style in (("val", "-"), ("train", "--")):
                values = m.get(f"{split}_{metric}")
                if values is None or not np.isfinite(values).any():
                    continue
                ok = np.isfinite(values)
                ax.plot(
                    epochs[ok],
                    np.asarray(values)[ok],
                    style,
                    color=colour,
                    marker="." if ok.sum() < 3 else None,
                    linewidth=1.5 if legend else 0.8,
                    label=label if legend and split == "val" else None,  # one legend entry per training
                )
    for ax, name in zip(axes[0], ("loss", "accuracy"), strict=True):
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not series:
            ax.text(0.5, 0.5, "no metrics.csv found", ha="center", va="center", transform=ax.transAxes)
    if legend and series:
        axes[0, 1].legend(fontsize=7, loc="best", ncols=2 if len(series) > 5 else 1)
    names = ", ".join(series) if legend else f"{len(series)} trainings"
    fig.suptitle(_wrap(f"{title}: {names}\nsolid: validation, dashed: training", fig), fontsize=10)
    return _save(fig, path)


def plot_series(
    x: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    path: str | Path,
    title: str,
    xlabel: str,
    ylabel: str,
    xticklabels: Sequence[str] | None = None,
    logy: bool = False,
) -> Path:
    """Lines of several named series against one x axis (``None`` values are left out)."""
    fig, axes = _new_figure(panel=(5.5, 4.0))
    _series_ax(axes[0, 0], x, series, xlabel, ylabel, xticklabels, logy)
    axes[0, 0].set_title(_wrap(title, fig), fontsize=10)
    return _save(fig, path)


def _series_ax(ax, x, series, xlabel, ylabel, xticklabels=None, logy=False) -> None:
    x = np.asarray(x, dtype=np.float64)
    for name, ys in series.items():
        y = np.asarray([np.nan if v is None else v for v in ys], dtype=np.float64)
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(x[ok], y[ok], "o-", label=name)
    if xticklabels is not None:
        ax.set_xticks(x, xticklabels)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_accuracy_vs_time(
    curves: Mapping[str, Mapping[str, Sequence[float | None]]],
    path: str | Path,
    title: str = "Accuracy against training time",
    equal: Mapping | None = None,
) -> Path:
    """Validation (solid) and test (dashed, where measured) accuracy of each method against its training time.

    Args:
        curves: ``{method: {"time_s", "val_acc", "test_acc"}}`` (``results.json`` ``curves``).
        equal: ``results.json`` ``speedup_at_equal_accuracy``: the fixed target (set by the global CNN alone,
            ``docs/protocol.md``) is drawn as a dotted line.
    """
    fig, axes = _new_figure(panel=(6.0, 4.2))
    ax = axes[0, 0]
    for name, curve in curves.items():
        style = method_style(name)
        t = np.asarray(curve["time_s"], dtype=np.float64)
        val = np.asarray([np.nan if v is None else v for v in curve["val_acc"]], dtype=np.float64)
        ax.plot(t, val, "-", **style, label=f"{name} (val)", markersize=4)
        test = np.asarray([np.nan if v is None else v for v in curve.get("test_acc", [])], dtype=np.float64)
        ok = np.isfinite(test)
        if ok.any():
            ax.plot(t[ok], test[ok], "--", **style, alpha=0.6, label=f"{name} (test)", markersize=3, fillstyle="none")
    if equal and equal.get("at_global_accuracy"):
        target = equal["at_global_accuracy"]["target_val_acc"]
        ax.axhline(target, color="0.4", linestyle=":", linewidth=1, label="fixed target (global CNN)")
    ax.set_xlabel("training time (s; decomposed methods: on one device per local net)")
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax.set_title(_wrap(title, fig), fontsize=10)
    return _save(fig, path)


def plot_grid_comparison(
    results: Sequence[Mapping], path: str | Path, title: str = "CNN-DNN against grid size"
) -> Path:
    """Test accuracy and training time of several runs (``results.json`` dicts) against their grid size.

    Runs with the same grid (e.g. several seeds) are averaged. Accuracy: global CNN, CNN-DNN, mean probability,
    majority vote; time: global CNN, CNN-DNN sequential and projected on N devices.
    """
    by_grid: dict[tuple[int, ...], list[Mapping]] = {}
    for r in results:
        by_grid.setdefault(tuple(r["decomposition"]["grid"]), []).append(r)
    if not by_grid:
        raise ValueError("plot_grid_comparison: no results given.")
    grids = sorted(by_grid, key=lambda g: (math.prod(g), g))
    labels = ["x".join(map(str, g)) for g in grids]
    x = np.arange(len(grids), dtype=np.float64)

    def mean(get) -> list[float | None]:
        out = []
        for g in grids:
            vals = [v for v in (get(r) for r in by_grid[g]) if v is not None]
            out.append(float(np.mean(vals)) if vals else None)
        return out

    acc = {
        name: mean(lambda r, k=key: r["accuracy"].get(k))
        for name, key in (
            ("global CNN", "global"),
            ("CNN-DNN", "cnn_dnn"),
            ("mean probability", "mean_prob"),
            ("majority vote", "majority_vote"),
        )
    }
    times = {
        "global CNN": mean(lambda r: r["time_s"].get("global")),
        "CNN-DNN, sequential": mean(lambda r: r["time_s"].get("cnn_dnn_sequential")),
        "CNN-DNN, projected on N devices": mean(lambda r: r.get("projected_time_s")),
    }
    fig, axes = _new_figure(ncols=2, panel=(5.2, 4.0))
    _series_ax(axes[0, 0], x, acc, "grid (N sub-domains)", "test accuracy", labels)
    _series_ax(axes[0, 1], x, times, "grid (N sub-domains)", "training time (s)", labels)
    axes[0, 0].set_title("accuracy", fontsize=9)
    axes[0, 1].set_title("time", fontsize=9)
    runs = sum(len(v) for v in by_grid.values())
    fig.suptitle(_wrap(f"{title} ({runs} run{'s' if runs != 1 else ''})", fig), fontsize=10)
    return _save(fig, path)


def plot_run_confusion(
    run, path: str | Path, class_names: Sequence[str] | None = None, title: str = "Test confusion matrices"
) -> Path | None:
    """Confusion matrices of a run's global CNN and CNN-DNN from their saved test predictions.

    Args:
        run: The run directory (a :class:`~ddcnn.rundir.RunDir` or a path).
        path: The PNG to write.
        class_names: Class names in label order; default ``0..K-1``.
        title: Figure title.

    Returns:
        ``path``, or ``None`` when neither the global nor the coarse stage has finished.
    """
    from ddcnn.rundir import RunDir

    run = run if isinstance(run, RunDir) else RunDir(run)
    predictions, num_classes = {}, 0
    for stage, name in (("global", "global CNN"), ("coarse", "CNN-DNN")):
        if run.is_done(stage):
            saved = run.load_probs(stage, "test")
            predictions[name] = (saved["labels"], saved["probs"].argmax(-1))
            num_classes = int(saved["probs"].shape[-1])
    if not predictions:
        return None
    if class_names is None:
        class_names = [str(c) for c in range(num_classes)]
    return plot_confusion_matrices(predictions, class_names, path, title=title)


def run_curve_files(run, num_subdomains: int) -> dict[str, Path]:
    """The Lightning ``metrics.csv`` of every training of a run that wrote one: local nets, coarse, global.

    Args:
        run: The run directory (a :class:`~ddcnn.rundir.RunDir` or a path).
        num_subdomains: Number of local nets.
    """
    from ddcnn.rundir import RunDir

    run = run if isinstance(run, RunDir) else RunDir(run)
    files = {f"local {i}": run.stage_dir("local", i) / "logs" / "metrics.csv" for i in range(num_subdomains)}
    files["coarse"] = run.stage_dir("coarse") / "logs" / "metrics.csv"
    files["global"] = run.stage_dir("global") / "logs" / "metrics.csv"
    return {k: v for k, v in files.items() if v.is_file()}


def save_run_plots(run, decomposition: Decomposition, data, results: Mapping) -> list[Path]:
    """Every figure of a finished (evaluated) run, into ``RUN_DIR/plots/``.

    Args:
        run: The run directory (a :class:`~ddcnn.rundir.RunDir` or a path).
        decomposition: The run's decomposition.
        data: The run's :class:`~ddcnn.data.datamodule.Prepared` data (a test sample and the class names).
        results: What the evaluate stage returned (``results.json``).

    Returns:
        The PNG files written: ``decomposition.png``, ``subdomain_accuracy.png``, ``confusion.png`` (when the
        global CNN or the coarse DNN finished), ``training_curves.png`` and ``accuracy_vs_time.png`` (when the run
        has curves).
    """
    from ddcnn.rundir import RunDir

    run = run if isinstance(run, RunDir) else RunDir(run)
    out_dir = Path(run.root) / PLOTS_DIR
    written = []
    sample = data.sample("test", 0)  # one sample's network input: the data may be memory-mapped and large
    label = data.class_names[int(data.y["test"][0])]
    written.append(
        plot_decomposition(
            sample,
            decomposition,
            out_dir / "decomposition.png",
            title=f"{decomposition.describe()}\n{data.name} test sample 0 (class {label}), normalised",
        )
    )
    acc = results["accuracy"]
    written.append(
        plot_subdomain_accuracy(
            acc["local"],
            decomposition.grid,
            out_dir / "subdomain_accuracy.png",
            title=f"{data.name}: test accuracy of each local net",
            reference={"CNN-DNN": acc.get("cnn_dnn"), "global CNN": acc.get("global")},
        )
    )
    confusion = plot_run_confusion(
        run, out_dir / "confusion.png", data.class_names, title=f"{data.name}: test confusion matrices"
    )
    if confusion is not None:
        written.append(confusion)
    curves = run_curve_files(run, decomposition.num_subdomains)
    written.append(
        plot_training_curves(curves, out_dir / "training_curves.png", title=f"{data.name}, {decomposition.describe()}")
    )
    if results.get("curves"):
        written.append(
            plot_accuracy_vs_time(
                results["curves"],
                out_dir / "accuracy_vs_time.png",
                title=f"{data.name}, {decomposition.describe()}: accuracy against training time",
                equal=results.get("speedup_at_equal_accuracy"),
            )
        )
    log.info("plots: %d figures in %s", len(written), out_dir)
    return written
