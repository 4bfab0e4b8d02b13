"""The comparison report across runs: one table per dataset, CSV files and plots.

It collects finished runs (each a run directory holding ``results.json`` and ``config.yaml``, e.g. the job folders
of a Hydra sweep ``ddcnn-train -m ...``), groups them by dataset (its name and what identifies its data: the folder
an image folder reads, the file name of an archive; :func:`dataset_labels`), backbone, grid and overlap (and any other
setting that differs between runs of one dataset, such as ``trainer.max_epochs``), and reports for every method of
:data:`ddcnn.report.results.METHODS` the test accuracy, balanced accuracy and ROC AUC (each as mean ± sample
standard deviation over the seeds), the sequential training time, the projected time on the devices the method can
use, the speedup against the global CNN on one device (equal device counts: ``docs/protocol.md``), the speedup to the
fixed target on one device, whether the timing was comparable, and the parameter count (definitions:
:func:`ddcnn.report.results.method_rows`), then the paired differences by seed with their 95% interval and verdict
(:func:`paired_rows`).

Files written into the output folder:

- ``report.md``: every dataset's table, the plots and any external baseline rows;
- ``<dataset>.md`` and ``<dataset>.csv``: the table of one dataset, then its paired differences;
- ``<dataset>_paired.csv``: the paired differences (CNN-DNN − global CNN, CNN-DNN − mean probability, global DDP −
  global CNN and the other pairs of :data:`~ddcnn.report.stats.PAIRS`; test accuracy in points, paired by seed within
  a configuration) with their 95% t-interval, the paired t-test's p, p Holm-adjusted over the report's rows, and the
  verdict (:func:`paired_rows`, :mod:`ddcnn.report.stats`);
- ``<dataset>_accuracy_vs_grid.png``, ``<dataset>_time_vs_grid.png``: one panel per backbone and overlap;
- ``<dataset>_<backbone>_<grid>_o<overlap>_subdomains.png``: mean test accuracy of every local net, laid out like the
  grid (3D grids: one panel per layer of the first axis);
- ``baselines.csv`` when baseline rows were given (:func:`load_baseline_rows`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddcnn.io import atomic_write_text
from ddcnn.report.results import METHODS, TIMING_RULE, baseline_flag, method_rows
from ddcnn.report.stats import NO_VERDICT, PAIRS, all_converged, holm, paired_difference, t_quantile_975
from ddcnn.rundir import NON_RESULT_KEYS, RunDir, absent_means, flatten, flatten_recorded

log = logging.getLogger(__name__)

__all__ = [
    "Run",
    "find_runs",
    "load_run",
    "data_identity",
    "dataset_labels",
    "load_baseline_rows",
    "comparison_rows",
    "paired_rows",
    "paired_columns",
    "paired_markdown",
    "table_markdown",
    "write_report",
]

# Settings that tell nothing about a run's method (where it ran, what it printed) or that the grouping shows
# anyway (data set, decomposition, backbone, seed). Any other setting that differs between runs of one dataset
# becomes part of the group label, so that runs of different epochs are never averaged together.
_IGNORED = (
    *NON_RESULT_KEYS,  # where and how a run executed: never a reason to split groups
    "seed",
    "decomposition",
    "model",
    "data.name",
    "data.path",
    "data.root",
    "data.source.path",
    "data.source.root",
)

# The leading columns of every row: its dataset and its configuration (see _config_columns).
_CONFIG_COLUMNS = (
    "dataset",
    "backbone",
    "grid",
    "num_subdomains",
    "overlap",
    "settings",
)

CSV_COLUMNS = (
    *_CONFIG_COLUMNS,
    "timing_context",
    "method",
    "method_key",
    "seeds",
    "accuracy_mean",
    "accuracy_std",
    "balanced_accuracy_mean",
    "balanced_accuracy_std",
    "auc_mean",
    "auc_std",
    "sequential_time_s",
    "projected_time_s",
    "devices",
    "speedup",
    "speedup_1_device",
    "speedup_vs_ddp",
    "ddp_devices",
    "timing_comparable",
    "speedup_to_target_mean",
    "speedup_to_target_low",
    "speedup_to_target_high",
    "target_not_comparable",
    "target_reached",
    "speedup_to_reverse_target_mean",
    "speedup_to_reverse_target_low",
    "speedup_to_reverse_target_high",
    "reverse_target_not_comparable",
    "reverse_target_reached",
    "unconverged_runs",
    "params",
)

PAIRED_COLUMNS = (
    *_CONFIG_COLUMNS,
    "comparison",
    "method_key",
    "baseline_key",
    "n",
    "seeds",
    "mean_points",
    "std_points",
    "ci_low_points",
    "ci_high_points",
    "p",
    "p_holm",
    "verdict",
    "baseline_converged",
)
# Comparisons of two arms trained once per dataset and seed whatever the grid (the global CNN and its DDP): their rows
# of every configuration hold the same differences where the runs share those trainings, and are then one row.
CONFIGURATION_FREE = (("global_ddp", "global"),)
ALL_CONFIGURATIONS = "all"

# Differences of a run's timing that mark its rows but do not split groups (they vary from run to run).
_MARK_ONLY = ("load", "reused")


@dataclass
class Run:
    """One finished run: its results, its configuration and the labels the report groups by."""

    path: Path
    results: dict
    config: dict
    dataset: str
    backbone: str
    grid: tuple[int, ...]
    overlap: tuple[int, ...]
    seed: int
    rows: list[dict] = field(default_factory=list)
    # What identifies the data beyond their name (:func:`data_identity`): runs of one name but other data never pool.
    data_source: str | None = None

    @property
    def timing_context(self) -> str:
        """Where this run's compared times were measured, in words; ``mixed (...)`` when they do not share one context,
        ``unknown`` for runs written before contexts were recorded. Runs of different contexts are never averaged."""
        timing = self.results.get("timing")
        if not timing:
            return "unknown"
        split = sorted(f for f in timing.get("differences", {}) if f not in _MARK_ONLY)
        if split:
            return "mixed (" + ", ".join(split) + ")"
        contexts = list((timing.get("contexts") or {}).values())
        if not contexts:
            return "unknown"
        c = contexts[0]
        trainings = c.get("concurrent_trainings", 1)
        isa = f" ({c['cpu_capability']})" if c.get("cpu_capability") else ""
        return (
            f"{c.get('device')}{isa}, {c.get('torch_threads')} thread(s), {trainings} training(s) at once, "
            f"{c.get('host')}"
        )

    @property
    def timing_marks(self) -> list[str]:
        """Why this run's compared times are not comparable (``timing.differences``), ``[]`` when they are."""
        timing = self.results.get("timing") or {}
        return [] if timing.get("comparable", True) else sorted(timing.get("differences", {}))

    def converged(self, training: str) -> bool | None:
        """Whether ``training`` (``global``, ``global_ddp``, ``local``: every local net) converged in this run;
        ``None`` when not recorded."""
        record = (self.results.get("convergence") or {}).get(training)
        records = record if isinstance(record, list) else [record] if record else []
        return all_converged([r.get("converged") for r in records]) if records else None

    @property
    def grid_label(self) -> str:
        return "x".join(map(str, self.grid))

    @property
    def overlap_label(self) -> str:
        return str(self.overlap[0]) if len(set(self.overlap)) == 1 else "x".join(map(str, self.overlap))


def _resolved_ensemble_size(path: Path, recorded: dict) -> dict:
    """``recorded`` (a run's config.yaml) with ``methods.global_ensemble.k: auto`` replaced by the ``k`` it chose (its
    ``global_ensemble/meta.json``): a run that chose 3 and one told 3 are one configuration (a page fixes ``k`` by one
    run's ``auto``)."""
    methods = recorded.get("methods") or {}
    ensemble = methods.get("global_ensemble") or {}
    meta = Path(path) / "global_ensemble" / "meta.json"
    if ensemble.get("k") != "auto" or not meta.is_file():
        return recorded
    k = json.loads(meta.read_text()).get("k")
    if k is None:
        return recorded
    return {**recorded, "methods": {**methods, "global_ensemble": {**ensemble, "k": int(k)}}}


# Sources that read a folder (``data.source.root``): the folder is the data, whatever ``data.name`` says (the
# image_folder config names every folder ``image_folder``).
_FOLDER_KEYS = ("source.root", "root")
# Sources that read one file (``data.source.path``, an archive): its name is the data; copies of one archive at two
# places are one dataset.
_FILE_KEYS = ("source.path", "path")
# Sources whose root is only where a published dataset is stored (torchvision's layout under $DDCNN_DATA): the
# dataset's name is the data, wherever a machine keeps it.
_STORED_AT_ROOT = ("torchvision_dataset",)


def _folder_is_the_data(flat: Mapping[str, Any]) -> bool:
    target = str(flat.get("source._target_") or "")
    return not target.endswith(_STORED_AT_ROOT) and any(flat.get(key) for key in _FOLDER_KEYS)


def data_identity(recorded: Mapping[str, Any]) -> str | None:
    """What identifies a run's data beyond ``data.name`` (``recorded``: its ``config.yaml``, as the run recorded it):
    the folder a folder source reads (the path as given, ``~`` expanded), the file name of an archive, ``None`` for a
    source that reads neither (scikit-learn's digits) or whose folder only stores a published dataset (torchvision's
    CIFAR-10 under ``$DDCNN_DATA``: two machines' copies are one dataset)."""
    flat = flatten(dict(recorded.get("data") or {}))
    for key in _FOLDER_KEYS if _folder_is_the_data(flat) else ():
        if flat.get(key):
            return str(Path(str(flat[key])).expanduser())
    for key in _FILE_KEYS:
        if flat.get(key):
            return Path(str(flat[key])).name
    return None


def load_run(path: str | Path) -> Run:
    """A run directory with ``results.json`` (the evaluate stage ran) and ``config.yaml``.

    Raises:
        FileNotFoundError: When either file is missing.
    """
    path = Path(path)
    results_file, config_file = path / "results.json", path / "config.yaml"
    if not results_file.is_file() or not config_file.is_file():
        missing = [f.name for f in (results_file, config_file) if not f.is_file()]
        raise FileNotFoundError(
            f"{path} is not a finished run: {missing} missing. Give run directories of ddcnn-train runs whose evaluate "
            f"stage finished (stage=all, or stage=evaluate afterwards)."
        )
    results = json.loads(results_file.read_text())
    config = _resolved_ensemble_size(path, RunDir(path).recorded_config())
    dec = results["decomposition"]
    model = config.get("model") or {}
    return Run(
        path=path,
        results=results,
        config=config,
        dataset=str((config.get("data") or {}).get("name") or results["data"]["name"]),
        backbone=str(model.get("name") or results.get("model_name") or results.get("model", "?")),
        grid=tuple(int(g) for g in dec["grid"]),
        overlap=tuple(int(o) for o in dec["overlap"]),
        seed=int(config.get("seed", results.get("seed", 0))),
        data_source=data_identity(config),
        # rows written before equal-device speedups existed are rebuilt by today's rule (method_rows reads any version)
        rows=(
            results["methods"]
            if results.get("methods") and all("speedup_1_device" in r for r in results["methods"])
            else method_rows(results)
        ),
    )


def find_runs(sweep_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """Run directories under ``sweep_dir`` (any depth): ``(finished, unfinished)``.

    A run directory holds ``config.yaml`` (written when a run starts); it is finished when ``results.json`` exists.
    """
    root = Path(sweep_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"sweep directory {root} does not exist.")
    folders = sorted({p.parent for p in root.rglob("config.yaml") if (p.parent / "fingerprint.json").is_file()})
    finished = [f for f in folders if (f / "results.json").is_file()]
    return finished, [f for f in folders if f not in finished]


def load_baseline_rows(path: str | Path) -> list[dict]:
    """Rows of another method measured elsewhere (e.g. ``ddcnn/baselines`` benchmarks), from a JSON file.

    The file holds a list of objects, or an object whose ``rows`` is that list. Each needs a ``name`` (or
    ``method``), an ``accuracy`` and a ``time_s`` (or ``wall_time_s``); a ``dataset`` and any other keys are kept.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"baseline rows {path} do not exist.") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"baseline rows {path} are not valid JSON ({err}).") from err
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise ValueError(f"baseline rows {path}: expected a list of objects (or {{'rows': [...]}}).")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"baseline rows {path}: row {i} is not an object.")
        name = row.get("name", row.get("method"))
        time_s = row.get("time_s", row.get("wall_time_s"))
        if name is None or "accuracy" not in row or time_s is None:
            raise ValueError(f"baseline rows {path}: row {i} needs name, accuracy and time_s; it has {sorted(row)}.")
        extra = {k: v for k, v in row.items() if k not in ("name", "method", "accuracy", "time_s", "wall_time_s")}
        out.append({"source": path.name, "name": str(name), "accuracy": row["accuracy"], "time_s": time_s, **extra})
    return out


# --- tables --------------------------------------------------------------------------------------
def _hashable(value: Any) -> Any:
    # Lists and dicts as JSON text: group labels and comparisons need hashable values.
    return json.dumps(value, sort_keys=True) if isinstance(value, list | dict) else value


def _flatten(d: Mapping) -> dict[str, Any]:
    """A run's recorded settings, flattened under today's names (:func:`ddcnn.rundir.flatten_recorded`)."""
    return {k: _hashable(v) for k, v in flatten_recorded(d).items()}


_UNSET = "<unset>"


def _setting(flat: Mapping[str, Any], key: str) -> Any:
    """A run's value of setting ``key``; where its record lacks the key (recorded by a ddcnn from before the setting
    existed), what it trained with (:func:`ddcnn.rundir.absent_means`: ``engine.precise_bn`` 0, say, which newer
    runs record), so that seeds trained by two versions of ddcnn with the same settings are one configuration."""
    if key in flat:
        return flat[key]
    meant = absent_means(key, _UNSET)
    return meant if meant == _UNSET else _hashable(meant)


def _ignored(key: str, extra: Sequence[str] = ()) -> bool:
    return any(key == p or key.startswith(p + ".") for p in (*_IGNORED, *extra))


def _varying_settings(runs: Sequence[Run], ignore: Sequence[str] = ()) -> list[str]:
    """Settings other than the grouping ones (and ``ignore``) whose values differ between ``runs``. A split seed that
    is every run's own seed (``data.split_seed: null``, recorded resolved: a data draw per seed) is one setting, not a
    difference between the seeds of a configuration."""
    flat = [_flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f if not _ignored(k, ignore)})
    if all(f.get("data.split_seed") == r.seed for f, r in zip(flat, runs, strict=True)):
        keys = [k for k in keys if k != "data.split_seed"]
    return [k for k in keys if len({repr(_setting(f, k)) for f in flat}) > 1]


def _settings_label(run: Run, keys: Sequence[str]) -> str:
    flat = _flatten(run.config)
    return ", ".join(f"{k}={_setting(flat, k)}" for k in keys)


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation over seeds; ``None`` when any run lacks the value (std: or has one)."""
    if not values or any(v is None for v in values):
        return None, None
    vals = [float(v) for v in values]
    return float(np.mean(vals)), (float(np.std(vals, ddof=1)) if len(vals) > 1 else None)


def geometric_summary(ratios: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    """The geometric mean of speedups (ratios of times) and its 95% t-interval on the log scale, exponentiated
    (``docs/protocol.md`` section 4: a ratio's mean is taken on its logarithm, so 2x and 0.5x average to 1x);
    ``(None, None, None)`` without a ratio, no interval for one."""
    logs = [math.log(float(r)) for r in ratios if r is not None and r > 0]
    if not logs:
        return None, None, None
    mean = float(np.mean(logs))
    if len(logs) < 2:
        return math.exp(mean), None, None
    half = t_quantile_975(len(logs) - 1) * float(np.std(logs, ddof=1)) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _target_summary(entries: Sequence[tuple[Run, dict]]) -> tuple[tuple, int, int]:
    """The geometric summary of the reached speedups to a target of the runs whose timing is comparable (no mark:
    not reused from another run's training, not measured beside another load), with the counts reached and left out
    for their marks."""
    reached = [(run, e) for run, e in entries if e.get("reached")]
    kept = [e["speedup"] for run, e in reached if not run.timing_marks]
    return geometric_summary(kept), len(reached), len(reached) - len(kept)


def comparison_rows(runs: Sequence[Run], ignore: Sequence[str] = ()) -> dict[str, list[dict]]:
    """Per dataset, one row per (backbone, grid, overlap, settings, method), averaged over seeds.

    ``accuracy_std`` is the sample standard deviation over seeds (``None`` for a single seed); the times, speedup
    and parameters are means over seeds. ``ignore`` names settings (dotted keys or prefixes) whose differences do not
    split groups, e.g. a key that a newer version of the configuration added with a value that changes nothing.
    """
    tables: dict[str, list[dict]] = {}
    for dataset, group, keys in _by_dataset(runs, ignore):
        cells: dict[tuple, list[tuple[Run, dict]]] = {}
        for run in group:
            config = _config_key(run, keys)
            for row in run.rows:
                # The timing context is part of the group: times measured in different contexts never average.
                cells.setdefault((*config, run.timing_context, row["key"]), []).append((run, row))
        order = list(METHODS)
        rows = []
        for key in sorted(cells, key=lambda k: (*k[:6], order.index(k[6]) if k[6] in order else len(order))):
            context, method = key[5:]
            entries = cells[key]
            acc = [float(row["accuracy"]) for _, row in entries]
            equal = [(run, e) for run, _ in entries if (e := _to_target(run, method)) is not None]
            back = [(run, e) for run, _ in entries if (e := _to_target(run, method, "time_to_target_reverse"))]
            equal_speedup, n_reached, n_marked = _target_summary(equal)
            back_speedup, n_back, n_back_marked = _target_summary(back)
            vs_ddp = [e for e in (_vs_ddp(run, method) for run, _ in entries) if e is not None]
            marks = sorted({m for run, _ in entries for m in run.timing_marks})
            marked = sum(bool(run.timing_marks) for run, _ in entries)
            unconverged = sum(bool(_row_unconverged(run, method)) for run, _ in entries)
            balanced = _mean_std([row.get("balanced_accuracy") for _, row in entries])
            auc = _mean_std([row.get("auc") for _, row in entries])
            rows.append(
                {
                    **_config_columns(dataset, key[:5]),
                    "timing_context": context,
                    "method": METHODS.get(method, entries[0][1].get("name", method)),
                    "method_key": method,
                    "seeds": len({run.seed for run, _ in entries}),
                    "runs": len(entries),
                    "accuracy_mean": float(np.mean(acc)),
                    "accuracy_std": float(np.std(acc, ddof=1)) if len(acc) > 1 else None,
                    "balanced_accuracy_mean": balanced[0],
                    "balanced_accuracy_std": balanced[1],
                    "auc_mean": auc[0],
                    "auc_std": auc[1],
                    "sequential_time_s": _mean(row.get("sequential_time_s") for _, row in entries),
                    "projected_time_s": _mean(row.get("projected_time_s") for _, row in entries),
                    "devices": entries[0][1].get("devices"),
                    "speedup": _mean(row.get("speedup") for _, row in entries),
                    "speedup_1_device": _mean(row.get("speedup_1_device") for _, row in entries),
                    "speedup_vs_ddp": _mean(e["speedup"] for e in vs_ddp) if vs_ddp else None,
                    "ddp_devices": "/".join(sorted({str(e["devices"]) for e in vs_ddp})) or None,
                    "timing_comparable": (
                        "yes" if not marked else f"no in {marked}/{len(entries)} runs ({', '.join(marks)})"
                    ),
                    "unconverged_runs": f"{unconverged}/{len(entries)}" if unconverged else None,
                    "speedup_to_target_mean": equal_speedup[0],
                    "speedup_to_target_low": equal_speedup[1],
                    "speedup_to_target_high": equal_speedup[2],
                    "target_not_comparable": n_marked,
                    "target_reached": f"{n_reached}/{len(equal)}" if equal else None,
                    "speedup_to_reverse_target_mean": back_speedup[0],
                    "speedup_to_reverse_target_low": back_speedup[1],
                    "speedup_to_reverse_target_high": back_speedup[2],
                    "reverse_target_not_comparable": n_back_marked,
                    "reverse_target_reached": f"{n_back}/{len(back)}" if back else None,
                    "params": _mean(row.get("params") for _, row in entries),
                }
            )
        tables[dataset] = rows
    return tables


def _vs_ddp(run: Run, method: str) -> dict | None:
    """The CNN-DNN projected on P devices against the DDP global CNN run on P devices (``results.json``
    ``speedup_equal_devices``) if ``method`` is the run's CNN-DNN row and DDP ran."""
    inputs = run.results.get("coarse_input") or {}
    if method != f"cnn_dnn_{inputs.get('coarse', 'probs')}":
        return None
    for p, e in (run.results.get("speedup_equal_devices") or {}).items():
        if e.get("baseline") == "global_ddp":
            return {"devices": int(p), "speedup": e["speedup"]}
    return None


def _row_unconverged(run: Run, method: str) -> bool:
    return any(f.get("kind") == "unconverged" and f.get("method") == method for f in run.results.get("flags") or [])


def _to_target(run: Run, method: str, key: str = "time_to_target") -> dict | None:
    """The run's speedup to a fixed target on one device (the global CNN's time over the CNN-DNN's with its local
    nets one after another; ``results.json`` ``time_to_target``, or ``time_to_target_reverse`` for the target the
    CNN-DNN set) if ``method`` is its CNN-DNN row; ``None`` for runs without that target (an older ddcnn, no
    ``val_target`` split) or another row."""
    ttt = run.results.get(key)
    inputs = run.results.get("coarse_input") or {}
    if not ttt or method != f"cnn_dnn_{inputs.get('coarse', 'probs')}":
        return None
    g, c = ttt.get("global") or {}, ttt.get("cnn_dnn") or {}
    cnn_dnn_s = (c.get("time_s_by_devices") or {}).get("1")
    reached = bool(g.get("reached") and c.get("reached") and cnn_dnn_s)
    return {"reached": reached, "speedup": g["time_s"] / cnn_dnn_s if reached else None}


def dataset_labels(runs: Sequence[Run]) -> dict[tuple[str, str | None], str]:
    """The label of each dataset, by ``(name, identity)`` (:func:`data_identity`): its name, with the folder's name
    where the data are a folder (``image_folder (flowers)``) or where one name holds several data (the file or
    folder name, the whole path where those names are alike too)."""
    keys = sorted({(run.dataset, run.data_source) for run in runs}, key=lambda k: (k[0], k[1] or ""))
    labels = {}
    for name, source in keys:
        alike = [s for n, s in keys if n == name]
        folder = source is not None and any(run.data_source == source and _reads_folder(run) for run in runs)
        if source is None or (len(alike) == 1 and not folder):
            labels[(name, source)] = name
            continue
        short = Path(source).name
        if sum(Path(s or "").name == short for s in alike) > 1:
            short = source  # two folders of one name: the path tells them apart
        labels[(name, source)] = name if short == name else f"{name} ({short})"
    return labels


def _reads_folder(run: Run) -> bool:
    return _folder_is_the_data(flatten(dict(run.config.get("data") or {})))


def _by_dataset(runs: Sequence[Run], ignore: Sequence[str]) -> Iterator[tuple[str, list[Run], list[str]]]:
    """Per dataset (its name and what identifies its data: two image folders of the same settings are two datasets),
    in label order (:func:`dataset_labels`): its runs and the settings that split them into groups
    (:func:`_varying_settings`)."""
    labels = dataset_labels(runs)
    by_dataset: dict[str, list[Run]] = {}
    for run in runs:
        by_dataset.setdefault(labels[(run.dataset, run.data_source)], []).append(run)
    for dataset, group in sorted(by_dataset.items()):
        yield dataset, group, _varying_settings(group, ignore)


def _config_key(run: Run, keys: Sequence[str]) -> tuple:
    """A run's configuration: backbone, number of sub-domains, grid, overlap and the settings that split groups."""
    return (run.backbone, math.prod(run.grid), run.grid_label, run.overlap_label, _settings_label(run, keys))


def _config_columns(dataset: str, key: tuple) -> dict[str, Any]:
    """The leading columns of a row (:data:`_CONFIG_COLUMNS`): its dataset and configuration (:func:`_config_key`)."""
    backbone, n, grid, overlap, label = key
    return dict(zip(_CONFIG_COLUMNS, (dataset, backbone, grid, n, overlap, label), strict=True))


def paired_columns(what: str, method: str, baseline: str, stats: Mapping) -> dict[str, Any]:
    """The columns of one paired difference (a comparison of :data:`ddcnn.report.stats.PAIRS` and its
    :func:`ddcnn.report.stats.paired_difference`), in points, as :func:`paired_rows` and the results page write them."""
    converged = stats["baseline_converged"]
    return {
        "comparison": what,
        "method_key": method,
        "baseline_key": baseline,
        "n": stats["n"],
        "seeds": " ".join(str(seed) for seed in stats["seeds"] or ()),
        "mean_points": stats["mean"],
        "std_points": stats["std"],
        "ci_low_points": stats["low"],
        "ci_high_points": stats["high"],
        "p": stats.get("p"),
        "p_holm": None,
        "verdict": stats["verdict"],
        "baseline_converged": {True: "yes", False: "no", None: "unknown"}[converged],
    }


def paired_rows(
    runs: Sequence[Run], ignore: Sequence[str] = (), pairs: Sequence[tuple] = PAIRS
) -> dict[str, list[dict]]:
    """Per dataset, the paired differences of ``pairs`` (:data:`PAIRS`, or others of its form) in each configuration
    (backbone, grid, overlap, the settings that split groups): test accuracy of the method minus the baseline's, in
    points, paired by seed, with mean, sample std, n, 95% t-interval and verdict
    (:func:`ddcnn.report.stats.paired_difference`). A seed with several runs (timed in different contexts) counts once,
    with its first run. The verdict is ``baseline not converged`` when the baseline of any seed did not converge, and
    names the seeds whose baseline row is at chance or decides like a constant guess (no lead against those). Each
    comparison is one row: the rows of :data:`CONFIGURATION_FREE` whose per-seed differences are the same in every
    configuration (one global CNN and DDP per seed, reused across grids) are one row of grid and overlap ``all``. ``p``
    is the paired t-test's; ``p_holm`` is Holm-adjusted over every row of the report that has a ``p``
    (:func:`holm_adjust`; the verdict stays the t-interval's)."""
    tables: dict[str, list[dict]] = {}
    for dataset, group, keys in _by_dataset(runs, ignore):
        configs: dict[tuple, dict[int, Run]] = {}
        for run in sorted(group, key=lambda r: str(r.path)):
            configs.setdefault(_config_key(run, keys), {}).setdefault(run.seed, run)
        rows, differences = [], {}
        for key in sorted(configs):
            by_seed = configs[key]
            for what, method, baseline, training in pairs:
                held = [
                    (seed, run)
                    for seed, run in sorted(by_seed.items())
                    if (run.results.get("accuracy") or {}).get(method) is not None
                    and (run.results.get("accuracy") or {}).get(baseline) is not None
                ]
                if not held:
                    continue
                diffs = [100 * (r.results["accuracy"][method] - r.results["accuracy"][baseline]) for _, r in held]
                converged = all_converged([r.converged(training) for _, r in held])
                stats = paired_difference(diffs, converged, [seed for seed, _ in held])
                flagged = [seed for seed, r in held if baseline_flag(r.results, baseline)]
                if flagged and converged is not False:
                    states = sorted({baseline_flag(r.results, baseline) for _, r in held} - {None})
                    stats["verdict"] = f"{' / '.join(states)} (seed{'s' if len(flagged) > 1 else ''} " + (
                        ", ".join(str(seed) for seed in flagged) + ")"
                    )
                rows.append({**_config_columns(dataset, key), **paired_columns(what, method, baseline, stats)})
                differences[id(rows[-1])] = tuple(zip(stats["seeds"], (round(d, 9) for d in diffs), strict=True))
        tables[dataset] = _one_row_per_comparison(rows, differences)
    holm_adjust([row for rows in tables.values() for row in rows])
    return tables


def _one_row_per_comparison(rows: list[dict], differences: Mapping[int, tuple]) -> list[dict]:
    """``rows`` with the rows of a :data:`CONFIGURATION_FREE` comparison (of one backbone and settings) that hold the
    same per-seed ``differences`` (keyed by the row's ``id``) merged into one row of grid and overlap
    :data:`ALL_CONFIGURATIONS`."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if (row["method_key"], row["baseline_key"]) in CONFIGURATION_FREE:
            groups.setdefault((row["backbone"], row["settings"], row["comparison"]), []).append(row)
    merged: dict[int, dict | None] = {}
    for group in groups.values():
        if len(group) > 1 and len({differences[id(row)] for row in group}) == 1:
            merged[id(group[0])] = {
                **group[0],
                "grid": ALL_CONFIGURATIONS,
                "overlap": ALL_CONFIGURATIONS,
                "num_subdomains": None,
            }
            merged.update(dict.fromkeys((id(row) for row in group[1:]), None))
    return [kept for row in rows if (kept := merged.get(id(row), row)) is not None]


def holm_adjust(rows: Sequence[dict]) -> None:
    """Set ``p_holm`` of each row of ``rows`` that has a ``p``: Holm-adjusted over them (one family,
    :func:`ddcnn.report.stats.holm`); ``None`` for the others."""
    tested = [row for row in rows if row.get("p") is not None]
    for row, adjusted in zip(tested, holm([row["p"] for row in tested]), strict=True):
        row["p_holm"] = adjusted
    for row in rows:
        if row.get("p") is None:
            row["p_holm"] = None


def paired_markdown(rows: Sequence[Mapping]) -> str:
    """The Markdown table of one dataset's :func:`paired_rows`."""
    with_settings = any(r["settings"] for r in rows)
    head = ["backbone", "grid", "overlap", *(["settings"] if with_settings else []), "difference", "seeds"]
    head += ["mean ± std (points)", "95% interval (points)", "p", "Holm-adjusted p", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        spread = "" if r["std_points"] is None else f" ± {r['std_points']:.2f}"
        interval = "-" if r["ci_low_points"] is None else f"[{r['ci_low_points']:+.2f}, {r['ci_high_points']:+.2f}]"
        verdict = r["verdict"]
        if r["baseline_converged"] == "unknown" and verdict not in NO_VERDICT:
            verdict += " (convergence unknown)"
        cells = [r["backbone"], r["grid"], r["overlap"], *([r["settings"]] if with_settings else [])]
        cells += [r["comparison"], str(r["n"]), f"{r['mean_points']:+.2f}{spread}", interval]
        cells += ["-" if r[k] is None else f"{r[k]:.2g}" for k in ("p", "p_holm")] + [verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _target_cell(row: Mapping, which: str = "target") -> str:
    """The geometric mean speedup to a target with its 95% interval on the log scale (:func:`geometric_summary`), the
    runs that reached it, and those left out because their timing is not comparable."""
    reached = row.get(f"{which}_reached")
    if not reached:
        return "-"
    mean, low, high = (row.get(f"speedup_to_{which}_{k}") for k in ("mean", "low", "high"))
    left_out = row.get(f"{which}_not_comparable") or 0
    counts = f"{reached}" + (f"; {left_out} not comparable, left out" if left_out else "")
    if mean is None:
        return f"not reached ({counts})" if not left_out else f"- ({counts})"
    return (f"{mean:.2f}x" if low is None else f"{mean:.2f}x [{low:.2f}, {high:.2f}]") + f" ({counts})"


def _num(value: Any, digits: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _accuracy(row: Mapping, key: str = "accuracy") -> str:
    """``mean ± std`` in percent of ``<key>_mean`` / ``<key>_std`` (``-`` when some run lacks the metric)."""
    if row.get(f"{key}_mean") is None:
        return "-"
    mean = 100 * row[f"{key}_mean"]
    if row.get(f"{key}_std") is None:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {100 * row[f'{key}_std']:.2f}"


def table_markdown(rows: Sequence[Mapping]) -> str:
    """The Markdown table of one dataset's :func:`comparison_rows` (accuracy in percent)."""
    with_settings = any(r["settings"] for r in rows)
    reverse = any(r.get("reverse_target_reached") for r in rows)
    contexts = {r.get("timing_context") for r in rows}
    with_context = len(contexts) > 1 or any(str(c).startswith("mixed") for c in contexts)
    head = ["backbone", "grid", "overlap", *(["settings"] if with_settings else []), "method", "seeds"]
    if with_context:
        head.insert(len(head) - 2, "timing context")
    head += [
        "test accuracy (%)",
        "balanced acc. (%)",
        "AUC (%)",
        "sequential time (s)",
        "projected time (s)",
        "devices",
        "speedup vs global, 1 device",
        "speedup vs DDP, P devices",
        "speedup to target, 1 device",
        *(["speedup to reverse target, 1 device"] if reverse else []),
        "timing comparable",
        "parameters",
        "unconverged runs",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["backbone"], r["grid"], r["overlap"], *([r["settings"]] if with_settings else [])]
        cells += [*([str(r.get("timing_context"))] if with_context else []), r["method"]]
        cells += [
            str(r["seeds"]),
            _accuracy(r),
            _accuracy(r, "balanced_accuracy"),
            _accuracy(r, "auc"),
            _num(r["sequential_time_s"], 1),
            _num(r["projected_time_s"], 1),
            "-" if r["devices"] is None else str(r["devices"]),
            "-" if r.get("speedup_1_device") is None else f"{r['speedup_1_device']:.2f}x",
            "-" if r.get("speedup_vs_ddp") is None else f"{r['speedup_vs_ddp']:.2f}x (P={r['ddp_devices']})",
            _target_cell(r),
            *([_target_cell(r, "reverse_target")] if reverse else []),
            str(r.get("timing_comparable") or "-"),
            "-" if r["params"] is None else f"{int(round(r['params'])):,}",
            f"**{r['unconverged_runs']}**" if r.get("unconverged_runs") else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _csv_text(rows: Sequence[Mapping], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return buffer.getvalue()


def _baselines_markdown(rows: Sequence[Mapping]) -> str:
    extra = sorted({k for r in rows for k in r} - {"source", "name", "accuracy", "time_s"})
    head = ["source", "name", "accuracy", "time (s)", *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        values = [r["source"], r["name"], r["accuracy"], r["time_s"], *(r.get(k) for k in extra)]
        lines.append("| " + " | ".join(_cell(v) for v in values) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# --- plots ---------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "data"


def _plot_vs_grid(rows: Sequence[Mapping], path: Path, title: str, kind: str) -> Path:
    """One panel per (backbone, overlap, settings); x: grids ordered by size; one line per method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ddcnn.report.plots import method_style

    panels: dict[tuple[str, str, str], list[Mapping]] = {}
    for r in rows:
        panels.setdefault((r["backbone"], r["overlap"], r["settings"]), []).append(r)
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(max(5.2 * ncols, 9.0), 4.0 * nrows + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for ax, ((backbone, overlap, settings), panel) in zip(axes, panels.items(), strict=False):
        grids = sorted({(r["num_subdomains"], r["grid"]) for r in panel})
        x = {g: i for i, (_, g) in enumerate(grids)}
        for method in [m for m in METHODS if any(r["method_key"] == m for r in panel)]:
            # rows of one grid in several timing contexts: one point each, in table order
            series = sorted(((x[r["grid"]], r) for r in panel if r["method_key"] == method), key=lambda p: p[0])
            xs = [i for i, _ in series]
            style = method_style(method)
            if kind == "accuracy":
                ys = [100 * r["accuracy_mean"] for _, r in series]
                err = [100 * (r["accuracy_std"] or 0.0) for _, r in series]
                ax.errorbar(xs, ys, yerr=err, **style, capsize=3, label=METHODS[method])
            else:
                ys = [r["projected_time_s"] for _, r in series]
                ax.plot(xs, ys, **style, label=f"{METHODS[method]}: projected")
                seq = [r["sequential_time_s"] for _, r in series]
                if seq != ys:
                    ax.plot(xs, seq, linestyle="--", **style, fillstyle="none", alpha=0.6)
        ax.set_xticks(range(len(grids)), [f"{g}\n(N={n})" for n, g in grids])
        ax.set_xlabel("grid of sub-domains")
        ax.set_ylabel("test accuracy (%)" if kind == "accuracy" else "training time (s), log scale")
        if kind == "time":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.set_title(f"{backbone}, overlap {overlap}" + (f"\n{settings}" if settings else ""), fontsize=9)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    # One legend for all panels, below them ("outside" needs the constrained layout, matplotlib >= 3.7).
    legend: dict[str, Any] = {}
    for ax in axes[: len(panels)]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside lower center", ncols=2, fontsize=8)
    note = "mean ± std over seeds" if kind == "accuracy" else "solid: projected on the devices; dashed: sequential"
    fig.suptitle(f"{title} ({note})", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    tmp.replace(path)
    return path


def _subdomain_maps(runs: Sequence[Run], out: Path, dataset: str) -> list[Path]:
    """One heat map per (backbone, grid, overlap): mean test accuracy of every local net over the seeds."""
    from ddcnn.report.plots import plot_subdomain_accuracy

    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.backbone, run.grid, run.overlap_label), []).append(run)
    written = []
    for (backbone, grid, overlap), group in sorted(groups.items(), key=lambda kv: (kv[0][0], math.prod(kv[0][1]))):
        local = np.mean([np.asarray(r.results["accuracy"]["local"], dtype=np.float64) for r in group], axis=0)
        name = f"{_slug(dataset)}_{_slug(backbone)}_{'x'.join(map(str, grid))}_o{_slug(overlap)}_subdomains.png"
        seeds = len({r.seed for r in group})
        written.append(
            plot_subdomain_accuracy(
                local,
                grid,
                out / name,
                title=f"{dataset}, {backbone}, overlap {overlap}: test accuracy of each local net "
                f"(mean of {seeds} seed{'s' if seeds != 1 else ''})",
            )
        )
    return written


# --- the report ----------------------------------------------------------------------------------
def write_report(
    runs: Sequence[Run],
    out_dir: str | Path,
    baselines: Sequence[Mapping] = (),
    plots: bool = True,
    ignore: Sequence[str] = (),
) -> dict[str, list[Path]]:
    """Write the comparison report of ``runs`` (and any ``baselines`` rows) into ``out_dir``.

    ``ignore``: settings whose differences between runs do not split groups (see :func:`comparison_rows`).

    Returns:
        The files written, by kind: ``markdown``, ``csv``, ``plots``.
    """
    if not runs:
        raise ValueError("no finished runs to report; give run directories or a sweep folder with results.json.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tables = comparison_rows(runs, ignore)
    paired = paired_rows(runs, ignore)
    grouped = {dataset: group for dataset, group, _ in _by_dataset(runs, ignore)}
    written: dict[str, list[Path]] = {"markdown": [], "csv": [], "plots": []}
    sections = [
        "# ddcnn comparison report",
        "",
        f"{len(runs)} runs. Test accuracy in percent, mean ± sample standard deviation over seeds (a single "
        "seed shows no ±). Times are training times in seconds on the machine that ran each stage: sequential = "
        "every stage the method needs one after another on one device; projected = on the devices it can use "
        "(N local nets in parallel, then the coarse DNN and any further training; 1 device for the global CNN and "
        "the end-to-end CNN-DNN); every speedup compares equal device counts (docs/protocol.md): speedup vs global, "
        "1 device = global CNN time / the method's time on one device (its sequential time); speedup vs DDP, P "
        "devices = the DDP global CNN's time on P devices / the CNN-DNN's local nets placed on P devices plus its "
        "coarse DNN; speedup to target, "
        "1 device = the global CNN's time to the fixed target (its accuracy on the held-out `val_target` split, "
        "which no selection saw, minus one binomial standard error of that split; without that split its best "
        "validation accuracy minus one standard error of the validation split) / the CNN-DNN's on one device, "
        "training clocks only: the geometric mean over the runs where both reached it and whose timing is "
        "comparable, with its 95% t-interval on the log scale (reached/runs; runs whose timing is not comparable "
        "are counted and left out). " + TIMING_RULE + " Runs whose times were measured in different contexts (device, "
        "threads, trainings sharing the machine, host, CPU instructions, code) are never averaged together; a "
        "`timing context` column appears when a table holds more than one, and `mixed (...)` marks a run whose own "
        "compared times come from different contexts; `timing comparable` says in how many runs the load differed or "
        "a stage was reused from another run's training. Paired differences: test accuracy of the method minus the "
        "baseline's, paired by "
        "seed within a configuration, mean ± sample std, 95% t-interval and the verdict that follows it (better / "
        "worse when the interval excludes 0, else within noise; n<2: no interval; no spread: no interval where every "
        "seed gave the same difference; baseline not converged: no verdict against it); p the paired t-test's and "
        "beside it Holm-adjusted over every paired row of this report (all its datasets: one family, the "
        "multiplicity of reading many rows at once; the verdict stays the interval's). The global DDP against the "
        "global CNN is one row of grid and overlap `all` where the same two trainings serve every grid.",
        "",
    ]
    for dataset, rows in tables.items():
        slug = _slug(dataset)
        table = table_markdown(rows)
        pairs = paired.get(dataset) or []
        pairs_md = f"Paired differences (test accuracy, points):\n\n{paired_markdown(pairs)}" if pairs else ""
        atomic_write_text(out / f"{slug}.md", f"# {dataset}\n\n{table}" + (f"\n{pairs_md}" if pairs else ""))
        atomic_write_text(out / f"{slug}.csv", _csv_text(rows, CSV_COLUMNS))
        written["markdown"].append(out / f"{slug}.md")
        written["csv"].append(out / f"{slug}.csv")
        if pairs:
            atomic_write_text(out / f"{slug}_paired.csv", _csv_text(pairs, PAIRED_COLUMNS))
            written["csv"].append(out / f"{slug}_paired.csv")
        sections += [f"## {dataset}", "", table, *([pairs_md] if pairs else [])]
        dataset_runs = grouped[dataset]
        if plots:
            figures = [
                _plot_vs_grid(rows, out / f"{slug}_accuracy_vs_grid.png", f"{dataset}: test accuracy", "accuracy"),
                _plot_vs_grid(rows, out / f"{slug}_time_vs_grid.png", f"{dataset}: training time", "time"),
                *_subdomain_maps(dataset_runs, out, dataset),
            ]
            written["plots"] += figures
            sections += [f"![{p.stem}]({p.name})" for p in figures] + [""]
        sections += ["Runs: " + ", ".join(f"`{r.path}`" for r in dataset_runs), ""]
    if baselines:
        sections += ["## External baselines", "", _baselines_markdown(baselines)]
        keys = ["source", "name", "accuracy", "time_s"]
        keys += sorted({k for r in baselines for k in r} - set(keys))
        atomic_write_text(out / "baselines.csv", _csv_text(baselines, keys))
        written["csv"].append(out / "baselines.csv")
    atomic_write_text(out / "report.md", "\n".join(sections))
    written["markdown"].insert(0, out / "report.md")
    log.info("comparison report of %d runs in %s", len(runs), out)
    return written
