"""How much faster a warm NiftiCache is than decoding and preprocessing the .nii.gz files.

Converts the first ``--n`` AdrenalMNIST3D training volumes to ``.nii.gz`` in a temporary folder, then times
(a) ``load_volume`` on every file (gzip decode, reorientation, normalisation) and (b) reading every volume from
a warm ``NiftiCache`` into memory. Both read files the operating system has just written, so the page cache is
warm for both and the ratio measures CPU work, not disk speed. Prints ``cache speedup: <x>``; target >= 5.

    python bench/nifti_cache.py [--size 64] [--n 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from ddcnn.data.convert import arrays_to_nifti
from ddcnn.data.nifti import NiftiCache, NiftiPreprocess, load_volume

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def best_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=64, choices=(28, 64), help="AdrenalMNIST3D edition")
    parser.add_argument("--n", type=int, default=200, help="number of volumes")
    parser.add_argument("--repeat", type=int, default=3, help="timing repeats; the fastest counts")
    args = parser.parse_args()

    archive = np.load(SHARED_DATA / f"adrenalmnist3d_{args.size}.npz")
    x, y = archive["x_train"][: args.n], archive["y_train"][: args.n]
    prep = NiftiPreprocess(normalize="minmax")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = arrays_to_nifti(x, y, Path(tmp) / "nifti", split_name="train", progress=False)
        paths = sorted(manifest.parent.rglob("*.nii.gz"))
        cache = NiftiCache(Path(tmp) / "cache", prep)
        cache.warm(paths, progress=False)

        decode = best_time(lambda: [load_volume(p, prep) for p in paths], args.repeat)
        cached = best_time(lambda: [np.array(cache.load(p)) for p in paths], args.repeat)  # np.array: read it all

    print(f"volumes: {len(paths)} x {args.size}^3, settings: {prep}")
    print(f"decode+preprocess: {decode:.3f} s ({1000 * decode / len(paths):.2f} ms/volume)")
    print(f"warm cache read:   {cached:.3f} s ({1000 * cached / len(paths):.2f} ms/volume)")
    print(f"cache speedup: {decode / cached:.1f}x")


if __name__ == "__main__":
    main()
