"""Tests for the NIfTI pipeline: discovery, preprocessing, cache, dataset, conversion and bad input."""

from __future__ import annotations

import csv
import gzip
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from nibabel.testing import data_path as nibabel_data
from torch.utils.data import DataLoader

from ddcnn.data import convert, nifti
from ddcnn.data.convert import arrays_to_nifti, npz_to_nifti, splits_to_nifti
from ddcnn.data.nifti import (
    NiftiCache,
    NiftiDataset,
    NiftiError,
    NiftiIndex,
    NiftiPreprocess,
    load_arrays,
    load_volume,
    scan_nifti,
)

SHARED_DATA = Path(__file__).parents[2].parent / "shared" / "data"
ANATOMICAL = Path(nibabel_data) / "anatomical.nii"  # 3D, LAS orientation, 2 mm voxels
EXAMPLE_4D = Path(nibabel_data) / "example4d.nii.gz"  # (128, 96, 24, 2), LAS


def save(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), path)
    return path


def cache_files(cache_dir: Path) -> list[Path]:
    """Every file under the cache, after checking none is a partial write: no temp file, each entry loads."""
    files = sorted(p for p in cache_dir.rglob("*") if p.is_file()) if cache_dir.exists() else []
    assert not [p for p in files if p.name.endswith(".tmp")], f"temporary files left in {cache_dir}"
    entries = [p for p in files if p.suffix == ".npy"]
    for entry in entries:
        np.load(entry)
    return entries


def minmax(v: np.ndarray) -> np.ndarray:
    axes = tuple(range(1, v.ndim))
    low, high = v.min(axis=axes, keepdims=True), v.max(axis=axes, keepdims=True)
    return (v - low) / np.where(high > low, high - low, 1)


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


def test_round_trip_single_channel_five_classes(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(10, 6, 7, 5), dtype=np.uint8)
    y = np.arange(10) % 5
    manifest = arrays_to_nifti(x, y, tmp_path / "out", class_names=list("abcde"), split_name="train", progress=False)

    index = scan_nifti(manifest)
    assert index.class_names == tuple("abcde")
    raw, labels = load_arrays(index, progress=False)
    assert raw.dtype == np.float32 and raw.shape == (10, 1, 6, 7, 5)
    np.testing.assert_array_equal(raw[:, 0], x)
    np.testing.assert_array_equal(labels, y)

    normed, _ = load_arrays(index, NiftiPreprocess(normalize="minmax"), progress=False)
    expected = np.stack([minmax(v[None].astype(np.float64)) for v in x])
    np.testing.assert_allclose(normed, expected, atol=1e-6)


def test_round_trip_multichannel_zscore(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(50, 10, size=(4, 3, 5, 6, 7)).astype(np.float32)
    y = np.array([0, 1, 2, 1])
    manifest = arrays_to_nifti(x, y, tmp_path, split_name="test", gzip=False, progress=False)

    index = scan_nifti(manifest)
    out, labels = load_arrays(index, NiftiPreprocess(normalize="zscore", channel_axis=3), progress=False)
    assert out.shape == x.shape
    mean = x.mean(axis=(2, 3, 4), keepdims=True)
    std = x.std(axis=(2, 3, 4), keepdims=True)
    np.testing.assert_allclose(out, (x - mean) / std, atol=1e-5)
    np.testing.assert_array_equal(labels, y)


def test_splits_manifest_rerun_replaces_rows_and_stale_files(tmp_path: Path) -> None:
    x = np.zeros((6, 3, 3, 3), np.uint8)
    y = np.array([0, 1, 0, 1, 0, 1])
    arrays_to_nifti(x, y, tmp_path, ["neg", "pos"], "train", progress=False)
    arrays_to_nifti(x[:2], y[:2], tmp_path, ["neg", "pos"], "val", progress=False)
    manifest = arrays_to_nifti(x[:3], y[:3], tmp_path, ["neg", "pos"], "train", progress=False)  # rerun, fewer

    index = scan_nifti(manifest)
    assert index.splits == ("train",) * 3 + ("val",) * 2
    assert len(index.select("train")) == 3 and len(index.select("val")) == 2
    # the three train volumes no longer listed are gone, so a folder scan sees the same files
    assert sorted(scan_nifti(tmp_path).paths) == sorted(index.paths)


def test_splits_to_nifti_writes_one_manifest(tmp_path: Path) -> None:
    x = np.ones((2, 2, 2, 2), np.int64)  # 64-bit ints need an explicit NIfTI dtype
    manifest = splits_to_nifti({"train": (x, [0, 1]), "val": (x[:1], [[1]])}, tmp_path, ["a", "b"], progress=False)
    rows = list(csv.DictReader(manifest.open()))
    assert [(r["split"], r["label"], r["class_name"]) for r in rows] == [
        ("train", "0", "a"),
        ("train", "1", "b"),
        ("val", "1", "b"),
    ]
    out, _ = load_arrays(scan_nifti(manifest), progress=False)
    np.testing.assert_array_equal(out, 1.0)


def test_folder_layout_sorted_classes_and_override(tmp_path: Path) -> None:
    for name, n in [("zebra", 2), ("ant", 1)]:
        for i in range(n):
            save(tmp_path / name / f"v{i}.nii.gz", np.full((2, 2, 2), i, np.float32))
    (tmp_path / "zebra" / "notes.txt").write_text("ignored")
    index = scan_nifti(tmp_path)
    assert index.class_names == ("ant", "zebra") and index.labels == (0, 1, 1) and index.splits is None
    assert scan_nifti(tmp_path, class_names=["zebra", "ant", "bee"]).labels == (1, 0, 0)


@pytest.mark.data
def test_adrenalmnist3d_subset_round_trip(tmp_path: Path) -> None:
    npz = SHARED_DATA / "adrenalmnist3d_28.npz"
    if not npz.is_file():
        pytest.skip(f"real data not available: {npz} is missing (shared data folder absent)")
    manifest = npz_to_nifti(npz, tmp_path / "adrenal", limit_per_split=6, progress=False)

    index = scan_nifti(manifest)
    archive = np.load(npz)
    assert index.class_names == tuple(archive["class_names"])
    for split in ("train", "val", "test"):
        x, y = load_arrays(index, split=split, cache_dir=tmp_path / "cache", progress=False)
        np.testing.assert_array_equal(x[:, 0], archive[f"x_{split}"][:6])
        np.testing.assert_array_equal(y, archive[f"y_{split}"][:6].reshape(-1))
    assert len(cache_files(tmp_path / "cache")) == 18


# ---------------------------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------------------------


def test_nibabel_anatomical_loads_canonical() -> None:
    img = nib.load(ANATOMICAL)
    assert nib.aff2axcodes(img.affine) == ("L", "A", "S")
    volume = load_volume(ANATOMICAL)
    assert volume.shape == (1, 33, 41, 25) and volume.dtype == np.float32
    np.testing.assert_array_equal(volume[0], np.flip(img.get_fdata(), axis=0))  # L->R flips axis 0


def test_nibabel_example4d_needs_channel_axis() -> None:
    with pytest.raises(NiftiError, match=r"example4d\.nii\.gz.*4D volume.*channel_axis"):
        load_volume(EXAMPLE_4D)
    volume = load_volume(EXAMPLE_4D, NiftiPreprocess(channel_axis=3))
    assert volume.shape == (2, 128, 96, 24)
    raw = nib.load(EXAMPLE_4D).get_fdata()
    np.testing.assert_array_equal(volume, np.moveaxis(np.flip(raw, axis=0), -1, 0))
    assert NiftiPreprocess(channel_axis=-1).key() == NiftiPreprocess(channel_axis=3).key()


def test_channel_axis_other_than_last(tmp_path: Path) -> None:
    data = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)  # channels first in the file
    path = save(tmp_path / "c.nii", data)
    np.testing.assert_array_equal(load_volume(path, NiftiPreprocess(channel_axis=0)), data)


def test_flipped_and_permuted_affines_load_equal(tmp_path: Path) -> None:
    data = np.random.default_rng(2).random((4, 5, 6)).astype(np.float32)
    reference = load_volume(save(tmp_path / "ras.nii", data))
    np.testing.assert_array_equal(reference[0], data)

    flipped = np.diag([-1.0, 1.0, 1.0, 1.0])
    flipped[0, 3] = data.shape[0] - 1  # same voxel positions in world space
    np.testing.assert_array_equal(load_volume(save(tmp_path / "las.nii.gz", data[::-1].copy(), flipped)), reference)

    permuted = np.eye(4)[[1, 0, 2, 3]]  # file axes (A, R, S)
    np.testing.assert_array_equal(
        load_volume(save(tmp_path / "ars.nii", data.transpose(1, 0, 2).copy(), permuted)), reference
    )


def test_resampling_to_spacing(tmp_path: Path) -> None:
    data = np.ones((10, 12, 8), np.float32)
    path = save(tmp_path / "v.nii.gz", data, np.diag([2.0, 1.0, 3.0, 1.0]))
    volume = load_volume(path, NiftiPreprocess(spacing=1.0))
    assert volume.shape == (1, 20, 12, 24)
    np.testing.assert_allclose(volume, 1.0)
    assert load_volume(path, NiftiPreprocess(spacing=(4, 2, 3))).shape == (1, 5, 6, 8)
    same = load_volume(path, NiftiPreprocess(spacing=(2, 1, 3)))
    np.testing.assert_array_equal(same[0], data)


def test_window_clips_hu_to_unit_range(tmp_path: Path) -> None:
    hu = np.linspace(-2000, 2000, 5 * 5 * 4, dtype=np.float32).reshape(5, 5, 4)
    path = save(tmp_path / "ct.nii.gz", hu)
    volume = load_volume(path, NiftiPreprocess(window=(-1000, 400), normalize="window"))
    assert volume.min() == 0.0 and volume.max() == 1.0
    np.testing.assert_allclose(volume[0], np.clip((hu + 1000) / 1400, 0, 1), atol=1e-6)
    clipped = load_volume(path, NiftiPreprocess(window=(-1000, 400)))
    assert clipped.min() == -1000 and clipped.max() == 400


def test_resize_to_target_shape(tmp_path: Path) -> None:
    data = np.random.default_rng(3).random((10, 12, 8)).astype(np.float32)
    path = save(tmp_path / "v.nii", data)
    volume = load_volume(path, NiftiPreprocess(target_shape=(16, 6, 9), normalize="minmax"))
    assert volume.shape == (1, 16, 6, 9)
    assert volume.min() >= 0 and volume.max() <= 1  # interpolation of [0, 1] stays in [0, 1]
    assert load_volume(path, NiftiPreprocess(target_shape=(10, 12, 8)))[0].tolist() == data.tolist()
    assert load_volume(path, NiftiPreprocess(dtype="float16")).dtype == np.float16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_shape": (4, 4)}, "target_shape"),
        ({"spacing": (1, 0, 1)}, "spacing"),
        ({"window": (400, -1000)}, "window"),
        ({"normalize": "window"}, "needs window"),
        ({"normalize": "l2"}, "normalize"),
        ({"channel_axis": 4}, "channel_axis"),
        ({"dtype": "int16"}, "dtype"),
    ],
)
def test_preprocess_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NiftiPreprocess(**kwargs)


def test_preprocess_key_is_canonical_and_covers_every_setting() -> None:
    base = NiftiPreprocess(target_shape=[8, 8, 8], spacing=1, window=[-1000, 400], normalize="window")
    assert base == NiftiPreprocess(
        target_shape=(8, 8, 8), spacing=(1.0, 1.0, 1.0), window=(-1000.0, 400.0), normalize="window"
    )
    assert (
        base.key()
        == NiftiPreprocess(target_shape=(8, 8, 8), spacing=(1, 1, 1), window=(-1000, 400), normalize="window").key()
    )
    variants = [
        NiftiPreprocess(),
        NiftiPreprocess(target_shape=(8, 8, 9)),
        NiftiPreprocess(spacing=2),
        NiftiPreprocess(window=(-1000, 400)),
        NiftiPreprocess(normalize="zscore"),
        NiftiPreprocess(normalize="minmax"),
        NiftiPreprocess(channel_axis=3),
        NiftiPreprocess(dtype="float64"),
    ]
    assert len({v.key() for v in [base, *variants]}) == len(variants) + 1


# ---------------------------------------------------------------------------------------------------------------
# Cache and dataset
# ---------------------------------------------------------------------------------------------------------------


def test_cache_reuses_entries_and_separates_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sources = [save(tmp_path / "src" / f"v{i}.nii.gz", np.full((3, 4, 5), i, np.float32)) for i in range(3)]
    prep = NiftiPreprocess(target_shape=(4, 4, 4))
    cache = NiftiCache(tmp_path / "cache", prep)
    assert cache.warm(sources, progress=False) == 3
    assert cache.directory == tmp_path / "cache" / prep.key()
    assert len(cache_files(tmp_path / "cache")) == 3 and (cache.directory / "settings.json").is_file()
    assert cache.warm(sources, progress=False) == 0

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("load_volume called although the volume is cached")

    monkeypatch.setattr(nifti, "load_volume", fail)
    cached = cache.load(sources[2])
    assert isinstance(cached, np.memmap) and cached.shape == (1, 4, 4, 4)
    np.testing.assert_array_equal(cached, 2.0)
    x, _ = load_arrays(NiftiIndex(sources, [0, 0, 0], ["a"]), prep, cache_dir=tmp_path / "cache", progress=False)
    np.testing.assert_array_equal(x[:, 0, 0, 0, 0], [0, 1, 2])
    monkeypatch.undo()

    other = NiftiCache(tmp_path / "cache", NiftiPreprocess(target_shape=(4, 4, 4), normalize="minmax"))
    assert other.directory != cache.directory
    other.load(sources[0])
    assert {p.parent.name for p in cache_files(tmp_path / "cache")} == {prep.key(), other.prep.key()}


def test_cache_reprocesses_edited_file(tmp_path: Path) -> None:
    source = save(tmp_path / "v.nii", np.zeros((2, 2, 2), np.float32))
    cache = NiftiCache(tmp_path / "cache")
    first = cache.entry_path(source)
    cache.load(source)
    size = source.stat().st_size
    save(source, np.ones((2, 2, 2), np.float32))
    assert source.stat().st_size == size  # only the modification time tells the edit apart
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert cache.entry_path(source) != first
    np.testing.assert_array_equal(cache.load(source), 1.0)
    assert len(cache_files(tmp_path / "cache")) == 2


def test_cache_rebuilds_a_damaged_entry(tmp_path: Path) -> None:
    source = save(tmp_path / "v.nii", np.full((2, 2, 2), 7, np.float32))
    cache = NiftiCache(tmp_path / "cache")
    cache.load(source)
    entry = cache.entry_path(source)
    entry.write_bytes(entry.read_bytes()[:40])
    np.testing.assert_array_equal(cache.load(source), 7.0)
    np.testing.assert_array_equal(np.load(entry), 7.0)


# Loads 25 small volumes with progress on, stderr being whatever the test redirects it to.
_LOAD_WITH_PROGRESS = """
import logging, sys
from pathlib import Path
from ddcnn.data.nifti import load_arrays, scan_nifti
if sys.argv[2] == "logging":  # as under ddcnn-train, where Hydra sends log records to the console and a file
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
x, _ = load_arrays(scan_nifti(Path(sys.argv[1])), cache_dir=Path(sys.argv[1]) / "cache")
assert x.shape[0] == 25
"""


@pytest.mark.parametrize("logging_on", [False, True], ids=["plain", "logging"])
def test_progress_in_a_log_file_is_one_line_per_step_without_carriage_returns(tmp_path: Path, logging_on: bool) -> None:
    arrays_to_nifti(np.zeros((25, 2, 2, 2), np.float32), [0] * 25, tmp_path / "data", progress=False)
    log_file = tmp_path / "job.log"
    with log_file.open("wb") as stderr:  # a file, as SLURM's slurm-*.out or `2> log`: not a terminal
        args = [str(tmp_path / "data"), "logging" if logging_on else "plain"]
        cmd = [sys.executable, "-c", _LOAD_WITH_PROGRESS, *args]
        subprocess.run(cmd, cwd=tmp_path, stderr=stderr, check=True, timeout=120)
    text = log_file.read_bytes().decode()  # read_text() would turn every \r into \n
    assert "\r" not in text, repr(text[-500:])
    lines = [line for line in text.splitlines() if "loading NIfTI" in line]
    assert 2 <= len(lines) <= 11, text  # one line per tenth, not one per volume
    assert re.fullmatch(r"(ddcnn\.data: )?loading NIfTI: done, 25 volumes in \d+\.\d s", lines[-1]), lines[-1]
    assert lines[-1].startswith("ddcnn.data: ") == logging_on  # through logging where it is configured


def test_progress_on_a_terminal_is_a_bar_and_nothing_when_there_is_nothing_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    sources = [save(tmp_path / f"v{i}.nii", np.zeros((2, 2, 2), np.float32)) for i in range(12)]
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert NiftiCache(tmp_path / "cache").warm(sources) == 12
    assert "\r" in sys.stderr.getvalue() and "preprocessing NIfTI" in sys.stderr.getvalue()  # tqdm redraws in place
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert NiftiCache(tmp_path / "cache").warm(sources) == 0
    assert sys.stderr.getvalue() == ""  # nothing to preprocess, no bar


def test_files_get_normal_permissions(tmp_path: Path) -> None:
    manifest = arrays_to_nifti(np.zeros((1, 2, 2, 2)), [0], tmp_path / "out", progress=False)
    cache = NiftiCache(tmp_path / "cache")
    cache.load(tmp_path / "out" / "0" / "volume_00000.nii.gz")
    umask = os.umask(0)
    os.umask(umask)
    for path in [manifest, *cache_files(tmp_path / "cache")]:
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path


def test_dataset_items_and_dataloader(tmp_path: Path) -> None:
    x = np.random.default_rng(4).random((5, 1, 4, 4, 4)).astype(np.float32)
    manifest = arrays_to_nifti(x, [0, 1, 2, 0, 1], tmp_path / "out", split_name="val", progress=False)
    dataset = NiftiDataset(scan_nifti(manifest), cache_dir=tmp_path / "cache", split="val")
    assert len(dataset) == 5 and dataset.class_names == ("0", "1", "2")
    for _ in range(2):  # second pass reads the cache
        volume, label = dataset[3]
        assert isinstance(volume, torch.Tensor) and volume.shape == (1, 4, 4, 4) and label == 0
        np.testing.assert_array_equal(volume.numpy(), x[3])
    batch, labels = next(iter(DataLoader(dataset, batch_size=5)))
    assert batch.shape == (5, 1, 4, 4, 4) and labels.tolist() == [0, 1, 2, 0, 1]


# ---------------------------------------------------------------------------------------------------------------
# Bad input: a NiftiError naming the file and the problem, and no partial cache entry
# ---------------------------------------------------------------------------------------------------------------


def _good_and_bad(tmp_path: Path, bad_name: str, write_bad) -> tuple[NiftiIndex, Path]:
    good = [save(tmp_path / "src" / f"good{i}.nii.gz", np.ones((3, 3, 3), np.float32)) for i in range(2)]
    bad = tmp_path / "src" / bad_name
    write_bad(bad)
    return NiftiIndex([*good, bad], [0, 0, 0], ["a"]), bad


def _valid_gz(shape: tuple[int, ...] = (8, 8, 8)) -> bytes:
    data = np.random.default_rng(5).random(shape).astype(np.float32)
    return gzip.compress(nib.Nifti1Image(data, np.eye(4)).to_bytes())


BAD_VOLUMES = {
    "random_bytes.nii.gz": (lambda p: p.write_bytes(os.urandom(500)), "corrupt or truncated"),
    "truncated.nii.gz": (lambda p: p.write_bytes(_valid_gz()[: len(_valid_gz()) // 2]), "corrupt or truncated"),
    "truncated.nii": (
        lambda p: p.write_bytes(nib.Nifti1Image(np.ones((8, 8, 8), np.float32), np.eye(4)).to_bytes()[:700]),
        "corrupt or truncated",
    ),
    "four_d.nii.gz": (lambda p: save(p, np.ones((3, 3, 3, 2), np.float32)), r"4D volume.*channel_axis"),
    "two_d.nii.gz": (lambda p: save(p, np.ones((3, 3), np.float32)), "2D image"),
    "nan.nii.gz": (lambda p: save(p, np.where(np.eye(3)[None] > 0, np.nan, 1).astype(np.float32)), "3 NaN"),
    "inf.nii.gz": (lambda p: save(p, np.full((3, 3, 3), np.inf, np.float32)), "27 infinite"),
}


@pytest.mark.parametrize("bad_name", sorted(BAD_VOLUMES))
def test_bad_volume_raises_and_leaves_no_partial_cache(tmp_path: Path, bad_name: str) -> None:
    write_bad, problem = BAD_VOLUMES[bad_name]
    index, bad = _good_and_bad(tmp_path, bad_name, write_bad)
    with pytest.raises(NiftiError, match=rf"{re.escape(bad_name)}.*{problem}") as info:
        load_arrays(index, cache_dir=tmp_path / "cache", progress=False)
    assert str(bad) in str(info.value)
    assert len(cache_files(tmp_path / "cache")) == 2  # the good volumes, complete
    with pytest.raises(NiftiError, match=problem):
        NiftiCache(tmp_path / "cache").warm([bad], progress=False)
    with pytest.raises(NiftiError, match=problem):
        NiftiDataset(index, cache_dir=tmp_path / "cache")[2]
    assert len(cache_files(tmp_path / "cache")) == 2


def test_mismatched_shapes_name_both_files(tmp_path: Path) -> None:
    a = save(tmp_path / "a.nii.gz", np.zeros((4, 4, 4), np.float32))
    b = save(tmp_path / "b.nii.gz", np.zeros((4, 5, 4), np.float32))
    index = NiftiIndex([a, b], [0, 0], ["x"], source=tmp_path)
    with pytest.raises(
        NiftiError, match=r"b\.nii\.gz.*mismatched volume shapes.*\(1, 4, 5, 4\).*\(1, 4, 4, 4\).*a\.nii\.gz"
    ):
        load_arrays(index, cache_dir=tmp_path / "cache", progress=False)
    assert len(cache_files(tmp_path / "cache")) == 2
    x, _ = load_arrays(index, NiftiPreprocess(target_shape=(4, 4, 4)), progress=False)
    assert x.shape == (2, 1, 4, 4, 4)


def _manifest(tmp_path: Path, lines: list[str]) -> Path:
    save(tmp_path / "vol.nii.gz", np.zeros((2, 2, 2), np.float32))
    path = tmp_path / "manifest.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("lines", "class_names", "problem"),
    [
        (
            ["path,label", "vol.nii.gz,a", "missing.nii.gz,a"],
            None,
            r"row 2 \(line 3\): file 'missing\.nii\.gz' not found",
        ),
        (["path,label", "vol.nii.gz,cat"], ["normal", "hyperplasia"], "row 1 .*unknown label 'cat'"),
        (["path,label", "vol.nii.gz,0", "vol.nii.gz,2"], ["normal", "hyperplasia"], "row 2 .*out of range label '2'"),
        (["path,label", "vol.nii.gz,-1"], None, "out of range label '-1'"),
        (["path,label", "vol.nii.gz,0", "vol.nii.gz,cat"], None, "row 2 .*mixes class names and integer labels"),
        (["path,label,split", "vol.nii.gz,0,training"], None, "unknown split 'training'"),
        (["path,label,class_name", "vol.nii.gz,0,a", "vol.nii.gz,0,b"], None, "row 2 .*named 'b' here but 'a'"),
        (["path,label"], None, "empty dataset"),
        (["file,class", "vol.nii.gz,0"], None, "header row with columns path,label"),
        (["\ufeffpath,label", "vol.nii.gz,0", "nowhere.nii,0"], None, "row 2 .*'nowhere.nii' not found"),
    ],
)
def test_bad_manifest(tmp_path: Path, lines: list[str], class_names: list[str] | None, problem: str) -> None:
    manifest = _manifest(tmp_path, lines)
    with pytest.raises(NiftiError, match=problem) as info:
        scan_nifti(manifest, class_names)
    assert str(manifest) in str(info.value)


def test_manifest_paths_relative_absolute_and_named_labels(tmp_path: Path) -> None:
    manifest = _manifest(tmp_path, ["path,label,split", f"{tmp_path / 'vol.nii.gz'},b,train", "", "vol.nii.gz,a,test"])
    index = scan_nifti(manifest)
    assert index.class_names == ("a", "b") and index.labels == (1, 0) and index.splits == ("train", "test")
    assert index.paths == (tmp_path / "vol.nii.gz",) * 2
    assert scan_nifti(manifest, ["b", "a"]).labels == (0, 1)


def test_binary_file_as_manifest(tmp_path: Path) -> None:
    path = tmp_path / "volume.nii.gz"
    path.write_bytes(_valid_gz())
    with pytest.raises(NiftiError, match=r"volume\.nii\.gz: not a readable CSV manifest"):
        scan_nifti(path)


def test_empty_class_folder(tmp_path: Path) -> None:
    save(tmp_path / "full" / "v.nii.gz", np.zeros((2, 2, 2), np.float32))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no volumes")
    with pytest.raises(NiftiError, match=r"empty.*empty class folder"):
        scan_nifti(tmp_path)


def test_folder_not_in_class_names(tmp_path: Path) -> None:
    save(tmp_path / "dog" / "v.nii.gz", np.zeros((2, 2, 2), np.float32))
    with pytest.raises(NiftiError, match=r"unknown label, class folder\(s\) \['dog'\]"):
        scan_nifti(tmp_path, ["cat"])


def test_empty_dataset(tmp_path: Path) -> None:
    save(tmp_path / "loose.nii.gz", np.zeros((2, 2, 2), np.float32))
    with pytest.raises(NiftiError, match=r"empty dataset.*1 NIfTI file"):
        scan_nifti(tmp_path)
    with pytest.raises(NiftiError, match="no such folder"):
        scan_nifti(tmp_path / "nowhere")
    empty = NiftiIndex([], [], ["a"], source=tmp_path)
    with pytest.raises(NiftiError, match="empty dataset"):
        load_arrays(empty, cache_dir=tmp_path / "cache")
    with pytest.raises(NiftiError, match="empty dataset"):
        NiftiDataset(empty)
    index = NiftiIndex([tmp_path / "loose.nii.gz"], [0], ["a"], splits=["train"], source=tmp_path)
    with pytest.raises(NiftiError, match="empty dataset, no volume in split 'test'"):
        load_arrays(index, split="test")
    with pytest.raises(NiftiError, match="no split column"):
        NiftiDataset(NiftiIndex([tmp_path / "loose.nii.gz"], [0], ["a"]), split="val")
    assert cache_files(tmp_path / "cache") == []


# ---------------------------------------------------------------------------------------------------------------
# Converter
# ---------------------------------------------------------------------------------------------------------------


def test_interrupted_conversion_leaves_no_half_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"n": 0}
    real = convert._nifti_bytes

    def interrupted(*args: object) -> bytes:
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args)

    def half_written(*args: object, **kwargs: object) -> bytes:
        raise OSError("disk full")

    monkeypatch.setattr(convert, "_nifti_bytes", interrupted)
    with pytest.raises(KeyboardInterrupt):
        arrays_to_nifti(np.zeros((5, 2, 2, 2)), [0] * 5, tmp_path, split_name="train", progress=False)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["train_00000.nii.gz", "train_00001.nii.gz"]  # complete volumes only, no temp, no manifest
    for path in tmp_path.rglob("*.nii.gz"):
        np.testing.assert_array_equal(load_volume(path), 0)

    monkeypatch.setattr(convert, "gzip_compress", half_written)
    with pytest.raises(OSError, match="disk full"):
        arrays_to_nifti(np.zeros((5, 2, 2, 2)), [0] * 5, tmp_path, split_name="train", progress=False)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == files


@pytest.mark.parametrize(
    ("x", "y", "problem"),
    [
        (np.zeros((2, 4, 4)), [0, 1], r"\(N, D, H, W\)"),
        (np.zeros((2, 4, 4, 4)), [0], "2 integer labels"),
        (np.zeros((2, 4, 4, 4)), [0.5, 1], "integer labels"),
        (np.zeros((2, 4, 4, 4)), [0, 3], "out of range"),
    ],
)
def test_converter_rejects_bad_arrays(tmp_path: Path, x: np.ndarray, y: list, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        arrays_to_nifti(x, y, tmp_path, class_names=["a", "b"], progress=False)
    assert not list(tmp_path.iterdir())


def test_convert_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    npz = tmp_path / "tiny.npz"
    x = np.arange(4 * 27, dtype=np.uint8).reshape(4, 3, 3, 3)
    np.savez(
        npz,
        x_train=x,
        y_train=np.array([[0], [1], [1], [0]]),
        x_test=x[:2],
        y_test=np.array([1, 0]),
        class_names=np.array(["no", "yes"]),
    )
    assert convert.main([str(npz), str(tmp_path / "out"), "--limit", "3", "--no-gzip"]) == 0
    assert "wrote 5 volumes" in capsys.readouterr().out
    index = scan_nifti(tmp_path / "out" / "manifest.csv")
    assert index.class_names == ("no", "yes") and index.splits == ("train",) * 3 + ("test",) * 2
    xs, ys = load_arrays(index, split="train", progress=False)
    np.testing.assert_array_equal(xs[:, 0], x[:3])
    assert ys.tolist() == [0, 1, 1]

    np.savez(tmp_path / "flat.npz", x_train=np.zeros((2, 3, 3)), y_train=np.zeros(2, int))
    assert convert.main([str(tmp_path / "flat.npz"), str(tmp_path / "flat")]) == 1
    assert "(N, D, H, W)" in capsys.readouterr().err


def test_the_source_names_each_volume_by_its_file_for_the_split_manifest(tmp_path: Path) -> None:
    """Issue #45 item 7: ``RUN_DIR/splits.csv`` names each volume by the file it was read from; the source carries
    each split's files in the order of its volumes."""
    from ddcnn.data.sources import nifti

    for name in ("ant", "zebra"):
        for i in range(5):
            save(tmp_path / "set" / name / f"v{i}.nii.gz", np.full((2, 2, 2), i + 10 * (name == "zebra"), np.float32))
    splits = nifti(tmp_path / "set", test_fraction=0.4, cache_dir=tmp_path / "cache", progress=False)
    for split, x, y in (("train", splits.x_train, splits.y_train), ("test", splits.x_test, splits.y_test)):
        files = splits.files[split]
        assert len(files) == len(y) and all(Path(f).is_file() for f in files)
        for path, volume, label in zip(files, x, y, strict=True):
            assert Path(path).parent.name == splits.class_names[label]
            assert float(volume.max()) == int(Path(path).name[1]) + 10 * (label == 1)  # this very file's values
