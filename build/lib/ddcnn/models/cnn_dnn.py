"""The CNN-DNN as one module: decomposition + N local CNNs + the coarse DNN.

Klawonn, Lanser, Weber, "A Domain Decomposition-Based CNN-DNN Architecture for Model Parallel Training
Applied to Image Recognition Problems", SIAM J. Sci. Comput. 46(5), 2024 (arXiv 2302.06564).

The module takes full images or volumes ``(B, C, *image_shape)`` and returns class logits ``(B, K)``.
It can be assembled from independently trained parts (the staged pipeline) or trained end to end; both
give the same function. The sub-domain boxes are stored as plain integers, so the module scripts with
TorchScript and needs no ddcnn code to run once exported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddcnn.decomposition import Decomposition

__all__ = ["CNNDNN"]


class CNNDNN(nn.Module):
    """Decomposition, local nets and coarse DNN in one ``nn.Module``.

    Args:
        decomposition: The grid of sub-domains; local net ``i`` sees sub-domain ``i``.
        local_nets: One network per sub-domain, each returning ``(B, K)`` logits.
        coarse: The coarse network on the stacked local outputs ``(B, N, K)``.
        coarse_input: ``"probs"`` (softmax of the local logits, as in the paper) or ``"logits"``.
    """

    __jit_unused_properties__ = ["decomposition"]  # noqa: RUF012 (TorchScript reads this class attribute)

    def __init__(
        self,
        decomposition: Decomposition,
        local_nets: Sequence[nn.Module],
        coarse: nn.Module,
        coarse_input: str = "probs",
    ) -> None:
        super().__init__()
        if len(local_nets) != decomposition.num_subdomains:
            raise ValueError(
                f"{len(local_nets)} local nets for {decomposition.num_subdomains} sub-domains; give one per sub-domain."
            )
        if coarse_input not in ("probs", "logits"):
            raise ValueError(f"coarse_input must be 'probs' or 'logits', got {coarse_input!r}.")
        self.local_nets = nn.ModuleList(local_nets)
        self.coarse = coarse
        self.use_probs = coarse_input == "probs"
        self.spatial_dims = decomposition.spatial_dims
        self.image_shape: list[int] = list(decomposition.image_shape)
        self.sub_shape: list[int] = list(decomposition.sub_shape)
        self.starts: list[list[int]] = [[b.start for b in decomposition.box(i)] for i in range(len(local_nets))]
        self.grid: list[int] = list(decomposition.grid)
        self.overlap: list[int] = list(decomposition.overlap)

    @property
    def decomposition(self) -> Decomposition:
        return Decomposition(tuple(self.grid), tuple(self.image_shape), tuple(self.overlap))

    def _subdomain(self, x: torch.Tensor, i: int) -> torch.Tensor:
        part = x
        for a in range(self.spatial_dims):
            part = part.narrow(2 + a, self.starts[i][a], self.sub_shape[a])
        return part

    def local_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of every local net, ``(B, N, K)``."""
        if x.dim() != 2 + self.spatial_dims or list(x.shape[2:]) != self.image_shape:
            raise ValueError(
                f"expected input of shape (B, C, {self.image_shape}) but got {list(x.shape)}; resize the input to the "
                f"training image shape."
            )
        outs = []
        for i, net in enumerate(self.local_nets):
            outs.append(net(self._subdomain(x, i)))
        return torch.stack(outs, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.local_logits(x)
        features = logits.softmax(dim=-1) if self.use_probs else logits
        return self.coarse(features)
