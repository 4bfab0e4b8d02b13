"""Every method's per-image test predictions of a finished run, compactly: what paired tests over test images (McNemar,
a paired bootstrap) need, small enough to keep beside a run's snapshot.

A run keeps each stage's full test outputs (``RUN_DIR/<stage>/probs_test.pt``: logits and probabilities in float32).
:func:`compact_test_predictions` keeps of them, per results row (the keys of ``results.json`` ``accuracy``): the
predicted class as ``uint8`` (``int16`` beyond 256 classes), and for two classes the probability of class 1 as
``float16``, which the ROC AUC needs; the averaging combiners (``mean_prob``, ``majority_vote``) come from the local
nets' saved outputs as the evaluate stage computes them. 10,000 test images cost 10 KB per method (30 KB with the
binary probability). ``cnn_dnn`` names the row of the run's main coarse DNN (``aliases``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ddcnn import registry
from ddcnn.io import atomic_torch_save, load_run_file
from ddcnn.report.combiners import majority_vote, mean_probability
from ddcnn.rundir import RunDir

__all__ = ["PREDICTIONS_FILE", "compact_test_predictions", "write_compact_predictions", "read_compact_predictions"]

PREDICTIONS_FILE = "predictions_test.pt"


def _classes(pred: torch.Tensor, num_classes: int) -> torch.Tensor:
    return pred.to(torch.uint8 if num_classes <= 256 else torch.int16)


def _entry(probs: torch.Tensor, pred: torch.Tensor, num_classes: int) -> dict[str, torch.Tensor]:
    entry = {"pred": _classes(pred, num_classes)}
    if num_classes == 2:
        entry["prob1"] = probs[:, 1].to(torch.float16)
    return entry


def compact_test_predictions(run_dir: str | Path) -> dict:
    """The compact test predictions of every finished method of the run in ``run_dir`` (module doc).

    Returns:
        ``{"labels", "num_classes", "methods": {key: {"pred", "prob1"?}}, "aliases": {"cnn_dnn": key}}``.

    Raises:
        FileNotFoundError: When the local nets have not finished (the run has no test predictions to keep).
    """
    run = RunDir(run_dir)
    n = 0
    while run.is_done("local", n):
        n += 1
    if n == 0:
        raise FileNotFoundError(f"{run.root} holds no finished local net: there are no test predictions to keep.")
    probs, labels = run.local_outputs(n, "test", "probs")
    k = int(probs.shape[-1])
    methods: dict[str, dict[str, torch.Tensor]] = {}
    methods["mean_prob"] = _entry(probs.mean(1), mean_probability(probs), k)
    # the majority vote's score is its share of the votes, as the evaluate stage's AUC takes it
    vote_share = torch.zeros(len(labels), k).scatter_add_(1, probs.argmax(-1), torch.ones(probs.shape[:2])) / n
    methods["majority_vote"] = _entry(vote_share, majority_vote(probs), k)
    aliases: dict[str, str] = {}
    for stage in registry.STAGES:
        if stage.row is None or not run.is_done(stage.name):
            continue
        key = stage.row.key
        if "{input}" in key:
            key = key.format(input=run.meta(stage.name).get("input", "probs"))
            if stage.name == "coarse":
                aliases["cnn_dnn"] = key
        saved = load_run_file(run.stage_dir(stage.name) / "probs_test.pt")
        if not torch.equal(saved["labels"], labels):
            raise ValueError(f"{run.stage_dir(stage.name)}: its test predictions are for other images than the run's.")
        methods[key] = _entry(saved["probs"], saved["probs"].argmax(-1), k)
    return {"labels": _classes(labels, k), "num_classes": k, "methods": methods, "aliases": aliases}


def write_compact_predictions(run_dir: str | Path, path: str | Path) -> Path:
    """:func:`compact_test_predictions` of ``run_dir`` written to ``path`` (atomically)."""
    path = Path(path)
    atomic_torch_save(compact_test_predictions(run_dir), path)
    return path


def read_compact_predictions(path: str | Path) -> dict:
    """A file of :func:`write_compact_predictions`, the classes as ``int64`` and the probabilities as ``float32``."""
    saved = load_run_file(Path(path))
    methods = {
        key: {name: (v.long() if name == "pred" else v.float()) for name, v in entry.items()}
        for key, entry in saved["methods"].items()
    }
    return {**saved, "labels": saved["labels"].long(), "methods": methods}
