"""Where the arrays come from: sklearn digits, ``.npz`` archives, torchvision on-disk formats, image folders.

Every source returns a :class:`Splits` of numpy arrays with a channel axis, ``x`` of shape
``(n, C, *spatial)`` and integer labels ``y`` of shape ``(n,)``. Nothing here downloads: a missing
dataset gets an error saying where to put the files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddcnn.data.arrays import FileRows, Rows, channel_axis_fix, npz_member
from ddcnn.data.splits import stratified_split

__all__ = [
    "Splits",
    "digits",
    "npz",
    "torchvision_dataset",
    "image_folder",
    "nifti",
    "dicom",
    "stratified_split",
    "source_identity",
    "NOT_IDENTITY",
]


@dataclass
class Splits:
    """Train/test (and optional validation) arrays of one dataset.

    Attributes:
        x_train: ``(n, C, *spatial)`` images, ``uint8`` (0..255), other integers or floating point: a numpy array,
            or :class:`~ddcnn.data.arrays.Rows` read lazily (sources called with ``lazy=True``).
        y_train: ``(n,)`` integer labels in ``[0, num_classes)``.
        x_test, y_test: The test split.
        x_val, y_val: An official validation split, or ``None`` (the datamodule carves one from train).
        class_names: Names of the classes, index = label.
        name: Short dataset name for reports.
        classes_listed: ``class_names`` lists every class (class folders): a declared ``data.num_classes`` must
            equal their number. Otherwise they may be made up from the labels seen.
        report: What the source found while reading (files ignored or skipped, duplicates), JSON-ready; kept with
            the prepared data and written to ``results.json``.
        groups: ``{"train": ..., "test": ..., "val": ...}`` an integer group per sample (a patient) that every split
            drawn from these samples keeps together, or ``None`` (every sample on its own).
        files: ``{"train": [...], "test": [...], "val": [...]}`` the file (or study folder) of each sample as the user
            gave it, or ``None`` for a source without files (arrays): ``RUN_DIR/splits.csv`` names each sample by it.
    """

    x_train: np.ndarray | Rows
    y_train: np.ndarray
    x_test: np.ndarray | Rows
    y_test: np.ndarray
    x_val: np.ndarray | Rows | None = None
    y_val: np.ndarray | None = None
    class_names: list[str] = field(default_factory=list)
    name: str = "data"
    classes_listed: bool = False
    report: dict = field(default_factory=dict)
    groups: dict[str, np.ndarray] | None = None
    files: dict[str, list[str]] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.x_train.shape[2:])


def _with_channel_axis(x: np.ndarray, spatial_dims: int, source: str) -> np.ndarray:
    # Channel-last colour images (n, H, W, 3) are the common archive layout; channels move first.
    _, fix = channel_axis_fix(x.shape, spatial_dims, source)
    return fix(x) if fix is not None else x


def _labels(y: np.ndarray, source: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"{source}: labels must be a vector of class indices, got shape {y.shape}.")
    if not np.issubdtype(y.dtype, np.integer):
        if np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0):
            y = y.astype(np.int64)
        else:
            raise ValueError(f"{source}: labels must be integer class indices, got dtype {y.dtype}.")
    return y.astype(np.int64)


def digits(test_fraction: float = 0.2, seed: int = 0) -> Splits:
    """scikit-learn's bundled handwritten digits (1797 images of 8x8, 10 classes), split stratified.

    Pixel values are 0..16 in the original and are rescaled to 0..255 ``uint8`` so every source looks alike.
    The images ship with scikit-learn, so this is the default that runs anywhere without a download.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    y = bunch.target.astype(np.int64)
    train, test = stratified_split(y, test_fraction, seed)
    return Splits(x[train], y[train], x[test], y[test], class_names=[str(c) for c in range(10)], name="digits")


def npz(path: str | Path, spatial_dims: int = 2, name: str | None = None, lazy: bool = False) -> Splits:
    """A ``.npz`` archive with ``x_train, y_train, x_test, y_test`` and optionally ``x_val, y_val, class_names``.

    This is the format of the archives in ``shared/data`` (MNIST, Fashion-MNIST, AdrenalMNIST3D). With ``lazy`` the
    images are :class:`~ddcnn.data.arrays.Rows`: members stored uncompressed (``np.savez``) are memory-mapped in
    place, compressed ones decompressed as a stream when read, so a study larger than memory can be prepared.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset archive {path} does not exist; put the .npz file there or set data.path to where it is "
            f"(see data/README.md)."
        )
    try:
        archive = np.load(path, allow_pickle=False)
        keys = set(archive.files)
    except Exception as err:  # zipfile.BadZipFile, OSError, ValueError: all mean the same to the user
        raise ValueError(f"dataset archive {path} cannot be read ({err}); the file is corrupt or not a .npz.") from err
    missing = {"x_train", "y_train", "x_test", "y_test"} - keys
    if missing:
        raise ValueError(
            f"dataset archive {path} lacks the arrays {sorted(missing)}; it holds {sorted(keys)}. Expected "
            f"x_train, y_train, x_test, y_test (and optionally x_val, y_val, class_names)."
        )
    src = str(path)

    def arr(key: str) -> np.ndarray:
        try:
            return archive[key]
        except Exception as err:
            raise ValueError(
                f"dataset archive {path}: array {key!r} cannot be read ({err}); the file is corrupt."
            ) from err

    def images(key: str):
        if lazy:
            try:
                rows = npz_member(path, key, spatial_dims)
            except (ValueError, OSError, KeyError) as err:
                if "spatial_dims" in str(err):
                    raise
                raise ValueError(
                    f"dataset archive {path}: array {key!r} cannot be read ({err}); the file is corrupt."
                ) from err
            if rows is not None:
                return rows
        return _with_channel_axis(arr(key), spatial_dims, src)

    x_train, x_test = images("x_train"), images("x_test")
    x_val = images("x_val") if "x_val" in keys else None
    y_train, y_test = _labels(arr("y_train"), src), _labels(arr("y_test"), src)
    y_val = _labels(arr("y_val"), src) if "y_val" in keys else None
    if "class_names" in keys:
        class_names = [str(c) for c in arr("class_names").tolist()]
    else:
        class_names = [str(c) for c in range(int(max(y_train.max(), y_test.max())) + 1)]
    return Splits(x_train, y_train, x_test, y_test, x_val, y_val, class_names, name=name or path.stem)


_TORCHVISION = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "cifar10": "CIFAR10"}
_TORCHVISION_LAYOUT = {
    "mnist": "<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "fashion_mnist": "<root>/FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]",
    "cifar10": "<root>/cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
}


def torchvision_dataset(name: str, root: str | Path) -> Splits:
    """MNIST, Fashion-MNIST or CIFAR-10 in torchvision's on-disk format under ``root`` (never downloads)."""
    import torchvision

    key = name.lower().replace("-", "_")
    if key not in _TORCHVISION:
        raise ValueError(f"unknown torchvision dataset {name!r}; supported: {sorted(_TORCHVISION)}.")
    root = Path(root).expanduser()
    if key == "cifar10":
        return _cifar10(root)
    cls = getattr(torchvision.datasets, _TORCHVISION[key])
    try:
        train = cls(str(root), train=True, download=False)
        test = cls(str(root), train=False, download=False)
    except RuntimeError as err:
        raise FileNotFoundError(
            f"{_TORCHVISION[key]} not found under {root} ({err}). ddcnn never downloads: place the files as "
            f"{_TORCHVISION_LAYOUT[key]} (torchvision's layout) or set data.root to their folder."
        ) from err

    def arrays(ds) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(ds.data)
        y = np.asarray(ds.targets, dtype=np.int64)
        return _with_channel_axis(x, 2, str(root)), y

    x_train, y_train = arrays(train)
    x_test, y_test = arrays(test)
    return Splits(x_train, y_train, x_test, y_test, class_names=list(train.classes), name=key)


def _cifar10(root: Path) -> Splits:
    """CIFAR-10's python format, read directly (torchvision insists on the official md5 sums, so it
    refuses re-packed or subset files; the layout and content are the same)."""
    import pickle

    folder = root / "cifar-10-batches-py"
    names = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 not found under {root}: {folder} lacks {missing}. ddcnn never downloads: place the files as "
            f"{_TORCHVISION_LAYOUT['cifar10']} (torchvision's layout) or set data.root to their folder."
        )

    def read(name: str) -> dict:
        try:
            with open(folder / name, "rb") as fh:
                return pickle.load(fh, encoding="latin1")
        except Exception as err:
            raise ValueError(f"CIFAR-10 file {folder / name} cannot be read ({err}); the file is corrupt.") from err

    def arrays(batches: list[str]) -> tuple[np.ndarray, np.ndarray]:
        parts = [read(n) for n in batches]
        x = np.concatenate([np.asarray(p["data"], dtype=np.uint8) for p in parts]).reshape(-1, 3, 32, 32)
        y = np.concatenate([np.asarray(p.get("labels", p.get("fine_labels")), dtype=np.int64) for p in parts])
        return x, y

    x_train, y_train = arrays(names[:5])
    x_test, y_test = arrays(["test_batch"])
    class_names = list(read("batches.meta")["label_names"])
    return Splits(x_train, y_train, x_test, y_test, class_names=class_names, name="cifar10")


def image_folder(
    root: str | Path,
    image_size: Sequence[int] | int | None = None,
    grayscale: bool | None = None,
    test_fraction: float = 0.3,
    seed: int = 0,
    resize_mode: str = "stretch",
    background: int = 0,
    on_bad_file: str = "error",
    duplicates: str = "report",
    in_channels: int | str = "auto",
    class_map: Mapping[str, str] | None = None,
) -> Splits:
    """A folder of images as it comes: one sub-folder per class, or a published split of such folders.

    ``ROOT/<class>/...`` is split into train and test stratified with a fixed seed (every class in both);
    ``ROOT/{train,val|valid,test}/<class>/...`` is used as given (test carved from train when absent; the datamodule
    carves validation from train when absent). Every PIL mode is converted deliberately, images are brought to
    ``image_size`` by ``resize_mode``, unreadable files are named or skipped, non-image files ignored and identical
    images counted or dropped: :mod:`ddcnn.data.images` says how. What was found is :attr:`Splits.report`.

    Args:
        root: The folder (``data.root``).
        image_size: ``(H, W)`` (or one int for both) every image is brought to; ``None``: all must have one size.
        grayscale: ``True`` reads 1 channel, ``False`` 3 (RGB); ``None`` follows ``in_channels``.
        test_fraction, seed: The stratified test split of a folder without a published test split.
        resize_mode: ``stretch``, ``pad`` or ``center_crop`` (``data.resize_mode``).
        background: Grey level 0..255 under transparent pixels and around padded images.
        on_bad_file: ``error`` or ``skip`` unreadable and truncated files.
        duplicates: ``report`` or ``drop`` identical images.
        in_channels: 1, 3 or ``auto``, from ``data.in_channels``: ``auto`` reads the majority's channels, 3 when at
            least half of the images are in colour (a tie keeps colour), else 1; an image is colour when two of its
            channels differ beyond a tolerance somewhere, so an RGB file with equal channels is grey
            (:func:`ddcnn.data.images.decide_channels` says it fully). The counts and the decision are logged and
            recorded (``Splits.report["channels"]``).
        class_map: ``data.source.class_map``: folder name -> class name, applied in every split before the splits'
            classes are compared (a published split whose ``test/`` names its class folders differently from
            ``train/``); ``None``: every folder is its class.
    """
    from ddcnn.data.images import BAD_FILE_POLICIES, DUPLICATE_POLICIES, RESIZE_MODES, read_folder

    for key, value, allowed in (
        ("data.resize_mode", resize_mode, RESIZE_MODES),
        ("data.source.on_bad_file", on_bad_file, BAD_FILE_POLICIES),
        ("data.source.duplicates", duplicates, DUPLICATE_POLICIES),
    ):
        if value not in allowed:
            raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}.")
    if isinstance(background, bool) or not isinstance(background, int) or not 0 <= background <= 255:
        raise ValueError(f"data.source.background must be a grey level 0..255 (0 = black), got {background!r}.")
    channels, set_by = _channels_setting(in_channels, grayscale)
    class_map = _class_map(class_map)
    if isinstance(image_size, int):
        image_size = (image_size, image_size)
    if image_size is not None and (len(image_size) != 2 or min(int(v) for v in image_size) < 1):
        raise ValueError(f"data.image_size={list(image_size)} must be two positive sizes [H, W] for images, or null.")
    found = read_folder(
        root,
        image_size=image_size,
        resize_mode=resize_mode,
        in_channels=channels,
        channels_set_by=set_by,
        class_map=class_map,
        background=background,
        on_bad_file=on_bad_file,
        duplicates=duplicates,
        test_fraction=test_fraction,
        seed=seed,
    )
    return Splits(
        *found.splits["train"],
        *found.splits["test"],
        *found.splits.get("val", (None, None)),
        class_names=found.class_names,
        name=Path(root).expanduser().name,
        classes_listed=True,
        report=found.report,
        files=found.files,
    )


def _channels_setting(in_channels: int | str, grayscale: bool | None) -> tuple[int | None, str | None]:
    """The channels the settings ask an image folder to be read with (``None``: decided from the images) and the
    setting that asked, refusing ``data.in_channels`` other than 1, 3, ``auto`` and a ``data.source.grayscale`` that
    contradicts it."""
    if in_channels not in ("auto", 1, 3) or isinstance(in_channels, bool):
        raise ValueError(
            f"data.in_channels={in_channels!r} cannot be read from image files: they give 1 (grey) or 3 (RGB) "
            f"channels; set data.in_channels=1, 3 or auto (3 when the folder holds colour images)."
        )
    if grayscale is not None and not isinstance(grayscale, bool):
        raise ValueError(
            f"data.source.grayscale must be true, false or null (follow data.in_channels), got {grayscale!r}."
        )
    channels = None if in_channels == "auto" else int(in_channels)
    set_by = None if channels is None else f"data.in_channels={channels}"
    if grayscale is not None:
        wanted = 1 if grayscale else 3
        if channels is not None and channels != wanted:
            raise ValueError(
                f"data.source.grayscale={str(grayscale).lower()} reads {wanted} channel(s) but data.in_channels="
                f"{channels}; set one of them (data.source.grayscale=null follows data.in_channels)."
            )
        channels, set_by = wanted, f"data.source.grayscale={str(grayscale).lower()}"
    return channels, set_by


def _class_map(class_map: Mapping | None) -> dict[str, str] | None:
    """``data.source.class_map`` checked: folder names (text; a whole number, as Hydra reads a folder named ``1``, is
    its text) to non-empty class names. Folder names it holds that the folder lacks are refused where it is read."""
    if class_map is None:
        return None
    if not isinstance(class_map, Mapping):
        raise ValueError(
            f"data.source.class_map must map folder names to class names, e.g. 'data.source.class_map="
            f"{{adenocarcinoma_left.lower.lobe: adenocarcinoma}}', or be null; got {class_map!r}."
        )

    def name(value, what: str) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(
                f"data.source.class_map: {what} {value!r} is not a name. Hydra reads true, false, null and numbers "
                f'such as 1.5 or 1e3 as values, not names: in a YAML file quote it ("true": ...), or rename the '
                f"folder."
            )
        return value

    return {name(k, "the folder name"): name(v, f"the class name of {k!r}") for k, v in class_map.items()}


def nifti(
    root: str | Path,
    target_shape: Sequence[int] | None = None,
    spacing: Sequence[float] | float | None = None,
    window: Sequence[float] | None = None,
    normalize: str = "none",
    channel_axis: int | None = None,
    cache_dir: str | Path | None = None,
    class_names: Sequence[str] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
    lazy: bool = False,
) -> Splits:
    """NIfTI volumes from a class-per-folder root or a CSV manifest (see :mod:`ddcnn.data.nifti`).

    A manifest's ``split`` column gives train/val/test; without one, the test split is stratified with a fixed
    seed. A manifest's ``group`` column (a patient) keeps each group in one split of every split drawn. Preprocessed
    volumes are cached under ``cache_dir`` (default ``<root>/.ddcnn_cache``), keyed by the preprocessing settings.
    Values are returned as float32 after windowing/normalisation, so the datamodule does not rescale them. With
    ``lazy`` the volumes are :class:`~ddcnn.data.arrays.Rows` read (and preprocessed, when not cached yet) one at a
    time as they are needed, so a study larger than memory can be prepared.
    """
    from ddcnn.data.nifti import NiftiPreprocess, scan_nifti

    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"NIfTI dataset {root} does not exist; set data.root to a folder with one sub-folder per class or to a "
            f"manifest.csv (see data/README.md)."
        )
    index = scan_nifti(root, class_names)
    # NiftiPreprocess makes tuples of Hydra's lists; the window is made one here, as its error message shows it
    prep = NiftiPreprocess(target_shape, spacing, None if window is None else tuple(window), normalize, channel_axis)
    if cache_dir is None:
        cache_dir = (root if root.is_dir() else root.parent) / ".ddcnn_cache"
    groups = None
    if index.groups is not None:  # the manifest's group column: one patient's volumes in one split
        groups = np.unique(np.asarray(index.groups), return_inverse=True)[1].astype(np.int64)
    files = [str(p) for p in index.paths]
    return _volume_splits(index, prep, cache_dir, root.stem, test_fraction, seed, progress, lazy, groups, files=files)


def _volume_splits(
    index,
    prep,
    cache_dir: str | Path,
    name: str,
    test_fraction: float,
    seed: int,
    progress: bool,
    lazy: bool,
    groups: np.ndarray | None = None,
    report: dict | None = None,
    files: list[str] | None = None,
) -> Splits:
    """The NIfTI volumes of ``index`` preprocessed by ``prep`` (cached), split by the index's split column, else with a
    stratified test split (over whole ``groups`` when given). ``files``: what names each volume in
    ``RUN_DIR/splits.csv`` (index order): its file, or the DICOM study folder it was read from."""
    from ddcnn.data.nifti import NiftiCache, load_arrays

    if lazy:
        cache = NiftiCache(cache_dir, prep)
        first = np.asarray(cache.load(index.paths[0]))
        x = FileRows(index.paths, lambda p: np.asarray(cache.load(p)), first.shape, first.dtype, name=str(name))
        y = np.asarray(index.labels, dtype=np.int64)
    else:
        x, y = load_arrays(index, prep, cache_dir=cache_dir, progress=progress)
    names = list(index.class_names)
    extra = {"report": report or {}}

    def take(rows: np.ndarray):
        return x.select(rows) if isinstance(x, FileRows) else x[rows]

    if index.splits is not None and "train" in index.splits and "test" in index.splits:
        split = np.asarray(index.splits)
        parts = {s: np.flatnonzero(split == s) for s in ("train", "val", "test")}
        parts = {s: rows for s, rows in parts.items() if len(rows) or s != "val"}
    else:
        train, test = stratified_split(y, test_fraction, seed, groups, what=f"dataset {name!r}: the test split")
        parts = {"train": train, "test": test}
    if groups is not None:
        extra["groups"] = {s: groups[rows] for s, rows in parts.items()}
    if files is not None:
        extra["files"] = {s: [files[r] for r in rows] for s, rows in parts.items()}
    xy = {s: (take(rows), y[rows]) for s, rows in parts.items()}
    return Splits(*xy["train"], *xy["test"], *xy.get("val", (None, None)), class_names=names, name=name, **extra)


def dicom(
    root: str | Path,
    series: dict | str | None = None,
    regrid: bool = False,
    correct_tilt: bool = False,
    target_shape: Sequence[int] | None = None,
    spacing: Sequence[float] | float | None = None,
    window: Sequence[float] | None = None,
    normalize: str = "none",
    cache_dir: str | Path | None = None,
    class_names: Sequence[str] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    progress: bool = True,
    lazy: bool = False,
) -> Splits:
    """DICOM CT studies (class folders of study folders, or a manifest ``path,label[,group][,split]``), one series per
    study chosen by ``series``, read by the rules of :mod:`ddcnn.data.dicom` and stored as NIfTI in the cache; from
    there the same preprocessing, cache and splits as :func:`nifti`.

    Every split keeps one patient's studies together: the manifest's ``group`` column, else the studies' PatientID
    (:attr:`Splits.groups`). What was dropped, set to air or resampled, and each study's spacing and orientation, are
    in :attr:`Splits.report` (``results.json``).

    Args:
        root: ``data.root``: the class folders or the manifest.
        series: ``data.source.series``: the series rule (:class:`~ddcnn.data.dicom.SeriesRule`).
        regrid, correct_tilt: Resample uneven slice spacing / a gantry tilt instead of refusing the study.
        target_shape, spacing, window, normalize, cache_dir, class_names, test_fraction, seed, progress, lazy: As
            :func:`nifti`.
    """
    from ddcnn.data.dicom import SeriesRule, convert_studies, scan_dicom
    from ddcnn.data.nifti import NiftiIndex, NiftiPreprocess

    root = Path(root).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"DICOM dataset {root} does not exist; set data.root to a folder <root>/<class>/<study>/... or to a "
            f"manifest.csv with columns path,label[,group][,split] (see docs/ct.md)."
        )
    index = scan_dicom(root, class_names)
    if cache_dir is None:
        cache_dir = (root if root.is_dir() else root.parent) / ".ddcnn_cache"
    paths, groups, report = convert_studies(
        index, cache_dir, SeriesRule.of(series), regrid=bool(regrid), correct_tilt=bool(correct_tilt), progress=progress
    )
    volumes = NiftiIndex(tuple(paths), index.labels, index.class_names, index.splits, index.source)
    prep = NiftiPreprocess(target_shape, spacing, None if window is None else tuple(window), normalize)
    studies = [str(p) for p in index.studies]  # the study folders the user gave, not the converted cache files
    return _volume_splits(
        volumes, prep, cache_dir, root.stem, test_fraction, seed, progress, lazy, groups, report, files=studies
    )


# Source settings that name where a copy or a cache goes, not what is read: not part of a source's identity.
NOT_IDENTITY = ("cache_dir", "progress", "lazy")


def _files_digest(paths: list[Path]) -> dict:
    import hashlib

    digest = hashlib.sha256()
    total = 0
    for path in sorted(paths):
        stat = path.stat()
        total += stat.st_size
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"count": len(paths), "bytes": total, "stat_sha256": digest.hexdigest()[:32]}


def _visible_files(root: Path) -> list[Path]:
    """Files under ``root``, hidden files and folders (``.ddcnn_cache``, ``.git``) left out."""
    out = []
    for path in root.rglob("*"):
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts):
            out.append(path)
    return out


def source_identity(spec: dict) -> dict:
    """What identifies the files a source configuration reads, found cheaply: the path, size and modification time of
    each (an edited, replaced or added file changes it). Part of the key of a prepared dataset in the store.

    Args:
        spec: The resolved ``data.source`` node (``_target_`` and its arguments).
    """
    target = str(spec.get("_target_", ""))
    if target.endswith(".nifti") and spec.get("root"):
        from ddcnn.data.nifti import FORMAT_VERSION, scan_nifti

        index = scan_nifti(Path(str(spec["root"])).expanduser(), spec.get("class_names"))
        files = list(index.paths) + ([index.source] if index.source is not None and index.source.is_file() else [])
        return {"nifti_format": FORMAT_VERSION, "files": _files_digest(files)}
    if target.endswith(".dicom") and spec.get("root"):
        from ddcnn.data.dicom import DICOM_FORMAT, scan_dicom

        index = scan_dicom(Path(str(spec["root"])).expanduser(), spec.get("class_names"))
        files = [p for study in index.studies for p in _visible_files(study)]
        files += [index.source] if index.source is not None and index.source.is_file() else []
        return {"dicom_format": DICOM_FORMAT, "files": _files_digest(files)}
    paths: list[Path] = []
    for key, value in spec.items():
        if key in NOT_IDENTITY or key.startswith("_") or not isinstance(value, str):
            continue
        path = Path(value).expanduser()
        if path.is_file():
            paths.append(path)
        elif path.is_dir():
            paths += _visible_files(path)
    if not paths:
        return {}
    if target.endswith(".image_folder"):
        from ddcnn.data.images import CHANNEL_RULE

        return {"channel_rule": CHANNEL_RULE, "files": _files_digest(paths)}
    return {"files": _files_digest(paths)}
