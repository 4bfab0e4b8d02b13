"""Combiners on hand-made probabilities with known answers."""

from __future__ import annotations

import pytest
import torch

from ddcnn.report.combiners import majority_vote, mean_probability


def test_mean_probability_can_disagree_with_the_vote():
    # Two weak votes for class 0, one confident vote for class 1.
    probs = torch.tensor([[[0.55, 0.45], [0.55, 0.45], [0.0, 1.0]]])
    assert mean_probability(probs).tolist() == [1]
    assert majority_vote(probs).tolist() == [0]


def test_majority_vote_tie_goes_to_larger_summed_probability_then_smaller_index():
    probs = torch.tensor(
        [
            [[0.6, 0.4, 0.0], [0.1, 0.9, 0.0]],  # 1 vote each; summed 0.7 vs 1.3 -> class 1
            [[0.5, 0.0, 0.5], [0.5, 0.0, 0.5]],  # argmax picks class 0 twice -> class 0
            [[0.0, 0.8, 0.2], [0.0, 0.2, 0.8]],  # 1 vote each, equal sums 1.0 -> smaller index 1
        ]
    )
    assert majority_vote(probs).tolist() == [1, 0, 1]


def test_a_combiner_refuses_probabilities_of_another_shape():
    probs = torch.softmax(torch.randn(5, 4, 3), -1)
    with pytest.raises(ValueError, match="samples, subdomains, classes"):
        majority_vote(probs[0])
