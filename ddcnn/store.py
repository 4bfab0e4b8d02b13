"""A content-addressed store of cached artifacts: built once by one process, published atomically, shared by all.

An entry is a folder of files named by a hash of what it depends on (a JSON-able dict: the dataset and its
preprocessing for prepared data; data, model, recipe and seed for a reusable stage result). Many processes may ask
for the same entry at once (P workers, the ``srun`` tasks of a step, the tasks of a SLURM array on several nodes):
one builds it, the others wait and then use it. Layout under the root::

    ROOT/<kind>/<key>/                  a finished entry: its files, entry.json (what it depends on, what the
                                        builder reported, size and sha256 of every file) and SHA256SUMS
    ROOT/<kind>/.<key>.claim            who builds it now: host, pid, a random token; refreshed while it builds
    ROOT/<kind>/.<key>.<token>.tmp/     the entry being built
    ROOT/<kind>/.trash-<key>-<token>/   a removed entry whose files were still open somewhere

**No lock, so it works on NFS and Lustre alike.** ``flock`` is not safe there (NFS ``nolock`` mounts make it a no-op,
Lustre refuses it without ``-o flock``, NFSv3 depends on ``lockd``). The protocol needs only two operations that are
atomic on local disks and on NFS (v3 and later) and Lustre: creating a file with ``O_EXCL`` and renaming a directory
onto a name that does not exist.

1. Correctness comes from the rename: an entry is built in a private ``.tmp`` folder, every file fsynced, its
   ``entry.json`` written, and the folder renamed to ``<key>``. A reader sees a complete entry or none. Two builders
   that both finish: the second rename fails (the target exists) and the second copy is discarded.
2. The claim only saves work: a process that creates ``.<key>.claim`` builds; the others poll for ``<key>``. The
   builder refreshes its claim (touches it) every ``stale_after_s / 4`` seconds from a thread. A waiter that sees a
   claim unchanged for ``stale_after_s`` seconds of its own clock (so clock skew between nodes does not matter), or
   whose process is gone on this machine, breaks it (rename to a unique name, check that it took the stale one) and
   builds itself. Should two waiters ever race there, the worst case is one entry built twice, never a torn one.

Removing an entry renames it away first, so a process that has its files open or memory-mapped keeps reading them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddcnn.io import ArtifactWriteError, atomic_write_json, atomic_write_text, make_dir, write_error

log = logging.getLogger(__name__)

__all__ = [
    "STORE_ENV",
    "STORE_FORMAT",
    "Entry",
    "Store",
    "StoreError",
    "default_root",
    "free_bytes",
    "store_main",
]

STORE_ENV = "DDCNN_STORE"
STORE_FORMAT = 1
ENTRY_FILE = "entry.json"
SUMS_FILE = "SHA256SUMS"
_CHUNK = 16 << 20  # bytes per read when hashing or copying


class StoreError(RuntimeError):
    """An entry cannot be built, found or used; the message says which and what to do."""


def default_root(configured: str | os.PathLike[str] | None = None) -> Path:
    """The store's root: ``configured`` (the ``store.root`` setting), else ``$DDCNN_STORE``, else ``~/.cache/ddcnn``
    (``$XDG_CACHE_HOME/ddcnn`` when that is set)."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "ddcnn"


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free space of the file system that holds ``path`` (or would hold it: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return shutil.disk_usage(path).free


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


_HOST = socket.gethostname()
_BOOT = _boot_id()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened for fsync
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _files(folder: Path) -> list[str]:
    """Relative paths of the regular files under ``folder`` (the entry's own records excluded), sorted."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).as_posix() not in (ENTRY_FILE, SUMS_FILE)
    )


@dataclass(frozen=True)
class Entry:
    """A finished entry of a :class:`Store`.

    Attributes:
        kind: Its kind (a folder of the store, e.g. ``prepared``).
        key: The hash of what it depends on (its folder name).
        path: Its folder.
        record: The content of its ``entry.json``: ``depends``, ``info`` (what the builder reported), ``files``
            (``{name: {"bytes", "sha256"}}``), ``created``, ``host``, ``pid``, ``build_s``.
    """

    kind: str
    key: str
    path: Path
    record: dict = field(repr=False)

    @property
    def depends(self) -> dict:
        """What the entry depends on (the settings it was built for)."""
        return self.record.get("depends", {})

    @property
    def info(self) -> dict:
        """What its builder reported."""
        return self.record.get("info", {})

    @property
    def files(self) -> dict[str, dict]:
        return self.record.get("files", {})

    @property
    def nbytes(self) -> int:
        """Total size of its files."""
        return sum(int(f["bytes"]) for f in self.files.values())

    def file(self, name: str) -> Path:
        """The path of one of its files."""
        return self.path / name

    def problems(self, checksums: bool = False) -> list[str]:
        """What is wrong with the files on disk (missing, another size; with ``checksums``, another sha256)."""
        out = []
        for name, meta in self.files.items():
            path = self.path / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                out.append(f"{name}: missing")
                continue
            if size != int(meta["bytes"]):
                out.append(f"{name}: {size} bytes, {meta['bytes']} were written")
            elif checksums and _sha256(path) != meta["sha256"]:
                out.append(f"{name}: sha256 differs from the one recorded when it was written")
        return out

    def copy_to(self, folder: str | os.PathLike[str], exclude: tuple[str, ...] = ()) -> None:
        """Copy its files (but ``exclude``) into ``folder``, each checked against its recorded sha256 while it is
        copied and renamed into place whole (a reader sees the old file or the new one, never a part).

        Raises:
            StoreError: A file differs from the checksum recorded when it was written.
        """
        folder = Path(folder)
        for rel, meta in self.files.items():
            if rel in exclude:
                continue
            dst = folder / rel
            make_dir(dst.parent)
            tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                _copy_checked(self.path / rel, tmp, meta["sha256"], self)
                os.replace(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)

    def describe(self) -> str:
        created = self.record.get("created", "?")
        return f"{self.kind}/{self.key} ({self.nbytes / 1e6:.1f} MB, built {created} on {self.record.get('host', '?')})"


class _Claim:
    """``.<key>.claim``: this process builds the entry; refreshed from a thread until released."""

    def __init__(self, path: Path, tmp: Path, token: str, refresh_s: float) -> None:
        self.path, self.tmp, self.token = path, tmp, token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, args=(refresh_s,), daemon=True, name="ddcnn-store-claim")

    @classmethod
    def take(cls, path: Path, refresh_s: float) -> _Claim | None:
        """Create the claim file (``O_EXCL``), or ``None`` when another process holds it."""
        token = uuid.uuid4().hex[:16]
        tmp = path.parent / f"{path.name[: -len('.claim')]}.{token}.tmp"
        body = {
            "token": token,
            "host": _HOST,
            "boot_id": _BOOT,
            "pid": os.getpid(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "tmp": tmp.name,
        }
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        try:
            os.write(fd, json.dumps(body).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        claim = cls(path, tmp, token, refresh_s)
        claim._thread.start()
        return claim

    def _refresh(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        seen = _read_claim(self.path)
        if seen is not None and seen[0].get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def _read_claim(path: Path) -> tuple[dict, int] | None:
    """The claim's content and modification time, or ``None`` when there is none. Opening the file makes an NFS
    client revalidate its attributes (close-to-open consistency), so the time is the server's current one."""
    try:
        with open(path, "rb") as fh:
            mtime = os.fstat(fh.fileno()).st_mtime_ns
            text = fh.read()
    except FileNotFoundError:
        return None
    try:
        body = json.loads(text) if text else {}
    except ValueError:
        body = {}
    return (body if isinstance(body, dict) else {}), mtime


def _dead_here(body: Mapping) -> bool:
    """Whether the claim's process ran on this machine and is gone (no need to wait for its refreshes to stop)."""
    if body.get("host") != _HOST or body.get("boot_id") != _BOOT or not body.get("pid"):
        return False
    try:
        os.kill(int(body["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError, ValueError):
        return False
    return False


class Store:
    """Content-addressed entries under ``root`` (see the module docstring for the protocol).

    Args:
        root: The store's folder (:func:`default_root` resolves the setting and the environment).
        stale_after_s: A builder's claim not refreshed for this long is taken for a dead process's.
        poll_s: How often a waiting process looks for the entry.
    """

    def __init__(self, root: str | os.PathLike[str], stale_after_s: float = 120.0, poll_s: float = 0.5) -> None:
        if float(stale_after_s) <= 0:
            raise ValueError(f"store.stale_after_s must be a positive number of seconds, got {stale_after_s!r}.")
        self.root = Path(root).expanduser()
        self.stale_after_s = float(stale_after_s)
        self.poll_s = float(poll_s)

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # --- addressing ---------------------------------------------------------------------------------------------
    @staticmethod
    def key(kind: str, depends: Mapping[str, Any]) -> str:
        """The hash that names the entry of ``kind`` built for ``depends`` (JSON, keys sorted)."""
        text = json.dumps({"kind": kind, "depends": depends}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def entry_dir(self, kind: str, key: str) -> Path:
        if not kind or "/" in kind or kind.startswith("."):
            raise ValueError(f"store kind must be a plain folder name, got {kind!r}.")
        return self.root / kind / key

    # --- reading ------------------------------------------------------------------------------------------------
    def open(self, kind: str, key: str) -> Entry | None:
        """The finished entry ``kind/key``, or ``None``."""
        folder = self.entry_dir(kind, key)
        try:
            record = json.loads((folder / ENTRY_FILE).read_text())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except ValueError:  # damaged from outside (a copy cut short): treat as absent, it is rebuilt
            return None
        return Entry(kind, key, folder, record)

    def get(self, kind: str, depends: Mapping[str, Any]) -> Entry | None:
        """The finished entry built for ``depends``, or ``None`` (nothing is built)."""
        return self.open(kind, self.key(kind, depends))

    def entries(self, kind: str | None = None) -> list[Entry]:
        """Every finished entry (of ``kind``), oldest first."""
        kinds = [kind] if kind else sorted(p.name for p in self.root.glob("*") if p.is_dir() and p.name[0] != ".")
        out = []
        for k in kinds:
            for folder in sorted((self.root / k).glob("*")):
                if folder.is_dir() and not folder.name.startswith(".") and (entry := self.open(k, folder.name)):
                    out.append(entry)
        return sorted(out, key=lambda e: float(e.record.get("created_unix", 0.0)))

    # --- building -----------------------------------------------------------------------------------------------
    def get_or_build(
        self,
        kind: str,
        depends: Mapping[str, Any],
        build: Callable[[Path], Mapping[str, Any] | None],
        describe: str | None = None,
        timeout_s: float | None = None,
        log_every_s: float = 30.0,
    ) -> Entry:
        """The entry built for ``depends``: found, built here, or built by another process while this one waits.

        Args:
            kind: The kind of entry (its folder in the store).
            depends: Everything the entry depends on (JSON-able); its hash names the entry, and it is recorded in
                ``entry.json``.
            build: ``build(folder)`` writes the entry's files into ``folder`` (empty, private to this process) and
                may return a dict recorded as the entry's ``info``; a ``"_sha256": {name: hexdigest}`` item in it
                gives checksums it computed while writing (the store computes the others).
            describe: How log lines and errors name the entry (default ``kind/key``).
            timeout_s: Give up waiting for another builder after this long (``None``: wait as long as it lives).
            log_every_s: While waiting, say so this often.

        Raises:
            StoreError: The store cannot be written, or ``timeout_s`` passed.
        """
        key = self.key(kind, depends)
        name = describe or f"{kind}/{key}"
        folder = self.entry_dir(kind, key)
        claim_path = folder.parent / f".{key}.claim"
        started = time.monotonic()
        watched: tuple[str, int] | None = None
        unchanged_since = time.monotonic()
        said = 0.0
        while True:
            entry = self.open(kind, key)
            if entry is not None:
                problems = entry.problems()
                if not problems:
                    return entry
                log.warning("store entry %s is damaged (%s); it is removed and built again", name, "; ".join(problems))
                self.remove(entry)
                continue
            self._make_kind_dir(folder.parent)
            claim = _Claim.take(claim_path, refresh_s=max(0.05, self.stale_after_s / 4))
            if claim is not None:
                try:
                    if self.open(kind, key) is not None:  # published between our look and our claim
                        continue
                    return self._build(kind, key, depends, build, claim, name)
                finally:
                    claim.release()
            # Another process builds it: wait, and take over if it stopped refreshing its claim.
            seen = _read_claim(claim_path)
            now = time.monotonic()
            if seen is None:
                continue
            body, mtime = seen
            if watched != (body.get("token", ""), mtime):
                watched, unchanged_since = (body.get("token", ""), mtime), now
            if _dead_here(body) or now - unchanged_since > self.stale_after_s:
                self._break(claim_path, body, name)
                watched = None
                continue
            if timeout_s is not None and now - started > timeout_s:
                raise StoreError(
                    f"gave up after {timeout_s:.0f} s waiting for {_holder(body)} to build {name} in {self.root}; "
                    f"it is still working. Wait for it, or stop it and run again."
                )
            if now - said >= log_every_s:
                log.info("%s: waiting for %s, which builds it (%s)", name, _holder(body), claim_path)
                said = now
            time.sleep(self.poll_s)

    def _make_kind_dir(self, path: Path) -> None:
        try:
            make_dir(path)
        except OSError as err:
            raise StoreError(
                f"cannot create the store folder {path} ({err.strerror or err}); set store.root (or the environment "
                f"variable {STORE_ENV}) to a writable folder, on a file system that every node of your cluster sees."
            ) from err

    def _break(self, claim_path: Path, body: Mapping, name: str) -> None:
        """Remove a dead builder's claim (only the one observed) and its half-built folder."""
        victim = claim_path.with_name(f"{claim_path.name}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(claim_path, victim)
        except FileNotFoundError:
            return  # another waiter broke it first
        taken = _read_claim(victim)
        if taken is not None and taken[0].get("token") != body.get("token"):
            # We took a fresh claim that replaced the stale one meanwhile: put it back unless yet another exists.
            with contextlib.suppress(OSError):
                os.link(victim, claim_path)
            with contextlib.suppress(FileNotFoundError):
                victim.unlink()
            return
        with contextlib.suppress(FileNotFoundError):
            victim.unlink()
        if body.get("tmp"):
            shutil.rmtree(claim_path.parent / str(body["tmp"]), ignore_errors=True)
        log.warning("%s: %s stopped refreshing its claim (it died?); this process builds it now", name, _holder(body))

    def _build(self, kind: str, key: str, depends: Mapping, build: Callable, claim: _Claim, name: str) -> Entry:
        tmp, folder = claim.tmp, self.entry_dir(kind, key)
        started = time.perf_counter()
        try:
            make_dir(tmp)
            info = dict(build(tmp) or {})
            known = dict(info.pop("_sha256", {}) or {})
            files = {}
            for rel in _files(tmp):
                path = tmp / rel
                with open(path, "rb+") as fh:  # fsync: a published entry must survive a power loss whole
                    os.fsync(fh.fileno())
                files[rel] = {"bytes": path.stat().st_size, "sha256": known.get(rel) or _sha256(path)}
            import ddcnn

            record = {
                "store_format": STORE_FORMAT,
                "kind": kind,
                "key": key,
                "depends": json.loads(json.dumps(depends, default=str)),
                "info": info,
                "files": files,
                "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "created_unix": time.time(),
                "host": _HOST,
                "pid": os.getpid(),
                "build_s": round(time.perf_counter() - started, 3),
                "ddcnn_version": ddcnn.__version__,
            }
            atomic_write_text(tmp / SUMS_FILE, "".join(f"{m['sha256']}  {rel}\n" for rel, m in files.items()))
            atomic_write_json(tmp / ENTRY_FILE, record)
            _fsync_dir(tmp)
            try:
                os.rename(tmp, folder)
            except OSError as err:
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another process published it first: use theirs
                log.info("%s: another process published it first; using that copy", name)
            _fsync_dir(folder.parent)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(err, OSError) and not isinstance(err, ArtifactWriteError):
                raised = write_error(tmp, err)
                if raised is not err:
                    raise StoreError(
                        f"cannot write {name} into the store {self.root}: {raised}. Free space there, or set "
                        f"store.root (or {STORE_ENV}) to another file system."
                    ) from err
            raise
        entry = self.open(kind, key)
        if entry is None:
            raise StoreError(f"{name} was published to {folder} but cannot be read back; check that folder.")
        log.info("%s: built in %.1f s, %s", name, time.perf_counter() - started, entry.path)
        return entry

    # --- housekeeping -------------------------------------------------------------------------------------------
    def remove(self, entry: Entry) -> None:
        """Remove an entry; processes that have its files open or mapped keep reading them."""
        trash = entry.path.parent / f".trash-{entry.key}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry.path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)  # an NFS client keeps open files as .nfs*: cleaned later

    def clean(self) -> list[Path]:
        """Remove what dead builders and removals left behind (half-built folders without a live claim, trash)."""
        removed = []
        for kind_dir in (p for p in self.root.glob("*") if p.is_dir()):
            claims = {}
            for claim in kind_dir.glob(".*.claim"):
                seen = _read_claim(claim)
                if seen is not None and not _dead_here(seen[0]):
                    claims[str(seen[0].get("tmp"))] = seen[1]
            for path in kind_dir.glob(".*"):
                stale_tmp = path.name.endswith(".tmp") and path.name not in claims
                if path.is_dir() and (stale_tmp or path.name.startswith(".trash-")):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    # --- node-local copies --------------------------------------------------------------------------------------
    def stage(self, entry: Entry, to: str | os.PathLike[str]) -> Entry:
        """A copy of ``entry`` in the store at ``to`` (node-local disk, e.g. ``$TMPDIR``), made once per node.

        Every file's sha256 is checked while it is copied. The copy is an entry of the store at ``to`` with the same
        key, made under the same protocol: the processes of one node copy it once.

        Raises:
            StoreError: ``to`` has too little space, or a copied file differs from the recorded checksum.
        """
        local = Store(to, self.stale_after_s, self.poll_s)
        if local.root.resolve() == self.root.resolve():
            return entry

        def copy(folder: Path) -> dict:
            free = free_bytes(folder)
            if free < entry.nbytes:
                raise StoreError(
                    f"store.stage_to={local.root} has {free / 1e9:.2f} GB free, but {entry.describe()} needs "
                    f"{entry.nbytes / 1e9:.2f} GB; point store.stage_to at a larger node-local disk, or set it to null "
                    f"to read the entry where it is ({entry.path})."
                )
            sums = {}
            for rel, meta in entry.files.items():
                dst = folder / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                _copy_checked(entry.path / rel, dst, meta["sha256"], entry)
                sums[rel] = meta["sha256"]
            return {**entry.info, "staged_from": str(entry.path), "_sha256": sums}

        return local.get_or_build(entry.kind, entry.depends, copy, describe=f"copy of {entry.kind}/{entry.key}")


def _copy_checked(src: Path, dst: Path, sha256: str, entry: Entry) -> None:
    """Copy ``src`` to the new file ``dst``, checking its sha256 on the way."""
    digest = hashlib.sha256()
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        while block := fin.read(_CHUNK):
            digest.update(block)
            fout.write(block)
    if digest.hexdigest() != sha256:
        raise StoreError(
            f"{src} differs from the checksum recorded when it was written (a damaged or changed file); "
            f"remove the entry ({entry.path}) so that it is built again."
        )


def _holder(body: Mapping) -> str:
    return f"pid {body.get('pid', '?')} on {body.get('host', '?')} (since {body.get('since', '?')})"


def store_main(argv: list[str] | None = None) -> int:
    """``ddcnn-store``: list, check, remove and clean the entries of the store."""
    import argparse

    parser = argparse.ArgumentParser(prog="ddcnn-store", description=store_main.__doc__)
    parser.add_argument("--root", help=f"the store (default: ${STORE_ENV}, else ~/.cache/ddcnn)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per entry: kind/key, size, date, what it holds")
    sub.add_parser("path", help="print the store's folder")
    check = sub.add_parser("verify", help="check every file of the entries against its recorded sha256")
    check.add_argument("keys", nargs="*", help="kind/key or key prefixes (default: all)")
    rm = sub.add_parser("remove", help="remove entries (processes that use them keep their open files)")
    rm.add_argument("keys", nargs="+", help="kind/key or key prefixes, or 'all'")
    sub.add_parser("clean", help="remove what dead builders left behind")
    args = parser.parse_args(argv)
    store = Store(default_root(args.root))
    if args.command == "path":
        print(store.root)
        return 0
    if args.command == "clean":
        for path in store.clean():
            print(f"removed {path}")
        return 0
    entries = store.entries()
    if args.command == "list":
        for e in entries:
            what = e.info.get("describe") or ""
            print(f"{e.kind}/{e.key}  {e.nbytes / 1e6:10.1f} MB  {e.record.get('created', '?')}  {what}")
        if not entries:
            print(f"(no entries in {store.root})")
        return 0
    wanted = getattr(args, "keys", []) or []
    if wanted and wanted != ["all"]:
        entries = [e for e in entries if any(f"{e.kind}/{e.key}".startswith(w) or e.key.startswith(w) for w in wanted)]
        if not entries:
            print(f"no entry of {store.root} matches {wanted}")
            return 1
    if args.command == "verify":
        bad = 0
        for e in entries:
            problems = e.problems(checksums=True)
            print(f"{e.kind}/{e.key}: " + ("ok" if not problems else "; ".join(problems)))
            bad += bool(problems)
        return 1 if bad else 0
    for e in entries:  # remove
        store.remove(e)
        print(f"removed {e.kind}/{e.key}")
    return 0
