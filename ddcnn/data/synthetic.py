"""Synthetic local outputs: what ``N`` local nets might say about ``K`` classes, for any size and class count.

Checking a combiner (the coarse DNN, the convex stacker, averaging) across dataset sizes and class counts needs local
outputs of 10^2 to 10^5 samples and 2 to 100 classes; training real local nets for each would take hours.
:func:`synthetic_local_outputs` draws outputs with the traits of real ones (measured on the local nets of digits,
MNIST and two-digit MNIST composites):

- every sub-domain sees the image partly: its own accuracy (drawn between 0.2 and 0.9), and a per-sample difficulty
  shared by all sub-domains (hard images are hard everywhere);
- a wrong local decision points to a confusable class (a fixed partner of the true class per sub-domain) or to a
  random one, with a weak trace of the true class left in the scores;
- overconfidence: logits scaled by 1.5 to 5, so probabilities saturate near 0 and 1;
- in-sample bias: on the training split the local nets are more accurate (``overfit`` of the remaining errors
  removed) and more confident, as nets evaluated on their own training images are;
- uneven classes (a Dirichlet draw of the class frequencies), so the majority-class rate is above ``1/K``.
"""

from __future__ import annotations

import torch

__all__ = ["synthetic_local_outputs"]


def synthetic_local_outputs(
    n_train: int,
    num_subdomains: int,
    num_classes: int,
    *,
    n_val: int | None = None,
    n_test: int = 5000,
    seed: int = 0,
    overfit: float = 0.6,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Local logits ``(n, N, K)`` and labels of the splits ``train``, ``val`` (default ``max(50, n_train // 6)``
    samples) and ``test``, fixed by ``seed``.

    Returns:
        ``(x, y)``: per split the logits and the labels.
    """
    if min(n_train, num_subdomains, n_test) < 1 or num_classes < 2:
        raise ValueError("synthetic local outputs need n_train, num_subdomains, n_test >= 1 and num_classes >= 2.")
    if not 0.0 <= overfit < 1.0:
        raise ValueError(f"overfit must lie in [0, 1), got {overfit!r}.")
    g = torch.Generator().manual_seed(int(seed))
    n, k = num_subdomains, num_classes
    accuracy = 0.2 + 0.7 * torch.rand(n, generator=g)
    scale = 1.5 + 3.5 * torch.rand(n, generator=g)
    partner = torch.stack([torch.randperm(k, generator=g) for _ in range(n)])
    # Class frequencies: a Dirichlet(5) draw through normalised Gamma(5) samples (sums of exponentials).
    frequencies = -torch.log(torch.rand(k, 5, generator=g)).sum(1)
    frequencies = frequencies / frequencies.sum()
    sizes = {"train": int(n_train), "val": int(n_val or max(50, n_train // 6)), "test": int(n_test)}
    x, y = {}, {}
    for split, m in sizes.items():
        labels = torch.multinomial(frequencies, m, replacement=True, generator=g)
        difficulty = torch.rand(m, generator=g)
        acc = accuracy if split != "train" else accuracy + (1 - accuracy) * overfit
        conf = scale if split != "train" else scale * 1.5
        p_correct = torch.sigmoid(torch.logit(acc)[None, :] - 3.0 * (difficulty[:, None] - 0.5))
        correct = torch.rand(m, n, generator=g) < p_correct
        confusable = partner[torch.arange(n)[None, :], labels[:, None]]
        other = torch.randint(k, (m, n), generator=g)
        wrong = torch.where(torch.rand(m, n, generator=g) < 0.5, confusable, other)
        target = torch.where(correct, labels[:, None], wrong)
        signal = 2.0 * torch.nn.functional.one_hot(target, k).float()
        signal = signal + 0.5 * torch.nn.functional.one_hot(labels, k)[:, None].float()
        noise = 0.7 * torch.randn(m, n, k, generator=g)
        x[split] = conf[None, :, None] * (signal + noise)
        y[split] = labels
    return x, y
