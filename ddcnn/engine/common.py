"""Prediction and the saved network: what a stage does with a trained net (read through the ``Batches`` protocol)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddcnn.io import atomic_torch_save
from ddcnn.rundir import SPLITS, TARGET_SPLIT

__all__ = ["predict_logits", "save_predictions", "save_net", "data_splits"]


@torch.inference_mode()
def predict_logits(net: nn.Module, data, split: str, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (float32, on the host) and labels of every sample of ``split``, in order, in full precision.

    Args:
        net: The network (put in eval mode).
        data: A :class:`~ddcnn.data.datamodule.Batches` source (``eval_batch``, ``eval_batch_size``).
        split: ``train``, ``val`` or ``test``.
        device: Where to run (default CPU).
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    net = net.to(device).eval()
    outs, labels = [], []
    for idx in torch.arange(data.size(split)).split(int(data.eval_batch_size)):
        x, y = data.eval_batch(split, idx, device)
        outs.append(net(x).float().cpu())
        labels.append(y.cpu())
    return torch.cat(outs), torch.cat(labels)


def data_splits(data) -> tuple[str, ...]:
    """The splits of ``data`` (a :class:`~ddcnn.data.datamodule.Batches`) that stages save outputs of: :data:`SPLITS`,
    and :data:`TARGET_SPLIT` where ``data.val_target_fraction`` carved it."""
    try:
        has_target = data.size(TARGET_SPLIT) > 0
    except KeyError:
        has_target = False
    return (*SPLITS, TARGET_SPLIT) if has_target else SPLITS


def save_predictions(net: nn.Module, data, folder: Path, device) -> dict[str, float]:
    """``probs_<split>.pt`` (logits, probabilities, labels) of every split (and of ``val_target`` where the data
    have it); returns the accuracy per split."""
    accuracy = {}
    for split in data_splits(data):
        logits, labels = predict_logits(net, data, split, device)
        atomic_torch_save(
            {"logits": logits, "probs": logits.softmax(-1), "labels": labels}, Path(folder) / f"probs_{split}.pt"
        )
        accuracy[split] = float((logits.argmax(-1) == labels).float().mean())
    return accuracy


def save_net(net: nn.Module, folder: Path) -> None:
    """``net.pt``: the state dict of the selected weights, on CPU."""
    atomic_torch_save({k: v.detach().cpu() for k, v in net.state_dict().items()}, Path(folder) / "net.pt")
