"""How many training batches ``engine.precise_bn`` needs (``docs/protocol.md``, "Convergence", cause 7).

    DDCNN_DATA=../shared/data python experiments/precise_bn_batches.py [--epochs 4] [--draws 3]

AdrenalMNIST3D 28³, ``vgg_small`` 3D at width 0.5 (``experiment=adrenal3d``'s net), AdamW 2e-3, batch 32, one thread,
trained in plain PyTorch (no ddcnn loop, so that nothing but the statistics differs). After each epoch: the
validation loss in evaluation mode (batch norm's running statistics, as training left them) and, on copies of the
weights, after recomputing the statistics as the exact average (momentum ``None``, as ``update_bn`` does) over the
first ``N`` of a shuffled order of training batches of size ``B``, for each ``(B, N)`` of :data:`CASES`, ``--draws``
shuffles each (mean ± std). The whole training set is the reference (``B`` 32 x 38, ``B`` 8 x 149).
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

CASES = ((32, 1), (32, 3), (32, 10), (32, 38), (8, 2), (8, 4), (8, 10), (8, 20), (8, 50), (8, 149))


def main(argv: list[str] | None = None) -> int:
    from ddcnn.models.vgg import vgg_small

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--draws", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    d = np.load(Path(os.environ.get("DDCNN_DATA", "../shared/data")) / "adrenalmnist3d_28.npz")
    xt, yt = torch.tensor(d["x_train"], dtype=torch.float32)[:, None], torch.tensor(d["y_train"]).long().flatten()
    xv, yv = torch.tensor(d["x_val"], dtype=torch.float32)[:, None], torch.tensor(d["y_val"]).long().flatten()
    mean, std = xt.mean(), xt.std()
    xt, xv = (xt - mean) / std, (xv - mean) / std
    torch.manual_seed(0)
    net = vgg_small(3, 1, 2, width_mult=0.5)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)

    def val_loss(model: torch.nn.Module) -> float:
        model.eval()
        with torch.no_grad():
            return F.cross_entropy(torch.cat([model(xv[i : i + 64]) for i in range(0, len(xv), 64)]), yv).item()

    def recomputed(batch: int, count: int, order: torch.Tensor) -> float:
        model = copy.deepcopy(net)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
                module.momentum = None
        model.train()
        with torch.no_grad():
            for k in range(count):
                if len(idx := order[k * batch : (k + 1) * batch]):
                    model(xt[idx])
        return val_loss(model)

    shuffle = torch.Generator().manual_seed(0)
    for epoch in range(args.epochs):
        start, losses = time.time(), []
        net.train()
        perm = torch.randperm(len(xt), generator=shuffle)
        for i in range(0, len(xt), 32):
            idx = perm[i : i + 32]
            loss = F.cross_entropy(net(xt[idx]), yt[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        row = [f"epoch {epoch} train {np.mean(losses):.3f} eval {val_loss(net):.3f}"]
        for batch, count in CASES:
            seeds = [torch.Generator().manual_seed(100 + r) for r in range(args.draws)]
            orders = [torch.randperm(len(xt), generator=g) for g in seeds]
            vals = [recomputed(batch, count, order) for order in orders]
            row.append(f"B{batch}xN{count}({batch * count}) {np.mean(vals):.3f}±{np.std(vals):.3f}")
        print(" | ".join(row), f"{time.time() - start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
