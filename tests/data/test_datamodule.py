"""Batches of prepared data: a local net reads only its sub-domain (with augmentation: the region its view needs),
and gets the numbers of the whole-image path."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddcnn.data.augment import Augment
from ddcnn.data.datamodule import Batches, PreparedBatches, TensorDataModule
from ddcnn.data.prepare import load_prepared, prepare
from ddcnn.data.sources import Splits, npz
from ddcnn.decomposition import Decomposition
from ddcnn.settings import RunSettings
from ddcnn.store import Store
from tests.conftest import prepare_settings

SPLITS = ("train", "val", "test")
ROOT = Path(__file__).resolve().parents[2]


def _splits(shape, n=48, seed=0) -> Splits:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 1, *shape), dtype=np.uint8)
    y = np.arange(n) % 3
    return Splits(x[:36], y[:36], x[36:], y[36:], class_names=["a", "b", "c"], name="rand")


def _old_batches(data, box, augment, seed) -> TensorDataModule:
    """Whole normalised images, augmented, then cut: the path local nets took before."""
    from ddcnn.data.datamodule import Crop

    crop = Crop((slice(None), slice(None), *box)) if box is not None else None
    return TensorDataModule(data.x, data.y, 8, seed=seed, view=crop, augment=augment)


@pytest.mark.parametrize(("shape", "grid"), [((20, 24), (2, 2)), ((12, 16, 20), (2, 2, 2))], ids=["2d", "3d"])
@pytest.mark.parametrize(
    "augment",
    [None, Augment(flip_axes=(0, 1), seed=3), Augment(flip_axes=(0,), rotate_deg=10, seed=3)],
    ids=["plain", "flips", "flip+rotation"],
)
def test_a_sub_domain_gets_the_box_of_the_whole_image_path(shape, grid, augment):
    data = prepare(_splits(shape), num_classes=3, in_channels=1, spatial_dims=len(shape))
    dec = Decomposition(grid, shape, 2)
    idx = torch.tensor([5, 0, 17, 9, 30, 2])
    for i in range(dec.num_subdomains):
        new = PreparedBatches(data, 8, seed=1, box=dec.box(i), augment=augment)
        old = _old_batches(data, dec.box(i), augment, seed=1)
        assert isinstance(new, Batches)
        for epoch in (0, 3):
            (a, ya), (b, yb) = new.train_batch(idx, epoch, "cpu"), old.train_batch(idx, epoch, "cpu")
            assert torch.equal(ya, yb) and a.dtype == torch.float32 and a.is_contiguous()
            if augment is None or augment.rotate_deg == 0:
                assert torch.equal(a, b)  # flips move values: bitwise
            else:  # the rotation samples the same points from a region: equal to float rounding
                torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
        for split in ("val", "test"):
            eval_idx = torch.arange(new.size(split))
            assert torch.equal(new.eval_batch(split, eval_idx, "cpu")[0], old.eval_batch(split, eval_idx, "cpu")[0])


def test_the_whole_image_path_is_the_augmentation_of_the_whole_image():
    data = prepare(_splits((20, 24)), num_classes=3, in_channels=1, spatial_dims=2)
    aug = Augment(flip_axes=(1,), rotate_deg=20, seed=2)
    new, old = PreparedBatches(data, 8, augment=aug), _old_batches(data, None, aug, 0)
    idx = torch.arange(10)
    assert torch.equal(new.train_batch(idx, 4, "cpu")[0], old.train_batch(idx, 4, "cpu")[0])


def test_a_flip_reads_the_mirrored_box_and_a_rotation_a_slightly_larger_one(monkeypatch):
    shape = (32, 32)
    data = prepare(_splits(shape), num_classes=3, in_channels=1, spatial_dims=2)
    box = Decomposition((2, 2), shape, 2).box(0)  # rows 0..17, columns 0..17
    regions = []
    read = data.read

    def spy(split, idx, region=None, flips=None, flip_axes=(), **where):
        regions.append((tuple((r.start, r.stop) for r in region), tuple(flip_axes)))
        return read(split, idx, region, flips, flip_axes, **where)

    monkeypatch.setattr(data, "read", spy)
    PreparedBatches(data, 8, box=box, augment=Augment(flip_axes=(1,), seed=0)).train_batch(torch.arange(16), 0, "cpu")
    assert regions == [(((0, 17), (0, 17)), (1,))]  # one gather of the box, of the flipped image for flipped samples
    # A flipped sample's box of the flipped image is its mirror box (columns 15..31), flipped: nothing else is read.
    idx, flips = torch.arange(6), torch.tensor([[True], [False], [True], [True], [False], [False]])
    gathered = read("train", idx, box, flips, (1,))
    plain, mirror = read("train", idx, box), read("train", idx, (slice(0, 17), slice(15, 32)))
    for b in range(6):
        assert torch.equal(gathered[b], mirror[b].flip(-1) if flips[b] else plain[b])
    regions.clear()
    PreparedBatches(data, 8, box=box, augment=Augment(rotate_deg=10, seed=0)).train_batch(torch.arange(16), 0, "cpu")
    (((rows, cols), _),) = set(regions)
    assert rows[0] == 0 and cols[0] == 0 and 17 < rows[1] < 24 and 17 < cols[1] < 24  # a little more, not all
    regions.clear()
    PreparedBatches(data, 8, box=box).eval_batch("test", torch.arange(4), "cpu")
    assert regions == [(((0, 17), (0, 17)), ())]


def _mapping_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            current = line.rstrip().endswith(str(path))
        elif current and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


# Maps the prepared data and makes every page of x_train.npy that holds none of the allowed slices unreadable
# (mprotect PROT_NONE); then reads batches. One byte outside the allowed slices and the process dies of SIGSEGV.
_GUARDED = """
import ctypes, mmap, sys
import torch
from pathlib import Path
from ddcnn.data.augment import Augment
from ddcnn.data.datamodule import PreparedBatches
from ddcnn.data.prepare import Prepared
entry, first, stop, full = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
data = Prepared.from_entry(entry)
mm, x = data._maps["train"], data.stored["train"]
n, depth = x.shape[0], x.shape[2]
slice_bytes = x[0, 0, 0].numel()
base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
data_offset = x.data_ptr() - base
page = mmap.PAGESIZE
libc = ctypes.CDLL("libc.so.6", use_errno=True)

def guard(allowed):
    keep = set()
    for i in range(n):
        for a, b in allowed:
            lo, hi = data_offset + (i * depth + a) * slice_bytes, data_offset + (i * depth + b) * slice_bytes
            keep.update(range(lo // page, (hi - 1) // page + 1))
    for p in range(data_offset // page, len(mm) // page):
        if p not in keep:
            assert libc.mprotect(ctypes.c_void_p(base + p * page), page, 0) == 0

def read_all(batches):
    for epoch in range(2):
        for idx in torch.randperm(n).split(8):
            batches.train_batch(idx, epoch, "cpu")

if full:  # the control: a global CNN's reads cross the guard
    guard([(first, stop)])
    read_all(PreparedBatches(data, 8))
# With flips: the box, read mirrored for a flipped sample.
guard([(first, stop), (depth - stop, depth - first)])
read_all(PreparedBatches(data, 8, box=(slice(first, stop), slice(None), slice(None)), augment=Augment((0,), seed=0)))
print("box and mirror", flush=True)
guard([(first, stop)])  # without augmentation: the box alone
read_all(PreparedBatches(data, 8, box=(slice(first, stop), slice(None), slice(None))))
print("box", flush=True)
"""


@pytest.fixture(scope="module")
def mapped_volumes(tmp_path_factory):
    """Mapped 3D data whose slices are whole pages: 16 slices of 128x128 uint8 (16 KiB each)."""
    root = tmp_path_factory.mktemp("vol")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(130, 16, 128, 128), dtype=np.uint8)
    y = np.arange(130) % 2
    np.savez(root / "v.npz", x_train=x[:120], y_train=y[:120], x_test=x[120:], y_test=y[120:])
    spec = {"_target_": "ddcnn.data.sources.npz", "path": str(root / "v.npz")}
    settings = prepare_settings(num_classes=2, in_channels=1, spatial_dims=3)
    return load_prepared(
        lambda: npz(root / "v.npz", spatial_dims=3), spec, settings, mode="mapped", store=Store(root / "store")
    )


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux (/proc, mprotect)")
@pytest.mark.parametrize("control", [False, True], ids=["sub-domain", "control: full images cross the guard"])
def test_a_local_net_reads_no_byte_outside_its_box(mapped_volumes, control):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [str(mapped_volumes.entry), "4", "8", str(int(control))]
    proc = subprocess.run([sys.executable, "-c", _GUARDED, *args], env=env, capture_output=True, text=True, timeout=120)
    if control:
        assert proc.returncode == -signal.SIGSEGV, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0 and proc.stdout.split("\n")[:2] == ["box and mirror", "box"], proc.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="needs Linux /proc/self/smaps")
def test_a_process_holds_none_of_the_pages_of_large_mapped_data_it_has_read(mapped_volumes, monkeypatch):
    import ddcnn.data.prepare as prepare_module

    file = mapped_volumes.entry / "x_train.npy"
    batches = PreparedBatches(mapped_volumes, 8)
    for idx in torch.arange(batches.size("train")).split(8):  # a small split stays mapped as it is read
        batches.train_batch(idx, 0, "cpu")
    assert 0 < _mapping_rss_kib(file) * 1024 <= file.stat().st_size + 2 * 4096  # whole pages
    mapped_volumes.release()
    assert _mapping_rss_kib(file) == 0
    monkeypatch.setattr(prepare_module, "KEEP_MAPPED_BYTES", file.stat().st_size // 2)  # now it counts as large
    for idx in torch.arange(batches.size("train")).split(8):
        batches.train_batch(idx, 0, "cpu")
        # Read through, then dropped from this process's page table: they stay in the page cache, shared.
        assert _mapping_rss_kib(file) == 0


def test_data_in_memory_are_normalised_once_per_split_and_box():
    data = prepare(_splits((20, 24)), num_classes=3, in_channels=1, spatial_dims=2)
    dec = Decomposition((2, 2), (20, 24), 2)
    box = dec.box(3)
    cached = PreparedBatches(data, 8, box=box)
    streamed = PreparedBatches(data, 8, box=box, cache=False)
    assert cached.cache and not streamed.cache
    idx = torch.tensor([3, 1, 2])
    assert torch.equal(cached.train_batch(idx, 0, "cpu")[0], streamed.train_batch(idx, 0, "cpu")[0])
    assert set(cached._cached) == {"train"} and tuple(cached._cached["train"].shape[2:]) == dec.sub_shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_on_a_gpu_the_batches_are_bitwise_those_of_the_cpu():
    data = prepare(_splits((12, 16, 20)), num_classes=3, in_channels=1, spatial_dims=3)
    box = Decomposition((2, 2, 2), (12, 16, 20), 2).box(5)
    for augment in (None, Augment(flip_axes=(0, 2), seed=1)):
        batches = PreparedBatches(data, 8, box=box, augment=augment, cache=False)
        idx = torch.tensor([4, 8, 15, 16, 23, 35])
        cpu, gpu = batches.train_batch(idx, 1, "cpu"), batches.train_batch(idx, 1, "cuda")
        assert gpu[0].is_cuda and torch.equal(gpu[0].cpu(), cpu[0]) and torch.equal(gpu[1].cpu(), cpu[1])


def _splitmix64_reference(seed: int, epoch: int, sample: int, draw: int) -> float:
    """The augmentation's generator written out in plain Python integers (SplitMix64 of (seed, epoch, sample, draw))."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z &= mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    key = mix(mix(seed + golden) + epoch * golden)
    z = mix(sample * golden + key)
    z = mix(z + draw * golden)
    return (z >> 40) / 2**24


def test_the_augmentation_draws_depend_only_on_seed_epoch_and_sample():
    """Counter-based draws: a sample's parameters are the same in any batch, in any order, in any process; they are
    those of SplitMix64 written in plain integers (so they are the same on every device: integer arithmetic only)."""
    from ddcnn.data.augment import RNG_VERSION, uniforms
    from ddcnn.rundir import AUGMENT_RNG

    assert RNG_VERSION == AUGMENT_RNG == "splitmix64/1"
    idx = torch.tensor([0, 5, 17, 2**40 + 3, 123456])
    u = uniforms(7, 3, idx, 4)
    assert u.dtype == torch.float32 and u.shape == (5, 4) and bool(((u >= 0) & (u < 1)).all())
    for row, j in enumerate(idx.tolist()):
        for k in range(4):
            assert float(u[row, k]) == _splitmix64_reference(7, 3, j, k + 1)
    assert torch.equal(uniforms(7, 3, idx.flip(0), 4), u.flip(0))  # the batch's order and company do not matter
    assert torch.equal(uniforms(7, 3, idx[2:3], 4)[0], u[2])
    assert not torch.equal(uniforms(7, 4, idx, 4), u) and not torch.equal(uniforms(8, 3, idx, 4), u)
    many = uniforms(0, 0, torch.arange(20000), 2)
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float((many < 0.5).float().mean()) - 0.5) < 0.01
    # Augment draws from it: flips and angles of a sample in an epoch, the same in a batch of one.
    aug = Augment(flip_axes=(0, 1), rotate_deg=10, seed=7)
    flips, angles = aug.draw(idx, 3)
    assert torch.equal(flips, u[:, :2] < 0.5) and float(angles.abs().max()) <= math.radians(10)
    one = aug.draw(idx[3:4], 3)
    assert torch.equal(one[0][0], flips[3]) and torch.equal(one[1][0], angles[3])


def test_an_augmented_runs_fingerprint_holds_the_generator_and_an_unaugmented_one_does_not(make_cfg):
    from ddcnn.rundir import fingerprint

    plain = RunSettings.from_config(make_cfg()).identity().settings
    assert plain["data"]["augment"] is None
    flips = RunSettings.from_config(make_cfg("data.augment={flip_axes:[1]}")).identity().settings
    assert flips["data"]["augment"] == {"flip_axes": [1], "rng": "splitmix64/1"}
    rotation = RunSettings.from_config(make_cfg("data.augment={flip_axes:[],rotate_deg:5.0}")).identity().settings
    assert rotation["data"]["augment"]["rng"] == "splitmix64/1"
    none = RunSettings.from_config(make_cfg("data.augment={flip_axes:[],rotate_deg:0.0}")).identity().settings
    assert "rng" not in none["data"]["augment"]  # no augmentation: its generator does not matter
    assert fingerprint(plain) != fingerprint(flips)
