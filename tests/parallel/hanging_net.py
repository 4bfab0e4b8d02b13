"""A local net whose training forward pass never returns on one sub-domain: its worker's main thread hangs."""

from __future__ import annotations

import multiprocessing
import threading

import torch
from torch import nn

from ddcnn.models.vgg import vgg_tiny


class _Deadlocked(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            threading.Event().wait()  # a lock nobody releases
        return self.net(x)


def vgg_tiny_hanging_on(hang_seed: int, **kwargs) -> nn.Module:
    """``vgg_tiny``, whose training forward hangs when built in a worker process under seed ``hang_seed`` (the local
    stage seeds torch with the sub-domain's seed just before it builds the net). Never in the test's own process: its
    torch seed is whatever an earlier test left (a local stage run in-process under that very seed, say), and the
    parent's memory plan traces a training step of the net it builds."""
    net = vgg_tiny(**kwargs)
    in_worker = multiprocessing.parent_process() is not None
    return _Deadlocked(net) if in_worker and torch.initial_seed() == hang_seed else net
