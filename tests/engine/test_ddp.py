"""One net over several devices with Lightning DDP (ddp_spawn, gloo on CPU, 2 processes)."""

from __future__ import annotations

import pytest
import torch

from ddcnn.data.datamodule import _EpochBatchSampler
from ddcnn.pipeline import train
from ddcnn.rundir import RunDir


def test_sampler_shards_one_permutation_across_ranks(monkeypatch):
    shards = []
    for rank in range(2):
        monkeypatch.setattr(_EpochBatchSampler, "_rank_world", staticmethod(lambda r=rank: (r, 2)))
        sampler = _EpochBatchSampler(n=11, batch_size=4, seed=1)
        sampler.set_epoch(3)
        batches = [idx for _, idx in sampler]
        assert len(batches) == len(sampler) == 2
        shards.append(torch.cat(batches))
    assert len(shards[0]) == len(shards[1]) == 6  # 11 samples padded to 12: same number of steps on both ranks
    assert set(torch.cat(shards).tolist()) == set(range(11))


@pytest.mark.slow
def test_global_and_local_nets_train_with_ddp_on_two_cpu_processes(make_cfg):
    cfg = make_cfg("engine.num_devices=2", "stage=local", "subdomain=0")
    meta = train(cfg)["local"][0]
    assert 0.0 <= meta["accuracy"]["test"] <= 1.0
    cfg = make_cfg("engine.num_devices=2", "stage=global")
    meta = train(cfg)["global"]
    run = RunDir(cfg.paths.run_dir)
    assert run.is_done("global") and (run.stage_dir("global") / "last.ckpt").is_file()
    probs = run.load_probs("global", "test")["probs"]
    assert probs.shape[0] == 100 and torch.allclose(probs.sum(-1), torch.ones(100), atol=1e-5)
