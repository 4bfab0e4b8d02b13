"""Arrays of samples read lazily, in ascending order, without ever holding the whole array in memory.

A source of a large dataset (a study of CT volumes) returns :class:`Rows` instead of numpy arrays when asked with
``lazy=True``; :mod:`ddcnn.data.prepare` then reads them a few megabytes at a time while it writes the prepared,
compact copy (in memory or into the store). Three kinds:

- :class:`ArrayRows`: an array already in memory (or a ``np.memmap``);
- :class:`FileRangeRows`: rows at a known place of a file (an ``.npz`` member stored uncompressed), read in place
  with ``pread``: the pages pass through the page cache, not through this process's memory as a mapping's would;
- :class:`NpzStreamRows`: a compressed ``.npz`` member, decompressed as a stream (forward seeks only);
- :class:`FileRows`: one file per sample (NIfTI volumes), read through a loader function.

Every kind can be turned into a numpy array (``np.asarray(rows)``) for code that wants one; that reads everything.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

__all__ = ["Rows", "ArrayRows", "FileRangeRows", "NpzStreamRows", "FileRows", "npz_member", "channel_axis_fix"]

Fix = Callable[[np.ndarray], np.ndarray]


class Rows:
    """Samples ``(n, *row_shape)`` of one dtype, read by ascending lists of row indices.

    Attributes:
        shape: ``(n, *row_shape)``.
        dtype: The element type of the rows read.
        name: What the rows are (named in error messages).
    """

    def __init__(self, shape: Sequence[int], dtype: np.dtype, name: str = "array") -> None:
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.name = name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.row_bytes * len(self)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, rows: np.ndarray) -> np.ndarray:
        """The rows ``rows`` (ascending row indices) as one array ``(len(rows), *row_shape)``."""
        raise NotImplementedError

    def chunks(self, rows: np.ndarray, max_bytes: int = 16 << 20) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """``(row_indices, array)`` pieces of at most about ``max_bytes`` that cover ``rows`` (ascending) in order."""
        rows = np.asarray(rows, dtype=np.int64)
        step = max(1, int(max_bytes) // max(self.row_bytes, 1))
        for start in range(0, len(rows), step):
            part = rows[start : start + step]
            yield part, self.read(part)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.read(np.arange(len(self)))
        return out if dtype is None else out.astype(dtype, copy=False)

    def __getitem__(self, index):
        rest: tuple = ()
        if isinstance(index, tuple):
            index, rest = index[0], index[1:]
        if isinstance(index, int | np.integer):
            out = self.read(np.asarray([int(index) % len(self)]))[0]
        else:
            picked = np.arange(len(self))[index]
            order = np.argsort(picked, kind="stable")
            data = self.read(picked[order])
            out = np.empty_like(data)
            out[order] = data
        return out[rest] if rest else out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, shape={self.shape}, dtype={self.dtype})"


class ArrayRows(Rows):
    """Rows of an in-memory array or a ``np.memmap`` (only the rows read are touched), with an optional ``fix``
    applied to every piece read (e.g. moving a channel axis)."""

    def __init__(self, array: np.ndarray, fix: Fix | None = None, shape: Sequence[int] | None = None, name="array"):
        super().__init__(shape if shape is not None else array.shape, array.dtype, name)
        self.array, self.fix = array, fix

    def read(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):  # a contiguous run: a slice, no index array
            out = np.asarray(self.array[int(rows[0]) : int(rows[-1]) + 1])
        else:
            out = np.asarray(self.array[rows])
        return self.fix(out) if self.fix is not None else out


def _runs(rows: np.ndarray) -> list[np.ndarray]:
    """``rows`` (ascending) cut into runs of consecutive indices."""
    return np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1) if len(rows) else []


class FileRangeRows(Rows):
    """Rows stored C-contiguous from byte ``offset`` of a file, read with ``np.fromfile`` (one read per run)."""

    def __init__(self, path: Path, offset: int, src_shape, dtype, fix: Fix | None, shape, name: str) -> None:
        super().__init__(shape, dtype, name)
        self.path, self.offset, self.fix = Path(path), int(offset), fix
        self.src_row_shape = tuple(int(s) for s in src_shape[1:])

    def read(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        count = int(np.prod(self.src_row_shape, dtype=np.int64))
        out = np.empty((len(rows), *self.src_row_shape), dtype=self.dtype)
        k = 0
        for run in _runs(rows):
            at = self.offset + int(run[0]) * count * self.dtype.itemsize
            data = np.fromfile(self.path, dtype=self.dtype, count=len(run) * count, offset=at)
            if data.size != len(run) * count:
                raise ValueError(f"{self.path}: {self.name} ends early; the archive is truncated or corrupt.")
            out[k : k + len(run)] = data.reshape(len(run), *self.src_row_shape)
            k += len(run)
        return self.fix(out) if self.fix is not None else out


class NpzStreamRows(Rows):
    """Rows of a compressed ``.npz`` member, decompressed as a stream: reading rows in ascending order decompresses
    the member once; going back restarts it."""

    def __init__(self, path: Path, member: str, offset: int, shape, dtype, fix: Fix | None, src_shape, name: str):
        super().__init__(shape, dtype, name)
        self.path, self.member, self.offset, self.fix = Path(path), member, int(offset), fix
        self.src_row_shape = tuple(src_shape[1:])
        self._zip: zipfile.ZipFile | None = None
        self._stream = None

    def _open(self):
        if self._stream is None:
            self._zip = zipfile.ZipFile(self.path)
            self._stream = self._zip.open(self.member)
        return self._stream

    def read(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        stream = self._open()
        row_bytes = int(np.prod(self.src_row_shape, dtype=np.int64)) * self.dtype.itemsize
        out = np.empty((len(rows), *self.src_row_shape), dtype=self.dtype)
        k = 0
        for run in _runs(rows):  # each run of consecutive rows is one read
            stream.seek(self.offset + int(run[0]) * row_bytes)
            data = stream.read(len(run) * row_bytes)
            if len(data) != len(run) * row_bytes:
                raise ValueError(f"{self.path}: member {self.member} ends early; the archive is truncated or corrupt.")
            out[k : k + len(run)] = np.frombuffer(data, dtype=self.dtype).reshape(len(run), *self.src_row_shape)
            k += len(run)
        return self.fix(out) if self.fix is not None else out

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_zip"] = state["_stream"] = None
        return state


class FileRows(Rows):
    """One file per row, read through ``load(path) -> array`` (every row must have ``shape[1:]``)."""

    def __init__(self, paths: Sequence[Path], load: Callable[[Path], np.ndarray], row_shape, dtype, name: str):
        super().__init__((len(paths), *row_shape), dtype, name)
        self.paths, self.load = list(paths), load

    def select(self, rows: Sequence[int]) -> FileRows:
        return FileRows([self.paths[int(i)] for i in rows], self.load, self.shape[1:], self.dtype, self.name)

    def read(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), *self.shape[1:]), dtype=self.dtype)
        for k, i in enumerate(np.asarray(rows, dtype=np.int64)):
            volume = self.load(self.paths[int(i)])
            if volume.shape != out.shape[1:]:
                raise ValueError(
                    f"{self.paths[int(i)]}: mismatched volume shapes, {volume.shape} here but {out.shape[1:]} in "
                    f"{self.paths[0]}. Set target_shape so that every volume is resized to one shape."
                )
            out[k] = volume
        return out


def channel_axis_fix(shape: Sequence[int], spatial_dims: int, source: str) -> tuple[tuple[int, ...], Fix | None]:
    """The channels-first shape of ``shape`` and the function that makes a piece of it so (``None``: already is).

    ``(n, *spatial)`` gains a channel axis; channel-last colour images ``(n, H, W, 3)`` have it moved first.

    Raises:
        ValueError: ``shape`` has the wrong number of axes for ``spatial_dims``.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == spatial_dims + 1:
        return (shape[0], 1, *shape[1:]), _add_channel_axis
    if len(shape) == spatial_dims + 2:
        if shape[-1] in (1, 3, 4) and shape[1] not in (1, 3, 4):
            return (shape[0], shape[-1], *shape[1:-1]), _channels_first
        return shape, None
    raise ValueError(
        f"{source}: images of shape {shape[1:]} do not fit spatial_dims={spatial_dims}; expected "
        f"(n, *spatial) or (n, C, *spatial) with {spatial_dims} spatial axes. Set data.spatial_dims to match."
    )


def _add_channel_axis(x: np.ndarray) -> np.ndarray:
    return x[:, None]


def _channels_first(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, -1, 1)


def npz_member(path: Path, key: str, spatial_dims: int | None = None) -> Rows | None:
    """Array ``key`` of the ``.npz`` archive ``path`` as lazy rows (channels first when ``spatial_dims`` is given), or
    ``None`` when it cannot be read lazily (Fortran order, object arrays, an unusual header): load it then.

    A member stored uncompressed (``np.savez``) is read in place; a compressed one (``np.savez_compressed``) is
    decompressed as a stream.
    """
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{key}.npy")
        with zf.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                src_shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                src_shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                return None
            offset = fh.tell()
        if fortran or dtype.hasobject or len(src_shape) < 1:
            return None
        encrypted = bool(info.flag_bits & 0x1)
        if info.compress_type == zipfile.ZIP_STORED and not encrypted:
            with open(path, "rb") as raw:
                raw.seek(info.header_offset)
                header = raw.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            start = info.header_offset + 30 + name_len + extra_len + offset
        else:
            start = None
    name = f"{path}:{key}"
    shape, fix = (tuple(src_shape), None) if spatial_dims is None else channel_axis_fix(src_shape, spatial_dims, name)
    if start is not None:
        return FileRangeRows(path, start, src_shape, dtype, fix, shape, name)
    return NpzStreamRows(path, f"{key}.npy", offset, shape, dtype, fix, src_shape, name)
