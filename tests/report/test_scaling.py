"""``ddcnn-scaling``: the predicted wall time table of a finished run."""

from __future__ import annotations

import json

import pytest

from ddcnn.cli import scaling_main
from ddcnn.report.scaling import run_times, scaling_table
from ddcnn.rundir import RunDir


def _fake_run(root, local_s: list[float], coarse_s=2.0, global_s=50.0, grid=(2, 2)):
    run = RunDir(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "fingerprint.json").write_text(
        json.dumps({"fingerprint": "x", "settings": {"decomposition": {"grid": list(grid)}}})
    )
    for i, t in enumerate(local_s):
        run.stage_dir("local", i).mkdir(parents=True)
        run.mark_done("local", i, {"time_s": t, "device": "cpu"})
    for stage, t in (("coarse", coarse_s), ("global", global_s)):
        if t is not None:
            run.stage_dir(stage).mkdir()
            run.mark_done(stage, None, {"time_s": t})
    return run


def test_table_rows_from_measured_times(tmp_path, capsys):
    _fake_run(tmp_path / "run", [10.0, 10.0, 10.0, 30.0])
    text, rows = scaling_table(tmp_path / "run", mixed=[1.0, 0.5])
    assert [r.label for r in rows] == ["1 x 1.0", "2 x 1.0", "4 x 1.0", "1 x 1 + 1 x 0.5"]
    assert [r.local_s for r in rows[:3]] == pytest.approx([60.0, 30.0, 30.0])
    assert rows[3].local_s == pytest.approx(40.0)  # 30 on the fast one, then the rest: 10+10 slow=40 vs 40 fast
    assert rows[1].speedup == pytest.approx(50.0 / 32.0)
    assert "| 2 x 1.0 | 30.0 | 32.0 | 1.56x | 100% |" in text
    assert "| global CNN, 1 x 1.0 | - | 50.0 | 1.00x | - |" in text

    scaling_main([str(tmp_path / "run"), "--devices", "1,4", "--mixed", "2x1.0,2x0.25", "--startup-s", "1"])
    out = capsys.readouterr().out
    assert "| 4 x 1.0 | 30.0 | 33.0 | 1.52x |" in out
    assert "| 2 x 1 + 2 x 0.25 |" in out and "start-up 1.0 s" in out


def test_unfinished_run_and_bad_arguments_say_what_is_wrong(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", [10.0, 10.0, 10.0, 10.0], coarse_s=None, global_s=None)
    times = run_times(run.root)
    assert times.coarse_s is None and times.global_s is None
    text, rows = scaling_table(run.root, [2])
    assert rows[0].speedup is None and "| 2 x 1.0 | 20.0 | 20.0 | - |" in text

    (run.stage_dir("local", 3) / "done").unlink()
    with pytest.raises(FileNotFoundError, match=r"local nets \[3\] have not finished"):
        run_times(run.root)
    with pytest.raises(SystemExit) as exit_info:
        scaling_main([str(run.root)])
    assert exit_info.value.code == 2 and "have not finished" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scaling_main([str(tmp_path / "run"), "--mixed", "2x"])
    assert "COUNTxSPEED" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scaling_main([str(tmp_path / "nothing")])
    assert "holds no local nets" in capsys.readouterr().err


def test_scaling_of_a_real_tiny_run(make_cfg, tmp_path):
    """From the meta files the pipeline writes (not hand-made ones)."""
    from ddcnn.pipeline import train

    cfg = make_cfg("data.train_subset=100", "trainer.limit_train_batches=1")
    train(cfg)
    text, rows = scaling_table(cfg.paths.run_dir)
    assert [r.devices for r in rows] == [1, 2, 4]
    assert rows[2].local_s <= rows[1].local_s <= rows[0].local_s
    assert all(r.speedup and r.speedup > 0 for r in rows)
