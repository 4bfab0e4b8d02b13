"""Framework overhead of ddcnn's training loop: its step time against a bare PyTorch loop, and its import time.

Both loops train the same network (same builder and seed, ``vgg_small`` by default) on the same 28x28 images (MNIST
when ``$DDCNN_DATA/mnist.npz`` exists, else the bundled digits resized to 28x28) with the same optimizer (the configured
AdamW), batch size (128) and torch threads, on the CPU. The bare loop is what a user would write: index the batch,
forward, cross-entropy, ``zero_grad``, ``backward``, ``step``; no logging, no checkpoints. ddcnn's loop runs as every
stage runs it (:func:`ddcnn.engine.loop.fit_batches`: Fabric, train metrics, validation, ``last.ckpt`` and
``metrics.csv`` after its last epoch).

A step's time is the time between the fetches of two consecutive batches of one epoch (the fetch, forward, backward,
optimizer step and whatever the loop does around them), taken from the data source's calls in both loops. The two
loops alternate, ``--rounds`` times, so that a disturbance of the machine hits both alike; the figure is the ratio of
the median step times (bare / ddcnn: 1.0 = no overhead; target >= 0.95).

The import times are those of a fresh interpreter: ``import torch``, ``import torch, torch._dynamo`` (which the first
optimizer a process builds imports: every training process pays it) and ``import ddcnn.engine.train`` (the loop,
Lightning Fabric, torch._dynamo), medians of ``--import-repeats``.

    python bench/overhead.py [--rounds 5] [--epochs 2] [--train-subset 2560] [--threads 0] [--model vgg_small]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import SHARED_DATA, config, quiet  # noqa: E402


class TimedBatches:
    """A ``Batches`` source that records when each training batch is fetched (the loop's step boundaries)."""

    def __init__(self, data) -> None:
        self.data, self.stamps = data, []
        self.batch_size, self.eval_batch_size, self.seed = data.batch_size, data.eval_batch_size, data.seed

    def size(self, split):
        return self.data.size(split)

    def labels(self, split):
        return self.data.labels(split)

    def train_batch(self, idx, epoch, device):
        self.stamps.append((epoch, time.perf_counter()))
        return self.data.train_batch(idx, epoch, device)

    def eval_batch(self, split, idx, device):
        return self.data.eval_batch(split, idx, device)


def step_times(stamps: list[tuple[int, float]]) -> list[float]:
    """Seconds between consecutive fetches within one epoch."""
    return [b - a for (ea, a), (eb, b) in zip(stamps, stamps[1:], strict=False) if ea == eb]


def bare_epochs(build_net, optimizer_node, data, epochs: int, seed: int) -> list[float]:
    """The bare PyTorch loop: per-step times of ``epochs`` epochs (the same sample order as ddcnn's loop)."""
    import hydra
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    net = build_net()
    opt = hydra.utils.instantiate(optimizer_node)(net.parameters())
    x, y = data.data["train"].x, data.data["train"].y
    stamps = []
    net.train()
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        for idx in order.split(data.batch_size):
            stamps.append((epoch, time.perf_counter()))
            loss = F.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return step_times(stamps)


def loop_epochs(build_net, optimizer_node, data, epochs: int, seed: int, folder: Path) -> list[float]:
    """ddcnn's loop, as a stage runs it: per-step times of ``epochs`` epochs."""
    import torch

    from ddcnn.engine.loop import fit_batches
    from ddcnn.settings import LoopSettings

    torch.manual_seed(seed)
    timed = TimedBatches(data)
    settings = LoopSettings(optimizer=optimizer_node, max_epochs=epochs, seed=seed, checkpoint_every=epochs)
    fit_batches(build_net(), timed, folder, settings)
    return step_times(timed.stamps)


def import_seconds(statement: str, repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds of ``python -c statement`` in a fresh interpreter (start-up included)."""
    walls, cpus = [], []
    for _ in range(repeats):
        before = os.times()
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", statement], check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        walls.append(time.perf_counter() - began)
        after = os.times()
        cpus.append((after.children_user - before.children_user) + (after.children_system - before.children_system))
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternations of the two loops")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per loop and round")
    parser.add_argument("--train-subset", type=int, default=2560, help="training images (20 steps of 128 each)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--model", default="vgg_small")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    parser.add_argument("--import-repeats", type=int, default=3)
    args = parser.parse_args()
    quiet()
    import torch

    from ddcnn.context import build_context, build_local_net
    from ddcnn.data.datamodule import TensorDataModule

    if args.threads:
        torch.set_num_threads(args.threads)
    mnist = SHARED_DATA / "mnist.npz"
    data_overrides = ["data=mnist", f"data.path={mnist}"] if mnist.is_file() else ["data.image_size=[28,28]"]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(
            [
                *data_overrides,
                f"data.train_subset={args.train_subset}",
                f"data.batch_size={args.batch_size}",
                f"model={args.model}",
                "decomposition=2x2",
            ],
            Path(tmp),
        )
        ctx = build_context(cfg)
        data = TensorDataModule(ctx.data.x, ctx.data.y, args.batch_size, seed=int(cfg.seed))
        shape = tuple(ctx.data.x["train"].shape[1:])

        def build_net():
            return build_local_net(ctx.settings, ctx.data)  # the family's builder on full 28x28 images (the global CNN)

        bare_loop_s, ddcnn_loop_s = [], []
        bare_epochs(build_net, cfg.optimizer, data, 1, int(cfg.seed))  # warm-up of kernels and allocator
        for rnd in range(args.rounds):
            bare_loop_s += bare_epochs(build_net, cfg.optimizer, data, args.epochs, int(cfg.seed))
            ddcnn_loop_s += loop_epochs(
                build_net, cfg.optimizer, data, args.epochs, int(cfg.seed), Path(tmp) / str(rnd)
            )
    bare, ours = statistics.median(bare_loop_s), statistics.median(ddcnn_loop_s)
    print(
        f"data: {cfg.data.name} {shape}, {args.train_subset} train images, {args.model}, batch {args.batch_size}, "
        f"{args.epochs} epochs x {args.rounds} rounds, torch threads {torch.get_num_threads()}, CPU"
    )
    print(f"bare PyTorch loop: median step {bare * 1e3:8.2f} ms ({len(bare_loop_s)} steps)")
    print(f"ddcnn loop:        median step {ours * 1e3:8.2f} ms ({len(ddcnn_loop_s)} steps)")
    print(f"overhead ratio (bare / ddcnn step time, target >= 0.95): {bare / ours:.3f}")
    torch_wall, torch_cpu = import_seconds("import torch", args.import_repeats)
    loop_wall, loop_cpu = import_seconds("import ddcnn.engine.train", args.import_repeats)
    print(
        f"import torch:               {torch_wall:5.2f} s wall, {torch_cpu:5.2f} s CPU (interpreter start-up included)"
    )
    print(
        f"import ddcnn.engine.train:  {loop_wall:5.2f} s wall, {loop_cpu:5.2f} s CPU (torch, Fabric, torch._dynamo, "
        f"the loop)"
    )
    print(f"load average: {' '.join(f'{v:.2f}' for v in os.getloadavg())} (1, 5, 15 min)")


if __name__ == "__main__":
    main()
