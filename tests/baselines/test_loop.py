"""The shared training loop, the single-process reference and the glue that hands benchmark rows to the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddcnn.baselines import ROW_KEYS, baseline_rows
from ddcnn.baselines.loop import TrainSpec, batch_order, train_single
from ddcnn.models import vgg_tiny


def test_batch_order_is_seeded_and_covers_the_epoch() -> None:
    a, b = batch_order(100, 32, seed=1, epoch=2), batch_order(100, 32, seed=1, epoch=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert sorted(torch.cat(a).tolist()) == list(range(100))
    assert not torch.equal(torch.cat(a), torch.cat(batch_order(100, 32, seed=1, epoch=3)))
    # A last batch of one sample is dropped (batch norm cannot train on it).
    assert [len(x) for x in batch_order(65, 32, 0, 0)] == [32, 32]


def test_cosine_schedule_and_validation() -> None:
    spec = TrainSpec(lr=0.1, schedule="cosine")
    assert spec.lr_at(0.0) == pytest.approx(0.1)
    assert spec.lr_at(0.5) == pytest.approx(0.05)
    assert spec.lr_at(1.0) == pytest.approx(0.0)
    assert TrainSpec(lr=0.1).lr_at(0.7) == 0.1
    for bad in ({"epochs": 0}, {"optimizer": "adam"}, {"lr": 0.0}, {"schedule": "step"}):
        with pytest.raises(ValueError):
            TrainSpec(**bad)


def test_train_single_learns_and_leaves_the_network_alone() -> None:
    torch.manual_seed(0)
    x = torch.randn(200, 1, 8, 8)
    y = (x[:, 0, :4].mean(dim=(1, 2)) > 0).long()
    net = vgg_tiny(2, 1, 2)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    result = train_single(net, x[:160], y[:160], x[160:], y[160:], TrainSpec(epochs=3, batch_size=16), threads=1)
    assert result["accuracy"] > 0.75
    assert result["steps"] == 3 * 10 and result["processes"] == 1
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_baseline_rows_reads_the_benchmark_file(tmp_path: Path) -> None:
    row = dict.fromkeys(ROW_KEYS, 1.0) | {"method": "filter-parallel (2 processes)"}
    path = tmp_path / "results_baselines.json"
    path.write_text(json.dumps({"config": {}, "rows": [row]}))
    assert baseline_rows(path) == [row]
    with pytest.raises(FileNotFoundError, match="bench/baselines.py"):
        baseline_rows(tmp_path / "missing.json")
    path.write_text(json.dumps({"rows": [{"method": "x"}]}))
    with pytest.raises(ValueError, match="lacks"):
        baseline_rows(path)
    path.write_text("[]")
    with pytest.raises(ValueError, match="rows"):
        baseline_rows(path)
