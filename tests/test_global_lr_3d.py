"""experiments/global_lr_3d.py: the 3D global CNN's learning-rate sweep of docs/protocol.md section 5b."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, load_script


@pytest.fixture(scope="module")
def sweep():
    return load_script("experiments/global_lr_3d.py", "global_lr_3d")


def _finished(folder: Path, probs: list[list[float]], labels: list[int], best_epoch: int = 3) -> None:
    folder.mkdir(parents=True)
    p = torch.tensor(probs, dtype=torch.float32)
    torch.save({"probs": p, "logits": p.log(), "labels": torch.tensor(labels)}, folder / "probs_val.pt")
    (folder / "meta.json").write_text(json.dumps({"best_epoch": best_epoch, "converged": True}))
    (folder / "done").write_text("")


def test_the_sweep_trains_the_pages_3d_command_with_only_the_global_stage_and_the_rate_where_it_differs(
    sweep, tmp_path
):
    results = sweep.page_script(REPO)
    page = results.RunSpec(
        next(d for d in results.plan(results._resolve(results._parser().parse_args([]))) if d.key == "adrenal3d"),
        "2x2x2",
        None,
        1,
    )
    workdir = tmp_path / "page"
    meta = workdir / "adrenal3d" / "2x2x2_s0" / "global_ensemble" / "meta.json"  # the k the page's first seed chose
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"k": 3}))
    recipe = sweep.command(results, 1, sweep.RATES[0], tmp_path / "out", workdir)
    other = sweep.command(results, 1, 0.001, tmp_path / "out", workdir)
    expected = page.overrides(workdir)
    assert recipe[3 : 3 + len(expected)] == expected and "engine.precise_bn=50" in expected
    assert recipe[3 + len(expected) :] == ["stage=global", f"hydra.run.dir={tmp_path / 'out' / 'lr0.002_s1'}"]
    assert other[3 + len(expected) :] == [
        "stage=global",
        "optimizer.lr=0.001",
        f"hydra.run.dir={tmp_path / 'out' / 'lr0.001_s1'}",
    ]


def test_the_higher_mean_validation_auc_wins_and_a_tie_keeps_the_recipes_rate(sweep, tmp_path):
    labels = [0, 0, 1, 1]
    good = [[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]]  # AUC 1
    fair = [[0.9, 0.1], [0.3, 0.7], [0.6, 0.4], [0.2, 0.8]]  # AUC 0.75
    for seed in sweep.SEEDS[:-1]:
        _finished(sweep.run_dir(tmp_path, 0.002, seed) / "global", fair, labels)
        _finished(sweep.run_dir(tmp_path, 0.001, seed) / "global", good, labels)
    partial = sweep.table(tmp_path)
    assert not partial["complete"] and partial["winner"] is None
    assert "6 of 8 trainings finished: no decision yet" in sweep.render(partial)
    _finished(sweep.run_dir(tmp_path, 0.002, sweep.SEEDS[-1]) / "global", fair, labels)
    _finished(sweep.run_dir(tmp_path, 0.001, sweep.SEEDS[-1]) / "global", good, labels)
    result = sweep.table(tmp_path)
    assert result["winner"] == 0.001 and result["means"]["0.001"]["val_auc"] == pytest.approx(1.0)
    assert result["means"]["0.002"]["val_auc"] == pytest.approx(0.75)
    # the kept validation loss, from the same probabilities: mean -log p(true class)
    first = result["rows"][0]
    assert first["val_loss"] == pytest.approx(-float(torch.tensor([0.9, 0.3, 0.4, 0.8]).double().log().mean()))
    assert "the page retrains" in sweep.render(result)
    # equal AUCs: the recipe's rate stands
    for seed in sweep.SEEDS:
        folder = sweep.run_dir(tmp_path, 0.001, seed) / "global"
        torch.save(
            torch.load(sweep.run_dir(tmp_path, 0.002, seed) / "global" / "probs_val.pt"), folder / "probs_val.pt"
        )
    tie = sweep.table(tmp_path)
    assert tie["winner"] == 0.002 and "the recipe's rate stands" in sweep.render(tie)
    assert sweep.summary(tie).endswith("the higher is 0.002: the recipe's rate stands.")
    # what the table reads, copied, gives the same table
    sweep.save(tmp_path, tmp_path / "copy")
    assert sweep.table(tmp_path / "copy") == tie


def test_the_protocols_sweep_result_is_what_the_committed_trainings_give(sweep):
    saved = REPO / "docs" / "next" / "global_lr_3d"
    if not saved.is_dir():
        pytest.skip("the sweep's trainings are not committed yet")
    protocol = " ".join((REPO / "docs" / "protocol.md").read_text().split())
    assert sweep.summary(sweep.table(saved)) in protocol
