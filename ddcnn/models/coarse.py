"""Coarse model of the CNN-DNN: a dense network that combines the sub-domain predictions into one.

Klawonn, Lanser & Weber, "A Domain Decomposition-Based CNN-DNN Architecture for Model Parallel Training Applied to
Image Recognition Problems", 2023, https://arxiv.org/abs/2302.06564.

Two things keep the coarse DNN robust across dataset sizes and class counts, and both live inside the module, so the
exported CNN-DNN computes exactly what was trained:

- **input scaling** (``input_norm="standardize"``): every input feature is standardised with the mean and standard
  deviation of the training rows (:meth:`CoarseMLP.fit_input_scaling`, kept as buffers in the state dict). Local
  logits range over tens of units and probabilities saturate near 0 and 1; unscaled, the same learning rate is too
  large for one and too small for the other;
- **skip connections that contain the simpler combiners** (``skip="mean_prob"``, ``linear=True``): the output is
  ``log(mean_i p_i)`` (the log of the mean of the local class probabilities: the "mean probability" combiner) plus
  a linear map of the scaled inputs plus the MLP, whose last layers start at (near) zero. The untrained network is
  the averaging combiner; the linear path can hold a multinomial logistic regression (the convex stacker, fit
  exactly by :mod:`ddcnn.stages.coarse`); the hidden layers learn what neither captures. With few rows per class
  an MLP fit from scratch cannot learn what averaging gets for free (measured on synthetic local outputs: 100 rows
  of 100 classes, the mean of 4 local nets 0.80 accuracy, a plain MLP and a logistic regression near chance); with
  many classes and rows a small MLP trained for a few hundred steps trails the converged logistic regression by 1-3
  points. The skips keep both simpler combiners inside the coarse DNN.

``skip="none"``, ``linear=False`` and ``input_norm="none"`` give the paper's plain MLP on the raw local outputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ddcnn.models import layers as _layers

__all__ = ["CoarseMLP", "INPUT_KINDS", "INPUT_NORMS", "SKIPS"]

INPUT_KINDS = ("probs", "logits")
INPUT_NORMS = ("standardize", "none")
SKIPS = ("mean_prob", "none")
# Standard deviations below this are a constant feature: it is centred but not divided (no noise amplification).
_MIN_STD = 1e-4
# With the averaging skip the MLP's last layer starts at this scale of PyTorch's default initialisation (the linear
# path at zero): the untrained network is the averaging combiner up to a small correction, and every weight still
# gets a gradient.
_SKIP_INIT_SCALE = 1e-2
# Probabilities are clamped to this before the log of their mean (a class that every local net rules out).
_MIN_PROB = 1e-12


class CoarseMLP(nn.Module):
    """Dense network from the ``N`` local class scores of ``K`` classes to ``K`` global logits.

    The input is what the local CNNs produced for one image, either as ``(B, N, K)`` or already flattened
    sub-domain-major as ``(B, N * K)``: class probabilities or logits (``inputs``).

    Args:
        num_subdomains: Number of sub-domains ``N`` (local networks).
        num_classes: Number of classes ``K``.
        hidden: Widths of the hidden layers; ``()`` gives a linear model.
        dropout: Dropout probability after each hidden activation.
        act: Activation name, see :func:`ddcnn.models.layers.act`.
        norm: Put a ``LayerNorm`` after each hidden linear layer (independent of the batch size, so it behaves the
            same in training and evaluation).
        inputs: What the module receives: ``probs`` (local class probabilities, as in the paper) or ``logits``.
        input_norm: ``standardize`` (per-feature mean and standard deviation of the training rows, set by
            :meth:`fit_input_scaling`; identity until then) or ``none``.
        skip: ``mean_prob`` (output = log of the mean local probability + the MLP's correction) or ``none``.
        linear: Add a linear map of the scaled inputs to the output, beside the hidden layers (ignored without
            hidden layers, where the MLP is that map).

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
        inputs: str = "probs",
        input_norm: str = "none",
        skip: str = "none",
        linear: bool = False,
    ) -> None:
        super().__init__()
        _layers.check_positive(num_subdomains=num_subdomains, num_classes=num_classes)
        for width in hidden:
            _layers.check_positive(hidden=width)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}.")
        act = _layers.check_act(act)
        for name, value, allowed in (("inputs", inputs, INPUT_KINDS), ("input_norm", input_norm, INPUT_NORMS)):
            if value not in allowed:
                raise ValueError(f"coarse.net.{name} must be one of {', '.join(allowed)}, got {value!r}.")
        if skip not in SKIPS:
            raise ValueError(f"coarse.net.skip must be one of {', '.join(SKIPS)}, got {skip!r}.")

        self.num_subdomains = num_subdomains
        self.num_classes = num_classes
        self.in_features = num_subdomains * num_classes
        self.inputs = inputs
        self.input_norm = input_norm
        self.skip = skip
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
        # The linear path: an nn.Linear beside the hidden layers (TorchScript needs a module, not None).
        self.has_linear = bool(linear) and len(hidden) > 0
        self.linear = nn.Linear(self.in_features, num_classes) if self.has_linear else nn.Identity()
        # The averaging combiner's weight in the output (fitted with the linear path; 1: the plain combiner).
        self.skip_scale = nn.Parameter(torch.ones(()), requires_grad=skip == "mean_prob")
        self.register_buffer("input_mean", torch.zeros(self.in_features))
        self.register_buffer("input_std", torch.ones(self.in_features))
        if skip == "mean_prob":
            with torch.no_grad():
                self.mlp[-1].weight.mul_(_SKIP_INIT_SCALE)
                self.mlp[-1].bias.zero_()
                if self.has_linear:
                    self.linear.weight.zero_()
                    self.linear.bias.zero_()

    def linear_layer(self) -> nn.Linear:
        """The layer that maps the scaled inputs linearly to the output: the linear path, or the whole MLP when it has
        no hidden layer."""
        if self.has_linear:
            return self.linear
        if len(self.mlp) == 1:
            return self.mlp[0]
        raise ValueError("this coarse DNN has no linear path (coarse.net.linear=false with hidden layers).")

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            if x.shape[1] != self.num_subdomains or x.shape[2] != self.num_classes:
                raise ValueError(
                    f"expected (B, {self.num_subdomains}, {self.num_classes}) local scores, got {list(x.shape)}"
                )
            return torch.flatten(x, 1)
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"expected (B, {self.num_subdomains}, {self.num_classes}) or (B, {self.in_features}) local scores, "
                f"got {list(x.shape)}"
            )
        return x

    @torch.no_grad()
    def fit_input_scaling(self, x: torch.Tensor) -> None:
        """Set the input scaling from the training rows ``x`` (``(n, N, K)`` or ``(n, N * K)``); a no-op with
        ``input_norm="none"``. Statistics are computed in float64; constant features are centred only."""
        if self.input_norm == "none":
            return
        flat = self._flat(x).double()
        mean = flat.mean(0)
        std = flat.std(0) if len(flat) > 1 else torch.ones_like(mean)
        std = torch.where(std < _MIN_STD, torch.ones_like(std), std)
        self.input_mean.copy_(mean.to(self.input_mean.dtype))
        self.input_std.copy_(std.to(self.input_std.dtype))

    def scale_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The scaled, flattened inputs ``(B, N * K)`` that the linear path and the hidden layers see."""
        return (self._flat(x) - self.input_mean) / self.input_std

    def averaging_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``log(mean_i p_i)``: the mean-probability combiner as logits, for local scores ``(B, N, K)`` or flat."""
        scores = self._flat(x).view(-1, self.num_subdomains, self.num_classes)
        probs = scores.softmax(dim=-1) if self.inputs == "logits" else scores
        return probs.mean(dim=1).clamp_min(1e-12).log()  # 1e-12: _MIN_PROB (TorchScript takes no globals)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits ``(B, num_classes)`` for local scores ``(B, num_subdomains, num_classes)`` or flattened."""
        flat = self._flat(x)
        z = (flat - self.input_mean) / self.input_std
        out = self.mlp(z)
        if self.has_linear:
            out = out + self.linear(z)
        if self.skip == "mean_prob":
            out = out + self.skip_scale * self.averaging_logits(flat)
        return out

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        # A coarse DNN saved before the input scaling and the skips existed: identity scaling, unit skip weight.
        defaults = {"input_mean": torch.zeros_like(self.input_mean), "input_std": torch.ones_like(self.input_std)}
        defaults["skip_scale"] = torch.ones(())
        for name, default in defaults.items():
            if prefix + name not in state_dict:
                state_dict[prefix + name] = default
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors)
