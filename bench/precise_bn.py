"""What ``engine.precise_bn`` costs: the epoch time of a 3D CNN with batch norm's statistics recomputed before each
validation (``precise_bn=N``, the default ``auto`` on volumes: 10) against the running statistics (``0``).

Both trainings run ddcnn's loop (:func:`ddcnn.engine.train.fit_tensors`) on the same network (``vgg_small`` 3D at
width 0.5, the builder and seed of ``experiment=adrenal3d``), the same volumes (AdrenalMNIST3D 28³ when
``$DDCNN_DATA/adrenalmnist3d_28.npz`` exists, else random volumes of its shape), batch 32, one torch thread. They
alternate, ``--rounds`` times, each for ``--epochs`` epochs, so that a disturbance of the machine hits both alike; the
figure is the ratio of the median epoch times (precise / running: 1.0 = free). The recomputation is ``N`` forwards
without backward (at most one epoch's batches): about a third of an epoch's steps at ``N`` = the epoch's batches.

    python bench/precise_bn.py [--rounds 3] [--epochs 2] [--batches 10] [--train 1188]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SHARED_DATA, quiet  # noqa: E402


def volumes(n_train: int) -> tuple[dict, dict, str]:
    """Training and validation volumes (uint8 masks scaled to [0, 1]) and where they came from."""
    path = SHARED_DATA / "adrenalmnist3d_28.npz"
    if path.is_file():
        d = np.load(path)
        x = {"train": d["x_train"][:n_train], "val": d["x_val"]}
        y = {"train": d["y_train"][:n_train], "val": d["y_val"]}
        source = f"AdrenalMNIST3D 28³ ({path})"
    else:
        rng = np.random.default_rng(0)
        x = {s: rng.integers(0, 2, (n, 28, 28, 28), dtype=np.uint8) for s, n in (("train", n_train), ("val", 98))}
        y = {s: rng.integers(0, 2, len(v)) for s, v in x.items()}
        source = "random volumes of AdrenalMNIST3D's shape"
    tx = {s: torch.tensor(v, dtype=torch.float32)[:, None] for s, v in x.items()}
    ty = {s: torch.tensor(v, dtype=torch.long) for s, v in y.items()}
    return tx, ty, source


def epoch_time(precise: int, x: dict, y: dict, epochs: int) -> float:
    """Median seconds per epoch of one training (``time_s`` of its epochs, the first left out when there are more)."""
    from ddcnn.engine.train import fit_tensors
    from ddcnn.models.vgg import vgg_small
    from ddcnn.settings import LoopSettings

    torch.manual_seed(0)
    net = vgg_small(3, 1, 2, width_mult=0.5)
    optimizer = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 2e-3, "weight_decay": 1e-4}
    settings = LoopSettings(optimizer=optimizer, max_epochs=epochs, seed=0, precise_bn=precise, write_best=False)
    with tempfile.TemporaryDirectory() as folder:
        result = fit_tensors(net, x, y, folder, settings, batch_size=32)
    times = [row["time_s"] for row in result.history]
    per_epoch = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    return statistics.median(per_epoch[1:] if len(per_epoch) > 1 else per_epoch)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=10, help="engine.precise_bn's N (auto on volumes: 10)")
    parser.add_argument("--train", type=int, default=1188, help="training volumes (AdrenalMNIST3D has 1,188)")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    x, y, source = volumes(args.train)
    steps = -(-len(y["train"]) // 32)
    print(
        f"precise_bn.py: {source}, {len(y['train'])} training volumes ({steps} batches of 32), one thread, load "
        f"{os.getloadavg()[0]:.2f}"
    )
    times: dict[int, list[float]] = {0: [], args.batches: []}
    for r in range(args.rounds):
        for precise in times:
            start = time.perf_counter()
            times[precise].append(epoch_time(precise, x, y, args.epochs))
            print(
                f"  round {r + 1}: precise_bn={precise}: {times[precise][-1]:.1f} s an epoch "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    running, precise = statistics.median(times[0]), statistics.median(times[args.batches])
    print(
        f"epoch time: running statistics {running:.1f} s, precise_bn={args.batches} {precise:.1f} s: ratio "
        f"{precise / running:.3f} (recomputed from {min(args.batches, steps)} of {steps} batches)"
    )


if __name__ == "__main__":
    main()
