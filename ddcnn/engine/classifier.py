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
        self._sums: dict[str, torch.Tensor] = {}  # per split: loss sum, correct, count of the running epoch

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
        return loss, logits

    # Epoch metrics are sums kept as tensors and logged once per epoch: a self.log() per step costs more than the
    # forward pass of a small sub-image. Under DDP the sums and counts are added over the ranks (exact means).
    def on_train_epoch_start(self) -> None:
        self._sums = {"train": torch.zeros(3, device=self.device)}

    def on_validation_epoch_start(self) -> None:
        self._sums["val"] = torch.zeros(3, device=self.device)

    def _accumulate(self, split: str, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        if split not in self._sums:  # a resumed epoch may start without on_*_epoch_start
            self._sums[split] = torch.zeros(3, device=self.device)
        n = len(y)
        step = torch.stack([loss.detach() * n, (logits.argmax(-1) == y).sum().to(loss.dtype), loss.new_tensor(n)])
        self._sums[split] = self._sums[split] + step.float()

    def _log_split(self, split: str, prog_bar: bool = False) -> None:
        sums = self._sums.pop(split, None)
        if sums is None or float(sums[2]) == 0:
            return
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        self.log(f"{split}_loss", sums[0] / sums[2], prog_bar=prog_bar)
        self.log(f"{split}_acc", sums[1] / sums[2], prog_bar=prog_bar)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, logits = self._step(batch)
        self._accumulate("train", loss, logits, batch[1])
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self._step(batch)
        self._accumulate("val", loss, logits, batch[1])

    def on_validation_epoch_end(self) -> None:
        # Validation closes a training epoch: its train metrics are complete, and the selection callbacks read both.
        if not self.trainer.sanity_checking:
            self._log_split("train")
        self._log_split("val", prog_bar=True)

    def on_train_epoch_end(self) -> None:
        self._log_split("train")  # epochs without validation

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": self.scheduler_factory(optimizer), "interval": "epoch"},
        }
