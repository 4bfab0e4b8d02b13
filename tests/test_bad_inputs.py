"""The bad-input catalogue: each case gives one clear paragraph (what, where, how to fix) and leaves no
partial artifact behind."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ddcnn.pipeline import train
from ddcnn.rundir import ArtifactWriteError, FingerprintMismatch, RunDir


def _npz(tmp_path: Path, kind: str) -> str:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (40, 16, 16), dtype=np.uint8)
    y = np.arange(40) % 10
    path = tmp_path / f"{kind}.npz"
    if kind == "nan":
        xf = x.astype(np.float32)
        xf[5, 3, 3] = np.nan
        np.savez(path, x_train=xf, y_train=y, x_test=xf[:10], y_test=y[:10])
    elif kind == "single_class":
        np.savez(path, x_train=x, y_train=np.zeros(40, int), x_test=x[:10], y_test=np.zeros(10, int))
    elif kind == "corrupt":
        np.savez(path, x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
        path.write_bytes(path.read_bytes()[:300])  # truncated download
    elif kind == "missing_keys":
        np.savez(path, images=x, labels=y)
    return str(path)


def _data(tmp_path: Path, kind: str) -> list[str]:
    return [
        "data=mnist",
        f"data.path={_npz(tmp_path, kind)}",
        "data.train_subset=null",
        "data.test_subset=null",
        "data.image_size=[16,16]",
    ]


def _folder(tmp_path: Path, kind: str = "") -> list[str]:
    """An image folder of 3 classes x 5 grey PNGs (a published train/valid/test split for ``split_mismatch``)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    root = tmp_path / "images"
    splits = ("train", "valid", "test") if kind == "split_mismatch" else ("",)
    for split in splits:
        for c in range(3):
            folder = root / split / (f"c{c}" if not (kind == "split_mismatch" and split == "test" and c == 2) else "x")
            folder.mkdir(parents=True)
            for k in range(5):
                size = (20, 20 + 4 * k) if kind == "sizes" else (20, 20)
                Image.fromarray(rng.integers(0, 255, size, dtype=np.uint8)).save(folder / f"img {k}.png")
    if kind == "truncated":
        path = root / "c1" / "img 2.png"
        path.write_bytes(path.read_bytes()[:60])
    return ["data=image_folder", f"data.root={root}", "data.image_size=[16,16]", "data.batch_size=4"]


# (case id, overrides (a function of tmp_path), exception type, pattern in the message)
CASES = [
    (
        "image_folder_truncated_file",
        lambda t: _folder(t, "truncated"),
        ValueError,
        r"1 of 15 files under .* cannot be read as images: c1/img 2\.png \(.*data\.source\.on_bad_file=skip",
    ),
    (
        "image_folder_num_classes_disagrees",
        lambda t: [*_folder(t), "data.num_classes=4"],
        ValueError,
        r"has 3 classes \(c0, c1, c2\) but data\.num_classes=4; set data\.num_classes=3 or auto",
    ),
    (
        "image_folder_sizes_differ",
        lambda t: [*_folder(t, "sizes"), "data.image_size=null"],
        ValueError,
        r"5 different sizes \(HxW\): 20x20 \(c0/img 0\.png\).*Set data\.image_size=\[H,W\]",
    ),
    (
        "image_folder_split_classes_differ",
        lambda t: _folder(t, "split_mismatch"),
        ValueError,
        r"class folders differ \(missing in test/: c2; in test/ but not in train/: x\).*No partner found for c2 "
        r"\(missing in test/\), x \(in test/ only\)",
    ),
    (
        "image_folder_unknown_resize_mode",
        lambda t: [*_folder(t), "data.resize_mode=fit"],
        ValueError,
        r"data\.resize_mode must be one of \['stretch', 'pad', 'center_crop'\], got 'fit'",
    ),
    (
        "image_folder_two_channels",
        lambda t: [*_folder(t), "data.in_channels=2"],
        ValueError,
        r"data\.in_channels=2 cannot be read from image files.*1, 3 or auto",
    ),
    (
        "image_folder_grayscale_disagrees",
        lambda t: [*_folder(t), "data.source.grayscale=true", "data.in_channels=3"],
        ValueError,
        r"data\.source\.grayscale=true reads 1 channel\(s\) but data\.in_channels=3",
    ),
    ("zero_classes", lambda t: ["data.num_classes=0"], ValueError, r"data\.num_classes must be a positive.* or auto"),
    ("grid_larger_than_image", lambda t: ["decomposition.grid=[20,20]"], ValueError, "at most 16 sub-domains"),
    ("overlap_too_large", lambda t: ["decomposition.overlap=17"], ValueError, "overlap of at most 16"),
    ("negative_overlap", lambda t: ["decomposition.overlap=-1"], ValueError, "must be >= 0"),
    ("non_integer_overlap", lambda t: ["decomposition.overlap=1.5"], ValueError, "whole numbers"),
    ("grid_rank_mismatch", lambda t: ["decomposition=2x2x2"], ValueError, "one entry per spatial axis"),
    (
        "unknown_model",
        lambda t: ["model._target_=ddcnn.models.vgg.vgg99"],
        ValueError,
        "cannot build the network of model",
    ),
    ("unknown_model_argument", lambda t: ["+model.depth=3"], ValueError, "cannot build the network of model"),
    ("unknown_norm", lambda t: ["model.norm=weird"], ValueError, "norm"),
    (
        "input_too_small_for_net",
        lambda t: ["model=resnet_tiny", "model.norm=instance", "decomposition=8x8", "decomposition.overlap=0"],
        ValueError,
        "fails on inputs of shape",
    ),
    (
        "missing_data_file",
        lambda t: ["data=mnist", f"data.path={t}/nowhere/mnist.npz"],
        FileNotFoundError,
        "does not exist",
    ),
    (
        "missing_torchvision_root",
        lambda t: ["data=mnist_torchvision", f"data.root={t}/nowhere"],
        FileNotFoundError,
        "never downloads",
    ),
    ("corrupt_archive", lambda t: _data(t, "corrupt"), ValueError, "corrupt"),
    ("archive_without_expected_arrays", lambda t: _data(t, "missing_keys"), ValueError, "lacks the arrays"),
    ("labels_outside_num_classes", lambda t: ["data.num_classes=5"], ValueError, "labels must be 0..4"),
    ("wrong_in_channels", lambda t: ["data.in_channels=3"], ValueError, "data.in_channels=1"),
    ("wrong_spatial_dims", lambda t: ["data.spatial_dims=3"], ValueError, "spatial_dims"),
    ("unsupported_spatial_dims", lambda t: ["data.spatial_dims=4"], ValueError, "2 \\(images\\) or 3"),
    ("zero_training_subset", lambda t: ["data.train_subset=0"], ValueError, "positive number"),
    ("single_class_training_split", lambda t: _data(t, "single_class"), ValueError, "single class"),
    ("nan_inputs", lambda t: _data(t, "nan"), ValueError, "NaN"),
    ("bad_image_size", lambda t: ["data.image_size=[16]"], ValueError, "2 positive sizes"),
    ("negative_batch_size", lambda t: ["data.batch_size=-4"], ValueError, "data.batch_size must be a positive"),
    ("fractional_epochs", lambda t: ["trainer.max_epochs=1.5"], ValueError, "trainer.max_epochs must be a positive"),
    ("val_fraction_out_of_range", lambda t: ["data.val_fraction=1.5"], ValueError, "strictly between 0 and 1"),
    ("unknown_coarse_input", lambda t: ["coarse.input=features"], ValueError, "'probs' or 'logits'"),
    ("unknown_stage", lambda t: ["stage=fine"], ValueError, "unknown stage"),
    (
        "subdomain_out_of_range",
        lambda t: ["stage=local", "subdomain=7"],
        ValueError,
        "subdomain \\[7\\] does not exist",
    ),
    ("subdomain_not_an_index", lambda t: ["stage=local", "subdomain=abc"], ValueError, "integer index"),
    (
        "global_ddp_devices_do_not_divide_the_batch",
        lambda t: ["methods.enabled.global_ddp=true", "methods.global_ddp.num_devices=3"],
        ValueError,
        "num_devices=3 does not divide data.batch_size=32",
    ),
    (
        "global_ddp_on_one_device",
        lambda t: ["stage=global_ddp", "methods.global_ddp.num_devices=1"],
        ValueError,
        "num_devices must be a whole number >= 2",
    ),
]


def _check_message(err: BaseException, pattern: str) -> None:
    import re

    message = str(err)
    assert re.search(pattern, message), message
    assert "\n" not in message and len(message) < 700, f"not one short paragraph: {message!r}"


@pytest.mark.parametrize(("overrides", "exc", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_configuration_is_explained_and_writes_nothing(make_cfg, tmp_path, overrides, exc, pattern):
    cfg = make_cfg(*overrides(tmp_path))
    with pytest.raises(exc) as info:
        train(cfg)
    _check_message(info.value, pattern)
    run_dir = Path(cfg.paths.run_dir)
    assert not run_dir.exists() or not any(run_dir.iterdir()), f"left behind: {list(run_dir.rglob('*'))}"


def test_run_dir_of_another_configuration(make_cfg):
    train(make_cfg("stage=local", "subdomain=0"))
    run = RunDir(make_cfg().paths.run_dir)
    before = sorted(p.relative_to(run.root) for p in run.root.rglob("*"))
    with pytest.raises(FingerprintMismatch) as info:
        train(make_cfg("stage=local", "subdomain=1", "seed=3"))
    _check_message(info.value, "seed: 0 -> 3")
    assert sorted(p.relative_to(run.root) for p in run.root.rglob("*")) == before


def test_mismatched_saved_probabilities(make_cfg):
    cfg = make_cfg("stage=local")
    train(cfg)
    run = RunDir(cfg.paths.run_dir)
    path = run.stage_dir("local", 2) / "probs_train.pt"
    saved = torch.load(path)
    saved["labels"] = saved["labels"].roll(1)
    torch.save(saved, path)
    with pytest.raises(ValueError) as info:
        train(make_cfg("stage=coarse"))
    _check_message(info.value, "local net 2 .*labels differ")
    assert not run.is_done("coarse")


def test_coarse_before_local_names_the_missing_nets(make_cfg):
    train(make_cfg("stage=local", "subdomain=[0,1]"))
    with pytest.raises(FileNotFoundError) as info:
        train(make_cfg("stage=coarse"))
    _check_message(info.value, r"local nets \[2, 3\] have not finished")


@pytest.fixture
def small_mount(tmp_path):
    """A real 600 KiB file system: too small for the run's checkpoints and predictions."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mnt)], capture_output=True
        ).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name == "done" or p.name.endswith(".tmp")]


def test_disk_full_while_writing(make_cfg, small_mount):
    cfg = make_cfg("model=vgg_small", "stage=local", "subdomain=0", run_dir=small_mount / "run")
    with pytest.raises(ArtifactWriteError) as info:
        train(cfg)
    _check_message(info.value, "No space left on device")
    assert _leftovers(small_mount) == []


def test_read_only_run_directory(make_cfg, small_mount):
    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    cfg = make_cfg("stage=local", "subdomain=0", run_dir=small_mount / "run")
    with pytest.raises(ArtifactWriteError) as info:
        train(cfg)
    _check_message(info.value, "Read-only file system")
