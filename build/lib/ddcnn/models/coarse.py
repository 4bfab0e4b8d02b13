"""Coarse model of the CNN-DNN: a dense network that combines the sub-domain predictions into one.

Klawonn, Lanser & Weber, "A Domain Decomposition-Based CNN-DNN Architecture for Model Parallel Training Applied to
Image Recognition Problems", 2023, https://arxiv.org/abs/2302.06564.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddcnn.models import layers as _layers

__all__ = ["CoarseMLP"]


class CoarseMLP(nn.Module):
    """Dense network from the ``N`` local class scores of ``K`` classes to ``K`` global logits.

    The input is what the local CNNs produced for one image, either as ``(B, N, K)`` or already flattened
    sub-domain-major as ``(B, N * K)``. Whether those are probabilities or logits is the caller's choice; the
    module treats them as plain features.

    Args:
        num_subdomains: Number of sub-domains ``N`` (local networks).
        num_classes: Number of classes ``K``.
        hidden: Widths of the hidden layers; ``()`` gives a linear model.
        dropout: Dropout probability after each hidden activation.
        act: Activation name, see :func:`ddcnn.models.layers.act`.
        norm: Put a ``LayerNorm`` after each hidden linear layer (independent of the batch size, so it behaves the
            same in training and evaluation).

    Attributes:
        in_features: ``num_subdomains * num_classes``.
    """

    def __init__(
        self,
        num_subdomains: int,
        num_classes: int,
        hidden: Sequence[int] = (64,),
        dropout: float = 0.0,
        act: str = "relu",
        norm: bool = False,
    ) -> None:
        super().__init__()
        _layers.check_positive(num_subdomains=num_subdomains, num_classes=num_classes)
        for width in hidden:
            _layers.check_positive(hidden=width)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        act = _layers.check_act(act)

        self.num_subdomains = num_subdomains
        self.num_classes = num_classes
        self.in_features = num_subdomains * num_classes
        modules: list[nn.Module] = []
        features = self.in_features
        for width in hidden:
            modules.append(nn.Linear(features, width))
            if norm:
                modules.append(nn.LayerNorm(width))
            modules.append(_layers.act(act))
            if dropout > 0:
                modules.append(nn.Dropout(dropout))
            features = width
        modules.append(nn.Linear(features, num_classes))
        self.mlp = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(B, num_classes)`` for local scores ``(B, num_subdomains, num_classes)`` or flattened."""
        if x.dim() == 3:
            if x.shape[1] != self.num_subdomains or x.shape[2] != self.num_classes:
                raise ValueError(
                    f"expected (B, {self.num_subdomains}, {self.num_classes}) local scores, got {list(x.shape)}"
                )
            x = torch.flatten(x, 1)
        elif x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"expected (B, {self.num_subdomains}, {self.num_classes}) or (B, {self.in_features}) local scores, "
                f"got {list(x.shape)}"
            )
        return self.mlp(x)
