"""GPU-first defaults (issue 23), checked on CPU: ``device=auto``, the GPU policy of the loop, peak memory, data held on
the device, and the opt-ins (``engine.compile``, ``engine.profile_steps``). Every path a CUDA run takes is exercised
with the device as an argument, so the same code runs here."""

from __future__ import annotations

import pytest

from ddcnn.parallel.devices import plan_workers, process_device
from ddcnn.rundir import RunDir
from ddcnn.runtime import resolve_device


# --- device=auto ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cuda_count", [0, 1, 4])
def test_auto_resolves_to_the_kind_parallel_workers_use(cuda_count):
    device = resolve_device("auto", cuda_count=cuda_count)
    assert device == ("cuda" if cuda_count else "cpu")
    kinds = {w.device.split(":")[0] for w in plan_workers(3, "auto", cores=6, cuda_count=cuda_count)}
    assert kinds == {device}  # local nets of the workers and the one-device stages: one kind


def test_explicit_devices_are_kept_and_auto_never_picks_mps():
    assert [resolve_device(d, cuda_count=2) for d in ("cpu", "cuda:1", "mps", None)] == ["cpu", "cuda:1", "mps", "cpu"]
    assert resolve_device("AUTO", cuda_count=0) == "cpu"


def test_the_default_config_says_auto_and_resolves_to_cpu_without_a_gpu(make_cfg, monkeypatch):
    cfg = make_cfg()
    assert cfg.device == "auto"
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert process_device(cfg) == "cpu"


def test_a_run_dir_recorded_with_device_cpu_accepts_device_auto(make_cfg, tmp_path):
    run = RunDir(tmp_path / "run")
    run.check_fingerprint(make_cfg("device=cpu"))
    run.check_fingerprint(make_cfg())  # device=auto (here: cpu) is not a settings change
    run.check_fingerprint(make_cfg("device=cuda"))  # where a run trains never changes its fingerprint
