"""The LightningModule every stage trains: cross-entropy classification of any ``nn.Module``."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Classifier"]


class Classifier(L.LightningModule):
    """Trains ``net`` (a local CNN, the coarse DNN, the global CNN or the assembled CNN-DNN).

    Args:
        net: The network; its output are class logits ``(B, num_classes)``.
        num_classes: Number of classes (checked against the network output once).
        optimizer: ``params -> Optimizer``, e.g. a Hydra ``_partial_`` of ``torch.optim.AdamW``.
        scheduler: ``optimizer -> LRScheduler`` stepped once per epoch, or ``None``.
        label_smoothing: Passed to the cross-entropy loss.
    """

    def __init__(
        self,
        net: nn.Module,
        num_classes: int,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler] | None = None,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.num_classes = num_classes
        self.optimizer_factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.scheduler_factory = scheduler
        self.label_smoothing = label_smoothing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.net(x)
        if logits.shape[-1] != self.num_classes:
            raise ValueError(
                f"the network returns {logits.shape[-1]} class scores but num_classes={self.num_classes}; build the "
                f"network with num_classes={self.num_classes}."
            )
        loss = F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)
        acc = (logits.argmax(-1) == y).float().mean()
        return loss, acc

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, acc = self._step(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True, batch_size=len(batch[1]), sync_dist=True)
        self.log("train_acc", acc, on_step=False, on_epoch=True, batch_size=len(batch[1]), sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, acc = self._step(batch)
        self.log(
            "val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch[1]), sync_dist=True
        )
        self.log("val_acc", acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(batch[1]), sync_dist=True)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "epoch"},
        }
