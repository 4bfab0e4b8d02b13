"""The one atomic writer of ddcnn: every artifact (run directory, NIfTI cache, converted data) goes through it.

A file is written to a hidden temporary name beside its target (``.<name>.<pid>-<random>.tmp``), flushed and
fsynced, then renamed onto the target, so a reader (or a process killed half way) sees either the old file or the
new one, never a part of one. Files are created with ``open(..., "xb")`` and so follow the umask like any other
file (``tempfile.mkstemp`` would make them private, mode 0600, which is awkward on the shared file systems of a
cluster).

Only errors that the user can fix by freeing space or choosing another location (``ENOSPC``, ``EDQUOT``,
``EROFS``, ``EACCES``) become :class:`ArtifactWriteError` with that advice; any other ``OSError`` is
raised as it is.

The one reader of the run directory's torch files is :func:`load_run_file`: ``torch.load(weights_only=True)``, so a run
directory received from someone else runs none of the code a pickle can hold; ddcnn writes tensors and plain types only.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "disk_errors",
    "ArtifactWriteError",
    "SPACE_OR_PERMISSION",
    "is_space_or_permission",
    "write_error",
    "atomic_open",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_torch_save",
    "make_dir",
    "TRUST_RUN_FILES",
    "UntrustedRunFile",
    "load_run_file",
]

# The errors a user fixes by freeing space or writing elsewhere; only these get that advice.
SPACE_OR_PERMISSION = frozenset(
    code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS, errno.EACCES) if code
)


# Set to 1, :func:`load_run_file` reads any pickle (``weights_only=False``): the opt-in for a file one trusts.
TRUST_RUN_FILES = "DDCNN_TRUST_RUN_FILES"


class ArtifactWriteError(OSError):
    """An artifact could not be written: disk full, quota exceeded, read-only or forbidden location."""


def is_space_or_permission(err: BaseException) -> bool:
    """Whether ``err`` is an ``OSError`` that freeing space or choosing a writable location would fix."""
    return isinstance(err, OSError) and err.errno in SPACE_OR_PERMISSION


def write_error(path: Path, err: OSError) -> OSError:
    """``err`` as an :class:`ArtifactWriteError` that names ``path`` and the fix, or ``err`` itself if it is another."""
    if isinstance(err, ArtifactWriteError) or not is_space_or_permission(err):
        return err
    return ArtifactWriteError(
        err.errno,
        f"cannot write {path}: {err.strerror or err}. Nothing half-written was left behind; free disk space or "
        f"choose a writable run directory (hydra.run.dir=...), then run the same command again to continue.",
    )


@contextlib.contextmanager
def disk_errors(what: str) -> Iterator[None]:
    """A full or unwritable disk met by ``what`` (``training in RUN_DIR/local/03``) as an :class:`ArtifactWriteError`
    that says what to do."""
    try:
        yield
    except OSError as err:
        if isinstance(err, ArtifactWriteError) or not is_space_or_permission(err):
            raise
        raise ArtifactWriteError(
            err.errno,
            f"{what} stopped: {err}. Free disk space or choose a writable run directory, then run the same command "
            f"again: it resumes from the last checkpoint.",
        ) from err


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], fsync: bool = True) -> Iterator[IO[bytes]]:
    """A binary file handle whose content replaces ``path`` only once the ``with`` block finished without error.

    Args:
        path: The target file; its folder is created.
        fsync: Flush the data to the device before the rename (a power loss then keeps old or new, not empty).
    """
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "xb") as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raised = write_error(path, err)
        if raised is err:
            raise
        raise raised from err
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes | memoryview, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    with atomic_open(path, fsync=fsync) as fh:
        fh.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", fsync=fsync)


def atomic_torch_save(obj: Any, path: str | os.PathLike[str], fsync: bool = True) -> None:
    """``torch.save`` through the atomic writer.

    The object is serialised in memory first: torch's zip writer reports a full disk as an obscure
    ``RuntimeError``, a plain file write as ``OSError(ENOSPC)``.
    """
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(path, buffer.getbuffer(), fsync=fsync)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any], fsync: bool = True) -> None:
    """Call ``write(fh)`` on a temporary file that then replaces ``path``."""
    with atomic_open(path, fsync=fsync) as fh:
        write(fh)


def make_dir(path: str | os.PathLike[str]) -> Path:
    """``mkdir -p`` that reports a full or unwritable location as :class:`ArtifactWriteError`."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raised = write_error(path, err)
        if raised is err:
            raise
        raise raised from err
    return path


class UntrustedRunFile(ValueError):
    """A run-directory file holds Python objects besides tensors and plain types: ``torch.load(weights_only=True)``
    refused it. The message names the file, what it holds and the fix."""


def load_run_file(path: str | os.PathLike[str], map_location: Any = None) -> Any:
    """A torch file of a run directory (a checkpoint, ``net.pt``, a fold's ``done.pt``) read with
    ``torch.load(weights_only=True)``: tensors, containers and plain Python types, never code.

    Args:
        path: The file.
        map_location: Where its tensors go, as ``torch.load`` takes it (``"cpu"``; ``None``: where they were saved).

    Raises:
        UntrustedRunFile: The file holds other Python objects (a file of another tool, an older ddcnn's, or one made
            to run code when read); read only with :data:`TRUST_RUN_FILES` ``=1``, which trusts whoever wrote it.
    """
    import pickle

    import torch

    trusted = os.environ.get(TRUST_RUN_FILES) == "1"
    try:
        return torch.load(path, map_location=map_location, weights_only=not trusted)
    except pickle.UnpicklingError as err:
        if trusted:
            raise
        named = re.search(r"GLOBAL ([\w.]+)", str(err))  # torch names the first object it refused
        found = f" (such as {named.group(1)})" if named else ""
        raise UntrustedRunFile(
            f"{path} holds Python objects besides tensors and plain types{found}; torch.load(weights_only=True) "
            f"refused it, since reading it could run code. If an older ddcnn wrote it, delete it and run the same "
            f"command again (what it held is trained again); if you trust whoever made it, run with "
            f"{TRUST_RUN_FILES}=1 to read it as a plain pickle."
        ) from err
