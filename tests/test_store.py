"""The content-addressed store: built once, published atomically, safe when several processes want the same entry."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddcnn.store import STORE_ENV, Store, StoreError, default_root, store_main

ROOT = Path(__file__).resolve().parents[1]


def _writer(text: str, log: Path | None = None, sleep_s: float = 0.0):
    def build(folder: Path) -> dict:
        if log is not None:
            with open(log, "a") as fh:
                fh.write(f"{os.getpid()}\n")
        time.sleep(sleep_s)
        (folder / "a.txt").write_text(text)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.bin").write_bytes(text.encode() * 3)
        return {"describe": text}

    return build


def test_an_entry_is_built_once_with_its_settings_and_checksums_beside_it(tmp_path):
    store = Store(tmp_path / "store")
    log = tmp_path / "builds.log"
    entry = store.get_or_build("demo", {"data": "x", "n": 1}, _writer("hello", log))
    again = store.get_or_build("demo", {"n": 1, "data": "x"}, _writer("other", log))  # same settings, other order
    assert again.path == entry.path and (entry.path / "a.txt").read_text() == "hello"
    assert log.read_text().count("\n") == 1
    record = json.loads((entry.path / "entry.json").read_text())
    assert record["depends"] == {"data": "x", "n": 1} and record["info"] == {"describe": "hello"}
    assert set(record["files"]) == {"a.txt", "sub/b.bin"}
    for name, meta in record["files"].items():
        data = (entry.path / name).read_bytes()
        assert meta == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    sums = (entry.path / "SHA256SUMS").read_text().splitlines()
    assert f"{record['files']['a.txt']['sha256']}  a.txt" in sums  # the format sha256sum -c reads
    other = store.get_or_build("demo", {"data": "x", "n": 2}, _writer("two"))
    assert other.path != entry.path and [e.key for e in store.entries("demo")] == [entry.key, other.key]
    assert not [p for p in entry.path.parent.iterdir() if p.name.startswith(".")]  # no claim or temporary left


def test_the_root_comes_from_the_setting_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "env"))
    assert default_root(None) == tmp_path / "env"
    assert default_root(str(tmp_path / "cfg")) == tmp_path / "cfg"
    monkeypatch.delenv(STORE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root(None) == tmp_path / "xdg" / "ddcnn"


_RACER = """
import sys, time
from pathlib import Path
from ddcnn.store import Store
root, log, start = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
while time.time() < start:
    time.sleep(0.005)
def build(folder):
    with open(log, "a") as fh:
        fh.write("built\\n")
    time.sleep(1.0)
    (folder / "x.txt").write_text("one copy")
entry = Store(root, poll_s=0.05).get_or_build("race", {"k": 1}, build)
print(entry.path, (entry.path / "x.txt").read_text())
"""


def test_processes_that_prepare_at_once_build_one_copy_and_all_use_it(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.time() + 1.5  # every racer has imported and waits for the same moment
    args = [str(tmp_path / "store"), str(tmp_path / "log"), str(start)]
    procs = [
        subprocess.Popen([sys.executable, "-c", _RACER, *args], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(set(outs)) == 1 and outs[0].endswith("one copy")
    assert (tmp_path / "log").read_text() == "built\n"


_DYING = """
import sys, time
from pathlib import Path
from ddcnn.store import Store
def build(folder):
    (folder / "partial.txt").write_text("half")
    print("building", flush=True)
    time.sleep(60)
Store(Path(sys.argv[1])).get_or_build("dead", {"k": 1}, build)
"""


def test_a_builder_killed_half_way_is_replaced_and_its_leftovers_removed(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _DYING, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    kind_dir = tmp_path / "dead"
    assert [p.name for p in kind_dir.iterdir() if p.name.endswith(".claim")]  # its claim is left behind
    started = time.monotonic()
    entry = Store(tmp_path, stale_after_s=600).get_or_build("dead", {"k": 1}, _writer("whole"))
    # Same machine: the dead pid is noticed at once, without waiting stale_after_s.
    assert time.monotonic() - started < 10
    assert (entry.path / "a.txt").read_text() == "whole" and not (entry.path / "partial.txt").exists()
    assert sorted(p.name for p in kind_dir.iterdir()) == [entry.key]


def test_a_claim_that_stops_being_refreshed_is_taken_over(tmp_path, caplog):
    store = Store(tmp_path, stale_after_s=0.6, poll_s=0.05)
    key = store.key("k", {"a": 1})
    (tmp_path / "k").mkdir()
    claim = tmp_path / "k" / f".{key}.claim"
    # A builder on another node that died: its pid means nothing here, only its silence counts.
    claim.write_text(json.dumps({"token": "t", "host": "node-elsewhere", "pid": 1, "tmp": f".{key}.t.tmp"}))
    (tmp_path / "k" / f".{key}.t.tmp").mkdir()
    started = time.monotonic()
    entry = store.get_or_build("k", {"a": 1}, _writer("late"))
    assert 0.6 <= time.monotonic() - started < 10
    assert (entry.path / "a.txt").read_text() == "late"
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [key]
    assert "stopped refreshing its claim" in caplog.text


def test_a_live_builder_is_waited_for(tmp_path):
    store = Store(tmp_path, stale_after_s=0.5, poll_s=0.05)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom ddcnn.store import Store\n"
        "def build(f):\n    print('claimed', flush=True)\n    time.sleep(2.0)\n    (f / 'a.txt').write_text('theirs')\n"
        "Store(Path(sys.argv[1]), stale_after_s=0.5).get_or_build('k', {'a': 1}, build)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    entry = store.get_or_build("k", {"a": 1}, _writer("mine"))  # waits 2 s: longer than stale_after_s
    assert proc.wait(timeout=30) == 0
    assert (entry.path / "a.txt").read_text() == "theirs"


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    store = Store(tmp_path)

    def broken(folder: Path) -> None:
        (folder / "junk").write_text("x")
        raise RuntimeError("source unreadable")

    with pytest.raises(RuntimeError, match="source unreadable"):
        store.get_or_build("k", {"a": 1}, broken)
    assert list((tmp_path / "k").iterdir()) == []
    assert (store.get_or_build("k", {"a": 1}, _writer("ok")).path / "a.txt").read_text() == "ok"


def test_a_damaged_entry_is_rebuilt(tmp_path, caplog):
    store = Store(tmp_path)
    entry = store.get_or_build("k", {"a": 1}, _writer("first"))
    (entry.path / "sub" / "b.bin").write_bytes(b"cut")
    assert entry.problems() == ["sub/b.bin: 3 bytes, 15 were written"]
    again = store.get_or_build("k", {"a": 1}, _writer("again"))
    assert (again.path / "a.txt").read_text() == "again" and "damaged" in caplog.text


def test_a_second_copy_that_loses_the_race_is_discarded(tmp_path):
    store = Store(tmp_path)
    key = store.key("k", {"a": 1})

    def slow_twin(folder: Path) -> None:
        # Another process (whose claim was broken by mistake) publishes first while this one builds.
        winner = tmp_path / "k" / key
        winner.mkdir()
        (winner / "a.txt").write_text("winner")
        (winner / "entry.json").write_text(json.dumps({"files": {"a.txt": {"bytes": 6, "sha256": "-"}}}))
        (folder / "a.txt").write_text("loser")

    entry = store.get_or_build("k", {"a": 1}, slow_twin)
    assert (entry.path / "a.txt").read_text() == "winner"
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [key]


def test_removing_an_entry_keeps_open_files_readable(tmp_path):
    store = Store(tmp_path)
    entry = store.get_or_build("k", {"a": 1}, _writer("kept"))
    with open(entry.path / "a.txt") as fh:
        store.remove(entry)
        assert fh.read() == "kept"
    assert store.get("k", {"a": 1}) is None and store.entries() == []


def test_staging_copies_once_and_checks_every_byte(tmp_path):
    shared, local = Store(tmp_path / "shared"), tmp_path / "node"
    entry = shared.get_or_build("k", {"a": 1}, _writer("data"))
    copy = shared.stage(entry, local)
    assert copy.path.parent.parent == local and copy.key == entry.key
    assert (copy.path / "sub" / "b.bin").read_bytes() == (entry.path / "sub" / "b.bin").read_bytes()
    assert copy.info["staged_from"] == str(entry.path)
    assert shared.stage(entry, local).path == copy.path  # found, not copied again
    # A file changed after it was written (same size): the copy refuses it.
    other = shared.get_or_build("k", {"a": 2}, _writer("more"))
    (other.path / "a.txt").write_text("MORE")
    with pytest.raises(StoreError, match="differs from the checksum"):
        shared.stage(other, local)


def test_store_command_lists_verifies_and_removes(tmp_path, capsys):
    store = Store(tmp_path)
    entry = store.get_or_build("k", {"a": 1}, _writer("one"))
    root = ["--root", str(tmp_path)]
    assert store_main([*root, "list"]) == 0
    assert f"k/{entry.key}" in capsys.readouterr().out
    assert store_main([*root, "verify"]) == 0
    (entry.path / "a.txt").write_text("two")  # same size, other bytes
    assert store_main([*root, "verify"]) == 1
    assert "sha256 differs" in capsys.readouterr().out
    assert store_main([*root, "remove", entry.key[:6]]) == 0
    assert store.entries() == []
    assert store_main([*root, "remove", "nothing"]) == 1
