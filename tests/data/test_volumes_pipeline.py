"""3D CT classification end to end: NIfTI folders and manifests, the chest-CT and AdrenalMNIST3D
configurations, and whole-volume augmentation before the decomposition."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest
import torch

from ddcnn.data.augment import Augment
from ddcnn.data.convert import npz_to_nifti
from ddcnn.data.sources import nifti
from ddcnn.pipeline import train
from tests.conftest import shared_data


def _write_ct_folder(root, shape=(128, 128, 64), per_class=4):
    """Synthetic CT-like volumes in HU: class 'lesion' has a dense blob, 'normal' does not."""
    rng = np.random.default_rng(0)
    for label in ("lesion", "normal"):
        (root / label).mkdir(parents=True)
        for k in range(per_class):
            vol = rng.normal(-700, 150, size=shape).astype(np.int16)  # lung parenchyma
            if label == "lesion":
                c = rng.integers(30, 90, size=2)
                vol[c[0] - 12 : c[0] + 12, c[1] - 12 : c[1] + 12, 20:40] = 60  # soft tissue
            nib.save(nib.Nifti1Image(vol, np.diag([0.8, 0.8, 2.5, 1.0])), root / label / f"case_{k}.nii.gz")


def test_chest_ct_config_on_generated_folder(make_cfg, tmp_path):
    root = tmp_path / "chest_ct"
    _write_ct_folder(root, per_class=3)
    cfg = make_cfg(
        "experiment=chest_ct",
        f"data.root={root}",
        "model=vgg_tiny",
        "data.train_subset=null",
        "data.test_subset=null",
        "data.val_fraction=0.34",
        "data.source.test_fraction=0.25",
        "data.batch_size=2",
    )
    assert list(cfg.data.source.target_shape) == [128, 128, 64]
    assert list(cfg.data.source.window) == [-1000, 400]
    results = train(cfg)
    assert results["decomposition"]["grid"] == [2, 2, 1]
    assert results["decomposition"]["image_shape"] == [128, 128, 64]
    assert len(results["metrics"]["local"]) == 4
    # The cache holds one preprocessed volume per file, under a folder named by the settings.
    cached = list((root / ".ddcnn_cache").rglob("*.npy"))
    assert len(cached) == 6


def test_windowing_maps_hounsfield_units_to_unit_interval(tmp_path):
    root = tmp_path / "ct"
    _write_ct_folder(root, shape=(16, 16, 8), per_class=3)
    splits = nifti(root, target_shape=(16, 16, 8), window=(-1000, 400), normalize="window", test_fraction=0.34)
    assert splits.x_train.min() >= 0.0 and splits.x_train.max() <= 1.0
    assert splits.x_train.shape[1:] == (1, 16, 16, 8)
    assert splits.class_names == ["lesion", "normal"]


def test_real_adrenal_volumes_through_nifti_manifest(make_cfg, tmp_path):
    archive = shared_data("adrenalmnist3d_28.npz")
    manifest = npz_to_nifti(archive, tmp_path / "adrenal", limit_per_split=24, progress=False)
    splits = nifti(manifest, normalize="none", progress=False)
    raw = np.load(archive)
    assert splits.x_train.shape == (24, 1, 28, 28, 28)
    assert np.array_equal(splits.x_train[0, 0], raw["x_train"][0].astype(np.float32))
    assert splits.x_val is not None and len(splits.y_val) == 24  # the manifest's official split is kept
    cfg = make_cfg(
        "data=nifti",
        f"data.root={manifest}",
        "data.source.target_shape=null",
        "data.source.normalize=none",
        "data.augment=null",
        "data.train_subset=null",
        "data.test_subset=null",
        "decomposition=2x2x2",
    )
    results = train(cfg)
    assert len(results["accuracy"]["local"]) == 8
    assert results["decomposition"]["sub_shape"] == [15, 15, 15]
    for key in ("global", "cnn_dnn", "mean_prob", "majority_vote"):
        m = results["metrics"][key]
        assert 0 <= m["balanced_accuracy"] <= 1 and m["auc"] is not None


def test_adrenal_experiment_config(make_cfg):
    shared_data("adrenalmnist3d_28.npz")
    cfg = make_cfg("experiment=adrenal3d", "model=vgg_tiny", "data.train_subset=64", "data.test_subset=40")
    assert cfg.data.spatial_dims == 3 and list(cfg.decomposition.grid) == [2, 2, 2]
    results = train(cfg)
    with open(f"{cfg.paths.run_dir}/results.json") as fh:
        saved = json.load(fh)
    assert saved["metrics"]["cnn_dnn"]["auc"] is not None
    assert results["data"]["n_val"] == 98  # the official validation split, not a carved one
    assert saved["decomposition"]["sub_shape"] == [18, 18, 18]  # overlap 8


@pytest.mark.parametrize("shape", [(2, 1, 10, 12), (2, 1, 6, 8, 10)])
def test_augmentation_depends_only_on_sample_and_epoch(shape):
    aug = Augment(flip_axes=(0,), rotate_deg=10, seed=3)
    x = torch.randn(*shape)
    idx = torch.tensor([5, 9])
    a, b = aug(x, idx, epoch=1), aug(x, idx, epoch=1)
    assert torch.equal(a, b)
    # The same sample in another batch position gets the same view: consistent across local nets.
    swapped = aug(x.flip(0), idx.flip(0), epoch=1)
    assert torch.equal(swapped.flip(0), a)
    assert not torch.equal(aug(x, idx, epoch=2), a)


def test_flip_only_augmentation_is_an_exact_flip():
    aug = Augment(flip_axes=(1,), seed=0)
    x = torch.arange(2 * 4 * 5, dtype=torch.float32).view(2, 1, 4, 5).repeat(1, 1, 1, 1)
    out = aug(x, torch.tensor([0, 1]), epoch=0)
    for k in range(2):
        assert torch.equal(out[k], x[k]) or torch.equal(out[k], x[k].flip(-1))
    with pytest.raises(ValueError, match="between 0 and 45"):
        Augment(rotate_deg=90)


def test_augmented_local_training_runs(make_cfg):
    cfg = make_cfg("+data.augment.flip_axes=[1]", "+data.augment.rotate_deg=5", "stage=local", "subdomain=0")
    meta = train(cfg)["local"][0]
    assert 0 <= meta["accuracy"]["test"] <= 1
