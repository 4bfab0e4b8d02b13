"""Batch norm synchronised over DDP ranks on any device, so that a DDP run normalises over the global batch.

``torch.nn.SyncBatchNorm`` runs only on GPUs (its statistics kernels are CUDA's); :class:`GlobalBatchNorm` computes
the same statistics with two differentiable all-reduces (``torch.distributed.nn.functional.all_reduce``: the
per-channel sums, then the centred sums of squares), so it also works with gloo on CPU. With every rank's share of a
batch, the mean, the (biased) variance used for normalising and the running statistics are those of the whole
batch, as one device would compute them, and the gradients flow back through the all-reduces to every rank's inputs.
The state dict is a plain batch norm's, so ``net.pt`` loads into the network as built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GlobalBatchNorm", "convert_batch_norm", "has_batch_norm"]


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over the batch of all DDP ranks (falls back to plain batch norm outside DDP or in eval mode)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {x.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not (self.training and distributed):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        count = x.new_tensor([x.numel() / channels])
        total = all_reduce(torch.cat([x.sum(dims), count]))
        n = total[-1]
        mean = total[:channels] / n
        centred = x - mean.view(shape)
        var = all_reduce((centred * centred).sum(dims)) / n
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * (n / (n - 1)).clamp(min=1)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def convert_batch_norm(module: nn.Module, device: str | torch.device | None = None) -> nn.Module:
    """``module`` with every ``BatchNorm{1,2,3}d`` synchronised over the DDP ranks, its state kept: on CUDA as
    ``torch.nn.SyncBatchNorm`` (its fused kernels), elsewhere as :class:`GlobalBatchNorm`."""
    if device is not None and torch.device(device).type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        new = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        setattr(module, name, convert_batch_norm(child, device))
    return module
