"""Prepared data: compact storage with the float32 path's numbers, statistics in float64, in memory or in the store."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddcnn.data.prepare import DataDoesNotFit, Prepared, PrepareSettings, load_prepared, prepare
from ddcnn.data.progress import Progress
from ddcnn.data.sources import Splits, digits, npz
from ddcnn.store import Store
from tests.conftest import prepare_settings, shared_data

ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "val", "test")


def _float32_path(splits: Splits, image_size=None, val_fraction=0.1, seed=0, mean=None, std=None):
    """The float32 preparation ddcnn used before compact storage, kept here as the reference: every split scaled
    (uint8 / 255) and resized as float32, then normalised with float32 statistics of the training split (or the
    given ones)."""
    from ddcnn.data.sources import stratified_split

    x = {"train": np.asarray(splits.x_train), "test": np.asarray(splits.x_test)}
    if splits.x_val is not None:
        x["val"] = np.asarray(splits.x_val)
    else:
        keep, held = stratified_split(splits.y_train, val_fraction, seed)
        x["val"], x["train"] = x["train"][held], x["train"][keep]

    def to_float(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t.to(torch.float32).div_(255.0) if t.dtype == torch.uint8 else t.to(torch.float32)

    out = {s: to_float(v) for s, v in x.items()}
    if image_size is not None:
        mode = {2: "bilinear", 3: "trilinear"}[len(image_size)]
        out = {s: F.interpolate(v, size=image_size, mode=mode, align_corners=False) for s, v in out.items()}
    dims = [0, *range(2, out["train"].dim())]
    mean = out["train"].mean(dim=dims) if mean is None else mean
    std = out["train"].std(dim=dims).clamp_min(1e-6) if std is None else std
    view = (1, -1) + (1,) * (out["train"].dim() - 2)
    return {s: (v - mean.view(view)) / std.view(view) for s, v in out.items()}, mean, std


def _float64_stats(values: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    v = values.double().transpose(0, 1).reshape(values.shape[1], -1).numpy()
    return v.mean(axis=1), v.std(axis=1, ddof=1)


def _hu_splits(n=40, shape=(6, 8, 10), dtype=np.int16, seed=0) -> Splits:
    rng = np.random.default_rng(seed)
    x = rng.integers(-1024, 2000, size=(n, 1, *shape)).astype(dtype)
    y = rng.integers(0, 3, size=n)
    y[:3] = [0, 1, 2]
    return Splits(x[:30], y[:30], x[30:], y[30:], class_names=["a", "b", "c"], name="hu")


def test_uint8_data_stay_uint8_and_reach_the_network_bitwise_as_before():
    splits = npz(shared_data("adrenalmnist3d_28.npz"), spatial_dims=3)
    data = prepare(splits, num_classes=2, in_channels=1, spatial_dims=3)
    assert data.stored_dtype == torch.uint8 and data.nbytes() == sum(
        v.size for v in (splits.x_train, splits.x_val, splits.x_test)
    )
    old, old_mean, old_std = _float32_path(splits)
    # The float64 statistics, rounded to float32, are those the float32 path computed (checked on this data set).
    assert torch.equal(data.mean, old_mean) and torch.equal(data.std, old_std)
    for split in SPLITS:
        assert torch.equal(data.inputs(split), old[split]), split
        assert torch.equal(data.y[split], torch.from_numpy(getattr(splits, f"y_{split}")))


def test_statistics_are_computed_once_in_float64():
    splits = _hu_splits(n=200, shape=(16, 16, 8))
    data = prepare(splits, num_classes=3, in_channels=1, spatial_dims=3, val_fraction=0.2)
    assert data.stored_dtype == torch.int16  # Hounsfield units stay int16
    mean64, std64 = _float64_stats(data.stored["train"].to(torch.float32))
    assert np.allclose(data.info["stats"]["mean"], mean64, rtol=1e-15, atol=0)
    assert np.allclose(data.info["stats"]["std"], std64, rtol=1e-14, atol=0)
    assert torch.equal(data.mean, torch.tensor(mean64).float()) and torch.equal(data.std, torch.tensor(std64).float())
    # The network sees the float32 path's formula with these constants, bitwise.
    old, _, _ = _float32_path(splits, val_fraction=0.2, mean=data.mean, std=data.std)
    for split in SPLITS:
        assert torch.equal(data.inputs(split), old[split])


def test_resized_and_float_data_are_float32_unless_float16_is_asked_for():
    splits = digits()
    exact = prepare(splits, num_classes=10, in_channels=1, spatial_dims=2, image_size=(16, 16), val_fraction=0.15)
    old, old_mean, old_std = _float32_path(splits, image_size=(16, 16), val_fraction=0.15)
    assert exact.stored_dtype == torch.float32 and torch.equal(exact.mean, old_mean)
    assert all(torch.equal(exact.inputs(s), old[s]) for s in SPLITS)
    half = prepare(
        splits, num_classes=10, in_channels=1, spatial_dims=2, image_size=(16, 16), val_fraction=0.15,
        float_storage="float16",
    )  # fmt: skip
    assert half.stored_dtype == torch.float16 and half.nbytes() * 2 == exact.nbytes()
    # Values in [0, 1] (uint8 / 255, resized) rounded to float16: at most 2^-12 off, 2^-11 relative.
    err = (half.stored["train"].float() - exact.stored["train"]).abs()
    assert 0 < float(err.max()) <= 2.0**-12
    assert float((err / exact.stored["train"].abs().clamp_min(1e-30)).max()) <= 2.0**-11
    # The statistics are those of the values the network sees.
    mean64, std64 = _float64_stats(half.stored["train"].float())
    assert np.allclose(half.info["stats"]["mean"], mean64, rtol=1e-14)


def test_a_window_maps_hounsfield_units_to_the_unit_interval_before_normalising():
    splits = _hu_splits()
    data = prepare(splits, num_classes=3, in_channels=1, spatial_dims=3, window=(-1000, 400), normalize=False)
    x = data.inputs("test")
    assert data.stored_dtype == torch.int16 and float(x.min()) == 0.0 and float(x.max()) == 1.0
    raw = torch.from_numpy(splits.x_test).float()
    assert torch.equal(x, (raw.clamp(-1000, 400) + 1000) / 1400)


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_lazy_archives_prepare_the_same_data_in_pieces(tmp_path, save, monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.integers(0, 255, size=(90, 12, 12), dtype=np.uint8)
    y = np.arange(90) % 3
    save(tmp_path / "d.npz", x_train=x[:70], y_train=y[:70], x_test=x[70:], y_test=y[70:])
    eager = prepare(npz(tmp_path / "d.npz"), num_classes=3, in_channels=1, spatial_dims=2, train_subset=50)
    import ddcnn.data.prepare as prepare_module

    monkeypatch.setattr(prepare_module, "_CHUNK_BYTES", 1000)  # pieces of 6 rows: routing across pieces is exercised
    lazy_splits = npz(tmp_path / "d.npz", lazy=True)
    assert type(lazy_splits.x_train).__name__ == ("FileRangeRows" if save is np.savez else "NpzStreamRows")
    lazy = prepare(lazy_splits, num_classes=3, in_channels=1, spatial_dims=2, train_subset=50)
    for split in SPLITS:
        assert torch.equal(lazy.stored[split], eager.stored[split]) and torch.equal(lazy.y[split], eager.y[split])
    assert lazy.info["stats"] == eager.info["stats"]


def _settings(**kw) -> PrepareSettings:
    return prepare_settings(num_classes=3, in_channels=1, spatial_dims=3, **kw)


def _archive(tmp_path: Path, n=60) -> tuple[Path, dict]:
    splits = _hu_splits(n=n, shape=(8, 8, 8))
    path = tmp_path / "hu.npz"
    np.savez(
        path, x_train=splits.x_train[:, 0], y_train=splits.y_train, x_test=splits.x_test[:, 0], y_test=splits.y_test
    )
    return path, {"_target_": "ddcnn.data.sources.npz", "path": str(path), "spatial_dims": 3}


def _load(path: Path, spec: dict, store: Store, mode: str, **settings) -> Prepared:
    return load_prepared(
        lambda: npz(path, spatial_dims=3, lazy=True), spec, _settings(**settings), mode=mode, store=store
    )


def test_mapped_data_hold_the_numbers_of_data_in_memory(tmp_path):
    path, spec = _archive(tmp_path)
    store = Store(tmp_path / "store")
    mapped = _load(path, spec, store, "mapped")
    memory = _load(path, spec, store, "memory")
    assert (mapped.holding, memory.holding) == ("mapped", "memory") and mapped.entry.parent.parent == store.root
    for split in SPLITS:
        assert torch.equal(mapped.stored[split], memory.stored[split]) and torch.equal(mapped.y[split], memory.y[split])
    assert torch.equal(mapped.mean, memory.mean) and torch.equal(mapped.std, memory.std)
    assert torch.equal(mapped.inputs("val"), memory.inputs("val"))
    # A worker process receives the entry's folder and maps the same files, not a copy of the data.
    blob = pickle.dumps(mapped)
    assert len(blob) < 20_000 < mapped.nbytes()
    again = pickle.loads(blob)
    assert again.holding == "mapped" and torch.equal(again.stored["train"], mapped.stored["train"])
    # Found again: nothing is read from the source.
    assert _load(path, spec, store, "auto").info["built"] is False
    found = load_prepared(lambda: pytest.fail("the source was read"), spec, _settings(), mode="auto", store=store)
    assert found.entry == mapped.entry


def test_an_entry_staged_to_node_local_disk_is_mapped_from_there(tmp_path):
    path, spec = _archive(tmp_path)
    store = Store(tmp_path / "shared")

    def load() -> Prepared:
        return load_prepared(
            lambda: npz(path, spatial_dims=3), spec, _settings(), mode="mapped", store=store, stage_to=tmp_path / "node"
        )

    data = load()
    assert data.entry.parent.parent == tmp_path / "node" and len(store.entries()) == 1
    assert torch.equal(data.inputs("test"), _load(path, spec, store, "mapped").inputs("test"))
    assert load().entry == data.entry


def test_an_edited_source_or_other_settings_make_a_new_entry_and_holding_does_not(tmp_path):
    path, spec = _archive(tmp_path)
    store = Store(tmp_path / "store")
    first = _load(path, spec, store, "mapped")
    assert _load(path, spec, store, "mapped", normalize=False).entry == first.entry  # normalising happens when read
    assert _load(path, spec, store, "mapped", val_fraction=0.2).entry != first.entry
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed
    assert _load(path, spec, store, "mapped").entry != first.entry
    assert len(store.entries("prepared")) == 3


def test_data_that_do_not_fit_the_memory_setting_are_refused_before_training(tmp_path):
    path, spec = _archive(tmp_path)
    store = Store(tmp_path / "store")
    with pytest.raises(DataDoesNotFit, match=r"data.memory.limit_gb=1e-05 .*Set data.memory.mode=mapped"):
        load_prepared(lambda: npz(path, spatial_dims=3), spec, _settings(), mode="memory", limit_gb=1e-5, store=store)
    # auto takes the store instead.
    data = load_prepared(lambda: npz(path, spatial_dims=3), spec, _settings(), mode="auto", limit_gb=1e-5, store=store)
    assert data.holding == "mapped"
    with pytest.raises(ValueError, match="data.memory.mode must be one of"):
        load_prepared(lambda: None, spec, _settings(), mode="ram", store=store)


_PREPARER = """
import sys, time
from pathlib import Path
from ddcnn.data.prepare import load_prepared
from ddcnn.data.sources import npz
from tests.conftest import prepare_settings
from ddcnn.store import Store
path, root, start = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
spec = {"_target_": "ddcnn.data.sources.npz", "path": str(path), "spatial_dims": 3}
while time.time() < start:
    time.sleep(0.005)
data = load_prepared(lambda: npz(path, spatial_dims=3, lazy=True), spec,
                     prepare_settings(num_classes=3, in_channels=1, spatial_dims=3), mode="mapped",
                     store=Store(root, poll_s=0.05))
print(data.entry, data.info["built"], float(data.inputs("train").sum()))
"""


def test_processes_preparing_at_once_write_one_copy_and_map_it(tmp_path):
    path, _ = _archive(tmp_path, n=400)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.time() + 8  # after every process imported torch (slow on a busy machine)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PREPARER, str(path), str(tmp_path / "store"), str(start)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    lines = [p.communicate(timeout=180)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len({(entry, total) for entry, _, total in lines}) == 1  # one entry, the same numbers
    assert sorted(built for _, built, _ in lines) == ["False", "True"]  # one wrote it, the other waited


def test_progress_in_a_file_is_one_line_per_step(caplog):
    with caplog.at_level(logging.INFO, logger="ddcnn.data"), Progress("preparing demo", 100, nbytes=10**9) as bar:
        for _ in range(100):
            bar.update()
    lines = [r.getMessage() for r in caplog.records]
    assert 10 <= len(lines) <= 11 and lines[-1].startswith("preparing demo: done, 100 samples")
    assert "preparing demo: 50% (50/100 samples, 500/1000 MB)" in lines[4]
    assert not any("\r" in line for line in lines)


def test_the_split_manifest_of_arrays_gives_each_samples_row_in_the_source(tmp_path):
    """Issue #45 item 7: ``splits.csv`` for a source without files: each sample's row in the source's split (the
    validation split carved from training rows, the target split carved from validation rows), none twice."""
    import csv
    import io

    from ddcnn.data.prepare import split_manifest

    path, _ = _archive(tmp_path)
    source = npz(path, spatial_dims=3)
    data = prepare(source, num_classes=3, in_channels=1, spatial_dims=3, val_fraction=0.3, split_seed=1)
    data = data.carve_val_target(0.5, seed=1)
    rows = list(csv.DictReader(io.StringIO(split_manifest(data))))
    assert len(rows) == sum(len(y) for y in data.y.values())
    for split in (*SPLITS, "val_target"):
        mine = [r for r in rows if r["split"] == split]
        assert [r["class"] for r in mine] == [data.class_names[int(v)] for v in data.y[split]]
        source_split = "test" if split == "test" else "train"  # validation and target carved from training rows
        assert {r["file_is"] for r in mine} == {f"row of the source's {source_split} split"}
        x = source.x_test if split == "test" else source.x_train
        for k, r in enumerate(mine):  # the row holds this very sample
            assert np.array_equal(x[int(r["file"])], data.stored[split][k].numpy())
    train_rows = [(r["file"], r["file_is"]) for r in rows if r["split"] != "test"]
    assert len(set(train_rows)) == len(train_rows)
    # a store entry prepared before origins were recorded: the rows of the prepared splits, said so
    data.origin = None
    assert "row of the prepared test split" in split_manifest(data)
