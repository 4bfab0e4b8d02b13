"""The other parallel-training systems, as baselines beside the CNN-DNN: filter-parallel convolutions and BPT-CNN.

* :mod:`ddcnn.baselines.filter_parallel`: the global CNN with every convolution's filters split over ``P``
  processes in proportion to their speeds (Marques et al., https://arxiv.org/abs/1712.02546).
* :mod:`ddcnn.baselines.bpt_cnn`: BPT-CNN's outer layer, a parameter server and ``P`` workers with speed-
  proportional incremental data allocation (IDPA) and damped asynchronous updates (AGWU) or synchronous averaging
  (Chen et al., https://arxiv.org/abs/1810.07742).
* :mod:`ddcnn.baselines.loop`: the training loop they share and the single-process reference.

``bench/baselines.py`` measures them and writes their rows as JSON; :func:`baseline_rows` reads them back for the
comparison report.
"""

from __future__ import annotations

import json
from pathlib import Path

from ddcnn.baselines.bpt_cnn import agwu_weight, idpa_allocate, train_bpt
from ddcnn.baselines.filter_parallel import (
    FilterParallelConv,
    calibrate_shares,
    split_channels,
    to_filter_parallel,
    to_single_model,
    train_filter_parallel,
)
from ddcnn.baselines.loop import TrainSpec, train_single

__all__ = [
    "ROW_KEYS",
    "FilterParallelConv",
    "TrainSpec",
    "agwu_weight",
    "baseline_rows",
    "calibrate_shares",
    "idpa_allocate",
    "split_channels",
    "to_filter_parallel",
    "to_single_model",
    "train_bpt",
    "train_filter_parallel",
    "train_single",
]

# The columns every row of the benchmark file has, whatever the method.
ROW_KEYS = ("method", "processes", "accuracy", "wall_time_s", "step_time_s", "speedup", "parallel_efficiency")


def baseline_rows(path: str | Path) -> list[dict]:
    """The rows of a ``bench/baselines.py --out`` file, for the comparison report.

    Each row is one method (the single-process global CNN, filter-parallel, BPT-CNN async and sync) trained on the
    same data, backbone and epochs, with at least the keys of :data:`ROW_KEYS`: ``accuracy`` on the test split,
    ``wall_time_s`` of training on this machine, ``speedup`` (single-process wall time over this one) and
    ``parallel_efficiency`` (speedup over ``processes``, the number of processes that compute; BPT-CNN's server
    is not counted).

    Args:
        path: The JSON file written by the benchmark.

    Raises:
        FileNotFoundError: If the file does not exist.
        ValueError: If it is not a benchmark file or a row lacks a key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"baseline results {path} do not exist; run bench/baselines.py --out {path} first.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"baseline results {path} are not valid JSON ({err}).") from err
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"baseline results {path} hold no 'rows' list; was it written by bench/baselines.py?")
    for i, row in enumerate(rows):
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"baseline results {path}: row {i} lacks {missing}.")
    return rows
