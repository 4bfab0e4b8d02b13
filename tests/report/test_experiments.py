"""The experiment configurations (conf/experiment/) compose, their sweeps give valid runs, and the face-folder
experiment runs through the real pipeline on a small generated folder."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from ddcnn.context import build_local_net
from ddcnn.decomposition import Decomposition
from ddcnn.pipeline import train
from ddcnn.report.compare import load_run, write_report
from ddcnn.rundir import RunDir
from ddcnn.settings import RunSettings
from tests.conftest import CONFIG_DIR, compose_config

# experiment -> (data.name, image shape, channels, local nets of the sweep)
EXPERIMENTS = {
    "mnist": ("mnist", (28, 28), 1, {"vgg_small", "resnet10"}),
    "fashion_mnist": ("fashion_mnist", (28, 28), 1, {"vgg_small", "resnet10"}),
    "cifar10": ("cifar10", (32, 32), 3, {"vgg11", "resnet18"}),
    "faces": ("faces", (56, 46), 1, {"vgg_small", "resnet10"}),
}


def _compose(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


class _Shape:
    """What the network builders need from the data (the datasets themselves are not read here)."""

    def __init__(self, cfg) -> None:
        self.spatial_dims, self.in_channels, self.num_classes = 2, int(cfg.data.in_channels), int(cfg.data.num_classes)


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_composes_and_every_run_of_its_sweep_can_start(experiment):
    name, image_shape, channels, models = EXPERIMENTS[experiment]
    cfg = _compose([f"experiment={experiment}"])
    assert cfg.data.name == name and cfg.data.in_channels == channels and cfg.data.num_classes >= 10
    assert all(cfg.methods.enabled.values()), "the paper-style experiments report every method"
    params = cfg.hydra.sweeper.params
    assert set(params["model"].split(",")) == models
    assert set(params["decomposition"].split(",")) == {"2x2", "4x4"}
    overlaps = [int(v) for v in str(params["decomposition.overlap"]).split(",")]
    assert 0 in overlaps and max(overlaps) > 0
    grids = [tuple(OmegaConf.load(Path(CONFIG_DIR) / "decomposition" / f"{g}.yaml").grid) for g in ("2x2", "4x4")]
    for model in sorted(models):
        run = _compose([f"experiment={experiment}", f"model={model}"])
        assert run.model.name == model and run.data.name == name  # the sweep's choice wins over the experiment's
        net = build_local_net(RunSettings.from_config(run), _Shape(run)).eval()
        for grid, overlap in itertools.product(grids, overlaps):
            dec = Decomposition(grid, image_shape, overlap)
            with torch.no_grad():
                assert net(torch.zeros(2, channels, *dec.sub_shape)).shape == (2, run.data.num_classes)


def test_real_mnist_archives_are_the_experiments_data():
    for experiment in ("mnist", "fashion_mnist"):
        cfg = compose_config([f"experiment={experiment}"], tiny=False)
        assert cfg.data.path.endswith(f"{experiment}.npz")
        assert cfg.data.source._target_ == "ddcnn.data.sources.npz"


def _face_folder(root, persons: int = 12, images: int = 6, shape=(20, 16)) -> None:
    """One sub-folder per person: a person-specific pattern plus noise, grayscale PNGs of varying brightness."""
    rng = np.random.default_rng(0)
    for p in range(persons):
        face = rng.uniform(0, 255, size=shape)
        folder = root / f"person_{p:02d}"
        folder.mkdir(parents=True)
        for k in range(images):
            img = np.clip(0.8 * face + rng.normal(0, 20, size=shape) + 10 * k, 0, 255).astype(np.uint8)
            Image.fromarray(img).save(folder / f"{k}.png")


def test_face_folder_experiment_runs_through_the_pipeline(tmp_path):
    faces = tmp_path / "faces"
    _face_folder(faces)
    run_dir = tmp_path / "run"
    cfg = compose_config(
        [
            "experiment=faces",
            "methods=default",
            "methods.enabled.coarse_alt=false",
            f"data.root={faces}",
            "data.num_classes=12",
            "data.image_size=[16,16]",
            "++report.plots=false",
            "++report.export=false",
        ],
        run_dir,
    )
    results = train(cfg)
    # 30% of each person's 6 images (2) are test images; every person is in train and test.
    assert results["data"]["n_test"] == 24 and results["data"]["n_train"] + results["data"]["n_val"] == 48
    run = RunDir(run_dir)
    for split in ("train", "test"):
        assert set(run.load_probs("local", split, 0)["labels"].tolist()) == set(range(12))
    assert results["decomposition"]["sub_shape"] == [10, 10]  # 2x2 with overlap 4 of 16x16
    assert {row["key"] for row in results["methods"]} == {
        "global",
        "mean_prob",
        "majority_vote",
        "cnn_dnn_probs",
        "cnn_dnn_val",
        "stacker",
    }
    written = write_report([load_run(run_dir)], tmp_path / "report", plots=False)
    assert (tmp_path / "report" / "faces.md") in written["markdown"]
