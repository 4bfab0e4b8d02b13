"""Image folders as they come (ddcnn/data/images.py and the image_folder source): modes, sizes, disguised formats,
odd names, bad and non-image files, published splits and duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddcnn.data.images import read_folder, read_image
from ddcnn.data.prepare import prepare
from ddcnn.data.sources import image_folder
from tests.conftest import prepare_settings


def _pattern(label: int, h: int, w: int, seed: int) -> np.ndarray:
    """A grey image whose bright band sits where its class says (so classes differ), with noise (so images differ)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 60, (h, w)).astype(np.uint8)
    rows = slice(label * h // 4, (label + 1) * h // 4)
    x[rows] = 200
    x[rng.integers(0, h, 8), rng.integers(0, w, 8)] = 255  # so that bilevel copies differ too
    return x


def _save_mode(path: Path, grey: np.ndarray, mode: str) -> None:
    """``grey`` saved as a file of PIL ``mode`` (the file format follows the mode; the name is ``path`` as given)."""
    if mode == "RGB":
        colour = np.stack([grey, grey // 2, 255 - grey], axis=-1)
        Image.fromarray(colour, "RGB").save(path, format="PNG")
    elif mode == "RGBA":
        alpha = np.full(grey.shape, 255, np.uint8)
        alpha[:, :2] = 0  # a transparent border
        Image.fromarray(np.stack([grey, grey, grey, alpha], -1), "RGBA").save(path, format="PNG")
    elif mode == "LA":
        Image.fromarray(np.stack([grey, np.full_like(grey, 255)], -1), "LA").save(path, format="PNG")
    elif mode == "P":
        Image.fromarray(grey).convert("P").save(path, format="PNG", transparency=0)
    elif mode == "I;16":
        Image.fromarray(grey.astype(np.uint16) * 257).save(path, format="PNG")
    elif mode == "1":
        Image.fromarray(grey > 128).save(path, format="PNG")
    elif mode == "CMYK":
        Image.fromarray(grey).convert("CMYK").save(path, format="JPEG", quality=95)
    elif mode == "JPEG-as-png":  # a .png name holding a JPEG
        Image.fromarray(grey).save(path, format="JPEG", quality=95)
    else:
        Image.fromarray(grey).save(path, format="PNG")


MODES = ["L", "RGBA", "LA", "P", "I;16", "1", "CMYK", "JPEG-as-png"]
SIZES = [(120, 90), (64, 256), (300, 120), (90, 90), (40, 400)]  # (H, W): ~100 to 400 px, aspect 0.1 to 6


def messy_folder(root: Path, splits=("train", "valid", "test"), classes=4, per_class=(6, 2, 3), colour=False) -> Path:
    """Class folders (in split folders when ``splits``) of mixed modes and sizes, names with spaces and parentheses,
    a non-image file in each class, and three duplicates: one within train, one across train and test (same class),
    one across classes."""
    layout = list(zip(splits, per_class, strict=True)) if splits else [(None, sum(per_class))]
    seed = 0
    for split, n in layout:
        for c in range(classes):
            folder = root / split / f"class {c}" if split else root / f"class {c}"
            folder.mkdir(parents=True)
            for k in range(n):
                h, w = SIZES[(k + c) % len(SIZES)]
                mode = MODES[(k + 3 * c) % len(MODES)]
                if colour and k == 0 and c == 0:
                    mode = "RGB"
                _save_mode(folder / f"scan ({k}) {mode.replace(';', '')}.png", _pattern(c, h, w, seed), mode)
                seed += 1
            (folder / "notes.txt").write_text("not an image")
    first = root / (splits[0] if splits else "") / "class 0"
    source = sorted(first.glob("*.png"))[0]
    (first / "copy of first.png").write_bytes(source.read_bytes())  # within one split, same class
    if splits:
        (root / splits[-1] / "class 0" / "leaked.png").write_bytes(source.read_bytes())  # train and test
    other = sorted((root / (splits[0] if splits else "") / "class 1").glob("*.png"))[0]
    (first / "wrong label.png").write_bytes(other.read_bytes())  # the same image in class 0 and class 1
    (first / "report.pdf").write_bytes(b"%PDF-1.4 not an image")  # PIL writes PDFs but does not read them
    (root / (splits[0] if splits else "") / "labels.csv").write_text("file,label\n")  # beside the class folders
    return root


# --- modes ------------------------------------------------------------------------------------------------------


def test_every_mode_is_converted_deliberately(tmp_path):
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (4, 1))
    Image.fromarray(ramp).save(tmp_path / "ramp16.png")
    assert Image.open(tmp_path / "ramp16.png").mode == "I;16"
    grey16 = read_image(tmp_path / "ramp16.png", 1)[0]
    # Scaled by the 16-bit range, not clipped: convert("L") turns all but the first 256 levels into 255.
    assert np.asarray(Image.open(tmp_path / "ramp16.png").convert("L")).mean() > 250
    assert grey16[0, 0] == 0 and grey16[0, -1] == 255 and abs(int(grey16[0, 128]) - 128) <= 1
    assert np.all(np.diff(grey16[0].astype(int)) >= 0) and len(np.unique(grey16)) > 200

    # Alpha composited onto the background (black by default, or data.source.background).
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., :3] = 255  # white under every pixel
    rgba[:, :2, 3] = 0  # left half transparent
    rgba[:, 2:, 3] = 255
    rgba[0, 3, 3] = 128  # one half-transparent pixel
    Image.fromarray(rgba, "RGBA").save(tmp_path / "alpha.png")
    out = read_image(tmp_path / "alpha.png", 1)[0]
    assert out[:, :2].max() == 0 and out[1:, 2:].min() == 255 and out[0, 3] == 128
    assert read_image(tmp_path / "alpha.png", 1, background=255)[0].min() == 255

    la = np.stack([np.full((4, 4), 200, np.uint8), np.array([[0, 255, 255, 255]] * 4, np.uint8)], -1)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    assert read_image(tmp_path / "la.png", 1)[0].tolist() == [[0, 200, 200, 200]] * 4

    # A palette expanded through its palette, with its transparent index.
    pal = Image.new("P", (3, 1))
    pal.putpalette([0, 0, 0, 255, 0, 0, 10, 20, 30] + [0] * 759)
    pal.putdata([0, 1, 2])
    pal.save(tmp_path / "palette.png", transparency=1)
    rgb = read_image(tmp_path / "palette.png", 3)
    assert rgb[:, 0, 0].tolist() == [0, 0, 0]
    assert rgb[:, 0, 1].tolist() == [0, 0, 0]  # index 1 (red) is transparent: composited onto black
    assert rgb[:, 0, 2].tolist() == [10, 20, 30]

    Image.fromarray(np.array([[True, False]])).save(tmp_path / "bilevel.png")
    assert read_image(tmp_path / "bilevel.png", 1)[0].tolist() == [[255, 0]]

    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=100)  # red in CMYK
    red = read_image(tmp_path / "cmyk.jpg", 3)[:, 0, 0]
    assert red[0] > 240 and red[1] < 15 and red[2] < 15

    Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32), "F").save(tmp_path / "float.tif")
    assert read_image(tmp_path / "float.tif", 1)[0].tolist() == [[0, 128, 255]]

    # A photo is read upright: the EXIF orientation 6 (rotate 90 degrees clockwise) is applied.
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.zeros((10, 30), np.uint8)).save(tmp_path / "portrait.jpg", exif=exif)
    assert read_image(tmp_path / "portrait.jpg", 1).shape == (1, 30, 10)


def test_format_by_content_and_resize_modes(tmp_path):
    wide = np.zeros((20, 80), np.uint8)
    wide[:, 30:50] = 255
    Image.fromarray(wide).save(tmp_path / "wide (1).png", format="JPEG", quality=100)  # a JPEG named .png
    path = tmp_path / "wide (1).png"
    assert Image.open(path).format == "JPEG"
    stretch = read_image(path, 1, (40, 40), "stretch")[0]
    pad = read_image(path, 1, (40, 40), "pad", background=0)[0]
    crop = read_image(path, 1, (40, 40), "center_crop")[0]
    assert stretch.shape == pad.shape == crop.shape == (40, 40)
    # stretch keeps the whole width (the bright band is the middle quarter), pad adds rows of background above and
    # below (the image is 10 rows high once fitted), center_crop keeps the middle quarter of the width.
    assert stretch[20, 0] < 30 and stretch[20, 20] > 220 and stretch[0, 20] > 220
    assert pad[:14].max() < 5 and pad[26:].max() < 5 and pad[20, 20] > 220
    assert crop.min() > 128  # the middle quarter of the width, the bright band, fills the square


# --- folders ----------------------------------------------------------------------------------------------------


def test_published_split_is_used_as_given_and_reports_duplicates(tmp_path):
    root = messy_folder(tmp_path / "data")
    splits = image_folder(root, image_size=(32, 32))
    assert splits.class_names == ["class 0", "class 1", "class 2", "class 3"]
    assert splits.in_channels == 1  # no colour image
    # 4 classes x (6 train, 2 valid, 3 test), plus the copy and the wrong label in train, the leaked copy in test
    assert (len(splits.y_train), len(splits.y_val), len(splits.y_test)) == (26, 8, 13)
    assert splits.x_train.shape[1:] == (1, 32, 32) and splits.x_train.dtype == np.uint8
    report = splits.report
    assert report["layout"] == "published split"
    assert report["split_folders"] == {"train": "train", "val": "valid", "test": "test"}
    assert report["not_images"]["count"] == 13  # notes.txt in 12 class folders, report.pdf
    assert report["outside_class_folders"] == {"count": 1, "examples": ["train/labels.csv"]}
    assert set(report["modes"]) == {"1", "CMYK", "I;16", "L", "LA", "P", "RGBA"}
    dup = report["duplicates"]
    assert dup["policy"] == "report" and dup["groups"] == 2  # the leaked copy joins the first image's group
    assert dup["copies"] == 3 and dup["across_classes"] == 1 and dup["across_splits"] == 1
    assert dup["test_also_in_train_or_val"] == 1 and dup["within_one_split"] == 2 and dup["dropped"] == 0
    json.dumps(report)  # recorded in the store entry and results.json
    # ddcnn-predict reads a file (read_image) exactly as the source read it for training.
    test_files = [p for c in range(4) for p in sorted((root / "test" / f"class {c}").glob("*.png"))]
    assert len(test_files) == len(splits.y_test)
    for k, path in enumerate(test_files):
        assert np.array_equal(read_image(path, 1, (32, 32)), splits.x_test[k]), path

    dropped = image_folder(root, image_size=(32, 32), duplicates="drop")
    # The copy in train and the one leaked to test: the test copy stays; the image in two classes goes entirely.
    assert dropped.report["duplicates"]["dropped"] == 4
    assert (len(dropped.y_train), len(dropped.y_val), len(dropped.y_test)) == (22, 8, 13)
    train_rows = {row.tobytes() for row in dropped.x_train}
    assert not any(row.tobytes() in train_rows for row in dropped.x_test)


@pytest.mark.parametrize("resize_mode", ["stretch", "pad"])
def test_predict_reads_a_file_as_training_did(tmp_path, resize_mode):
    """A folder read in colour: grey images are repeated into RGB, colour ones kept; ddcnn-predict's reader gives the
    same."""
    root = messy_folder(tmp_path / "data", per_class=(2, 1, 2), colour=True)
    splits = image_folder(root, image_size=(24, 20), resize_mode=resize_mode, in_channels=3)
    assert splits.in_channels == 3
    test_files = [p for c in range(4) for p in sorted((root / "test" / f"class {c}").glob("*.png"))]
    for k, path in enumerate(test_files):
        assert np.array_equal(read_image(path, 3, (24, 20), resize_mode), splits.x_test[k]), path
    assert not np.array_equal(splits.x_test[1, 0], splits.x_test[1, 2])  # the colour image of class 0
    assert np.array_equal(splits.x_test[2, 0], splits.x_test[2, 2])  # a grey one


def test_class_folders_colour_bad_and_non_image_files(tmp_path):
    root = messy_folder(tmp_path / "data", splits=(), per_class=(4, 0, 2), colour=True)
    found = read_folder(root, image_size=(24, 32), test_fraction=0.3, seed=0, in_channels=3)
    assert found.report["in_channels"] == 3 and found.report["colour_images"] == 2  # a colour image and its copy
    assert found.splits["train"][0].shape[1:] == (3, 24, 32) and "val" not in found.splits
    assert sorted(set(found.splits["test"][1].tolist())) == [0, 1, 2, 3]
    forced = image_folder(root, image_size=(24, 32), in_channels=1)
    assert forced.in_channels == 1
    assert image_folder(root, image_size=(24, 32), grayscale=True).in_channels == 1

    # Unreadable files: one error naming them all, or skipped with a count.
    good = sorted((root / "class 2").glob("*.png"))[0].read_bytes()
    (root / "class 2" / "cut off.png").write_bytes(good[: len(good) // 2])
    (root / "class 3" / "garbage.jpg").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError) as err:
        image_folder(root, image_size=(24, 32))
    message = str(err.value)
    assert "2 of" in message and "class 2/cut off.png" in message and "class 3/garbage.jpg" in message
    assert "data.source.on_bad_file=skip" in message
    skipped = image_folder(root, image_size=(24, 32), on_bad_file="skip")
    assert skipped.report["bad_files"]["count"] == 2
    assert len(skipped.y_train) + len(skipped.y_test) == len(forced.y_train) + len(forced.y_test)

    with pytest.raises(ValueError, match=r"different sizes.*data\.image_size=\[H,W\]"):
        image_folder(root, image_size=None, on_bad_file="skip")


def test_bad_layouts_are_explained(tmp_path):
    root = messy_folder(tmp_path / "a", per_class=(2, 1, 1))
    (root / "valid" / "class 3").rename(root / "valid" / "class three")
    with pytest.raises(ValueError, match=r"missing in valid/: class 3; in valid/ but not in train/: class three"):
        image_folder(root, image_size=(16, 16))
    mixed = messy_folder(tmp_path / "b", per_class=(2, 1, 1))
    (mixed / "extra").mkdir()
    with pytest.raises(ValueError, match="mixes split folders"):
        image_folder(mixed, image_size=(16, 16))
    no_test = messy_folder(tmp_path / "c", splits=("train", "val"), per_class=(6, 2))
    carved = image_folder(no_test, image_size=(16, 16), test_fraction=0.5)
    assert len(carved.y_val) == 9 and sorted(set(carved.y_test.tolist())) == [0, 1, 2, 3]  # 8 + the leaked copy
    with pytest.raises(ValueError, match="data.resize_mode must be one of"):
        image_folder(no_test, image_size=(16, 16), resize_mode="fit")


def test_class_count_from_the_folders_or_checked(tmp_path):
    root = messy_folder(tmp_path / "data", per_class=(3, 1, 1))
    splits = image_folder(root, image_size=(16, 16))
    data = prepare(splits, num_classes="auto", in_channels="auto", spatial_dims=2)
    assert data.num_classes == 4 and data.in_channels == 1
    assert data.info["class_counts"]["val"] == {f"class {c}": 1 for c in range(4)}
    assert data.info["report"]["duplicates"]["groups"] == 2
    with pytest.raises(
        ValueError, match=r"has 4 classes \(class 0, .*data\.num_classes=5; set data\.num_classes=4 or auto"
    ):
        prepare(splits, num_classes=5, in_channels=1, spatial_dims=2)


def test_published_folder_trains_with_nothing_else_typed(make_cfg, tmp_path):
    """``ddcnn-train data=image_folder data.root=FOLDER`` (plus tiny sizes for speed): classes and channels from the
    folder, the published split as given, the class counts and the duplicate report in results.json."""
    from ddcnn.pipeline import train

    root = messy_folder(tmp_path / "slices", per_class=(6, 2, 3))
    cfg = make_cfg("data=image_folder", f"data.root={root}", "data.image_size=[16,16]", "data.batch_size=8")
    results = train(cfg)
    data = json.loads((tmp_path / "run" / "results.json").read_text())["data"]
    assert data["num_classes"] == 4 and data["image_shape"] == [16, 16]
    assert data["class_counts"]["val"] == {f"class {c}": 2 for c in range(4)}
    assert data["class_counts"]["test"]["class 0"] == 4  # 3 + the leaked copy
    assert data["report"]["duplicates"]["test_also_in_train_or_val"] == 1
    assert data["report"]["split_folders"]["val"] == "valid"
    assert data["report"]["channels"]["decision"] == "47 grey, 0 colour: read as 1 channel"  # the counts, recorded
    assert results["data"]["n_train"] == 26
    recorded = json.loads((tmp_path / "run" / "fingerprint.json").read_text())["settings"]["data"]
    assert recorded["num_classes"] == 4 and recorded["in_channels"] == 1  # what ran, not "auto"


def test_report_and_class_counts_come_back_from_the_store(tmp_path, caplog):
    """Read once: a second run maps the prepared copy and still reports what the folder held, without reading it."""
    import logging

    from ddcnn.data.prepare import load_prepared
    from ddcnn.store import Store

    root = messy_folder(tmp_path / "data", per_class=(3, 1, 1))
    spec = {"_target_": "ddcnn.data.sources.image_folder", "root": str(root), "image_size": [16, 16]}
    settings = prepare_settings(num_classes="auto", in_channels="auto", spatial_dims=2, image_size=(16, 16))
    store = Store(tmp_path / "store")
    reads = []

    def source():
        reads.append(1)
        return image_folder(root, image_size=(16, 16))

    first = load_prepared(source, spec, settings, mode="mapped", store=store, progress=False)
    with caplog.at_level(logging.INFO, logger="ddcnn.data.prepare"):
        again = load_prepared(source, spec, settings, mode="mapped", store=store, progress=False)
    assert len(reads) == 1 and again.holding == "mapped"
    assert again.info["report"] == first.info["report"] and again.info["report"]["duplicates"]["groups"] == 2
    assert again.info["class_counts"]["test"]["class 0"] == 2  # 1 + the leaked copy
    assert "as read when prepared" in caplog.text and "test per class: class 0 2" in caplog.text


def test_a_folder_is_decoded_once_with_the_default_settings(make_cfg, tmp_path, monkeypatch):
    """``data=image_folder`` as typed: the first run prepares the folder into the store, a second run (or worker) maps
    it without decoding a file (decoding 20,000 small PNGs costs seconds; a folder of photographs, minutes)."""
    from ddcnn.context import load_data
    from ddcnn.data import images
    from ddcnn.settings import RunSettings

    root = messy_folder(tmp_path / "data", per_class=(3, 1, 1))
    monkeypatch.setenv("DDCNN_STORE", str(tmp_path / "store"))
    cfg = make_cfg("data=image_folder", f"data.root={root}", "data.image_size=16")  # one number: both sides
    settings = RunSettings.from_config(cfg)
    first = load_data(settings)
    assert first.holding == "mapped" and first.info["built"] and tuple(first.image_shape) == (16, 16)
    decoded = []
    monkeypatch.setattr(images, "_decode", lambda *a: decoded.append(a))
    again = load_data(settings)
    assert again.holding == "mapped" and not again.info["built"] and not decoded
    assert again.info["class_counts"] == first.info["class_counts"]


def test_classes_too_small_for_every_split_are_named(tmp_path, caplog):
    """Tens of classes with a few images each: a class of 3 images has one in train, validation and test; one of 2
    has no validation image, one of 1 no test image; the log names them and the report lists them."""
    import logging

    root = tmp_path / "few"
    for c, n in enumerate([1, 2, 3, 5, 8]):
        (root / f"class {c}").mkdir(parents=True)
        for k in range(n):
            Image.fromarray(_pattern(c % 4, 12, 12, 100 * c + k)).save(root / f"class {c}" / f"{k}.png")
    with caplog.at_level(logging.WARNING, logger="ddcnn.data.images"):
        splits = image_folder(root)
    assert splits.report["classes_short"] == {
        "no_test": ["class 0"],
        "no_val": ["class 1"],
        "images": {"class 0": 1, "class 1": 2},
    }
    assert "2 class(es) have too few images to appear in every split" in caplog.text
    assert "class 0 (1 image(s): no test image); class 1 (2 image(s): no validation image)" in caplog.text
    data = prepare(splits, num_classes="auto", in_channels="auto", spatial_dims=2, val_fraction=0.15)
    counts = data.info["class_counts"]
    assert [counts[s]["class 2"] for s in ("train", "val", "test")] == [1, 1, 1]
    assert counts["val"]["class 1"] == 0 and counts["test"]["class 0"] == 0
    with pytest.raises(ValueError, match=r"data.source.test_fraction=0 must be strictly between 0 and 1"):
        image_folder(root, test_fraction=0)


def test_enlarging_every_image_is_warned_with_its_cost(tmp_path, caplog):
    import logging

    root = tmp_path / "small"
    for c in range(2):
        (root / str(c)).mkdir(parents=True)
        for k in range(3):
            Image.fromarray(_pattern(c, 28, 28, 10 * c + k)).save(root / str(c) / f"{k}.png")
    with caplog.at_level(logging.WARNING, logger="ddcnn.data.images"):
        splits = image_folder(root, image_size=(64, 64))
    assert splits.report["enlarged"] == {"count": 6, "largest": [28, 28]}
    assert "every image is smaller than data.image_size=[64, 64] (the largest 28x28)" in caplog.text
    assert "5.2 times its pixels" in caplog.text and "data.image_size=null" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ddcnn.data.images"):
        image_folder(root, image_size=(28, 28))
    assert "enlarged" not in caplog.text


# --- channels: the majority decides ------------------------------------------------------------------------------


def _mixed_folder(root: Path, grey: int, colour: int, equal_rgb: int = 0) -> dict[str, list[Path]]:
    """Two class folders of ``grey`` grey slices (``equal_rgb`` of them stored as RGB with R = G = B) and ``colour``
    slices carrying a red watermark, alternating between the classes; the paths of each kind."""
    paths: dict[str, list[Path]] = {"grey": [], "colour": []}
    for k in range(grey + colour):
        folder = root / f"class {k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        x = _pattern(k % 2, 24, 24, seed=k)
        path = folder / f"slice {k:02d}.png"
        rgb = np.stack([x, x, x], axis=-1)
        if k < colour:
            rgb[2:6, 2:10] = (220, 30, 30)  # the watermark
            Image.fromarray(rgb, "RGB").save(path)
        else:
            Image.fromarray(rgb, "RGB").save(path) if k - colour < equal_rgb else Image.fromarray(x).save(path)
        paths["colour" if k < colour else "grey"].append(path)
    return paths


@pytest.mark.parametrize(
    ("grey", "colour", "channels", "why"),
    [
        (7, 3, 1, "most are grey; data.in_channels=3 keeps colour"),
        (3, 7, 3, "most are colour; data.in_channels=1 reads every image as grey"),
        (5, 5, 3, "a tie keeps colour; data.in_channels=1 reads every image as grey"),
    ],
)
def test_channels_follow_the_majority_of_the_images(tmp_path, caplog, grey, colour, channels, why):
    """``data.in_channels: auto`` reads the majority's channels, with the counts logged once and recorded; two of the
    grey slices are RGB files with equal channels, which count as grey (as colour, 7/3 would be a 5/5 tie: RGB)."""
    import logging

    paths = _mixed_folder(tmp_path / "slices", grey, colour, equal_rgb=2)
    with caplog.at_level(logging.INFO, logger="ddcnn.data.images"):
        splits = image_folder(tmp_path / "slices", image_size=(16, 16), test_fraction=0.3)
    assert splits.in_channels == channels
    decision = f"{grey} grey, {colour} colour: read as {channels} channel{'s' if channels == 3 else ''} ({why})"
    assert splits.report["channels"] == {
        "grey": grey, "colour": colour, "in_channels": channels, "rule": "majority", "decision": decision
    }  # fmt: skip
    assert caplog.text.count(decision) == 1
    # Every file is in the arrays as ddcnn-predict reads it with that channel count: a colour slice read as 1 channel
    # is its grey made before resizing, taken from the one decoding pass.
    rows = {row.tobytes() for x in (splits.x_train, splits.x_test) for row in x}
    assert len(rows) == grey + colour
    for path in paths["grey"] + paths["colour"]:
        assert read_image(path, channels, (16, 16)).tobytes() in rows, path


def test_a_channel_count_set_overrides_the_majority(tmp_path):
    _mixed_folder(tmp_path / "grey", 7, 3)
    three = image_folder(tmp_path / "grey", image_size=(16, 16), in_channels=3)
    assert three.in_channels == 3 and three.report["channels"]["rule"] == "data.in_channels=3"
    assert three.report["channels"]["decision"] == "7 grey, 3 colour: read as 3 channels (data.in_channels=3)"
    _mixed_folder(tmp_path / "colour", 3, 7)
    one = image_folder(tmp_path / "colour", image_size=(16, 16), grayscale=True)
    assert one.in_channels == 1
    assert one.report["channels"]["decision"] == "3 grey, 7 colour: read as 1 channel (data.source.grayscale=true)"


def test_a_folder_prepared_under_another_channel_rule_is_prepared_again(tmp_path, monkeypatch):
    """The store key of a prepared folder holds the rule that decides ``auto`` channels: an entry prepared under
    another rule (before: RGB as soon as one image was in colour) is not mapped with its other channel count."""
    from ddcnn.data import images
    from ddcnn.data.prepare import load_prepared
    from ddcnn.store import Store

    root = tmp_path / "slices"
    _mixed_folder(root, 7, 3)
    spec = {"_target_": "ddcnn.data.sources.image_folder", "root": str(root), "image_size": [16, 16]}
    settings = prepare_settings(num_classes="auto", in_channels="auto", spatial_dims=2, image_size=(16, 16))
    store, reads = Store(tmp_path / "store"), []

    def source():
        reads.append(1)
        return image_folder(root, image_size=(16, 16))

    first = load_prepared(source, spec, settings, mode="mapped", store=store, progress=False)
    assert first.in_channels == 1 and first.info["report"]["channels"]["colour"] == 3  # recorded with the data
    load_prepared(source, spec, settings, mode="mapped", store=store, progress=False)
    assert len(reads) == 1
    monkeypatch.setattr(images, "CHANNEL_RULE", "3 channels as soon as one image is in colour")
    load_prepared(source, spec, settings, mode="mapped", store=store, progress=False)
    assert len(reads) == 2


# --- data.source.class_map: class folders named differently in each split ----------------------------------------


def _renamed_split(root: Path, test_names: list[str]) -> Path:
    """A published split whose test/ names the class folders of train/ as another release of the data did."""
    train = ["adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib", "normal", "squamous cell (left hilum)"]
    for split, names in (("train", train), ("test", test_names)):
        for c, name in enumerate(names):
            (root / split / name).mkdir(parents=True)
            for k in range(3):
                Image.fromarray(_pattern(c, 12, 12, 100 * c + 10 * len(split) + k)).save(
                    root / split / name / f"{k}.png"
                )
    return root


def test_a_renamed_test_split_is_refused_with_the_class_map_that_reads_it(make_cfg, tmp_path):
    """The refusal prints the setting to type (shell-quoted, Hydra-escaped); typed, the real configuration reads the
    folder with one class per pair, named by the shorter name."""
    import shlex

    from ddcnn.context import load_data
    from ddcnn.settings import RunSettings

    root = _renamed_split(tmp_path / "chest", ["adenocarcinoma", "NORMAL", "squamous cell"])
    with pytest.raises(ValueError) as err:
        image_folder(root, image_size=(12, 12))
    message = str(err.value)
    assert (
        "missing in test/: adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib, normal, squamous cell (left hilum); in test/ "
        "but not in train/: NORMAL, adenocarcinoma, squamous cell" in message
    )
    setting = message.splitlines()[1].strip()
    assert setting == (
        "'data.source.class_map={NORMAL: normal, adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib: adenocarcinoma, "
        'squamous\\ cell\\ \\(left\\ hilum\\): "squamous cell"}\''
    )
    [override] = shlex.split(setting)  # what a shell hands to ddcnn-train
    cfg = make_cfg("data=image_folder", f"data.root={root}", "data.image_size=12", override)
    data = load_data(RunSettings.from_config(cfg))
    assert data.class_names == ["adenocarcinoma", "normal", "squamous cell"]
    assert data.info["class_counts"]["test"] == {"adenocarcinoma": 3, "normal": 3, "squamous cell": 3}


def test_class_map_names_what_it_cannot_pair_and_refuses_unknown_folders(tmp_path):
    root = _renamed_split(tmp_path / "chest", ["adenocarcinoma", "healthy", "squamous cell"])
    with pytest.raises(ValueError) as err:
        image_folder(root, image_size=(12, 12))
    message = str(err.value)
    assert "\n    'data.source.class_map={adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib: adenocarcinoma, " in message
    assert "No partner found for normal (missing in test/), healthy (in test/ only): rename or remove" in message
    given = {"adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib": "adenocarcinoma", "healthy": "normal"}
    with pytest.raises(ValueError) as err:  # the setting printed holds what was given, and the pair still needed
        image_folder(root, image_size=(12, 12), class_map=given)
    assert "{adenocarcinoma_left.lower.lobe_T2_N0_M0_Ib: adenocarcinoma, healthy: normal, squamous\\ " in str(err.value)
    given["squamous cell (left hilum)"] = "squamous cell"
    assert image_folder(root, image_size=(12, 12), class_map=given).class_names == [
        "adenocarcinoma", "normal", "squamous cell"
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"class_map names folder\(s\) that .* does not hold: helthy\. Its keys"):
        image_folder(root, image_size=(12, 12), class_map={**given, "helthy": "normal"})
    with pytest.raises(ValueError, match="data.source.class_map must map folder names to class names"):
        image_folder(root, image_size=(12, 12), class_map=["healthy"])


def test_the_split_manifest_names_every_image_by_its_file_from_memory_and_from_the_store(tmp_path):
    """Issue #45 item 7: a user could not find the test images. ``splits.csv`` names each one by the file it was read
    from, with its split and class, also when the prepared copy is mapped from the store."""
    import csv
    import io

    from ddcnn.data.prepare import load_prepared, split_manifest
    from ddcnn.store import Store

    root = messy_folder(tmp_path / "data", splits=None, per_class=(3, 2, 3))
    spec = {"_target_": "ddcnn.data.sources.image_folder", "root": str(root), "image_size": [16, 16]}
    settings = prepare_settings(num_classes="auto", in_channels="auto", spatial_dims=2, image_size=(16, 16))
    manifests = []
    for mode in ("memory", "mapped", "mapped"):  # in memory; written into the store; mapped from it
        data = load_prepared(
            lambda: image_folder(root, image_size=(16, 16)), spec, settings, mode=mode, store=Store(tmp_path / "s")
        )
        manifests.append(split_manifest(data))
    assert manifests[0] == manifests[1] == manifests[2]
    rows = list(csv.DictReader(io.StringIO(manifests[0])))
    assert list(rows[0]) == ["file", "split", "class", "file_is"]
    assert [sum(r["split"] == s for r in rows) for s in ("train", "val", "test")] == [
        len(data.y[s]) for s in ("train", "val", "test")
    ]
    assert {r["file_is"] for r in rows} == {"path"}
    for r in rows:
        path = Path(r["file"])
        assert path.is_file() and path.is_relative_to(root), r  # the file itself, as the user gave the root
        assert path.relative_to(root).parts[0] == r["class"]  # its class folder
    assert len({r["file"] for r in rows}) == len(rows)  # each image once
