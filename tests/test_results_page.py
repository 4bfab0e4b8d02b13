"""experiments/results.py: its tiny mode writes a page whose every table line the manifest traces back to the runs."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddcnn.report.compare import load_run
from tests.conftest import REPO, load_script

# The paired comparisons of the page: label -> the training whose convergence is its baseline's.
PAIRED = {
    "CNN-DNN − global CNN": "global",
    "CNN-DNN − mean probability": "local",
    "CNN-DNN − ensemble of global CNNs (mean probability)": "global_ensemble",
}


@pytest.fixture(scope="module")
def results():
    return load_script("experiments/results.py", "results_page")


@pytest.fixture(scope="module")
def tiny(results, tmp_path_factory):
    """The tiny mode, run once with --jobs 2 (its timing run alone, then the other): (output, run directories)."""
    base = tmp_path_factory.mktemp("results")
    out, workdir = base / "out", base / "runs"
    assert results.main(["--tiny", "--out", str(out), "--workdir", str(workdir), "--jobs", "2"]) == 0
    return out, workdir


@pytest.fixture(scope="module")
def committed(results):
    """The committed page (docs/results.md), its manifest, its snapshots and its tables recomputed from them once
    (the slow part of a check: the tests of the committed page share it)."""
    docs = REPO / "docs"
    if not (docs / "results.md").is_file():
        pytest.skip("docs/results.md has not been generated yet (python experiments/results.py)")
    page, manifest = _page_and_manifest(docs)
    root = docs / "results" / "runs"
    return page, manifest, root, results.recompute_tables(manifest, root)


def _one_seed_verdict(converged: bool | None) -> str:
    """What the page says of a difference over one seed against a baseline of this convergence."""
    return "baseline not converged" if converged is False else "n<2: no interval"


def _page_and_manifest(out: Path) -> tuple[str, dict]:
    return (out / "results.md").read_text(), json.loads((out / "results_manifest.json").read_text())


@pytest.mark.slow
def test_tiny_page_holds_the_runs_figures(results, tiny):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    # the header describes the training of the runs (from their records), then the invocation that wrote the page
    for label in (
        "machine of the runs",
        "torch threads per training",
        "load of the runs (1 min)",
        "training dates",
        "CPU",
        "code",
        "jobs",
    ):
        assert f"| {label} |" in page
    machine = results._machine()
    # with the CPU instructions torch's kernels used: two machines of one model name may differ in them
    cpu = f"{machine['cpu']} ({machine['cpu_capability']})"
    assert f"| machine of the runs | {cpu}, {machine['cores']} cores, {machine['system']} |" in page
    # the first run of the dataset (it trains the global CNN) ran alone, the other in the --jobs 2 phase
    assert "| jobs | timing runs: 1 with 1 at a time; accuracy runs: 1 with 2 at a time |" in page
    assert "| runs trained by | `python experiments/results.py --tiny" in page
    assert "| page written by | `python experiments/results.py --tiny" in page
    assert "Flagged rows:" in page
    assert all(line in page for line in results.flag_lines(workdir, sorted(manifest["runs"])))
    # two run directories (overlap 0 and 2), each with its fingerprint; the global CNN came from the store once
    assert sorted(manifest["runs"]) == ["digits/2x2_o0_s0", "digits/2x2_o2_s0"]
    for name, entry in manifest["runs"].items():
        assert entry["fingerprint"] == json.loads((workdir / name / "fingerprint.json").read_text())["fingerprint"]
        assert entry["methods"]["cnn_dnn_logits"]["accuracy"] > 0
    # the timing run trained the global CNN, the other run (accuracy phase) copied it from the store
    reused = ["reused_from" in json.loads((workdir / n / "global" / "meta.json").read_text()) for n in manifest["runs"]]
    assert sorted(reused) == [False, True]
    # each run's own CPU time and commit, the page's code line saying they are one code's
    records = [json.loads((workdir / n / "experiment_run.json").read_text()) for n in manifest["runs"]]
    assert all(r["cpu_s"] > 1 and r["commit"] for r in records)
    assert "(every run) |" in page
    # the report's table and the AUC table, each line on the page
    kinds = [t["kind"] for t in manifest["tables"]]
    # and the equal-devices table where the runs' results.json project the CNN-DNN on P devices (today's report does)
    projected = all(
        "projected_time_s_by_devices" in json.loads((workdir / n / "results.json").read_text())
        for n in manifest["runs"]
    )
    # first the primary verdicts of docs/protocol.md section 5a: Holm-adjusted, one family, each comparison once: the
    # differences over the two configurations (overlap 0 and 2) are the primary table's, so no table over
    # configurations repeats them (the global DDP's row is one comparison, in the paired table)
    assert kinds == ["primary", "glance", "paired", "report", "auc"] + (["devices"] if projected else [])
    assert not any(line.startswith("| CNN-DNN − global CNN |") for line in page.splitlines())
    assert "## Primary verdicts" in page and "| Holm-adjusted p |" in page
    primary = results.primary_rows(workdir, sorted(manifest["runs"]))
    assert [row["comparison"] for row in primary] == [what for what, *_ in results.PRIMARY]
    assert all(row["p_holm"] >= row["p"] for row in primary)
    # the runs' own clock: from the first run's start to the last one's end
    assert "| training dates | 2 runs trained from " in page
    # each run's snapshot carries where each of its trainings stopped, and its epochs
    for name in manifest["runs"]:
        snap = out / "results" / "runs" / name
        for stage in ("global", "coarse", "local/00"):
            assert "best_epoch" in json.loads((snap / stage / "meta.json").read_text())
            assert (snap / stage / "meta.json").read_bytes() == (workdir / name / stage / "meta.json").read_bytes()
        assert (snap / "global" / "logs" / "metrics.csv").read_text().startswith("epoch")
    # the CNN-DNN's accuracy of the first run, as the report rounds it, is on the page
    accuracy = manifest["runs"]["digits/2x2_o0_s0"]["methods"]["cnn_dnn_logits"]["accuracy"]
    assert f"| {100 * accuracy:.2f} |" in page
    # checked against the original run directories and against the committed snapshot alike
    assert results.check_manifest(page, manifest, workdir) == []
    assert results.check_manifest(page, manifest, out / "results" / "runs") == []
    assert results.main(["--check", "--out", str(out)]) == 0


@pytest.mark.slow
def test_check_fails_when_a_figure_on_the_page_is_altered(results, tiny):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    line = next(line for line in page.splitlines() if "CNN-DNN (coarse DNN on logits)" in line)
    cell = re.search(r"\| (\d+\.\d\d) \|", line)
    altered_value = f"{float(cell.group(1)) + 0.01:.2f}"
    altered = page.replace(line, line.replace(cell.group(0), f"| {altered_value} |", 1))
    assert altered != page
    problems = results.check_manifest(altered, manifest, workdir)
    assert any("in no table the runs give" in p for p in problems)
    # a line dropped from the page is named too
    dropped = page.replace(line + "\n", "")
    assert any("not on the page" in p for p in results.check_manifest(dropped, manifest, workdir))


@pytest.mark.slow
def test_the_page_says_which_candidate_each_coarse_fit_kept(results, tiny, tmp_path):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    names = sorted(manifest["runs"])
    kept = [json.loads((workdir / n / "coarse" / "meta.json").read_text())["fit"]["kept"] for n in names]
    lines = results.coarse_kept_lines(workdir, names)
    assert lines and all(line in page for line in lines)
    assert f"of {len(names)} runs: " in lines[0] and all(results.KEPT_LABELS[k] in lines[0] for k in kept)
    # a fit that kept averaging is named: its CNN-DNN is the mean probability by construction
    copy = tmp_path / "runs"
    for name in names:
        shutil.copytree(workdir / name / "coarse", copy / name / "coarse")
    meta = copy / names[0] / "coarse" / "meta.json"
    record = json.loads(meta.read_text())
    record["fit"]["kept"] = "averaging"
    meta.write_text(json.dumps(record))
    (line,) = results.coarse_kept_lines(copy, names)
    assert f"of {len(names)} runs: " in line and "averaging the local nets in 1" in line
    assert f"(`{names[0]}`) its predictions are the mean probability's" in line
    # check_manifest names the line when the page drops it
    dropped = page.replace(lines[0] + "\n", "")
    assert any("coarse fits kept" in p for p in results.check_manifest(dropped, manifest, workdir))


@pytest.mark.slow
def test_the_glance_table_pairs_the_cnn_dnn_with_averaging_by_seed(results, tiny):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    (glance,) = [t for t in manifest["tables"] if t["kind"] == "glance"]
    rows = glance["lines"][2:]
    assert [row.split(" | ")[1:4] for row in rows] == [["2x2", "0", "1"], ["2x2", "2", "1"]]
    for row, name in zip(rows, ["digits/2x2_o0_s0", "digits/2x2_o2_s0"], strict=True):
        assert row in page
        methods = manifest["runs"][name]["methods"]
        lead = 100 * (methods["cnn_dnn_logits"]["accuracy"] - methods["mean_prob"]["accuracy"])
        behind = 100 * (methods["cnn_dnn_logits"]["accuracy"] - methods["global"]["accuracy"])
        # one seed: the lead and no verdict, because one seed gives no interval or because the baseline (one epoch)
        # did not converge, as the run recorded it
        run = load_run(workdir / name)
        to_mean_prob, to_global = (_one_seed_verdict(run.converged(t)) for t in ("local", "global"))
        assert f"| {lead:+.2f} ({to_mean_prob}) | {behind:+.2f} ({to_global}) |" in row
        assert f"| {100 * methods['global']['accuracy']:.2f} |" in row
    # a summary figure altered on the page fails the check like any table's
    altered = page.replace(rows[0], rows[0].replace(" (", "1 (", 1))
    assert altered != page
    assert any("in no table the runs give" in p for p in results.check_manifest(altered, manifest, workdir))


@pytest.mark.slow
def test_the_page_carries_the_reports_paired_differences_and_check_verifies_them(results, tiny):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    (paired,) = [t for t in manifest["tables"] if t["kind"] == "paired"]
    # ddcnn-report's "Paired differences" of the dataset, line for line, on the page after the glance table
    report = (workdir / "report" / "digits" / "digits.md").read_text().split("Paired differences")[1]
    assert paired["lines"] == [line for line in report.splitlines() if line.startswith("|")]
    assert (
        "| difference | seeds | mean ± std (points) | 95% interval (points) | p | Holm-adjusted p | verdict |"
        in (paired["lines"][0])
    )
    rows = paired["lines"][2:]
    # per overlap, the CNN-DNN against the global CNN, the mean probability and the ensemble of global CNNs whose k
    # the first run chose (the tiny page has no DDP), one seed
    ensemble = "CNN-DNN − ensemble of global CNNs (mean probability)"
    assert [r.split(" | ")[2:4] for r in rows] == [
        ["0", "CNN-DNN − global CNN"],
        ["0", "CNN-DNN − mean probability"],
        ["0", ensemble],
        ["2", "CNN-DNN − global CNN"],
        ["2", "CNN-DNN − mean probability"],
        ["2", ensemble],
    ]
    for r in rows:  # one seed: no interval; no verdict either against a baseline that did not converge
        run = load_run(workdir / f"digits/2x2_o{r.split(' | ')[2]}_s0")
        verdict = _one_seed_verdict(run.converged(PAIRED[r.split(" | ")[3]]))
        assert r.endswith(f"| 1 | {r.split(' | ')[5]} | - | - | - | {verdict} |")  # no interval, no p
    assert page.index(paired["lines"][0]) > page.index(results.GLANCE_HEAD)
    # a paired line edited on the page (its verdict, or its mean) fails the check, and so does one dropped
    line = rows[0]
    verdict = line.rstrip(" |").split(" | ")[-1]
    for edited in (line.replace(f"| {verdict} |", "| better |"), line.replace(" | 1 | ", " | 3 | ")):
        assert edited != line
        problems = results.check_manifest(page.replace(line, edited), manifest, workdir)
        assert any("in no table the runs give" in p for p in problems)
        assert any("table paired of digits: 1 line(s) not on the page" in p for p in problems)
    assert any("not on the page" in p for p in results.check_manifest(page.replace(line + "\n", ""), manifest, workdir))
    # and the manifest's copy of the table is recomputed from the runs, not trusted
    forged = json.loads(json.dumps(manifest))
    (table,) = [t for t in forged["tables"] if t["kind"] == "paired"]
    table["lines"][2] = line.replace(f"| {verdict} |", "| better |")
    problems = results.check_manifest(page.replace(line, table["lines"][2]), forged, workdir)
    assert any("table paired of digits: not what the runs give" in p for p in problems)


def _committed_seeds(tmp_path: Path, config: str = "mnist/2x2_o0") -> tuple[Path, list[str]]:
    """A copy of the committed page's runs of one configuration over its seeds (real runs, nothing trained)."""
    snapshots = REPO / "docs" / "results" / "runs"
    names = sorted(p.relative_to(snapshots).as_posix() for p in snapshots.glob(f"{config}_s*"))
    if len(names) < 2:
        pytest.skip(f"the committed page has fewer than 2 seeds of {config}")
    root = tmp_path / "runs"
    for name in names:
        shutil.copytree(snapshots / name, root / name)
    return root, names


def test_two_page_datasets_of_one_data_source_get_a_report_each(results, tmp_path):
    """MNIST and the larger-data point mnist_10k are one data source: ddcnn-report over both at once gives one MNIST
    table holding both, which the page's per-dataset table never equals (the interim page failed on it). Each page
    dataset gets its own report, whose table is the one the page recomputes from that dataset's runs."""
    root, names = _committed_seeds(tmp_path)
    names = names[:2]
    args = results._resolve(results._parser().parse_args([]))
    mnist = next(d for d in results.plan(args) if d.key == "mnist")
    larger = results.dataclasses.replace(mnist, key="mnist_larger", title="MNIST, more data")
    specs = []
    for name, dataset in zip(names, (mnist, larger), strict=True):
        grid, seed = name.split("/")[1].split("_o")[0], int(name.rsplit("_s", 1)[1])
        spec = results.RunSpec(dataset, grid, 0, seed)
        if spec.name != name:
            shutil.copytree(root / name, root / spec.name)
        specs.append(spec)
    out = results.report(specs, root, 1, plots=False)
    for spec in specs:
        ((data_name, lines),) = results.report_lines(root, [spec.name]).items()
        written = (out / spec.dataset.key / f"{results._slug(data_name)}.md").read_text().splitlines()
        assert [line for line in written if line.startswith("|")][: len(lines)] == lines
        assert " | 1 | " in lines[2]  # one seed each: neither report pooled the other's run


def _set_convergence(root: Path, name: str, global_converged: bool | None) -> None:
    """Record the convergence of a run's global CNN and local nets (None: not recorded, as an older ddcnn wrote)."""
    path = root / name / "results.json"
    data = json.loads(path.read_text())
    data.pop("convergence", None)
    if global_converged is not None:
        local = [{"converged": True} for _ in data["accuracy"]["local"]]
        data["convergence"] = {"global": {"converged": global_converged}, "local": local}
    path.write_text(json.dumps(data))


def test_the_glance_leads_carry_the_paired_interval_and_verdict_of_the_report_stats(results, tmp_path):
    from ddcnn.report.stats import paired_difference

    root, names = _committed_seeds(tmp_path)
    accuracy = [json.loads((root / n / "results.json").read_text())["accuracy"] for n in names]

    def expected(baseline: str, converged: bool | None) -> dict:
        return paired_difference([100 * (a["cnn_dnn"] - a[baseline]) for a in accuracy], converged)

    def cells(lines: list[str]) -> list[str]:
        (row,) = lines[2:]
        return row.split(" | ")[8:10]

    for name in names:
        _set_convergence(root, name, True)
    lines = results.glance_lines(root, names)
    assert lines[0] == results.GLANCE_HEAD
    for cell, baseline in zip(cells(lines), ("mean_prob", "global"), strict=True):
        stats = expected(baseline, True)
        assert stats["verdict"] in ("better", "worse", "within noise")
        assert cell == f"{stats['mean']:+.2f} [{stats['low']:+.2f}, {stats['high']:+.2f}] {stats['verdict']}"
    # the glance and the paired table give the same interval and verdict
    paired = results.paired_lines(root, names)
    for comparison, baseline in (("CNN-DNN − mean probability", "mean_prob"), ("CNN-DNN − global CNN", "global")):
        (row,) = [line for line in paired if f"| {comparison} |" in line]
        stats = expected(baseline, True)
        assert f"| [{stats['low']:+.2f}, {stats['high']:+.2f}] | {stats['p']:.2g} | " in row
        assert row.endswith(f" | {stats['verdict']} |")
    # one seed's global CNN did not converge: no verdict against it, only against the (converged) local nets
    _set_convergence(root, names[-1], False)
    to_mean_prob, to_global = cells(results.glance_lines(root, names))
    stats = expected("global", False)
    assert to_global == f"{stats['mean']:+.2f} [{stats['low']:+.2f}, {stats['high']:+.2f}] baseline not converged"
    assert to_mean_prob.endswith(expected("mean_prob", True)["verdict"])
    (row,) = [line for line in results.paired_lines(root, names) if "| CNN-DNN − global CNN |" in line]
    assert row.endswith("| baseline not converged |")
    # runs that never recorded their convergence (an older ddcnn): the interval's verdict, said to rest on that
    for name in names:
        _set_convergence(root, name, None)
    for cell in cells(results.glance_lines(root, names)):
        assert cell.endswith(" (convergence unknown)")
    # one seed: no interval, no verdict
    assert results.lead_cell(results.paired_table(root, names[:1])[0]).endswith("(n<2: no interval)")


def test_the_coarse_input_block_states_protocol_section_6_as_the_runs_give_it(results, tmp_path):
    """docs/coarse.md's block on coarse.input's default, from real runs of two configurations: it says whether the
    criteria of section 6 hold, and says "not met" once a row is worse."""
    root, names = _committed_seeds(tmp_path, "mnist/2x2_o0")
    other_root, other = _committed_seeds(tmp_path / "other", "mnist/4x4_o0")
    for name in other:
        shutil.copytree(other_root / name, root / name)
    manifest = {"runs": {name: {} for name in [*names, *other]}}

    def block() -> str:
        return "\n".join(results.coarse_input_block(manifest, root))

    text = block()
    row = next(line for line in text.splitlines() if line.startswith("| mnist |"))
    pooled = next(r for r in results.pooled_rows(root, [*names, *other]) if r["method_key"] == "cnn_dnn_logits")
    assert row.startswith(f"| mnist | {len(names)} | {results.lead_cell(pooled)} |")
    better = pooled["verdict"] == "better"
    assert ("(1) better over the configurations of every 2D dataset: " + ("met" if better else "not met")) in text
    # what the default gives: the CNN-DNN on probabilities (and on logits) minus the global CNN, each seed's mean over
    # the configurations paired by seed, from the runs' own accuracies
    standing = next(
        line for line in text.splitlines()[text.splitlines().index(row) + 1 :] if line.startswith("| mnist")
    )
    per_seed = {}
    for name in [*names, *other]:
        acc = json.loads((root / name / "results.json").read_text())["accuracy"]
        per_seed.setdefault(int(name.rsplit("_s", 1)[1]), []).append(100 * (acc["cnn_dnn_probs"] - acc["global"]))
    means = [sum(d) / len(d) for d in per_seed.values() if len(d) == 2]
    cells = standing.strip("| ").split(" | ")
    assert cells[2].startswith(f"{sum(means) / len(means):+.2f} [")
    assert cells[2] == results.lead_cell(results.pooled_rows(root, [*names, *other], results.STANDING_PAIRS)[0])
    assert (
        cells[3].split(" [")[0]
        == results.lead_cell(
            next(r for r in results.pooled_rows(root, [*names, *other]) if r["comparison"] == "CNN-DNN − global CNN")
        ).split(" [")[0]
    )
    # logits 3 points below probabilities in every seed of 2x2/0: that row is worse, and criterion (2) fails
    for name in names:
        path = root / name / "results.json"
        data = json.loads(path.read_text())
        seed = int(name.rsplit("_s", 1)[1])
        data["accuracy"]["cnn_dnn_logits"] = data["accuracy"]["cnn_dnn_probs"] - 0.03 - 0.002 * seed  # with a spread
        path.write_text(json.dumps(data))
    assert "(2) no row worse: not met (mnist 2x2, 0)" in block()


def test_the_pooled_table_averages_each_seed_over_the_configurations_then_pairs_by_seed(results, tmp_path):
    from ddcnn.report.stats import paired_difference

    root, names = _committed_seeds(tmp_path, "mnist/2x2_o0")
    other_root, other = _committed_seeds(tmp_path / "other", "mnist/4x4_o0")
    for name in other:
        shutil.copytree(other_root / name, root / name)
    names += other
    seeds = sorted(
        {int(n.rsplit("_s", 1)[1]) for n in other} & {int(n.rsplit("_s", 1)[1]) for n in names[: -len(other)]}
    )
    if len(seeds) < 2:
        pytest.skip("the committed page has fewer than 2 seeds holding both configurations")
    for name in names:
        _set_convergence(root, name, True)
    # a seed holding only one configuration counts in the paired table but not here
    lonely = [n for n in names if int(n.rsplit("_s", 1)[1]) not in seeds]

    def accuracy(name: str) -> dict:
        return json.loads((root / name / "results.json").read_text())["accuracy"]

    lines = results.pooled_lines(root, names)
    assert lines[0] == results.POOLED_HEAD
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert "coarse DNN on logits − on probabilities" in rows  # the page's runs train both coarse inputs
    for label, method, baseline in (
        ("CNN-DNN − global CNN", "cnn_dnn", "global"),
        ("coarse DNN on logits − on probabilities", "cnn_dnn_logits", "cnn_dnn_probs"),
    ):
        per_seed = [
            sum(
                100 * (accuracy(f"{c}_s{s}")[method] - accuracy(f"{c}_s{s}")[baseline])
                for c in ("mnist/2x2_o0", "mnist/4x4_o0")
            )
            / 2
            for s in seeds
        ]
        stats = paired_difference(per_seed, True)
        assert f"| {len(seeds)} | 2 | {stats['mean']:+.2f} ± {stats['std']:.2f} " in rows[label], (rows[label], lonely)
        assert f"| [{stats['low']:+.2f}, {stats['high']:+.2f}] | {stats['p']:.2g} | " in rows[label]
        assert rows[label].endswith(f" | {stats['verdict']} |")
    # the global DDP against the global CNN is the same two trainings in both configurations: the paired table's one
    # row, not a difference over configurations
    assert not any("global DDP − global CNN" in line for line in lines)
    # an unconverged global CNN in any seed: no verdict against it
    _set_convergence(root, names[0], False)
    (row,) = [line for line in results.pooled_lines(root, names) if "| CNN-DNN − global CNN |" in line]
    assert row.endswith("| baseline not converged |")
    # one configuration: the paired table is already the dataset's, no pooled table
    assert results.pooled_lines(root, [n for n in names if n.startswith("mnist/2x2_o0")]) == []


def test_a_comparison_of_trainings_shared_by_every_grid_is_one_row(results, tmp_path):
    """The global CNN and its DDP are trained once per seed and serve every grid: their difference is one comparison
    (one row of grid and overlap "all", one p in the family), not one per configuration; where a configuration's
    trainings differ, each is its own row."""
    root, names = _committed_seeds(tmp_path, "mnist/2x2_o0")
    other_root, other = _committed_seeds(tmp_path / "other", "mnist/4x4_o0")
    for name in other:
        shutil.copytree(other_root / name, root / name)
    both = [*names, *other]

    def accuracy(name: str) -> dict:
        return json.loads((root / name / "results.json").read_text())["accuracy"]

    shared = all(
        accuracy(f"mnist/4x4_o0_s{n.rsplit('_s', 1)[1]}")[k] == accuracy(n)[k]
        for n in names
        if f"mnist/4x4_o0_s{n.rsplit('_s', 1)[1]}" in other
        for k in ("global", "global_ddp")
    )
    if not shared or len(names) != len(other):
        pytest.skip("the committed page's 2x2/0 and 4x4/0 runs do not share their global CNN and DDP")
    ddp = [r for r in results.paired_table(root, both) if r["method_key"] == "global_ddp"]
    assert [(r["grid"], r["overlap"], r["num_subdomains"], r["n"]) for r in ddp] == [("all", "all", None, len(names))]
    # another DDP in one seed of 4x4: the two configurations' comparisons differ, two rows
    path = root / other[0] / "results.json"
    data = json.loads(path.read_text())
    data["accuracy"]["global_ddp"] -= 0.01
    path.write_text(json.dumps(data))
    ddp = [r for r in results.paired_table(root, both) if r["method_key"] == "global_ddp"]
    assert sorted(r["grid"] for r in ddp) == ["2x2", "4x4"]


def test_the_secondary_rows_are_holm_adjusted_over_the_pages_secondary_family(results, tmp_path):
    """Per-configuration rows and rows over configurations show the paired t-test's p and beside it p Holm-adjusted
    over every such row of the page (two datasets here); a comparison the primary table prints is not printed again
    over the configurations."""
    from ddcnn.report.stats import holm

    root, names = _committed_seeds(tmp_path, "mnist/2x2_o0")
    other_root, other = _committed_seeds(tmp_path / "other", "mnist/4x4_o0")
    fashion_root, fashion = _committed_seeds(tmp_path / "fashion", "fashion_mnist/2x2_o0")
    for source, group in ((other_root, other), (fashion_root, fashion)):
        for name in group:
            shutil.copytree(source / name, root / name)
    family = [*names, *other, *fashion]
    rows = [r for group in (names + other, fashion) for r in results.paired_table(root, group)]
    pooled = results.pooled_rows(root, [*names, *other])
    tested = [r["p"] for r in (*rows, *pooled) if r["p"] is not None]
    assert len(tested) > len(pooled) > 0
    adjusted = sorted(f"{p:.2g}" for p in holm(tested))
    tables = results.secondary_tables(root, family, [])
    printed = []
    for paired_lines, pooled_lines in tables.values():
        for line in [*paired_lines[2:], *pooled_lines[2:]]:
            p, p_holm = line.rstrip(" |").split(" | ")[-3:-1]
            if p != "-":
                printed.append(p_holm)
                assert float(p_holm) >= float(p)
    assert sorted(printed) == adjusted
    # ddcnn-report of one dataset adjusts within that dataset: a smaller family, never a larger adjusted p
    own = [r["p_holm"] for r in results.paired_table(root, fashion)]
    page = [line.rstrip(" |").split(" | ")[-2] for line in tables["fashion_mnist"][0][2:]]
    assert len(own) == len(page) and any(p is not None for p in own)
    assert all(p is None and q == "-" or p <= float(q) + 5e-3 for p, q in zip(own, page, strict=True))
    # the primary table prints CNN-DNN − global CNN of MNIST: not again over its configurations
    primary = [results.PRIMARY_HEAD, "|---|", "| mnist | CNN-DNN − global CNN | 5 | 2 | 10,000 | +0.10 | [x] |"]
    _, mnist_pooled = results.secondary_tables(root, family, primary)["mnist"]
    assert not any("| CNN-DNN − global CNN |" in line for line in mnist_pooled)
    assert any("| CNN-DNN − mean probability |" in line for line in mnist_pooled)


def test_check_fails_when_a_paired_line_of_the_committed_page_is_edited(results, committed):
    page, manifest, root, recomputed = committed
    tables = [t for t in manifest["tables"] if t["kind"] == "paired"]
    if not tables:
        pytest.skip("the committed page has no paired differences yet (python experiments/results.py --rewrite)")
    line = tables[0]["lines"][2]
    verdict = line.rstrip(" |").split(" | ")[-1]
    edited = line.replace(f"| {verdict} |", "| better |" if not verdict.startswith("better") else "| worse |")
    assert edited != line
    problems = results.check_manifest(page.replace(line, edited), manifest, root, recomputed)
    assert any("in no table the runs give" in p for p in problems)


@pytest.mark.slow
def test_check_fails_when_a_run_wrote_other_figures(results, tiny, tmp_path):
    out, workdir = tiny
    page, manifest = _page_and_manifest(out)
    root = tmp_path / "runs"
    shutil.copytree(out / "results" / "runs", root)
    results_file = root / "digits" / "2x2_o2_s0" / "results.json"
    data = json.loads(results_file.read_text())
    row = next(r for r in data["methods"] if r["key"] == "cnn_dnn_logits")
    row["accuracy"] = 1.0 - row["accuracy"]
    data["flags"] = [{"method": "cnn_dnn_logits", "kind": "chance", "message": "at chance", "try": "lower the lr"}]
    results_file.write_text(json.dumps(data))
    problems = results.check_manifest(page, manifest, root)
    assert any("SHA-256" in p for p in problems)
    assert any("methods figures differ" in p for p in problems)
    assert any("not what the runs give" in p for p in problems)
    # a flag the page does not list
    assert any("flags figures differ" in p for p in problems)
    assert any("flags of digits: 1 line(s) not on the page" in p for p in problems)
    # and a run directory that is gone
    shutil.rmtree(root / "digits" / "2x2_o0_s0")
    assert any("no results.json" in p for p in results.check_manifest(page, manifest, root))


@pytest.mark.slow
def test_an_interrupted_invocation_reuses_finished_runs(results, tiny, capsys):
    out, workdir = tiny
    before = {p: p.stat().st_mtime_ns for p in workdir.rglob("results.json")}
    again = out.parent / "again"
    assert results.main(["--tiny", "--out", str(again), "--workdir", str(workdir)]) == 0
    assert "reused" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in workdir.rglob("results.json")} == before


def test_the_committed_results_page_is_what_its_runs_wrote(results, committed):
    """docs/results.md against its manifest and the committed snapshots of its runs (once the page exists)."""
    docs = REPO / "docs"
    page, manifest, root, recomputed = committed
    assert results.check_manifest(page, manifest, root, recomputed) == []
    # and the README's, docs/methods.md's and the docstring's generated figures are what its runs give
    assert results.check_blocks(manifest, docs / "results" / "runs") == []
    readme = (REPO / "README.md").read_text()
    _, block = readme.split(results._markers("summary")[0])
    assert block.split(results._markers("summary")[1])[0].strip()
    # each summary row's seeds are those its differences pair (rows of an interim page hold different seeds)
    body = block.split(results._markers("summary")[1])[0]
    family = next((t["runs"] for t in manifest.get("tables", []) if t.get("kind") == "primary"), None)
    if family:  # a page with primary verdicts: README's rows are its primary rows, one per comparison
        rows = [line.split(" | ") for line in body.splitlines() if line.startswith("| ") and " | " in line]
        primary = results.primary_rows(docs / "results" / "runs", family)
        assert [(r[0].lstrip("| "), r[1], r[2]) for r in rows[1:]] == [
            (row["dataset"], row["comparison"], str(row["seeds"])) for row in primary
        ]
        return
    rows = [line.split(" | ") for line in body.splitlines()]
    paired = {}
    for name, runs in results._by_dataset(manifest).items():
        for row in results.paired_table(docs / "results" / "runs", runs):
            if row["comparison"] == "CNN-DNN − global CNN":
                paired[name, f"{row['grid']}, {row['overlap']}"] = str(row["n"])
    summary = [r for r in rows if len(r) == 6 and r[1].isdigit()]
    assert summary and all(r[1] == paired[r[0].lstrip("| "), r[2]] for r in summary)


def test_readmes_summary_states_the_primary_verdicts_of_a_page_that_has_them(results, tiny):
    out, _ = tiny
    _, manifest = _page_and_manifest(out)
    lines = results.summary_block(manifest, out / "results" / "runs")
    assert "Its primary verdicts (fixed in advance: docs/protocol.md section 5a)" in lines[0]
    # its CNN-DNN is the one the page's runs trained (PAGE_INPUT), which today's default is not: it says so
    said = "the CNN-DNN (the coarse DNN on the local logits, as the page's runs trained it; `coarse.input`'s default "
    assert said + "is `probs`" in lines[0]
    rows = [line.split(" | ") for line in lines if line.startswith("| digits |")]
    assert [r[1] for r in rows] == [what for what, *_ in results.PRIMARY]
    primary = results.primary_rows(out / "results" / "runs", next(t["runs"] for t in manifest["tables"]))
    assert [r[-1].rstrip(" |") for r in rows] == [row["verdict"] for row in primary]


def test_adrenal3d_has_primary_verdicts_of_balanced_accuracy_and_auc_beside_accuracy(results):
    """docs/protocol.md 5a: on AdrenalMNIST3D the three comparisons of balanced accuracy and of AUC are primary too;
    their differences are scikit-learn's metrics on the snapshot's kept test predictions (one seed here: the page's
    seed 0 at the global rate before protocol 5b, kept in tests/fixtures as its snapshot had them)."""
    from sklearn.metrics import balanced_accuracy_score, roc_auc_score

    from ddcnn.report.predictions import read_compact_predictions

    found = [REPO / "tests" / "fixtures" / "adrenal3d_run" / "adrenal3d" / "2x2x2_s0" / "predictions_test.pt"]
    run = found[0].parent
    rows = results.primary_rows(run.parents[1], [f"adrenal3d/{run.name}"])
    assert [r["comparison"] for r in rows] == [
        f"{what}{suffix}" for what, *_ in results.PRIMARY for suffix in ("", " (balanced accuracy)", " (AUC x 100)")
    ]
    pred = read_compact_predictions(found[0])
    y = pred["labels"].numpy()

    def entry(key):
        return pred["methods"][pred["aliases"].get(key, key)]

    for row in rows:
        method, baseline = next((m, b) for what, m, b, _ in results.PRIMARY if row["comparison"].startswith(what))
        if row["comparison"].endswith("(AUC x 100)"):
            expected = roc_auc_score(y, entry(method)["prob1"].float()) - roc_auc_score(
                y, entry(baseline)["prob1"].float()
            )
        elif row["comparison"].endswith("(balanced accuracy)"):
            expected = balanced_accuracy_score(y, entry(method)["pred"]) - balanced_accuracy_score(
                y, entry(baseline)["pred"]
            )
        else:
            expected = (entry(method)["pred"].numpy() == y).mean() - (entry(baseline)["pred"].numpy() == y).mean()
        assert row["difference"] == pytest.approx(100 * expected), row["comparison"]
        assert row["low"] <= row["difference"] <= row["high"]


def test_a_primary_verdict_names_the_runs_where_the_cnn_dnn_itself_did_not_converge(results, tmp_path):
    """A reviewer reads the primary table: the baseline's convergence withholds a verdict, and the method under test's
    is named beside its verdict (an unconverged local net can move the CNN-DNN's difference either way); the runs of
    the page's fixture converged, and one local net marked unconverged is named in every row of its run."""
    import json
    import shutil

    run = tmp_path / "adrenal3d" / "2x2x2_s0"
    shutil.copytree(REPO / "tests" / "fixtures" / "adrenal3d_run" / "adrenal3d" / "2x2x2_s0", run)
    clean = results.primary_rows(tmp_path, ["adrenal3d/2x2x2_s0"])
    assert clean and all("unconverged" not in row["verdict"] and not row["method_unconverged"] for row in clean)
    record = json.loads((run / "results.json").read_text())
    record["convergence"]["local"][3]["converged"] = False
    (run / "results.json").write_text(json.dumps(record))
    flagged = results.primary_rows(tmp_path, ["adrenal3d/2x2x2_s0"])
    named = "; the CNN-DNN holds an unconverged training in 1 of its 1 runs (adrenal3d/2x2x2_s0)"
    for before, row in zip(clean, flagged, strict=True):
        assert row["difference"] == before["difference"] and row["p_holm"] == before["p_holm"]
        # the mean probability averages the same local nets: its comparison has no verdict, and still names the run
        against_local = row["comparison"].startswith("CNN-DNN − mean probability")
        assert row["verdict"] == ("baseline not converged" if against_local else before["verdict"]) + named


def test_a_second_invocation_into_a_training_workdir_is_refused_until_the_first_is_gone(results, tmp_path):
    """Two invocations training into one workdir would remove each other's runs (--retrain) and race for the page:
    the second is refused at once, naming the first; once the first is killed, its lock is free."""
    workdir = tmp_path / "runs"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import importlib.util, sys, time; from pathlib import Path; "
            "spec = importlib.util.spec_from_file_location('results', sys.argv[1]); "
            "m = sys.modules['results'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "held = m.hold_workdir(Path(sys.argv[2])); print('held', flush=True); time.sleep(120)",
            str(REPO / "experiments" / "results.py"),
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=rf"results.py \(pid {holder.pid} on .*\) is training into {workdir}"):
            results.main(["--tiny", "--out", str(tmp_path / "page"), "--workdir", str(workdir)])
        assert not (tmp_path / "page").exists()
    finally:
        holder.kill()
        holder.wait()
    held = results.hold_workdir(workdir)  # the kernel released the killed holder's lock
    held.release()


def test_tiny_mode_never_writes_into_docs(results, capsys):
    with pytest.raises(SystemExit):
        results.main(["--tiny"])
    assert "--tiny needs --out" in capsys.readouterr().err


@pytest.mark.slow
def test_a_later_invocation_restores_snapshotted_runs_instead_of_training_them(results, tiny, tmp_path, capsys):
    out, workdir = tiny
    # --snapshot copies the finished runs of a workdir, nothing else
    saved = tmp_path / "saved"
    assert results.main(["--tiny", "--snapshot", "--out", str(saved), "--workdir", str(workdir)]) == 0
    assert "2 of 2 runs finished" in capsys.readouterr().out
    assert not (saved / "results.md").exists()
    # a later session: the committed snapshot is all there is; one run had been started again and left half-done
    fresh = tmp_path / "runs"
    half_done = fresh / "digits" / "2x2_o0_s0" / "local" / "00" / "last.ckpt"
    half_done.parent.mkdir(parents=True)
    half_done.write_bytes(b"a checkpoint of a training cut short")
    assert results.main(["--tiny", "--out", str(saved), "--workdir", str(fresh)]) == 0
    assert capsys.readouterr().out.count("restored from its snapshot") == 2
    assert not half_done.exists()  # the half-done training gave way to the snapshot, none ran
    local = fresh / "digits" / "2x2_o0_s0" / "local"
    assert {p.name for p in local.rglob("*") if p.is_file()} == {"meta.json", "metrics.csv"}
    page, manifest = _page_and_manifest(saved)
    original_page, original = _page_and_manifest(out)
    assert {n: e["results_sha256"] for n, e in manifest["runs"].items()} == {
        n: e["results_sha256"] for n, e in original["runs"].items()
    }
    assert [t["lines"] for t in manifest["tables"]] == [t["lines"] for t in original["tables"]]
    assert results.check_manifest(page, manifest, saved / "results" / "runs") == []


@pytest.mark.slow
def test_a_snapshot_of_other_settings_is_trained_again_not_restored(results, tiny, tmp_path, capsys):
    out, workdir = tiny
    saved = tmp_path / "saved"
    shutil.copytree(out / "results" / "runs", saved / "results" / "runs")
    record = saved / "results" / "runs" / "digits" / "2x2_o2_s0" / "experiment_run.json"
    data = json.loads(record.read_text())
    data["command"] = data["command"].replace("trainer.max_epochs=1", "trainer.max_epochs=2")  # another recipe
    record.write_text(json.dumps(data))
    fresh = tmp_path / "runs"
    assert results.main(["--tiny", "--out", str(saved), "--workdir", str(fresh)]) == 0
    printed = capsys.readouterr().out
    assert "digits/2x2_o0_s0: restored from its snapshot" in printed
    assert "digits/2x2_o2_s0: its snapshot was run with other settings" in printed
    assert (fresh / "digits" / "2x2_o2_s0" / "local").is_dir()  # trained here
    # the store root differs between machines, yet names the same run: the other one was restored
    assert results._portable("ddcnn-train a=1 store.root=/x/store b=2") == results._portable("ddcnn-train a=1 b=2")


def test_the_committed_64_cubed_page_is_what_its_runs_wrote(results):
    """docs/ct64/results.md (issue #47's row, a page of its own) against its manifest and committed snapshots, counted
    against its own budget."""
    out = REPO / "docs" / "ct64"
    if not (out / "results.md").is_file():
        pytest.skip("docs/ct64/results.md has not been written yet (--datasets adrenal3d_64 --out docs/ct64)")
    page, manifest = _page_and_manifest(out)
    assert results.check_manifest(page, manifest, out / "results" / "runs") == []
    assert sorted(manifest["runs"]) == [f"adrenal3d_64/2x2x2_o2_s{seed}" for seed in results.CT64_SEEDS]
    assert f"of the {results.OWN_BUDGETS['adrenal3d_64'][0] // 3600} CPU-hours the page may cost" in page


def test_git_keeps_the_snapshots_the_page_is_checked_against():
    """``.gitignore`` ignores run folders (``runs/``); the page's snapshots under ``docs/results/runs/`` must still be
    committed, or the committed page cannot be checked (and an unfinished invocation's runs are lost)."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for path in (
        "docs/results/runs/mnist/2x2_o0_s0/results.json",
        "docs/results/runs/a/b/plots/accuracy_vs_time.png",
        "docs/ct64/results/runs/adrenal3d_64/2x2x2_o2_s0/results.json",
    ):
        check = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert check.returncode == 1, f"git ignores {path}: see .gitignore"


@pytest.mark.slow
def test_a_rerun_with_other_flags_refuses_the_old_runs_or_retrains_them(results, tiny, tmp_path, capsys):
    out, workdir = tiny
    runs = tmp_path / "runs"
    shutil.copytree(workdir, runs, symlinks=True)
    before = {p: p.read_bytes() for p in runs.rglob("results.json")}
    again = tmp_path / "out"
    # another epoch cap over runs made with one epoch: refused before anything trains, naming the flag and the fix
    with pytest.raises(SystemExit) as refused:
        results.main(["--tiny", "--out", str(again), "--workdir", str(runs), "--epochs", "2"])
    message = str(refused.value)
    assert "trainer.max_epochs: 1 -> 2" in message and "--retrain" in message and "--workdir" in message
    assert {p: p.read_bytes() for p in runs.rglob("results.json")} == before
    assert not (again / "results.md").exists()
    # --retrain trains them again under the planned command, and the page publishes only those
    assert results.main(["--tiny", "--out", str(again), "--workdir", str(runs), "--epochs", "2", "--retrain"]) == 0
    assert capsys.readouterr().out.count("--retrain: training it again") == 2
    page, manifest = _page_and_manifest(again)
    for name in manifest["runs"]:
        record = json.loads((runs / name / "experiment_run.json").read_text())
        assert "trainer.max_epochs=2" in record["command"] and "--epochs 2" in record["invocation"]
        assert (runs / name / "results.json").read_bytes() != before[runs / name / "results.json"]
    assert results.check_manifest(page, manifest, again / "results" / "runs") == []


def test_the_recorded_and_planned_commands_differ_by_flag(results):
    recorded = "ddcnn-train a=1 'scheduler={x:1}' store.root=/m1/store b=2 hydra.run.dir=d/r"
    assert results.command_differences(recorded, "ddcnn-train a=1 'scheduler={x:1}' b=2 hydra.run.dir=d/r") == []
    assert results.command_differences(recorded, "ddcnn-train a=2 b=2 c=3 hydra.run.dir=d/r") == [
        "a: 1 -> 2",
        "c: (not set) -> 3",
        "scheduler: {x:1} -> (not set)",
    ]


def test_a_setting_the_plan_now_states_is_no_difference_where_the_run_trained_with_it(results, tmp_path):
    """The page's commands state engine.min_steps=0 since its default changed (issue #45); a run recorded before the
    setting existed trained without it, as one that recorded 0 did: both are reused. One that trained with another
    value, or a setting it never recorded, still differs."""
    recorded = "ddcnn-train a=1 hydra.run.dir=d/r"
    planned = "ddcnn-train a=1 engine.min_steps=0 engine.patience=2 trainer.max_epochs=15 hydra.run.dir=d/r"
    config = tmp_path / "config.yaml"
    config.write_text("engine:\n  patience: 2\ntrainer:\n  max_epochs: 15\n")  # no min_steps: from before it
    assert results.command_differences(recorded, planned, config) == []
    assert results.command_differences(recorded, planned) == [
        "engine.min_steps: (not set) -> 0",
        "engine.patience: (not set) -> 2",
        "trainer.max_epochs: (not set) -> 15",
    ]
    config.write_text("engine:\n  patience: 4\n  min_steps: 200\ntrainer:\n  max_epochs: 15\n")
    assert results.command_differences(recorded, planned, config) == [
        "engine.min_steps: (not set) -> 0",
        "engine.patience: (not set) -> 2",
    ]
    # a value the recorded command set otherwise, or a setting the planned command drops, is never excused
    assert results.command_differences("ddcnn-train a=1 b=2", "ddcnn-train a=1", config) == ["b: 2 -> (not set)"]
    changed = "ddcnn-train a=1 trainer.max_epochs=14 hydra.run.dir=d/r"
    assert results.command_differences(changed, planned, config) == [
        "engine.min_steps: (not set) -> 0",
        "engine.patience: (not set) -> 2",
        "trainer.max_epochs: 14 -> 15",
    ]
    assert results.command_differences(recorded, "ddcnn-train a=1 x.y=3 hydra.run.dir=d/r", config) == [
        "x.y: (not set) -> 3"
    ]


def test_timing_runs_come_first_per_seed_alone(results):
    args = results._resolve(results._parser().parse_args(["--seeds", "0", "1"]))
    specs = results.run_specs(results.plan(args), args.seeds)
    order = results.phases(specs)
    assert [phase for phase, _ in order] == ["timing", "accuracy"] * 2
    timing, accuracy = order[0][1], order[1][1]
    # the first run of each dataset trains its global CNN and DDP (the others copy them from the store)
    first = ["mnist/2x2_o0_s0", "fashion_mnist/2x2_o0_s0", "adrenal3d/2x2x2_s0", "mnist_10k/2x2_o0_s0"]
    assert [s.name for s in timing] == first
    assert len(accuracy) == 6 and all(s.seed == 0 for s in accuracy)
    # and it fixes the ensemble's k for the dataset: auto there, the number it chose everywhere else
    assert [results.k_source(d).name for d in results.plan(args)] == first
    assert sorted(s.name for _, runs in order for s in runs) == sorted(s.name for s in specs)


def test_the_recipe_shares_one_threshold_and_keeps_the_cosine_schedule_whole(results):
    args = results._resolve(results._parser().parse_args([]))
    assert args.seeds == [0, 1, 2, 3, 4] and args.min_epochs == 8 and args.train_subset == results.TRAIN_SUBSET
    mnist, _, adrenal, large = results.plan(args)
    assert large.seeds == (0, 1, 2) and "data.train_subset=10000" in large.overrides and large.grids == ("2x2",)
    (scheduler,) = [o for o in mnist.overrides if o.startswith("scheduler=")]
    assert "threshold:0.002,threshold_mode:abs" in scheduler and "patience:0" in scheduler
    assert "engine.min_delta=0.002" in mnist.overrides and "engine.patience=2" in mnist.overrides
    assert ("engine.min_epochs=8" in mnist.overrides) == results._engine_has("min_epochs")
    assert "engine.patience=null" in adrenal.overrides and not any("scheduler" in o for o in adrenal.overrides)
    with pytest.raises(SystemExit, match=r"--patience 2 .*--lr-patience 1.* give --patience 3 or more"):
        results._resolve(results._parser().parse_args(["--lr-patience", "1"]))


def test_the_64_cubed_row_is_opt_in_with_ddp_on_its_first_seed_only(results, tmp_path):
    """#47 item 5: AdrenalMNIST3D 64³ under the protocol (experiment=adrenal3d's recipe, overlap 2, 3 seeds, the
    global DDP on one seed), not in the default page."""
    args = results._resolve(results._parser().parse_args([]))
    assert "adrenal3d_64" not in [d.key for d in results.plan(args)]
    args = results._resolve(results._parser().parse_args(["--datasets", "adrenal3d_64"]))
    (ct,) = results.plan(args)
    specs = results.run_specs([ct], args.seeds)
    assert [s.name for s in specs] == [f"adrenal3d_64/2x2x2_o2_s{seed}" for seed in (0, 1, 2)]
    first, second = specs[0].overrides(tmp_path), specs[1].overrides(tmp_path)
    assert "data=adrenal3d_64" in first and "decomposition.overlap=2" in first and "engine.patience=null" in first
    assert "methods.enabled.global_ddp=true" in first and not any("global_ddp" in o for o in second)
    assert not any("global_ensemble" in o for o in first)  # no room in its budget (said in the plan)


def test_the_page_states_the_coarse_input_its_runs_trained_with_and_they_stay_its_plan(results, tmp_path):
    """coarse.input's default returned to probs after the page's runs trained at logits (docs/protocol.md section 6):
    every dataset of the plan states logits, so the committed runs are still the planned ones (none stale), and a
    page written again means by "CNN-DNN" what its runs trained."""
    from ddcnn.settings.read import yaml_default

    assert yaml_default("coarse.input") == "probs" and results.PAGE_INPUT == "coarse.input=logits"
    keys = ["mnist", "fashion_mnist", "mnist_10k", "adrenal3d", "adrenal3d_64"]
    args = results._resolve(results._parser().parse_args(["--datasets", *keys]))
    datasets = results.plan(args)
    assert all(results.PAGE_INPUT in d.overrides for d in datasets)
    tiny = results.plan(results._resolve(results._parser().parse_args(["--tiny"])))
    assert results.PAGE_INPUT in tiny[0].overrides
    snapshots = REPO / "docs" / "results" / "runs"
    manifest = json.loads((REPO / "docs" / "results_manifest.json").read_text())
    specs = [s for s in results.run_specs(datasets, args.seeds) if s.name in manifest["runs"]]
    assert len(specs) == len(manifest["runs"])
    assert results.stale_runs(specs, snapshots) == {}
    # a run trained at probs is another command's: the plan never passes it off as the page's
    config = snapshots / specs[0].name / "config.yaml"
    recorded = json.loads((snapshots / specs[0].name / "experiment_run.json").read_text())["command"]
    planned = results.planned_command(specs[0], snapshots)
    with_probs = config.read_text().replace("input: logits", "input: probs")
    assert with_probs != config.read_text()
    (tmp_path / "config.yaml").write_text(with_probs)
    assert results.command_differences(recorded, planned, tmp_path / "config.yaml") == [
        "coarse.input: (not set) -> logits"
    ]


def test_check_names_a_docstring_default_that_is_not_the_scripts(results, monkeypatch):
    """check_blocks (which the committed page's test runs) adds these problems to those of the generated blocks."""
    assert results.docstring_problems() == []
    monkeypatch.setattr(results, "__doc__", results.__doc__.replace("``--epochs`` = 15", "``--epochs`` = 20"))
    assert results.docstring_problems() == ["the script's docstring says --epochs = 20, its default is 15"]


@pytest.mark.slow
def test_the_equal_devices_table_compares_ddp_with_the_cnn_dnn_on_as_many_devices(results, tiny, tmp_path):
    out, _ = tiny
    _, manifest = _page_and_manifest(out)
    root = tmp_path / "runs"
    shutil.copytree(out / "results" / "runs", root)
    names = sorted(manifest["runs"])
    for name in names:  # runs of a ddcnn before the projection: no table
        path = root / name / "results.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "projected_time_s_by_devices": None}))
    assert results.devices_lines(root, names) == []
    for name, ddp in zip(names, (30.0, 50.0), strict=True):  # as the evaluate stage writes it
        path = root / name / "results.json"
        data = json.loads(path.read_text())
        last = "4" if name.endswith("o0_s0") else "N"  # N: the run's number of sub-domains, 4
        data["projected_time_s_by_devices"] = {"1": 40.0, "2": 25.0, last: 12.5}
        data["time_s"]["global_ddp"] = ddp
        data["devices"] = {"global_ddp": 2}
        path.write_text(json.dumps(data))
    lines = results.devices_lines(root, names)
    assert lines[0] == results.DEVICES_HEAD
    rows = [line.split(" | ") for line in lines[2:]]
    # per configuration (overlap 0 and 2, one seed each) one row per device count: 1, 2 and N = 4
    assert [(r[1], r[2], r[4]) for r in rows] == [("2x2", "0", "1"), ("2x2", "0", "2"), ("2x2", "0", "4")] + [
        ("2x2", "2", "1"),
        ("2x2", "2", "2"),
        ("2x2", "2", "4"),
    ]
    on_two = rows[1]
    assert on_two[6:9] == ["30.0", "25.0", "1.20x (paired over 1 seed(s)) |"]
    assert rows[0][6] == "-" and rows[2][6] == "-"  # DDP ran on 2 devices only
    assert rows[4][6:8] == ["50.0", "25.0"]
    # on a page the table is checked like every other: recomputed from the runs
    table = {"kind": "devices", "dataset": "digits", "runs": names, "lines": lines}
    only = {"format": results.MANIFEST_FORMAT, "runs": {}, "header_lines": [], "tables": [table]}
    with_table = "\n".join(lines) + "\n"
    assert results.check_manifest(with_table, only, root) == []
    altered = with_table.replace(lines[3], lines[3].replace("30.0", "20.0"))
    assert any("in no table the runs give" in p for p in results.check_manifest(altered, only, root))


@pytest.mark.slow
def test_rewrite_writes_the_page_again_from_its_snapshots_without_training(results, tiny, tmp_path, capsys):
    out, _ = tiny
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    page, manifest = _page_and_manifest(out)
    assert results.main(["--rewrite", "--out", str(copy)]) == 0
    assert "written again from 2 snapshotted runs" in capsys.readouterr().out
    again, rewritten = _page_and_manifest(copy)
    # the same runs, untouched, and the same tables; only the line of the invocation that wrote the page differs
    assert {n: e["results_sha256"] for n, e in rewritten["runs"].items()} == {
        n: e["results_sha256"] for n, e in manifest["runs"].items()
    }
    assert [t["lines"] for t in rewritten["tables"]] == [t["lines"] for t in manifest["tables"]]
    changed = [line for line in again.splitlines() if line not in page.splitlines()]
    assert len(changed) == 1 and changed[0].startswith("| page written by | `python experiments/results.py --rewrite")
    assert "| runs trained by | `python experiments/results.py --tiny" in again
    assert results.main(["--check", "--out", str(copy)]) == 0
    # the section's command line is the runs' recorded one
    record = json.loads((copy / "results" / "runs" / "digits" / "2x2_o0_s0" / "experiment_run.json").read_text())
    (line,) = [line for line in again.splitlines() if line.startswith("Runs: `ddcnn-train ")]
    assert "trainer.max_epochs=1" in line and "trainer.max_epochs=1" in record["command"] and "seed=" not in line
    # a finished run snapshotted after the page was written (its manifest does not list it): refused, never dropped
    extra = copy / "results" / "runs" / "digits" / "2x2_o0_s9"
    shutil.copytree(copy / "results" / "runs" / "digits" / "2x2_o0_s0", extra)
    with pytest.raises(SystemExit, match=r"1 finished run\(s\) that .* does not list \(digits/2x2_o0_s9\).*--interim"):
        results.main(["--rewrite", "--out", str(copy)])
    assert (extra / "experiment_run.json").is_file() and (extra / "results.json").is_file()


@pytest.mark.slow
def test_rewrite_of_a_page_from_before_kept_predictions_keeps_its_snapshots(results, tiny, tmp_path):
    """The committed page of before #44 has snapshots without predictions_test.pt (and without the stages' test
    outputs to make them from): --rewrite must write it again without them, and a failure must never leave the
    snapshots deleted (it once removed all 45 before failing on the first)."""
    out, _ = tiny
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    runs = copy / "results" / "runs"
    for kept in runs.rglob("predictions_test.pt"):
        kept.unlink()
    files = sorted(p.relative_to(runs) for p in runs.rglob("*") if p.is_file())
    assert results.main(["--rewrite", "--out", str(copy)]) == 0
    assert sorted(p.relative_to(runs) for p in runs.rglob("*") if p.is_file()) == files
    assert results.main(["--check", "--out", str(copy)]) == 0
    # a snapshot whose predictions cannot be made (a local net marked done whose test outputs are unreadable) fails
    # the rewrite and leaves every snapshot in place
    local = runs / "digits" / "2x2_o2_s0" / "local" / "00"
    (local / "done").write_text("")
    (local / "probs_test.pt").write_bytes(b"")
    with pytest.raises(Exception):  # noqa: B017 (torch's error for an empty file)
        results.main(["--rewrite", "--out", str(copy)])
    (local / "done").unlink()
    (local / "probs_test.pt").unlink()
    assert sorted(p.relative_to(runs) for p in runs.rglob("*") if p.is_file()) == files


@pytest.mark.slow
def test_an_interim_page_holds_the_finished_runs_of_the_plan_and_says_so(results, tiny, tmp_path, capsys):
    """--interim: a checked page from the finished snapshots of the planned command only (a missing run and one of
    other settings are left out and named), marked interim; a later invocation restores its runs."""
    out, _ = tiny
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    record = copy / "results" / "runs" / "digits" / "2x2_o2_s0" / "experiment_run.json"
    data = json.loads(record.read_text())
    data["command"] = data["command"].replace("trainer.max_epochs=1", "trainer.max_epochs=2")  # another recipe
    record.write_text(json.dumps(data))
    assert results.main(["--tiny", "--interim", "--out", str(copy)]) == 0
    assert "interim" in capsys.readouterr().out
    page, manifest = _page_and_manifest(copy)
    assert list(manifest["runs"]) == ["digits/2x2_o0_s0"]
    assert "| **interim** | 1 of the 2 planned runs are finished (seeds digits: 0); missing: digits/2x2_o2_s0." in page
    assert not (copy / "results" / "runs" / "digits" / "2x2_o2_s0").exists()  # a page holds the snapshots of its runs
    assert results.main(["--check", "--out", str(copy)]) == 0
    summary = results.summary_block(manifest, copy / "results" / "runs")[0]  # README's lines on the committed page
    assert summary.startswith("The committed page is interim (1 of the 2 planned runs; its header names the rest): 1 ")
    # the page rewritten keeps saying it is interim
    assert results.main(["--rewrite", "--out", str(copy)]) == 0
    assert "| **interim** | 1 of the 2 planned runs" in (copy / "results.md").read_text()
    # nothing finished: no page
    shutil.rmtree(copy / "results" / "runs" / "digits" / "2x2_o0_s0")
    assert results.main(["--tiny", "--interim", "--out", str(copy)]) == 1


def test_the_estimate_uses_only_seeds_with_every_planned_run(results, tmp_path):
    """A seed with only some of its dataset's runs (an interim page's) would lower the estimate: it is left out, as
    are runs at another training set (their CPU does not scale with it); a dataset without a whole seed, or without
    any run, has no estimate (said so)."""
    args = results._resolve(results._parser().parse_args([]))
    root = tmp_path / "runs"

    def run(name: str, seed: int, cpu: float, size: int = args.train_subset) -> None:  # what estimate reads of a run
        folder = root / name
        folder.mkdir(parents=True)
        config = {"seed": seed, "data": {"train_subset": size}, "engine": {"min_epochs": 8}}
        (folder / "config.yaml").write_text(json.dumps(config))
        (folder / "results.json").write_text(json.dumps({"time_s": {"global_ddp": 10.0}, "startup_s": {}}))
        (folder / "experiment_run.json").write_text(json.dumps({"cpu_s": cpu}))

    for grid in ("2x2_o0", "2x2_o2", "4x4_o0", "4x4_o2"):  # seed 0 whole
        run(f"mnist/{grid}_s0", 0, 1000.0)
    run("mnist/2x2_o0_s1", 1, 100.0)  # seed 1: one of its four runs
    for grid in ("2x2_o0", "2x2_o2", "4x4_o0", "4x4_o2"):  # seed 2 whole, but at another training set: not scaled
        run(f"mnist/{grid}_s2", 2, 50.0, size=args.train_subset // 2)
    run("adrenal3d/2x2x2_s0", 0, 500.0)
    cost = results.estimate(root, args)
    seeds = len(args.seeds)
    assert cost["mnist"] == pytest.approx(seeds * (4 * (1000.0 - 20.0) + 20.0))  # seed 0 only; one DDP per seed
    assert cost["adrenal3d"] == pytest.approx(seeds * 500.0)  # one run per seed planned: every seed is whole
    assert cost["fashion_mnist"] is None  # no run at all
    text = results.estimate_text(root, args)
    assert "no estimate yet, the page's runs hold no seed with every run of fashion_mnist, mnist_10k" in text
    args.datasets = [key for key in args.datasets if key not in ("fashion_mnist", "mnist_10k")]  # the rest has one
    assert f"about {cost['mnist'] + cost['adrenal3d']:.0f} s CPU" in results.estimate_text(root, args)
    assert "6.2 CPU-hours, within the 14 allowed" in results.estimate_text(root, args)
    args.seeds = list(range(17))  # 17 seeds: over
    assert "21.0 CPU-hours, over the 14 allowed" in results.estimate_text(root, args)


def test_the_cpu_of_a_process_tree_counts_its_ended_and_running_children(results):
    """What the sampler of a training reads: a child that ended (waited for) and one still running both count."""
    import sys

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    code = f"import subprocess, sys, time\nsubprocess.run([sys.executable, '-c', {burn!r}])\n{burn}time.sleep(30)\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        cpu = 0.0
        for _ in range(100):  # until both have burnt their 0.6 s (the parent then sleeps)
            cpu = results.tree_cpu(proc.pid)
            if cpu >= 1.2:
                break
            __import__("time").sleep(0.1)
        assert 1.2 <= cpu < 5.0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_run_finished_after_a_stopped_invocation_records_the_cpu_of_both(results, tmp_path, monkeypatch):
    """An invocation stopped part-way (a session's end) leaves its CPU, sampled while it trained, in the run
    directory's ledger; the invocation that finishes the run counts it in ``cpu_s`` and names it."""
    monkeypatch.setattr(results, "SAMPLE_S", 0.5)
    args = results._resolve(results._parser().parse_args(["--tiny"]))
    spec = results.run_specs(results.plan(args), args.seeds)[0]
    ledger = tmp_path / spec.name / results.LEDGER
    ledger.parent.mkdir(parents=True)
    stopped = {"started": "2026-12-03T20:00:00+00:00", "wall_s": 900.0, "cpu_s": 700.0}
    ledger.write_text(json.dumps([stopped]))
    seen: list[list[dict]] = []
    write = results._wait

    def watching(proc, timeout_s, progress):  # what a stop at any sample would have left behind
        def keep(cpu: float) -> None:
            progress(cpu)
            seen.append(json.loads(ledger.read_text()))

        return write(proc, timeout_s, keep)

    monkeypatch.setattr(results, "_wait", watching)
    record = results.train(spec, tmp_path, 1, None, print)
    assert seen and all(entries[0] == stopped and entries[1]["cpu_s"] > 0 for entries in seen)
    assert record["earlier_invocations"] == [stopped] and record["cpu_s"] > 700.0
    assert record["cpu_s"] - 700.0 >= seen[-1][1]["cpu_s"] - 0.5  # this invocation's own rusage, not less
    assert not ledger.exists()


def test_a_page_figure_copied_outside_a_generated_block_fails_the_check(results, tmp_path):
    """Issue #44 item 6: --check compared table lines and generated blocks only; docs/coarse.md's hand-copied table
    (the AdrenalMNIST3D row of the page among them) passed. Any of the page's figures outside a generated block, in
    README, docs/ or the script's docstring, now fails it."""
    page = "| mnist | 5 | +0.53 [+0.39, +0.67] better |\n| 2x2 | 97.85 ± 0.22 | speedup 1.10x |\n"
    doc = tmp_path / "notes.md"
    begin, end = results._markers("summary")
    block = f"{begin}\n+0.53 copied by the generator\n{end}"
    doc.write_text(f"# Notes\n\n{block}\nThe margin is ±0.5 points, at 0.05; lr 0.002.\n")
    assert results.figures_outside_blocks(page, [doc]) == []  # inside a block, or no page figure
    doc.write_text(doc.read_text() + "On MNIST the CNN-DNN leads by +0.53 points (97.85 ± 0.22), 1.10x faster.\n")
    problems = results.figures_outside_blocks(page, [doc], "the page reads −0.39 here")
    assert [p.split(": the page's figure ")[1].split(" ")[0] for p in problems[:3]] == ["+0.53", "1.10x", "97.85"]
    assert problems[0].startswith(f"{doc}:7:") and "docstring" not in problems[0]
    assert results.figures_outside_blocks("−0.39 in a table", [], "it fell by −0.39") != []
    # and the committed prose holds none
    if (REPO / "docs" / "results.md").is_file():
        page = (REPO / "docs" / "results.md").read_text()
        assert results.figures_outside_blocks(page, results.prose_files(), results.__doc__) == []


def test_a_run_trained_where_only_docs_differ_from_the_commit_records_the_commit_clean(results, tmp_path):
    """The page writes its snapshots into the training checkout's ``docs/``: that is no uncommitted code, and a run
    trained beside them records the bare commit; a changed tracked file elsewhere is still named."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "snapshot.json").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = git("rev-parse", "--short", "HEAD")

    (tmp_path / "docs" / "snapshot.json").write_text('{"retrained": true}\n')
    (tmp_path / "untracked.py").write_text("y = 2\n")
    assert results._git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert results._git_commit(tmp_path) == f"{head} (with uncommitted changes)"


def test_a_page_of_the_64_cubed_row_alone_counts_against_its_own_budget(results):
    """Issue #47 gives the 64³ row 10 CPU-hours of its own; a page that holds any other dataset has the page's."""
    budget, why = results.page_budget(["adrenal3d_64/2x2x2_o2_s0", "adrenal3d_64/2x2x2_o2_s1"])
    assert budget == 10 * 3600 and "docs/cost.md" in why
    assert results.page_budget(["mnist/2x2_o0_s0", "adrenal3d_64/2x2x2_o2_s0"]) == (
        results.CPU_BUDGET_S,
        "the script's docstring",
    )
