"""Folders of image files as they come: decoding every PIL mode, one size, one channel count, bad files, duplicates.

What a file becomes (:func:`canonical`), decided per PIL mode and documented in data/README.md ("Your own images"):

- ``L`` and ``RGB`` are kept; ``1`` (bilevel) becomes 0/255 grey; ``CMYK``, ``YCbCr``, ``RGBX`` become ``RGB``
  (PIL's conversion).
- Alpha (``RGBA``, ``LA``, ``PA`` and their premultiplied forms) is composited onto ``background`` (default 0, black):
  a transparent pixel carries no intensity, so it reads as the background of slices and scans (air, outside the field
  of view) and as the zeros that convolutions pad with, whatever colour the file happens to store under alpha 0.
- ``P`` (palette) is expanded through its palette, with its transparency (``tRNS``) when it has one.
- 16-bit integers (``I;16`` and its byte orders, and ``I`` holding values in 0..65535, as PIL opens some 16-bit files)
  are scaled by the type's range, ``round(v * 255 / 65535)``: ``convert("L")`` would clip every value above 255, so
  that almost all of a 16-bit ramp became white. Other ``I`` (32-bit) and ``F`` (float) images have no type range:
  floats in [0, 1] are scaled by 255, anything else by the image's own minimum and maximum.
- Multi-frame files (animated GIF, multi-page TIFF) give their first frame; an EXIF orientation is applied, so a photo
  is read upright as a viewer shows it.

The format is found from the content (PIL sniffs the file's header): a ``.png`` holding a JPEG is read as the JPEG it
is, and a file of any name that PIL recognises is an image. A file PIL does not recognise is *not an image* (ignored
and counted) unless its name claims an image format, in which case it is a *bad file* like a truncated one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

__all__ = [
    "RESIZE_MODES",
    "BAD_FILE_POLICIES",
    "DUPLICATE_POLICIES",
    "SPLIT_FOLDERS",
    "canonical",
    "is_colour",
    "decide_channels",
    "fit",
    "read_image",
    "FolderImages",
    "read_folder",
    "class_map_override",
]

RESIZE_MODES = ("stretch", "pad", "center_crop")
BAD_FILE_POLICIES = ("error", "skip")
DUPLICATE_POLICIES = ("report", "drop")
# Folder names of a published split (compared in lower case), in the order splits are listed.
SPLIT_FOLDERS = {"train": ("train", "training"), "val": ("val", "valid", "validation"), "test": ("test", "testing")}
# An image is in colour when some pixel's red, green and blue differ by more than this many levels: a grey image saved
# as RGB JPEG decodes with equal channels (measured: 0 levels apart with Pillow 13), a drawn colour mark is far above.
COLOUR_TOLERANCE = 2
# How data.in_channels=auto decides (decide_channels), part of the store key of a prepared image folder
# (ddcnn.data.sources.source_identity): a folder prepared under another rule (before, 3 channels as soon as one image
# was in colour) is prepared again rather than mapped with the other channel count.
CHANNEL_RULE = f"majority of images, a tie to colour; colour beyond {COLOUR_TOLERANCE} levels"
# A stretch that changes an image's aspect ratio by more than this factor is counted and warned about.
STRETCH_WARN = 1.5  # 4:3 and 3:2 photographs stretched to a square pass; 16:9 is counted
SHOWN = 10  # files named in the report and the log
SHOWN_IN_ERRORS = 5  # files named in an error message (one short paragraph)
_ALPHA_MODES = {"RGBA": "RGBA", "RGBa": "RGBA", "LA": "LA", "La": "LA", "PA": "RGBA"}


def canonical(im, background: int = 0):
    """The image as PIL mode ``L`` or ``RGB``, converted as the module docstring says (``im`` is a PIL image)."""
    from PIL import Image, ImageOps

    if im.getexif().get(0x0112, 1) != 1:  # EXIF orientation
        im = ImageOps.exif_transpose(im)
    mode = im.mode
    if mode in ("L", "RGB"):
        return im
    if mode == "1":
        return im.convert("L")
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
        if mode == "RGB":
            return im
    if mode in _ALPHA_MODES:
        a = np.asarray(im.convert(_ALPHA_MODES[mode]), dtype=np.uint16)
        colour, alpha = a[..., :-1], a[..., -1:]
        out = (colour * alpha + int(background) * (255 - alpha) + 127) // 255
        out = out.astype(np.uint8)
        return Image.fromarray(out[..., 0] if out.shape[-1] == 1 else out, "L" if out.shape[-1] == 1 else "RGB")
    if mode.startswith("I") or mode == "F":
        return Image.fromarray(_scale_to_uint8(np.asarray(im), mode), "L")
    return im.convert("RGB")


def _scale_to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    if mode.startswith("I;16") or (mode == "I" and a.size and a.min() >= 0 and a.max() <= 65535):
        return ((a.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    a = a.astype(np.float64)
    finite = a[np.isfinite(a)]
    if mode == "F" and finite.size and finite.min() >= 0 and finite.max() <= 1:
        return np.round(np.nan_to_num(a) * 255).astype(np.uint8)
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    if high <= low:
        return np.zeros(a.shape, dtype=np.uint8)
    return np.round((np.clip(np.nan_to_num(a, nan=low), low, high) - low) * (255 / (high - low))).astype(np.uint8)


def is_colour(im) -> bool:
    """Whether a PIL image (as :func:`canonical` returns it) holds colour: ``RGB`` with two channels further apart
    than :data:`COLOUR_TOLERANCE` at some pixel; ``L``, and ``RGB`` with equal channels, are grey (PIL's channel
    differences: a tenth of the time numpy's reductions over a last axis of 3 take)."""
    from PIL import ImageChops

    if im.mode != "RGB":
        return False
    r, g, b = im.split()
    return any(ImageChops.difference(p, q).getextrema()[1] > COLOUR_TOLERANCE for p, q in ((r, g), (g, b), (r, b)))


def decide_channels(grey: int, colour: int, in_channels: int | None = None, set_by: str | None = None) -> dict:
    """How many channels a folder of ``grey`` grey and ``colour`` colour images is read with, and why (JSON-ready).

    An image is *colour* when, once converted (:func:`canonical`: ``RGBA`` and ``P`` composited, ``CMYK`` converted
    to ``RGB``), two of its channels differ by more than :data:`COLOUR_TOLERANCE` levels at some pixel
    (:func:`is_colour`); an ``RGB`` file whose channels are equal everywhere, as a grey scan saved as RGB or JPEG
    decodes, is grey. With ``in_channels=None`` (``data.in_channels: auto``) the majority decides: 3 channels (RGB)
    when at least half of the images are in colour, a tie included (colour is information that a grey reading would
    lose), else 1, each colour image then read as its grey (PIL's ITU-R 601-2 luma). A few coloured marks on a folder
    of grey scans (37 watermarked slices of 1,000) no longer make the whole folder RGB. ``in_channels`` 1 or 3 is
    what ``set_by`` (default ``data.in_channels=<n>``) asked for, whatever the images.

    Returns:
        ``grey``, ``colour``, ``in_channels`` (1 or 3), ``rule`` (``majority`` or the setting) and ``decision``, the
        sentence the log and ``results.json`` give, e.g. ``963 grey, 37 colour: read as 1 channel (most are grey;
        data.in_channels=3 keeps colour)``.
    """
    counts = f"{grey} grey, {colour} colour"
    if in_channels is not None:
        rule = set_by or f"data.in_channels={in_channels}"
        channels = int(in_channels)
        decision = f"{counts}: read as {channels} channel{'s' if channels > 1 else ''} ({rule})"
    else:
        rule = "majority"
        channels = 3 if colour >= grey and colour else 1
        decision = f"{counts}: read as {channels} channel{'s' if channels > 1 else ''}"
        if grey and colour:
            why = "a tie keeps colour" if grey == colour else "most are colour" if channels == 3 else "most are grey"
            other = (
                "data.in_channels=1 reads every image as grey" if channels == 3 else "data.in_channels=3 keeps colour"
            )
            decision += f" ({why}; {other})"
    return {"grey": grey, "colour": colour, "in_channels": channels, "rule": rule, "decision": decision}


def fit(im, size: Sequence[int] | None, mode: str = "stretch", background: int = 0):
    """``im`` (PIL, ``L`` or ``RGB``) brought to ``size = (H, W)`` as ``mode`` says (bilinear, antialiased):

    - ``stretch``: scaled to ``size``; the aspect ratio follows ``size``.
    - ``pad``: scaled to fit inside ``size`` keeping its aspect ratio, centred on ``background``.
    - ``center_crop``: scaled to cover ``size`` keeping its aspect ratio, the centre cut out.
    """
    from PIL import Image

    if size is None:
        return im
    h, w = int(size[0]), int(size[1])
    if mode == "stretch":
        return im.resize((w, h), Image.BILINEAR)
    width, height = im.size
    scale = min(w / width, h / height) if mode == "pad" else max(w / width, h / height)
    nw, nh = max(1, round(width * scale)), max(1, round(height * scale))
    scaled = im.resize((nw, nh), Image.BILINEAR) if (nw, nh) != (width, height) else im
    if mode == "pad":
        fill = int(background) if im.mode == "L" else (int(background),) * 3
        canvas = Image.new(im.mode, (w, h), fill)
        canvas.paste(scaled, ((w - nw) // 2, (h - nh) // 2))
        return canvas
    left, top = (nw - w) // 2, (nh - h) // 2
    return scaled.crop((left, top, left + w, top + h))


def read_image(
    path: str | Path,
    in_channels: int,
    size: Sequence[int] | None = None,
    resize_mode: str = "stretch",
    background: int = 0,
) -> np.ndarray:
    """One image file as the image-folder source reads it: ``(C, H, W)`` uint8 with ``C = in_channels`` (1 or 3)."""
    from PIL import Image

    with Image.open(path) as im:
        im = canonical(im, background)
        source = im if in_channels == 3 and is_colour(im) else im.convert("L")  # as _decode: grey before resizing
        array = np.asarray(fit(source, size, resize_mode, background), dtype=np.uint8)
    if array.ndim == 2:
        return np.repeat(array[None], in_channels, axis=0)
    return np.moveaxis(array, -1, 0)


# ----------------------------------------------------------------------------------------------------------------
# Reading a folder
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class _File:
    path: Path
    split: str  # train, val or test
    label: int
    kind: str = "image"  # image, not_image or bad
    reason: str = ""
    array: np.ndarray | None = None  # (H, W) grey or (H, W, 3) colour, uint8, at the target size
    colour: bool = False
    grey: np.ndarray | None = None  # a colour image read with data.in_channels=auto: its grey (H, W), until decided
    mode: str = ""
    size: tuple[int, int] = (0, 0)  # (H, W) as stored in the file
    digest: str = ""


@dataclass
class FolderImages:
    """The images of a folder: per split ``(x, y)`` with ``x`` of shape ``(n, C, H, W)`` uint8, and what was found.

    Attributes:
        class_names: Sorted class folder names, index = label.
        splits: ``train`` and ``test`` always, ``val`` when the folder holds a published validation split.
        report: What was read, ignored, skipped and found duplicated (JSON-ready; ``summary`` is one log line).
        files: Per split, the file of each image (in the order of ``splits``), below the root as given.
    """

    class_names: list[str]
    splits: dict[str, tuple[np.ndarray, np.ndarray]]
    report: dict
    files: dict[str, list[str]] = field(default_factory=dict)


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def _visible_files(folder: Path) -> list[Path]:
    """Files below ``folder`` at any depth, hidden files and folders left out, sorted by their relative path."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        out += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return sorted(out, key=lambda p: p.relative_to(folder).parts)


def _layout(root: Path, class_map: Mapping[str, str] | None = None) -> tuple[dict[str, Path], list[str], dict]:
    """``({split: folder}, class_names, members)``: a published split (``train/``, ``val|valid/``, ``test/`` of class
    folders) or class folders (one ``train`` holding them all). A class is a folder's name as ``class_map`` maps it
    (itself when the map does not name it); ``members[split][label]`` are the folder names that make class ``label``
    in ``split`` (several when the map sends several folders to one class)."""
    dirs = _visible_dirs(root)
    named = {d: s for d in dirs for s, names in SPLIT_FOLDERS.items() if d.name.lower() in names}
    if not named:
        if len(dirs) < 2:
            raise ValueError(
                f"image folder {root} has {len(dirs)} class sub-folder(s); a classifier needs at least 2. Put the "
                f"images of each class in their own sub-folder (ROOT/<class>/...), or a published split as "
                f"ROOT/train/<class>/..., ROOT/test/<class>/... (and optionally ROOT/val/<class>/...)."
            )
        folders = {"train": root}
    else:
        folders = _split_folders(root, dirs, named)
    names = {s: [d.name for d in _visible_dirs(f)] for s, f in folders.items()}
    class_map = dict(class_map or {})
    unknown = sorted(set(class_map) - {n for ns in names.values() for n in ns})
    if unknown:
        present = "; ".join(f"{_slash(root, folders[s])}: {_names(ns)}" for s, ns in names.items())
        raise ValueError(
            f"data.source.class_map names folder(s) that {root} does not hold: {_names(unknown)}. Its keys are "
            f"class folder names as they are on disk ({present}); correct or remove those entries."
        )
    classes = {s: sorted({class_map.get(n, n) for n in ns}) for s, ns in names.items()}
    reference = classes["train"]
    if any(c != reference for c in classes.values()):
        raise ValueError(_class_mismatch(root, folders, names, classes, class_map))
    if len(reference) < 2:
        where = f"{folders['train'].name}/ has" if len(folders) > 1 or folders["train"] != root else "has"
        raise ValueError(
            f"image folder {root}: {where} {len(reference)} class(es); a classifier needs at least 2."
            + (" data.source.class_map sends every folder to one class." if class_map else "")
        )
    members = {s: [[n for n in ns if class_map.get(n, n) == c] for c in reference] for s, ns in names.items()}
    return folders, reference, members


def _split_folders(root: Path, dirs: list[Path], named: dict[Path, str]) -> dict[str, Path]:
    """The split folders of a published split, in :data:`SPLIT_FOLDERS` order, checked."""
    others = [d.name for d in dirs if d not in named]
    if others:
        raise ValueError(
            f"image folder {root} mixes split folders ({', '.join(d.name for d in named)}) with other folders "
            f"({', '.join(others[:SHOWN])}); a published split holds only train/, val/ (or valid/) and test/ with one "
            f"sub-folder per class inside each. Move or remove the others, or point data.root at one folder of class "
            f"folders."
        )
    folders: dict[str, Path] = {}
    for d, split in named.items():
        if split in folders:
            raise ValueError(
                f"image folder {root} has two {split} folders ({folders[split].name}/ and {d.name}/); keep one."
            )
        folders[split] = d
    if "train" not in folders:
        raise ValueError(
            f"image folder {root} has the split folders {', '.join(d.name for d in named)} but no train/ folder; a "
            f"published split needs ROOT/train/<class>/... (validation and test are carved from it when absent)."
        )
    return {s: folders[s] for s in SPLIT_FOLDERS if s in folders}


def _slash(root: Path, folder: Path) -> str:
    return "ROOT/" if folder == root else f"{folder.name}/"


def _alnum(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


def _same_class(a: str, b: str) -> bool:
    """Whether two folder names plausibly name one class: equal up to case and non-alphanumerics (``Normal`` and
    ``normal``, ``large.cell`` and ``large_cell``), or one begins the other up to a non-alphanumeric character
    (``adenocarcinoma`` and ``adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib``; not ``cat`` and ``category``)."""
    if _alnum(a) and _alnum(a) == _alnum(b):
        return True
    short, long = sorted((a.lower(), b.lower()), key=len)
    return len(short) < len(long) and long.startswith(short) and not long[len(short)].isalnum()


def _pairs(missing: list[str], extra: list[str]) -> list[tuple[str, str]]:
    """The ``(missing, extra)`` names that pair one to one by :func:`_same_class` (a name with two candidates pairs
    with none: a guess between them would be a coin toss)."""
    out = []
    for m in missing:
        candidates = [e for e in extra if _same_class(m, e)]
        if len(candidates) == 1 and sum(_same_class(o, candidates[0]) for o in missing) == 1:
            out.append((m, candidates[0]))
    return out


def _effective(class_map: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in class_map.items() if k != v}


# Hydra's override grammar (hydra/grammar/OverrideLexer.g4): a dict key is unquoted, made of ASCII letters, digits and
# these characters, or of the ones escaped with a backslash; a key that reads as a number, true, false or null is not
# a name (only a plain whole number comes back as its text: data.source.class_map's check reads it as one).
_HYDRA_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-/+.$%*@?|")
_HYDRA_ESCAPED = frozenset("\\()[]{}:=, \t")
_HYDRA_NOT_NAMES = re.compile(r"[+-]?(\d[\d_]*\.?[\d_]*(e[+-]?\d+)?|\.\d+(e[+-]?\d+)?|inf|nan|true|false|null)", re.I)
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


def _hydra_key(name: str) -> str | None:
    """``name`` as Hydra's override grammar reads it back as a dict key, or ``None`` where it cannot."""
    if "${" in name or any(ch not in _HYDRA_KEY_CHARS and ch not in _HYDRA_ESCAPED for ch in name):
        return None
    if _HYDRA_NOT_NAMES.fullmatch(name) and not re.fullmatch(r"0|[1-9]\d*", name):
        return None
    return "".join(f"\\{ch}" if ch in _HYDRA_ESCAPED else ch for ch in name)


def _hydra_value(name: str) -> str | None:
    """``name`` as a Hydra override value that reads back as this text (quoted unless a plain name)."""
    if _PLAIN_NAME.fullmatch(name) and not _HYDRA_NOT_NAMES.fullmatch(name):
        return name
    if any(ch in name for ch in '"\\') or "${" in name or not name.isprintable():
        return None
    return f'"{name}"'


def class_map_override(class_map: Mapping[str, str]) -> str | None:
    """The command-line setting ``data.source.class_map={folder: class, ...}`` of ``class_map``, quoted for a POSIX
    shell, or ``None`` when a name cannot be typed in a Hydra override (non-ASCII letters, quotes)."""
    import shlex

    items = []
    for folder, name in _effective(class_map).items():
        key, value = _hydra_key(folder), _hydra_value(name)
        if key is None or value is None:
            return None
        items.append(f"{key}: {value}")
    return shlex.quote(f"data.source.class_map={{{', '.join(items)}}}")


def _class_mismatch(root: Path, folders: dict, names: dict, classes: dict, class_map: dict) -> str:
    """The refusal of splits whose classes differ: what is missing where, and the ``data.source.class_map`` setting
    that pairs the names it can pair (:func:`_pairs`; a pair's shorter name becomes the class, on a tie train's)."""
    train, train_at = set(classes["train"]), _slash(root, folders["train"])
    group = {c: c for s in classes for c in classes[s]}  # union-find over class names: paired names, one class

    def find(c: str) -> str:
        while group[c] != c:
            c = group[c]
        return c

    differences, unpaired = [], []
    for split, have in classes.items():
        where = _slash(root, folders[split])
        missing, extra = sorted(train - set(have)), sorted(set(have) - train)
        differences += [f"missing in {where}: {_names(missing)}"] if missing else []
        differences += [f"in {where} but not in {train_at}: {_names(extra)}"] if extra else []
        pairs = _pairs(missing, extra)
        for m, e in pairs:
            group[find(e)] = find(m)
        paired = {n for p in pairs for n in p}
        unpaired += [f"{m} (missing in {where})" for m in missing if m not in paired]
        unpaired += [f"{e} (in {where} only)" for e in extra if e not in paired]
    members = defaultdict(set)
    for c in group:
        members[find(c)].add(c)
    chosen = {c: min(ms, key=lambda n: (len(n), n not in train, n)) for ms in members.values() for c in ms}
    suggested = dict(class_map)
    for folder in {n for ns in names.values() for n in ns}:
        now = class_map.get(folder, folder)
        if chosen[now] != now:
            suggested[folder] = chosen[now]
    suggested = dict(sorted(suggested.items()))
    text = (
        f"image folder {root}: the splits' class folders differ ({'; '.join(differences)}), so a label would not "
        f"mean the same class in each."
    )
    if _effective(suggested) != _effective(class_map):
        setting = class_map_override(suggested)
        if setting is None:
            shown = _names([f"{k} -> {v}" for k, v in _effective(suggested).items()])
            text += (
                f" The names pair up ({shown}), but some cannot be typed in a Hydra override (its grammar reads "
                f"ASCII names, and reads true, null or 1e3 as no name): rename the folders to match."
            )
        else:
            text += (
                " The names pair up (equal up to case and punctuation, or one begins the other): to read each pair "
                "as one class, add this setting (data.source.class_map maps a folder name to its class in every "
                f"split), or rename the folders to match:\n    {setting}\n"
            )
    if unpaired:
        text += (
            f"{'' if text.endswith(chr(10)) else ' '}No partner found for {_names(unpaired)}: rename or remove those "
            f"folders, or map them with data.source.class_map={{folder: class, ...}} (applied in every split)."
        )
    return text.rstrip("\n")


def _names(items: list[str]) -> str:
    more = f" and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _image_suffixes() -> set[str]:
    """The file name extensions of the formats PIL can open (not those it only writes, such as ``.pdf``)."""
    from PIL import Image

    return {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.OPEN}


def _decode(f: _File, size, resize_mode: str, in_channels: int | None, background: int, claimed: set[str]) -> _File:
    """Read one file (runs in a worker thread: PIL releases the GIL while decoding and resizing)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(f.path) as opened:
            f.mode = opened.mode
            im = canonical(opened, background)
            im.load()
    except UnidentifiedImageError:
        if f.path.suffix.lower() in claimed:
            f.kind, f.reason = "bad", "not an image PIL can identify"
        else:
            f.kind = "not_image"
        return f
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        f.kind, f.reason = "bad", " ".join(str(err).split()) or type(err).__name__
        return f
    f.size = (int(im.size[1]), int(im.size[0]))
    f.colour = is_colour(im)
    grey = im if im.mode == "L" else None
    if not f.colour and grey is None:
        grey = im.convert("L")
    # Identity of the decoded pixels: grey images by their grey values, whatever mode they were stored in.
    key = grey if grey is not None else im
    f.digest = hashlib.blake2b(f"{key.mode}{key.size}".encode() + key.tobytes(), digest_size=16).hexdigest()
    # A grey image (and every image read with one channel: PIL's luma) is made grey before resizing, as ddcnn has
    # always read grey images; read with three channels, its grey is repeated into each (_arrays).
    source = im if f.colour and in_channels != 1 else (grey if grey is not None else im.convert("L"))
    f.array = np.asarray(fit(source, size, resize_mode, background), dtype=np.uint8)
    if f.colour and in_channels is None:
        # The channel count is decided once every file is read (decide_channels): a colour image keeps its grey too,
        # made before resizing as above, so that a folder read as 1 channel is not decoded again. It costs a resize
        # and a third more memory for the colour images only (300 colour JPEGs of 500x400 to 64x64 on 2 threads:
        # 1.19 s instead of 1.11 s).
        f.grey = np.asarray(fit(im.convert("L"), size, resize_mode, background), dtype=np.uint8)
    return f


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _listing(items: list[str], shown: int = SHOWN_IN_ERRORS) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return "; ".join(items[:shown]) + more


def read_folder(
    root: str | Path,
    *,
    image_size: Sequence[int] | None = None,
    resize_mode: str = "stretch",
    in_channels: int | None = None,
    channels_set_by: str | None = None,
    class_map: Mapping[str, str] | None = None,
    background: int = 0,
    on_bad_file: str = "error",
    duplicates: str = "report",
    test_fraction: float = 0.3,
    seed: int = 0,
    workers: int | None = None,
) -> FolderImages:
    """Read a folder of class folders, or a published split of them, into arrays.

    Args:
        root: ``ROOT/<class>/...`` (images at any depth below a class folder), or ``ROOT/train/<class>/...`` with
            ``ROOT/test/...`` and optionally ``ROOT/val/`` (or ``valid/``, ``validation/``).
        image_size: ``(H, W)`` every image is brought to; ``None``: all images must have one size.
        resize_mode: ``stretch``, ``pad`` or ``center_crop`` (:func:`fit`).
        in_channels: 1 (grey) or 3 (RGB); ``None``: decided by the images (:func:`decide_channels`).
        channels_set_by: The setting that gave ``in_channels``, as the report names it (default
            ``data.in_channels=<in_channels>``).
        class_map: Folder name -> class name, applied in every split before the splits' classes are compared
            (``data.source.class_map``); a folder it does not name is its own class.
        background: Grey level (0..255) under transparent pixels and around padded images.
        on_bad_file: ``error``: one error naming every unreadable file; ``skip``: leave them out, counted.
        duplicates: ``report``: count identical images (same decoded pixels); ``drop``: also remove them (see
            :func:`_drop`).
        test_fraction, seed: The stratified test split carved when the folder has no test split.
        workers: Decoding threads (default: the CPUs of this process, at most 8).
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"image folder {root} does not exist; set data.root to a folder with one sub-folder per class "
            f"(ROOT/<class>/...) or a published split (ROOT/train/<class>/..., ROOT/test/<class>/...)."
        )
    started = time.perf_counter()
    folders, class_names, members = _layout(root, class_map)
    files, outside = _list_files(folders, members)
    size = tuple(int(v) for v in image_size) if image_size is not None else None
    claimed = _image_suffixes()  # also loads PIL's plugins once, before the threads use them
    n_workers = workers or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        files = list(pool.map(lambda f: _decode(f, size, resize_mode, in_channels, background, claimed), files))
    images = _check_read(root, folders, members, files, on_bad_file, size)
    colour = sum(f.colour for f in images)
    decided = decide_channels(len(images) - colour, colour, in_channels, channels_set_by)
    channels = decided["in_channels"]
    for f in images:  # a colour image of a folder read as grey is its grey, read when it was decoded
        if f.grey is not None and channels == 1:
            f.array = f.grey
        f.grey = None
    report = _read_report(root, folders, files, outside, images, decided, on_bad_file)
    report["image_size"] = list(size) if size is not None else None
    if size is not None and resize_mode == "stretch":
        report["stretched"] = _stretched(images, size)
    kept = images
    if duplicates == "drop":  # what was found, in the splits as found (before a test split is carved)
        kept = _drop(images)
        report["duplicates"] = _duplicates(root, images, kept, duplicates)
    if "test" not in folders:  # carved from train, stratified, as ddcnn has always split a folder of class folders
        from ddcnn.data.splits import stratified_split

        if isinstance(test_fraction, bool) or not 0.0 < float(test_fraction) < 1.0:
            raise ValueError(
                f"data.source.test_fraction={test_fraction!r} must be strictly between 0 and 1 (the share of every "
                f"class held out as the test split of {root}, which has no test/ folder); e.g. 0.3, the default."
            )
        train = [f for f in kept if f.split == "train"]
        _, held = stratified_split(np.asarray([f.label for f in train], dtype=np.int64), test_fraction, seed)
        for i in held:
            train[i].split = "test"
    if duplicates != "drop":  # in the splits the data are trained and tested on
        report["duplicates"] = _duplicates(root, images, kept, duplicates)
    parts = {split: part for split in SPLIT_FOLDERS if (part := [f for f in kept if f.split == split])}
    splits = {split: _arrays(part, channels) for split, part in parts.items()}
    report["classes_short"] = _classes_short(class_names, kept, has_val="val" in folders)
    if size is not None:
        report["enlarged"] = _enlarged(images, size)
    report["seconds"] = round(time.perf_counter() - started, 2)
    report["summary"] = _summary(report, splits)
    _log(root, report)
    paths = {split: [str(f.path) for f in part] for split, part in parts.items()}
    return FolderImages(class_names, splits, report, paths)


def _list_files(folders: dict[str, Path], members: dict[str, list[list[str]]]) -> tuple[list[_File], list[Path]]:
    """Every visible file below each class folder of each split, and the files beside the class folders."""
    files: list[_File] = []
    outside: list[Path] = []
    for split, folder in folders.items():
        outside += sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
        for label, names in enumerate(members[split]):
            files += [_File(p, split, label) for name in names for p in _visible_files(folder / name)]
    return files, outside


def _check_read(root: Path, folders: dict, members: dict, files: list[_File], on_bad_file: str, size):
    """The images read; unreadable files (unless skipped), an empty class folder or mixed sizes without a target
    size are errors that name the files and the fix."""
    bad = [f for f in files if f.kind == "bad"]
    if bad and on_bad_file == "error":
        raise ValueError(
            f"{len(bad)} of {len(files)} files under {root} cannot be read as images: "
            f"{_listing([f'{_rel(root, f.path)} ({f.reason})' for f in bad])}. Remove or replace them, or set "
            f"data.source.on_bad_file=skip to leave them out (they are counted in the log and in results.json)."
        )
    images = [f for f in files if f.kind == "image"]
    present = {(f.split, f.label) for f in images}
    for split, folder in folders.items():
        for label, names in enumerate(members[split]):
            if (split, label) not in present:
                where = " and ".join(str(folder / name) for name in names)
                raise ValueError(f"class folder {where} holds no readable images; add some or remove the folder.")
    if size is None:
        shapes = defaultdict(list)
        for f in images:
            shapes[f.array.shape[:2]].append(f)
        if len(shapes) > 1:
            shown = [f"{h}x{w} ({_rel(root, fs[0].path)})" for (h, w), fs in sorted(shapes.items())]
            raise ValueError(
                f"images under {root} have {len(shapes)} different sizes (HxW): {_listing(shown)}. Set "
                f"data.image_size=[H,W] to bring them to one size; data.resize_mode=stretch|pad|center_crop says how."
            )
    return images


def _read_report(root, folders, files, outside, images, channels: dict, on_bad_file: str) -> dict:
    published = folders["train"] != root
    not_images = [f.path for f in files if f.kind == "not_image"]
    bad = [f for f in files if f.kind == "bad"]
    return {
        "layout": "published split" if published else "class folders",
        "split_folders": {s: f.name for s, f in folders.items()} if published else None,
        "files": len(files),
        "images": len(images),
        "in_channels": channels["in_channels"],
        "colour_images": channels["colour"],
        "channels": channels,
        "modes": dict(sorted(Counter(f.mode for f in images).items())),
        "sizes": _sizes(images),
        "not_images": {"count": len(not_images), "examples": [_rel(root, p) for p in not_images[:SHOWN]]},
        "outside_class_folders": {"count": len(outside), "examples": [_rel(root, p) for p in outside[:SHOWN]]},
        "bad_files": {"count": len(bad), "policy": on_bad_file,
                      "examples": [f"{_rel(root, f.path)} ({f.reason})" for f in bad[:SHOWN]]},
    }  # fmt: skip


def _arrays(part: list[_File], channels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``x`` of shape ``(n, channels, H, W)`` uint8 (grey images repeated into RGB when the folder is
    read in colour), ``y`` the labels."""
    x = np.empty((len(part), channels, *part[0].array.shape[:2]), dtype=np.uint8)
    for k, f in enumerate(part):
        x[k] = f.array if f.array.ndim == 2 else np.moveaxis(f.array, -1, 0)  # a grey (H, W) fills every channel
    return x, np.asarray([f.label for f in part], dtype=np.int64)


def _sizes(images: list[_File]) -> dict:
    hs = [f.size[0] for f in images]
    ws = [f.size[1] for f in images]
    ratios = [w / h for h, w in (f.size for f in images)]
    return {
        "distinct": len({f.size for f in images}),
        "height": [min(hs), max(hs)],
        "width": [min(ws), max(ws)],
        "aspect_w_over_h": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def _stretched(images: list[_File], size: tuple[int, ...]) -> int:
    target = size[1] / size[0]
    out = 0
    for f in images:
        factor = (f.size[1] / f.size[0]) / target
        out += max(factor, 1 / factor) > STRETCH_WARN
    return out


def _enlarged(images: list[_File], size: tuple[int, ...]) -> dict:
    """The images smaller than ``size`` along both axes (enlarged: more pixels, no more detail), and the largest."""
    small = [f for f in images if f.size[0] < size[0] and f.size[1] < size[1]]
    largest = max((f.size for f in images), key=lambda hw: hw[0] * hw[1])
    return {"count": len(small), "largest": list(largest)}


# A class needs this many images for one in each of train, validation (carved from train) and test.
MIN_IMAGES_PER_CLASS = 3


def _classes_short(class_names: list[str], kept: list[_File], has_val: bool) -> dict:
    """Classes left without a test image, or (when validation is carved from train: every class with at least 2
    training images gives one, :func:`ddcnn.data.splits.stratified_split`) without a validation image."""
    counts = Counter((f.split, f.label) for f in kept)
    total = Counter(f.label for f in kept)
    no_test = [class_names[c] for c in range(len(class_names)) if not counts["test", c]]
    no_val = [
        class_names[c]
        for c in range(len(class_names))
        if (not counts["val", c] if has_val else counts["train", c] < 2) and class_names[c] not in no_test
    ]
    return {
        "no_test": no_test,
        "no_val": no_val,
        "images": {name: total[class_names.index(name)] for name in no_test + no_val},
    }


def _groups(images: list[_File]) -> list[list[_File]]:
    by_digest = defaultdict(list)
    for f in images:
        by_digest[f.digest].append(f)
    return [g for g in by_digest.values() if len(g) > 1]


_PRIORITY = {"test": 0, "val": 1, "train": 2}


def _drop(images: list[_File]) -> list[_File]:
    """Every image once: a group of identical images in two or more classes is removed entirely (its label is
    ambiguous); otherwise one copy stays, the one in the test split if there is one, else in validation, else the
    first by path, so that no test image is also a training or validation image."""
    drop: set[int] = set()
    for group in _groups(images):
        if len({f.label for f in group}) > 1:
            drop |= {id(f) for f in group}
        else:
            keep = min(group, key=lambda f: _PRIORITY[f.split])
            drop |= {id(f) for f in group if f is not keep}
    return [f for f in images if id(f) not in drop]


def _duplicates(root: Path, found: list[_File], kept: list[_File], policy: str) -> dict:
    """Identical images (same decoded pixels): groups, extra copies, and which cross splits or classes."""
    groups = _groups(found)
    return {
        "policy": policy,
        "groups": len(groups),
        "copies": sum(len(g) - 1 for g in groups),
        "across_classes": sum(len({f.label for f in g}) > 1 for g in groups),
        "across_splits": sum(len({f.split for f in g}) > 1 for g in groups),
        "test_also_in_train_or_val": sum(
            any(f.split == "test" for f in g) and any(f.split != "test" for f in g) for g in groups
        ),
        "within_one_split": sum(max(Counter(f.split for f in g).values()) > 1 for g in groups),
        "dropped": len(found) - len(kept),
        "examples": [[f"{_rel(root, f.path)} ({f.split})" for f in g] for g in groups[:SHOWN]],
    }


def _summary(report: dict, splits: dict) -> str:
    dup = report["duplicates"]
    counts = ", ".join(f"{s} {len(y)}" for s, (_, y) in splits.items())
    text = (
        f"{report['images']} images ({report['layout']}: {counts}); {report['channels']['decision']}; "
        f"{report['sizes']['distinct']} size(s), {report['not_images']['count']} non-image file(s) ignored, "
        f"{report['outside_class_folders']['count']} file(s) outside the class folders ignored, "
        f"{report['bad_files']['count']} unreadable file(s) {'skipped' if report['bad_files']['count'] else ''}"
    ).rstrip()
    text += (
        f"; duplicates: {dup['groups']} group(s) of identical images ({dup['copies']} extra copies; "
        f"{dup['across_splits']} across splits, {dup['test_also_in_train_or_val']} with a test image also in "
        f"train/val, "
        f"{dup['across_classes']} across classes), {dup['dropped']} dropped"
    )
    return text


def _log(root: Path, report: dict) -> None:
    log.info("image folder %s: %s (read in %.1f s)", root, report["summary"], report["seconds"])
    dup = report["duplicates"]
    if dup["groups"] and dup["policy"] == "report":
        log.warning(
            "image folder %s holds %d group(s) of identical images (%d across splits, %d across classes), e.g. %s; "
            "set data.source.duplicates=drop to keep one copy of each (the test copy) and drop images found in two "
            "classes",
            root, dup["groups"], dup["across_splits"], dup["across_classes"], " = ".join(dup["examples"][0]),
        )  # fmt: skip
    if report["bad_files"]["count"]:
        log.warning("image folder %s: skipped %d unreadable file(s): %s", root, report["bad_files"]["count"],
                    "; ".join(report["bad_files"]["examples"]))  # fmt: skip
    outside = report["outside_class_folders"]
    if outside["count"]:
        log.info("image folder %s: ignored %d file(s) outside the class folders, e.g. %s", root, outside["count"],
                 "; ".join(outside["examples"]))  # fmt: skip
    if report["not_images"]["count"]:
        log.info("image folder %s: ignored %d file(s) that are not images, e.g. %s", root,
                 report["not_images"]["count"], "; ".join(report["not_images"]["examples"]))  # fmt: skip
    short = report["classes_short"]
    if short["no_test"] or short["no_val"]:
        missing = [f"{name} ({short['images'][name]} image(s): no test image)" for name in short["no_test"]]
        missing += [f"{name} ({short['images'][name]} image(s): no validation image)" for name in short["no_val"]]
        log.warning(
            "image folder %s: %d class(es) have too few images to appear in every split: %s. A class needs %d images "
            "for one in each of train, validation and test; its accuracy is not measured on a split it is missing "
            "from. Add images to these classes, remove their folders, or lay out a published split (ROOT/train, "
            "ROOT/val, ROOT/test) that holds each class in each",
            root, len(missing), _listing(missing, SHOWN), MIN_IMAGES_PER_CLASS,
        )  # fmt: skip
    enlarged = report.get("enlarged")
    if enlarged and enlarged["count"] == report["images"]:
        (h, w), target = enlarged["largest"], report["image_size"]
        log.warning(
            "image folder %s: every image is smaller than data.image_size=[%d, %d] (the largest %dx%d) and is "
            "enlarged: %.1f times its pixels in memory, on disk and in every convolution, with no detail added. "
            "data.image_size=null keeps the images' own size (when they share one), or set a smaller data.image_size",
            root, target[0], target[1], h, w, target[0] * target[1] / (h * w),
        )  # fmt: skip
    if report.get("stretched"):
        log.warning(
            "image folder %s: %d of %d images change their aspect ratio by more than %.0f%% when stretched to "
            "data.image_size (data.resize_mode=stretch); data.resize_mode=pad keeps it (padding with "
            "data.source.background), center_crop keeps it by cutting the edges",
            root, report["stretched"], report["images"], (STRETCH_WARN - 1) * 100,
        )  # fmt: skip
