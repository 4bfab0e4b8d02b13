"""The exported CNN-DNN (TorchScript + preprocessing) and ``ddcnn-predict`` on PNG, ``.npy`` and NIfTI files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

from ddcnn.data.sources import digits
from ddcnn.export import METADATA_FILE, exported_path
from ddcnn.pipeline import train
from ddcnn.predict import export_main, predict_main
from ddcnn.rundir import RunDir
from tests.conftest import assert_real_png, compose_config

# Tinier than the shared tiny settings: these runs only have to produce a CNN-DNN, not a good one.
FAST = [
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "coarse.max_epochs=1",
    "report.plots=true",  # the defaults, stated: the tests below check what they write
    "report.export=true",
]
RUN_PLOTS = ("decomposition.png", "subdomain_accuracy.png", "confusion.png", "training_curves.png")


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> Path:
    """A finished 2D digits run (8x8 images resized to 16x16 in training) with the whole test split."""
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    train(compose_config([*FAST, "data.test_subset=null"], run_dir))
    return run_dir


@pytest.fixture(scope="module")
def volume_run(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """A finished 3D run on generated float volumes (no resize in training) and its raw test volumes."""
    root = tmp_path_factory.mktemp("volumes")
    rng = np.random.default_rng(0)
    x = rng.random((80, 1, 8, 8, 8), dtype=np.float32)
    y = (x[:, 0, :4].mean(axis=(1, 2, 3)) > x[:, 0, 4:].mean(axis=(1, 2, 3))).astype(np.int64)
    np.savez(root / "vol.npz", x_train=x[:60], y_train=y[:60], x_test=x[60:], y_test=y[60:])
    overrides = [
        *FAST,
        "data=mnist",
        f"data.path={root / 'vol.npz'}",
        "data.source.spatial_dims=3",
        "data.spatial_dims=3",
        "data.num_classes=2",
        "data.train_subset=null",
        "data.test_subset=null",
        "decomposition=2x2x2",
        "decomposition.overlap=[1,1,0]",
    ]
    train(compose_config(overrides, root / "run"))
    return root / "run", x[60:]


def _load_plain_torch(path: Path) -> tuple[torch.jit.ScriptModule, dict]:
    """How a user without ddcnn loads the file: torch only."""
    extra = {METADATA_FILE: ""}
    with warnings.catch_warnings():  # recent torch: "torch.jit.load is deprecated" (see ddcnn/export.py)
        warnings.simplefilter("ignore", FutureWarning)
        model = torch.jit.load(str(path), _extra_files=extra)
    return model, json.loads(extra[METADATA_FILE])


def _predict_json(argv: list[str], capsys) -> tuple[int, list[dict], str]:
    rc = predict_main([*argv, "--json"])
    out, err = capsys.readouterr()
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_exported_model_reproduces_the_pipeline_test_predictions(digits_run):
    path = exported_path(digits_run)
    assert path.is_file(), "the evaluate stage exports the CNN-DNN (report.export defaults to true)"
    model, meta = _load_plain_torch(path)
    assert meta["class_names"] == [str(c) for c in range(10)]
    assert (meta["in_channels"], meta["spatial_dims"], meta["image_shape"]) == (1, 2, [16, 16])
    assert meta["preprocessing"]["resize"]["to"] == [16, 16]
    # Raw 8x8 uint8 test images, as the source gives them: the model scales, resizes and normalises itself.
    raw = torch.from_numpy(digits().x_test)
    assert raw.dtype == torch.uint8 and raw.shape[1:] == (1, 8, 8)
    with torch.inference_mode():
        probs = model.predict_proba(raw)
        logits = model(raw)
    staged = RunDir(digits_run).load_probs("coarse", "test")
    assert probs.shape == staged["probs"].shape == (len(raw), 10)
    # 1e-4: the coarse DNN standardises its inputs (1/std of near-saturated probabilities reaches ~1e3), which
    # amplifies the float32 rounding differences of the local nets run on another batch shape.
    assert torch.allclose(probs, staged["probs"], atol=1e-4)
    assert torch.equal(probs.argmax(-1), staged["probs"].argmax(-1))
    assert torch.allclose(logits.softmax(-1), probs)


def test_export_command_writes_a_loadable_copy(digits_run, tmp_path, capsys):
    out = tmp_path / "copy.pt"
    assert export_main([str(digits_run), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    original, _ = _load_plain_torch(exported_path(digits_run))
    copy, meta = _load_plain_torch(out)
    x = torch.rand(3, 1, 8, 8)
    assert torch.allclose(copy(x), original(x), atol=1e-6)
    assert meta["run_dir"] == str(digits_run.resolve())
    assert export_main([str(tmp_path)]) == 2
    assert "not a ddcnn run directory" in capsys.readouterr().err


def test_predict_command_on_a_png_of_a_digit(digits_run, tmp_path, capsys):
    """The console script, as a user calls it, on an 8x8 digit saved as PNG."""
    splits = digits()
    j = 7
    png = tmp_path / "digit.png"
    Image.fromarray(splits.x_test[j, 0]).save(png)
    script = Path(sys.executable).with_name("ddcnn-predict")
    if not script.is_file():
        pytest.fail(f"console script {script} missing: reinstall the package (pip install -e .)")
    done = subprocess.run([str(script), str(digits_run), str(png), "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    staged = RunDir(digits_run).load_probs("coarse", "test")["probs"][j]
    assert result["file"] == str(png)
    assert result["class"] == str(int(staged.argmax()))
    probs = torch.tensor([result["probabilities"][str(k)] for k in range(10)])
    assert torch.allclose(probs, staged, atol=1e-5)
    assert predict_main([str(digits_run), str(png)]) == 0  # the plain-text form of the same prediction
    text = capsys.readouterr().out
    assert text.startswith(f"{png}\t{result['class']}\t(p={float(staged.max()):.4f})") and "9: " in text


def test_predict_reads_rgb_images_and_npy_batches_as_training_did(digits_run, tmp_path, capsys):
    splits = digits()
    rgb = tmp_path / "rgb.png"
    Image.fromarray(splits.x_test[3, 0]).convert("RGB").save(rgb)  # grey content stored as RGB
    batch = tmp_path / "batch.npy"
    np.save(batch, splits.x_test[:4])
    single = tmp_path / "single.npy"
    np.save(single, splits.x_test[5, 0])  # (H, W) without channel axis
    rc, results, err = _predict_json([str(digits_run), str(rgb), str(batch), str(single)], capsys)
    assert rc == 0, err
    staged = RunDir(digits_run).load_probs("coarse", "test")["probs"]
    assert [r["file"] for r in results] == [str(rgb), *(f"{batch}[{i}]" for i in range(4)), str(single)]
    for r, j in zip(results, [3, 0, 1, 2, 3, 5], strict=True):
        probs = torch.tensor([r["probabilities"][str(k)] for k in range(10)])
        assert torch.allclose(probs, staged[j], atol=1e-5), r["file"]


def test_predict_explains_inputs_of_the_wrong_shape(digits_run, tmp_path, capsys):
    channels = tmp_path / "three_channels.npy"
    np.save(channels, np.zeros((3, 8, 8), np.uint8))
    axes = tmp_path / "five_axes.npy"
    np.save(axes, np.zeros((2, 1, 8, 8, 1), np.uint8))
    volume = tmp_path / "volume.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8), np.float32), np.eye(4)), volume)
    good = tmp_path / "good.npy"
    np.save(good, digits().x_test[0])
    text = tmp_path / "notes.txt"
    text.write_text("not an input")
    rc = predict_main([str(digits_run), str(channels), str(axes), str(volume), str(good), str(text)])
    out, err = capsys.readouterr()
    assert rc == 2  # some inputs failed; the good one is still classified
    assert out.startswith(str(good))
    lines = err.splitlines()
    assert len(lines) == 4
    assert f"{channels}: input of shape (3, 8, 8) has 3 channel(s)" in lines[0] and "expects 1" in lines[0]
    assert "(B, 1, ...)" in lines[0]
    assert f"{axes}: array of shape (2, 1, 8, 8, 1) has 5 axes" in lines[1] and "(1, H, W) or (H, W)" in lines[1]
    assert f"{volume}: a NIfTI file holds a 3D volume but the model takes 2D images" in lines[2]
    assert f"{text}: unknown file type" in lines[3]
    assert predict_main([str(tmp_path / "nowhere"), str(good)]) == 2
    assert "no such run directory or model file" in capsys.readouterr().err


def test_predict_command_on_a_nifti_volume(volume_run, tmp_path, capsys):
    run_dir, x_test = volume_run
    j = 4
    path = tmp_path / "case.nii.gz"
    nib.save(nib.Nifti1Image(x_test[j, 0], np.eye(4)), path)  # RAS+ already: loads unchanged
    rc, results, err = _predict_json([str(run_dir), str(path)], capsys)
    assert rc == 0, err
    staged = RunDir(run_dir).load_probs("coarse", "test")["probs"][j]
    probs = torch.tensor([results[0]["probabilities"][str(k)] for k in range(2)])
    assert torch.allclose(probs, staged, atol=1e-5)
    assert results[0]["index"] == int(staged.argmax())
    # Training did not resize (data.image_size unset), so another shape is refused with the fix named.
    small = tmp_path / "small.nii"
    nib.save(nib.Nifti1Image(x_test[j, 0, :6], np.eye(4)), small)
    assert predict_main([str(run_dir), str(small)]) == 2
    err = capsys.readouterr().err
    assert f"{small}: spatial shape (6, 8, 8) differs from the training shape (8, 8, 8)" in err
    assert "Resize or crop the input to (8, 8, 8)" in err


def test_a_missing_export_is_made_on_first_predict(volume_run, tmp_path, capsys):
    run_dir, x_test = volume_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "export")
    npy = tmp_path / "case.npy"
    np.save(npy, x_test[0])
    rc, results, err = _predict_json([str(copy), str(npy)], capsys)
    assert rc == 0, err
    assert "has no exported model yet; exporting it" in err
    assert exported_path(copy).is_file()
    staged = RunDir(run_dir).load_probs("coarse", "test")["probs"][0]
    assert results[0]["index"] == int(staged.argmax())


@pytest.mark.parametrize("which", ["digits", "volume"])
def test_every_run_saves_real_plots(which, digits_run, volume_run):
    run_dir = digits_run if which == "digits" else volume_run[0]
    for name in RUN_PLOTS:
        assert_real_png(run_dir / "plots" / name)


def test_report_flags_turn_plots_and_export_off(digits_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(digits_run, copy, ignore=shutil.ignore_patterns("plots", "export"))
    cfg = compose_config(
        [*FAST, "data.test_subset=null", "stage=evaluate", "report.plots=false", "report.export=false"], copy
    )
    results = train(cfg)
    assert results["accuracy"]["cnn_dnn"] is not None
    assert not (copy / "plots").exists() and not (copy / "export").exists()


@pytest.mark.parametrize("case", ["uint8 resized, stored as float16", "int16 HU, windowed"])
def test_export_preprocessing_is_the_training_preprocessing(case):
    from ddcnn.data.prepare import prepare
    from ddcnn.data.sources import Splits
    from ddcnn.export import Preprocess, _jit_deprecation_quiet

    rng = np.random.default_rng(0)
    if case.startswith("uint8"):
        x = rng.integers(0, 256, size=(40, 1, 10, 12), dtype=np.uint8)
        kw = {"spatial_dims": 2, "image_size": (16, 14), "float_storage": "float16"}
    else:
        x = rng.integers(-1500, 1500, size=(40, 1, 6, 8, 10)).astype(np.int16)
        kw = {"spatial_dims": 3, "window": (-1000, 400)}
    y = np.arange(40) % 2
    data = prepare(Splits(x[:30], y[:30], x[30:], y[30:], class_names=["a", "b"]), num_classes=2, in_channels=1, **kw)
    pre = Preprocess(
        data.image_shape,
        data.mean,
        data.std,
        resize="image_size" in kw,
        round_float16=data.stored_dtype == torch.float16,
        window=data.window,
    )
    with _jit_deprecation_quiet():
        scripted = torch.jit.script(pre)
    # Raw test samples through the exported preprocessing = what the networks saw in training, bit for bit.
    assert torch.equal(scripted(torch.from_numpy(x[30:])), data.inputs("test"))
