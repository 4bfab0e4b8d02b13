"""The figures of ddcnn.report.plots: real, non-empty PNGs of plausible size, and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest

from ddcnn.decomposition import Decomposition
from ddcnn.report.plots import (
    plot_confusion_matrices,
    plot_decomposition,
    plot_grid_comparison,
    plot_heatmap,
    plot_series,
    plot_subdomain_accuracy,
    plot_training_curves,
    read_metrics_csv,
)
from tests.conftest import assert_real_png

# Lightning's CSVLogger writes training and validation values of an epoch on separate rows.
METRICS_CSV = """epoch,step,train_acc,train_loss,val_acc,val_loss
0,4,,,0.40,1.60
0,4,0.30,1.90,,
1,9,,,0.60,1.20
1,9,0.55,1.40,,
2,14,,,0.70,0.90
2,14,0.68,1.00,,
"""


@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("overlap", [0, 2])
def test_decomposition_overlay(tmp_path, spatial_dims, overlap):
    shape = (16, 12) if spatial_dims == 2 else (10, 12, 8)
    dec = Decomposition((2,) * spatial_dims, shape, overlap)
    image = np.random.default_rng(0).random((1, *shape))
    out = plot_decomposition(image, dec, tmp_path / "dec.png")
    assert out == tmp_path / "dec.png"
    assert_real_png(out)
    rgb = np.random.default_rng(1).random((3, *shape))  # colour images are shown in colour
    assert_real_png(plot_decomposition(rgb, dec, tmp_path / "rgb.png", title="colour"))


def test_decomposition_overlay_refuses_an_image_of_another_shape(tmp_path):
    dec = Decomposition((2, 2), (16, 16), 2)
    with pytest.raises(ValueError, match=r"image of shape \(1, 8, 8\) does not fit the decomposition of \(16, 16\)"):
        plot_decomposition(np.zeros((1, 8, 8)), dec, tmp_path / "x.png")


@pytest.mark.parametrize("grid", [(2, 2), (4, 4), (2, 2, 2), (1, 3)])
def test_subdomain_accuracy_map_is_laid_out_like_the_grid(tmp_path, grid):
    n = int(np.prod(grid))
    accuracy = np.linspace(0.6, 0.95, n)
    assert_real_png(plot_subdomain_accuracy(accuracy, grid, tmp_path / "acc.png", reference={"CNN-DNN": 0.9}))
    with pytest.raises(ValueError, match=f"{n + 1} values for a grid"):
        plot_subdomain_accuracy(np.ones(n + 1), grid, tmp_path / "bad.png")


def test_heatmap_across_runs_with_missing_cells(tmp_path):
    values = np.array([[0.9, 0.85, np.nan], [0.92, 0.88, 0.8]])
    out = plot_heatmap(
        values,
        tmp_path / "heat.png",
        "CNN-DNN accuracy",
        xlabel="grid",
        ylabel="overlap",
        xticklabels=["2x2", "4x4", "8x8"],
        yticklabels=["0", "2"],
        colorbar_label="test accuracy",
    )
    assert_real_png(out)
    with pytest.raises(ValueError, match="must be 2D"):
        plot_heatmap(np.zeros(3), tmp_path / "bad.png", "t", "x", "y")


@pytest.mark.parametrize("num_classes", [5, 10, 40])
def test_confusion_matrices_side_by_side(tmp_path, num_classes):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, num_classes, 300)
    noisy = np.where(rng.random(300) < 0.7, labels, rng.integers(0, num_classes, 300))
    out = plot_confusion_matrices(
        {"global CNN": (labels, labels), "CNN-DNN": (labels, noisy)},
        [f"class {k}" for k in range(num_classes)],
        tmp_path / "cm.png",
    )
    assert_real_png(out)


def test_training_curves_from_lightning_csv(tmp_path):
    csv = tmp_path / "metrics.csv"
    csv.write_text(METRICS_CSV)
    metrics = read_metrics_csv(csv)
    np.testing.assert_array_equal(metrics["epoch"], [0, 1, 2])
    np.testing.assert_allclose(metrics["val_acc"], [0.4, 0.6, 0.7])
    np.testing.assert_allclose(metrics["train_loss"], [1.9, 1.4, 1.0])
    curves = {f"local {i}": csv for i in range(16)} | {"global": csv, "missing": tmp_path / "none.csv"}
    assert_real_png(plot_training_curves(curves, tmp_path / "many.png"))  # 17 trainings: no legend per line
    assert_real_png(plot_training_curves({"coarse": metrics}, tmp_path / "one.png"))


def test_accuracy_and_time_against_grid_size(tmp_path):
    def result(grid, acc, seconds):
        return {
            "decomposition": {"grid": grid},
            "accuracy": {"global": 0.95, "cnn_dnn": acc, "mean_prob": acc - 0.02, "majority_vote": None},
            "time_s": {"global": 10.0, "cnn_dnn_sequential": seconds},
            "projected_time_s": seconds / np.prod(grid),
        }

    runs = [result([2, 2], 0.93, 12.0), result([2, 2], 0.91, 13.0), result([4, 4], 0.9, 20.0)]
    assert_real_png(plot_grid_comparison(runs, tmp_path / "grid.png"))
    out = plot_series(
        [4, 16], {"CNN-DNN": [0.9, None]}, tmp_path / "s.png", "accuracy", "N", "accuracy", ["2x2", "4x4"]
    )
    assert_real_png(out)


def test_every_method_of_the_family_has_its_own_colour_and_marker_in_every_plot(tmp_path):
    """A plot of the whole family (12 methods) must not give two methods one look: the default colour cycle has 10
    colours, so the global CNN and its transfer variant were both blue on the results page."""
    from matplotlib.colors import to_hex

    from ddcnn.report.plots import method_style, plot_accuracy_vs_time
    from ddcnn.report.results import METHODS

    looks = {key: (to_hex(method_style(key)["color"]), method_style(key)["marker"]) for key in METHODS}
    assert len({colour for colour, _ in looks.values()}) == len(METHODS), looks
    assert len({marker for _, marker in looks.values()}) == len(METHODS), looks
    assert method_style("cnn_dnn") == method_style("cnn_dnn_probs")  # a run's own CNN-DNN: the paper's

    curves = {
        key: {"time_s": [1.0, 2.0, 3.0], "val_acc": [0.5, 0.7, 0.8], "test_acc": [None, None, 0.79]}
        for key in ("global", "cnn_dnn", "mean_prob", "e2e", "transfer", "global_transfer", "global_ddp")
    }
    path = plot_accuracy_vs_time(curves, tmp_path / "curves.png")
    assert_real_png(path)


def _inside_and_apart(fig, texts) -> None:
    """Every drawn text of ``texts`` lies inside the figure, and neighbouring ones do not overlap."""
    renderer = fig.canvas.get_renderer()
    figure_box = fig.bbox
    boxes = [t.get_window_extent(renderer) for t in texts if t.get_visible() and t.get_text()]
    assert boxes
    for box in boxes:
        assert figure_box.x0 - 1 <= box.x0 and box.x1 <= figure_box.x1 + 1, "a label runs off the figure"
        assert figure_box.y0 - 1 <= box.y0 and box.y1 <= figure_box.y1 + 1, "a label runs off the figure"
    for a, b in zip(boxes, boxes[1:], strict=False):
        assert not a.overlaps(b), "two labels overlap"


@pytest.mark.parametrize("num_classes", [5, 12, 40, 120])
def test_confusion_matrices_stay_legible_with_long_class_names(num_classes):
    """Issue #45: 40-character class names under every column ran into each other and off the figure. Long names
    are numbered on the axes and named (cut to 48 characters) in an index legend below; the figure grows
    with the class count."""
    from ddcnn.report.plots import class_tick_labels, confusion_figure

    names = [f"Longbranch specimen of a very long class name number {k}" for k in range(num_classes)]
    ticks, legend = class_tick_labels(names)
    assert ticks == [str(k) for k in range(num_classes)]
    # cut in the middle: the names differ only at their end
    assert legend[3] == "3: Longbranch specimen of a very l…ss name number 3" and len(legend) == num_classes
    assert len(set(legend)) == num_classes
    rng = np.random.default_rng(0)
    labels = rng.integers(0, num_classes, 400)
    fig = confusion_figure({"global CNN": (labels, labels), "CNN-DNN": (labels, labels[::-1])}, names, "t")
    fig.canvas.draw()
    for ax in fig.axes[:2]:  # the two panels (then the colour bar and the legend)
        _inside_and_apart(fig, ax.get_xticklabels())
        _inside_and_apart(fig, ax.get_yticklabels()[::-1])
    key = next(ax for ax in fig.axes if any(t.get_text().startswith("0: ") for t in ax.texts))
    assert names[0][:20] in key.texts[0].get_text()
    assert sum(t.get_text().count("\n") + 1 for t in key.texts) == num_classes  # every class named once
    _inside_and_apart(fig, key.texts)
    side = fig.get_figheight()
    small = confusion_figure({"a": (labels % 5, labels % 5)}, [f"c{k}" for k in range(5)], "t")
    assert side > small.get_figheight()  # sized by the class count (and its legend)
    # short names stay the tick labels, slanted past six classes
    ticks, legend = class_tick_labels([f"class {k}" for k in range(12)])
    assert ticks[0] == "class 0" and legend == []
