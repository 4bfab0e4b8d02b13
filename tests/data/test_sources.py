"""Data sources and preparation: real digits, npz archives, torchvision layouts, image folders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddcnn.data.datamodule import TensorDataModule, prepare
from ddcnn.data.sources import digits, image_folder, npz, stratified_split, torchvision_dataset
from tests.conftest import shared_data


def test_digits_split_is_stratified_and_fixed():
    a, b = digits(), digits()
    assert a.x_train.shape[1:] == (1, 8, 8) and a.x_train.dtype == np.uint8
    assert len(a.y_train) + len(a.y_test) == 1797
    assert np.array_equal(a.y_test, b.y_test)
    assert set(np.unique(a.y_test)) == set(range(10))


def test_prepare_normalises_with_training_statistics_and_resizes():
    data = prepare(digits(), num_classes=10, in_channels=1, spatial_dims=2, image_size=(16, 16), val_fraction=0.15)
    assert data.image_shape == (16, 16)
    assert abs(float(data.x["train"].mean())) < 1e-4
    assert abs(float(data.x["train"].std()) - 1) < 1e-2
    assert float(data.x["test"].mean()) != pytest.approx(0.0, abs=1e-6)  # test uses train statistics
    n = sum(len(data.y[s]) for s in ("train", "val", "test"))
    assert n == 1797


def test_stratified_split_keeps_every_class_on_both_sides():
    y = np.repeat(np.arange(5), [2, 3, 10, 20, 7])
    keep, held = stratified_split(y, 0.3, seed=1)
    assert set(y[keep]) == set(y[held]) == set(range(5))
    assert len(np.intersect1d(keep, held)) == 0


def test_npz_archive_and_label_checks(tmp_path):
    x = np.zeros((20, 6, 6), np.uint8)
    path = tmp_path / "a.npz"
    np.savez(path, x_train=x, y_train=np.arange(20) % 3, x_test=x[:5], y_test=np.arange(5) % 3)
    splits = npz(path)
    assert splits.x_train.shape == (20, 1, 6, 6) and splits.num_classes == 3
    with pytest.raises(ValueError, match="labels must be 0..1"):
        prepare(splits, num_classes=2, in_channels=1, spatial_dims=2)
    with pytest.raises(ValueError, match="set data.in_channels=1"):
        prepare(splits, num_classes=3, in_channels=3, spatial_dims=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        npz(tmp_path / "missing.npz")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="corrupt"):
        npz(tmp_path / "bad.npz")


def test_nan_inputs_and_single_class_are_refused(tmp_path):
    x = np.zeros((20, 1, 4, 4), np.float32)
    x[3, 0, 1, 1] = np.nan
    path = tmp_path / "n.npz"
    np.savez(path, x_train=x, y_train=np.arange(20) % 2, x_test=x[:4], y_test=np.arange(4) % 2)
    with pytest.raises(ValueError, match="NaN"):
        prepare(npz(path), num_classes=2, in_channels=1, spatial_dims=2)
    np.savez(path, x_train=x * 0, y_train=np.zeros(20, int), x_test=x[:4] * 0, y_test=np.zeros(4, int))
    with pytest.raises(ValueError, match="single class"):
        prepare(npz(path), num_classes=2, in_channels=1, spatial_dims=2)


def test_real_mnist_archive():
    splits = npz(shared_data("mnist.npz"))
    assert splits.x_train.shape == (60000, 1, 28, 28)
    data = prepare(splits, num_classes=10, in_channels=1, spatial_dims=2, train_subset=500, test_subset=200)
    assert len(data.y["train"]) == 500 and len(data.y["test"]) == 200


def _write_idx(path, array: np.ndarray) -> None:
    # IDX format: magic (0, 0, type 0x08 = ubyte, ndim), big-endian sizes, raw bytes.
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_torchvision_mnist_layout_is_read_without_download(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    _write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 255, (12, 28, 28)))
    _write_idx(raw / "train-labels-idx1-ubyte", np.arange(12) % 10)
    _write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 255, (5, 28, 28)))
    _write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(5))
    splits = torchvision_dataset("mnist", tmp_path)
    assert splits.x_train.shape == (12, 1, 28, 28) and splits.y_test.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(FileNotFoundError, match="never downloads"):
        torchvision_dataset("fashion_mnist", tmp_path)


def test_torchvision_cifar10_layout(tmp_path):
    import pickle

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [*((f"data_batch_{i}", 4) for i in range(1, 6)), ("test_batch", 3)]:
        batch = {"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8), "labels": list(range(n))}
        with open(folder / name, "wb") as fh:
            pickle.dump(batch, fh)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, fh)
    splits = torchvision_dataset("cifar10", tmp_path)
    assert splits.x_train.shape == (20, 3, 32, 32) and splits.x_test.shape == (3, 3, 32, 32)
    assert splits.class_names[0] == "c0"
    # The pixel layout is torchvision's: row-major 1024 red, then green, then blue values per image.
    with open(folder / "data_batch_1", "rb") as fh:
        first = pickle.load(fh)["data"][0]
    assert np.array_equal(splits.x_train[0, 1].ravel(), first[1024:2048])
    (folder / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="lacks \\['test_batch'\\]"):
        torchvision_dataset("cifar10", tmp_path)


def test_image_folder_reads_any_class_per_folder_layout(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for person in ("alice", "bob", "carol"):
        (tmp_path / person).mkdir()
        for k in range(4):
            Image.fromarray(rng.integers(0, 255, (20, 15), dtype=np.uint8)).save(tmp_path / person / f"{k}.png")
    splits = image_folder(tmp_path, image_size=(16, 12), test_fraction=0.25, seed=0)
    assert splits.class_names == ["alice", "bob", "carol"]
    assert splits.x_train.shape[1:] == (1, 16, 12)
    assert sorted(splits.y_test.tolist()) == [0, 1, 2]
    again = image_folder(tmp_path, image_size=(16, 12), test_fraction=0.25, seed=0)
    assert np.array_equal(splits.x_test, again.x_test)


def test_datamodule_batches_and_view():
    x = {s: torch.arange(40, dtype=torch.float32).view(10, 1, 2, 2) for s in ("train", "val", "test")}
    y = {s: torch.arange(10) for s in x}
    dm = TensorDataModule(x, y, batch_size=4, seed=3, view=lambda t: t[..., :1, :])
    assert (dm.batch_size, dm.eval_batch_size, dm.seed) == (4, 16, 3)
    assert dm.size("train") == 10 and dm.labels("val").tolist() == list(range(10))
    idx = torch.tensor([7, 2, 5])
    bx, by = dm.train_batch(idx, 2, "cpu")
    assert by.tolist() == [7, 2, 5] and torch.equal(bx, x["train"][idx][..., :1, :])  # the samples asked for, viewed
    tx, ty = dm.eval_batch("test", torch.arange(10), "cpu")
    assert tx.shape == (10, 1, 1, 2) and ty.tolist() == list(range(10))
    with pytest.raises(ValueError, match="differ in length"):
        TensorDataModule({"train": x["train"]}, {"train": y["train"][:9]})


def test_nifti_manifest_group_column_keeps_each_patient_in_one_split(tmp_path):
    import nibabel as nib

    from ddcnn.data.sources import nifti

    rng = np.random.default_rng(0)
    rows = ["path,label,group"]
    for patient in range(6):
        for visit in range(3):
            name = f"p{patient}_{visit}.nii.gz"
            nib.save(nib.Nifti1Image(rng.normal(size=(6, 6, 4)).astype(np.float32), np.eye(4)), tmp_path / name)
            rows.append(f"{name},{'a' if patient % 2 else 'b'},patient{patient}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    splits = nifti(tmp_path / "manifest.csv", test_fraction=0.34, progress=False)
    assert not set(splits.groups["train"]) & set(splits.groups["test"])
    assert len(splits.y_train) % 3 == 0 and len(splits.y_test) % 3 == 0  # whole patients of 3 visits each
    data = prepare(splits, num_classes=2, in_channels=1, spatial_dims=3, val_fraction=0.25)
    groups = {s: set(data.groups[s].tolist()) for s in ("train", "val", "test")}
    assert all(groups.values()) and not groups["train"] & groups["val"]
    assert sum(len(g) for g in groups.values()) == 6
