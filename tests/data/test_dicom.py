"""DICOM CT series (ddcnn/data/dicom.py): pydicom's bundled CT series read with the right geometry, series built from
them (shuffled names, a duplicate, a gap, a tilt, two matching series, a second patient, JPEG 2000) read, refused or
corrected as stated, a tiny ``data=dicom`` run with patient groups, and no identifying tag in what a run writes."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

pydicom = pytest.importorskip("pydicom")

from ddcnn.data.dicom import (  # noqa: E402 - after the skip: the module needs pydicom
    AIR_HU,
    DicomError,
    choose_series,
    main,
    read_series,
    scan_study,
    series_to_nifti,
)

TEST_FILES = Path(pydicom.__file__).parent / "data" / "test_files"
CT5N = TEST_FILES / "dicomdirtests" / "98892001" / "CT5N"  # 5 slices, InstanceNumber 6 -> 10 runs z 8.76 -> -1.24
CT2N = TEST_FILES / "dicomdirtests" / "98892001" / "CT2N"  # 2 scouts (ImageType LOCALIZER)
STUDY_77654033 = TEST_FILES / "dicomdirtests" / "77654033"  # CR images and CT2: 4 slices with a 202.5 mm gap
J2K = TEST_FILES / "693_J2KI.dcm"
SECRET_NAME, SECRET_ID = "Doe^Jane^Secret", "PAT-7Q3X-SECRET"


def _slices(folder: Path = CT5N) -> list:
    """The slices of a bundled series, sorted by position along z (ascending)."""
    out = [pydicom.dcmread(p, force=True) for p in sorted(folder.iterdir())]
    return sorted(out, key=lambda ds: float(ds.ImagePositionPatient[2]))


def _write(dest: Path, slices: list, names: list[str] | None = None, **tags) -> Path:
    """``slices`` written to ``dest`` (one new SOPInstanceUID each), ``tags`` set on every one, named ``names``."""
    dest.mkdir(parents=True, exist_ok=True)
    for k, ds in enumerate(slices):
        ds = copy.deepcopy(ds)
        ds.SOPInstanceUID = pydicom.uid.generate_uid()
        if getattr(ds, "file_meta", None) is not None and "MediaStorageSOPInstanceUID" in ds.file_meta:
            ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        for key, value in tags.items():
            setattr(ds, key, value)
        ds.save_as(dest / (names[k] if names else f"IM{k:04d}"))
    return dest


def _ct5n(dest: Path, **tags) -> Path:
    return _write(dest, _slices(), **tags)


def _hu(ds) -> np.ndarray:
    return ds.pixel_array.astype(np.float32) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)


def test_ct5n_read_in_ascending_z_with_hounsfield_units_and_scouts_dropped():
    study = scan_study(CT5N.parent)  # CT5N beside the CT2N scouts
    assert study.dropped == {"localizer/scout": 2}
    series = choose_series(study)
    volume = read_series(series, study.folder)
    assert volume.data.shape == (16, 16, 5)
    assert volume.data.min() == -888 and volume.data.max() == 85
    # Voxel k runs up the normal: the first slice is InstanceNumber 10 at z = -1.2375, 2.5 mm apart.
    assert volume.affine[2, 3] == pytest.approx(-1.2375) and volume.affine[2, 2] == pytest.approx(2.5)
    numbers = [int(ds.InstanceNumber) for ds in _slices()]
    assert numbers == [10, 9, 8, 7, 6]
    for k, ds in enumerate(_slices()):
        np.testing.assert_array_equal(volume.data[:, :, k], _hu(ds).T)
    assert volume.orientation == "LPS" and volume.spacing == pytest.approx((0.488281, 0.488281, 2.5))
    # RAS+: x and y of DICOM's LPS negated.
    assert volume.affine[0, 0] < 0 and volume.affine[1, 1] < 0 and volume.affine[0, 3] == pytest.approx(72.2, abs=1e-3)


def test_file_names_and_instance_numbers_do_not_decide_the_order(tmp_path):
    slices = _slices()
    names = ["z", "a", "m", "b", "y"]  # no order of names matches z
    for k, ds in enumerate(slices):
        ds.InstanceNumber = [3, 1, 5, 2, 4][k]
    shuffled = _write(tmp_path / "study", slices, names)
    reference = read_series(choose_series(scan_study(CT5N)))
    volume = read_series(choose_series(scan_study(shuffled)))
    np.testing.assert_array_equal(volume.data, reference.data)
    np.testing.assert_allclose(volume.affine, reference.affine)


def test_gap_of_202_mm_refused_even_with_regrid():
    study = scan_study(STUDY_77654033)  # the CR images are no CT series: they have no position and are dropped
    series = choose_series(study)
    with pytest.raises(DicomError, match=r"161 missing slice\(s\): gap\(s\) of 202\.5 mm") as err:
        read_series(series, study.folder)
    assert "Routine Brain" in str(err.value) and "77654033" in str(err.value) and "regrid=true" in str(err.value)
    with pytest.raises(DicomError, match="too wide to interpolate"):
        read_series(series, study.folder, regrid=True)


def test_missing_slice_refused_or_regridded(tmp_path):
    slices = _slices()
    study = scan_study(_write(tmp_path / "study", slices[:2] + slices[3:]))
    with pytest.raises(DicomError, match=r"1 missing slice\(s\): gap\(s\) of 5 mm in a stack of 2\.5 mm"):
        read_series(study.series[0], study.folder)
    volume = read_series(study.series[0], study.folder, regrid=True)
    assert volume.corrected == ("regrid",) and volume.data.shape == (16, 16, 5)
    np.testing.assert_allclose(volume.data[:, :, 2], (_hu(slices[1]).T + _hu(slices[3]).T) / 2, atol=1e-4)
    np.testing.assert_array_equal(volume.data[:, :, 3], _hu(slices[3]).T)


def test_duplicated_position_refused(tmp_path):
    slices = _slices()
    study = scan_study(_write(tmp_path / "study", [*slices, slices[2]]))
    with pytest.raises(DicomError, match=r"duplicated slice positions: 1 slice\(s\) share a position .* 3\.76 mm"):
        read_series(study.series[0], study.folder)


def test_gantry_tilt_refused_or_corrected(tmp_path):
    slices = _slices()
    step = float(slices[0].PixelSpacing[0])  # one row per slice: atan(0.488 / 2.5) = 11.05 degrees
    for k, ds in enumerate(slices):
        x, y, z = (float(v) for v in ds.ImagePositionPatient)
        ds.ImagePositionPatient = [x, y + k * step, z]
    study = scan_study(_write(tmp_path / "study", slices))
    with pytest.raises(DicomError, match=r"gantry tilt of 11\.05 degrees") as err:
        read_series(study.series[0], study.folder)
    assert "correct_tilt=true" in str(err.value)
    volume = read_series(study.series[0], study.folder, correct_tilt=True)
    assert volume.corrected == ("tilt",) and volume.tilt_deg == pytest.approx(11.05, abs=0.01)
    # Slice k starts k rows further along the column direction: in the straight stack its row j sits at row j + k,
    # and the rows it does not cover are air.
    for k, ds in enumerate(slices):
        np.testing.assert_allclose(volume.data[:, k:, k], _hu(ds).T[:, : 16 - k], atol=1e-3)
        assert (volume.data[:, :k, k] == AIR_HU).all()


def test_one_series_per_study_chosen_by_the_rule(tmp_path):
    study_dir = tmp_path / "study"
    _ct5n(study_dir / "thin", SeriesInstanceUID="1.2.3.1", SeriesNumber=2, SeriesDescription="Thorax 1.0 B30f",
          ConvolutionKernel="B30f", SliceThickness=1.0)  # fmt: skip
    _ct5n(study_dir / "thick", SeriesInstanceUID="1.2.3.2", SeriesNumber=3, SeriesDescription="Thorax 5.0 B70f",
          ConvolutionKernel="B70f", SliceThickness=5.0)  # fmt: skip
    study = scan_study(study_dir)
    with pytest.raises(DicomError, match="2 series match the series rule") as err:
        choose_series(study)
    assert "'Thorax 1.0 B30f' (kernel B30f, 1 mm, 5 slice(s)" in str(err.value)
    assert "'Thorax 5.0 B70f' (kernel B70f, 5 mm, 5 slice(s)" in str(err.value)
    assert choose_series(study, {"kernel": "b30"}).uid == "1.2.3.1"
    assert choose_series(study, {"thickness": [3, 6]}).uid == "1.2.3.2"
    assert choose_series(study, "thorax 5").uid == "1.2.3.2"
    assert choose_series(study, {"uid": "1.2.3.1"}).uid == "1.2.3.1"
    with pytest.raises(DicomError, match=r"no series matches the series rule \(kernel='B45'\); candidates: series 2"):
        choose_series(study, {"kernel": "B45"})


def test_mixed_sizes_and_orientations_refused(tmp_path):
    slices = _slices()
    small = pydicom.dcmread(TEST_FILES / "CT_small.dcm")  # 128 x 128
    small.SeriesInstanceUID, small.ImageOrientationPatient = slices[0].SeriesInstanceUID, [1, 0, 0, 0, 1, 0]
    small.PatientID = slices[0].PatientID
    small.ImagePositionPatient = [-72.2, -143.0, 11.2625]
    study = scan_study(_write(tmp_path / "sizes", [*slices, small]))
    with pytest.raises(DicomError, match=r"mixed slice sizes \(5 of 16x16, 1 of 128x128\)"):
        read_series(study.series[0], study.folder)
    slices = _slices()
    slices[1].ImageOrientationPatient = [1, 0, 0, 0, 0.9962, 0.0872]  # 5 degrees about x
    study = scan_study(_write(tmp_path / "orientations", slices))
    with pytest.raises(DicomError, match=r"mixed orientations \(2 different ImageOrientationPatient\)"):
        read_series(study.series[0], study.folder)


def test_enhanced_multi_frame_ct_refused_with_the_reason_and_other_objects_dropped(tmp_path):
    ds = _slices()[0]
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.2.1"  # Enhanced CT Image Storage: geometry per frame, not top-level
    del ds.ImagePositionPatient, ds.ImageOrientationPatient
    ds.NumberOfFrames = 1
    _write(tmp_path / "study" / "enhanced", [ds])
    for name, dest in (("rtdose.dcm", "dose"), ("SC_rgb_rle.dcm", "capture")):  # of the same patient
        other = pydicom.dcmread(TEST_FILES / name)
        other.PatientID = ds.PatientID
        other.save_as(tmp_path / "study" / dest)
    (tmp_path / "study" / "notes.txt").write_text("not DICOM")
    study = scan_study(tmp_path / "study")
    assert study.dropped == {"radiotherapy object": 1, "secondary capture": 1} and study.ignored == 1
    with pytest.raises(DicomError, match=r"enhanced \(multi-frame\) CT.*Convert the series with dcm2niix"):
        read_series(choose_series(study), study.folder)


def test_a_low_dose_series_is_kept_and_a_dose_report_dropped(tmp_path):
    _ct5n(tmp_path / "study" / "ct", SeriesDescription="Low Dose Chest 1.25mm")
    report = _slices()[:1]
    _write(tmp_path / "study" / "dose", report, SeriesDescription="Dose Report", SeriesInstanceUID="1.2.3.77")
    study = scan_study(tmp_path / "study")
    assert study.dropped == {"dose summary or report": 1}
    assert choose_series(study).description == "Low Dose Chest 1.25mm"


def test_a_study_folder_of_two_patients_refused(tmp_path):
    _ct5n(tmp_path / "study" / "a", PatientID=SECRET_ID)
    _ct5n(tmp_path / "study" / "b", PatientID="OTHER-PATIENT", SeriesInstanceUID="1.2.3.9")
    with pytest.raises(DicomError, match="images of 2 different patients") as err:
        scan_study(tmp_path / "study")
    assert SECRET_ID not in str(err.value)


def _j2k_series(dest: Path, source: Path = J2K) -> Path:
    ds = pydicom.dcmread(source)
    first = np.asarray([float(v) for v in ds.ImagePositionPatient])
    orientation = np.asarray([float(v) for v in ds.ImageOrientationPatient])
    normal = np.cross(orientation[:3], orientation[3:])  # J2K_pixelrep_mismatch.dcm is oblique
    slices = []
    for k in range(2):
        copy = pydicom.dcmread(source)
        copy.ImagePositionPatient = [float(v) for v in first + k * float(ds.get("SliceThickness") or 1.0) * normal]
        slices.append(copy)
    return _write(dest, slices)


@pytest.mark.parametrize("name", ["693_J2KI.dcm", "J2K_pixelrep_mismatch.dcm"])
def test_jpeg2000_refused_naming_the_plugin_where_no_decoder_is_installed(tmp_path, monkeypatch, name):
    from pydicom.pixels.decoders.base import get_decoder

    study = scan_study(_j2k_series(tmp_path / "study", TEST_FILES / name))
    # Pillow built with OpenJPEG decodes JPEG 2000 here; a machine without it (or pylibjpeg, gdcm) has no decoder.
    syntax = pydicom.dcmread(TEST_FILES / name, stop_before_pixels=True).file_meta.TransferSyntaxUID
    decoder = get_decoder(syntax)
    if decoder.available_plugins:
        volume = read_series(study.series[0], study.folder)
        assert volume.data.shape == (512, 512, 2) and -1024 <= volume.data.min() < volume.data.max() < 4000
    monkeypatch.setattr(decoder, "_available", {})
    with pytest.raises(DicomError, match=re.escape(f"{syntax.name} ({syntax}), which pydicom cannot decode")) as err:
        read_series(study.series[0], study.folder)
    assert "pylibjpeg-openjpeg" in str(err.value) and "python-gdcm" in str(err.value)


def test_padding_becomes_air_and_is_counted(tmp_path):
    slices = _slices()
    ds = slices[0]
    pixels = ds.pixel_array.copy()
    pixels[0, :4] = -2000  # the series' PixelPaddingValue
    ds.PixelData = pixels.astype(pixels.dtype).tobytes()
    volume = read_series(scan_study(_write(tmp_path / "study", slices)).series[0])
    assert volume.padded == 4 and volume.data.min() == AIR_HU
    assert (volume.data[:4, 0, 0] == AIR_HU).all()


def test_dicom_to_nifti_writes_the_affine(tmp_path, capsys):
    out = tmp_path / "ct5n.nii.gz"
    assert main([str(CT5N), str(out)]) == 0
    assert "16 x 16 x 5 voxels" in capsys.readouterr().out
    image = nib.load(out)
    volume = series_to_nifti(CT5N, tmp_path / "again.nii")
    np.testing.assert_allclose(image.affine, volume.affine, atol=1e-6)
    np.testing.assert_array_equal(image.get_fdata(), volume.data)
    canonical = nib.as_closest_canonical(image)
    assert nib.aff2axcodes(canonical.affine) == ("R", "A", "S")
    assert main([str(STUDY_77654033), str(tmp_path / "gap.nii.gz")]) == 1
    assert "missing slice" in capsys.readouterr().err


needs_dcm2niix = pytest.mark.skipif(shutil.which("dcm2niix") is None, reason="dcm2niix (Debian package) not installed")


def _dcm2niix(series: Path, out: Path) -> tuple[list[Path], str]:
    out.mkdir()
    done = subprocess.run(["dcm2niix", "-z", "y", "-f", "ref", "-o", str(out), str(series)],
                          check=True, capture_output=True, text=True)  # fmt: skip
    return sorted(out.glob("*.nii.gz")), done.stdout + done.stderr


def _oblique(dest: Path, slices: list, degrees: float, step: float, roll: bool = False) -> Path:
    """``slices`` turned ``degrees`` about x and stacked ``step`` mm apart along the new normal (a straight stack)."""
    angle = np.radians(degrees)
    row, col = np.array([1.0, 0, 0]), np.array([0, np.cos(angle), np.sin(angle)])
    normal = np.cross(row, col)
    out = []
    for k, ds in enumerate(slices):
        ds = copy.deepcopy(ds)
        ds.ImageOrientationPatient = [float(v) for v in (*row, *col)]
        ds.ImagePositionPatient = [float(v) for v in np.array([-72.2, -143.0, 0.0]) + step * k * normal]
        ds.InstanceNumber = k + 1
        if roll:  # a different image per slice
            ds.PixelData = np.roll(ds.pixel_array, 3 * k, axis=0).tobytes()
        out.append(ds)
    return _write(dest, out)


def _clinical_size(dest: Path) -> Path:
    """40 slices of 512 x 512 from pydicom's JPEG 2000 CT slice (decoded here, written uncompressed), 15 degrees
    oblique, 1.25 mm apart."""
    ds = pydicom.dcmread(J2K)
    try:
        ds.decompress()
    except Exception as err:  # noqa: BLE001 - no JPEG 2000 decoder installed
        pytest.skip(f"no JPEG 2000 decoder to build the 512 x 512 series ({err})")
    return _oblique(dest, [ds] * 40, 15.0, 1.25, roll=True)


@needs_dcm2niix
@pytest.mark.parametrize("case", ["ct5n", "oblique", "clinical_size"])
def test_agrees_with_dcm2niix(tmp_path, case):
    if case == "ct5n":
        series = CT5N
    elif case == "oblique":  # CT5N's slices turned 20 degrees about x
        series = _oblique(tmp_path / "oblique", _slices(), 20.0, 2.5)
    else:
        series = _clinical_size(tmp_path / "big")
    series_to_nifti(series, tmp_path / "ours.nii.gz")
    ours = nib.as_closest_canonical(nib.load(tmp_path / "ours.nii.gz"))
    files, said = _dcm2niix(series, tmp_path / "ref")
    assert len(files) == 1, said
    ref = nib.as_closest_canonical(nib.load(files[0]))
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours.affine, ref.affine, atol=0.05)
    a, b = ours.get_fdata(), ref.get_fdata()
    inside = b >= AIR_HU  # dcm2niix keeps the padding outside the field of view (-3995 .. -1025 HU in the 512 series)
    assert np.abs(a - b)[inside].max() <= 1.0
    assert (a[~inside] == AIR_HU).all()


@needs_dcm2niix
def test_what_dcm2niix_warns_about_is_refused_or_corrected(tmp_path):
    # a missing slice: dcm2niix warns "Interslice distance varies" and writes an equalised copy (_Eq_1)
    slices = _slices()
    gap = _write(tmp_path / "gap", slices[:2] + slices[3:])
    files, said = _dcm2niix(gap, tmp_path / "ref_gap")
    assert "Interslice distance varies" in said and any("_Eq_" in f.name for f in files)
    with pytest.raises(DicomError, match="missing slice"):
        series_to_nifti(gap, tmp_path / "gap.nii.gz")
    # a gantry tilt: dcm2niix warns and writes a corrected copy (_Tilt_1); ours refuses, or corrects on request with
    # the same voxel values (dcm2niix pads the field of view and places it 4 rows, 1.95 mm, from where DICOM's first
    # slice is; ours keeps slice 0 where its ImagePositionPatient says, as test_gantry_tilt_refused_or_corrected checks)
    slices = _slices()
    for k, ds in enumerate(slices):
        x, y, z = (float(v) for v in ds.ImagePositionPatient)
        ds.ImagePositionPatient = [x, y + k * float(ds.PixelSpacing[0]), z]
        ds.GantryDetectorTilt = 11.05
    tilted = _write(tmp_path / "tilt", slices)
    files, said = _dcm2niix(tilted, tmp_path / "ref_tilt")
    assert "gantry tilt" in said.lower() and any("_Tilt_" in f.name for f in files)
    with pytest.raises(DicomError, match="gantry tilt of 11.05 degrees"):
        series_to_nifti(tilted, tmp_path / "tilt.nii.gz")
    series_to_nifti(tilted, tmp_path / "tilt.nii.gz", correct_tilt=True)
    a = nib.as_closest_canonical(nib.load(tmp_path / "tilt.nii.gz")).get_fdata()
    b = nib.as_closest_canonical(nib.load(next(f for f in files if "_Tilt_" in f.name))).get_fdata()
    rows = a.shape[1]
    offsets = [
        r for r in range(b.shape[1] - rows + 1)
        if np.abs(a - b[:, r : r + rows])[(a > AIR_HU) & (b[:, r : r + rows] > AIR_HU)].max() <= 1.0
    ]  # fmt: skip
    assert offsets, "no placement of ours inside dcm2niix's tilt-corrected volume agrees within 1 HU"


# --------------------------------------------------------------------------------------------------------------
# data=dicom: a labelled set with patient groups, end to end
# --------------------------------------------------------------------------------------------------------------


def _dataset(root: Path, patients: int = 8, studies_each: int = 2) -> dict[str, str]:
    """``root/<class>/<study>/`` with ``studies_each`` studies per patient, all of a patient in one class; class
    ``dense`` has a +300 HU block. Returns each study's patient (by its folder name)."""
    rng = np.random.default_rng(0)
    base = _slices()
    owner = {}
    for p in range(patients):
        label = "dense" if p % 2 else "plain"
        for s in range(studies_each):
            slices = []
            for ds in base:
                ds = copy.deepcopy(ds)
                pixels = ds.pixel_array.astype(np.int32) + rng.integers(-20, 20, size=(16, 16))
                if label == "dense":
                    pixels[4:12, 4:12] += 300
                ds.PixelData = pixels.astype(ds.pixel_array.dtype).tobytes()
                slices.append(ds)
            name = f"study{p}{s}"
            _write(root / label / name / "series", slices, PatientID=f"{SECRET_ID}-{p}", PatientName=SECRET_NAME,
                   SeriesInstanceUID=f"1.2.826.0.1.{p}.{s}", StudyInstanceUID=f"1.2.826.0.2.{p}.{s}")  # fmt: skip
            owner[name] = p
    return owner


def test_dicom_source_keeps_each_patient_in_one_split(tmp_path):
    from ddcnn.data.prepare import prepare
    from ddcnn.data.sources import dicom

    _dataset(tmp_path / "set")
    splits = dicom(tmp_path / "set", target_shape=[16, 16, 8], window=[-1000, 400], normalize="window",
                   test_fraction=0.25, progress=False)  # fmt: skip
    assert splits.x_train.shape[1:] == (1, 16, 16, 8) and 0 <= splits.x_train.min() <= splits.x_train.max() <= 1
    report = splits.report["dicom"]
    assert report["studies"] == 16 and report["patient_groups"] == 8
    assert {r["orientation"] for r in report["per_study"]} == {"LPS"}
    assert report["per_study"][0]["spacing_mm"] == [0.4883, 0.4883, 2.5]
    assert not set(splits.groups["train"]) & set(splits.groups["test"])
    data = prepare(splits, num_classes=2, in_channels=1, spatial_dims=3, val_fraction=0.25, split_seed=3)
    sets = {s: set(data.groups[s].tolist()) for s in ("train", "val", "test")}
    assert all(sets.values()) and not sets["train"] & sets["val"] and not sets["val"] & sets["test"]
    assert data.info["n_groups"] == {s: len(v) for s, v in sets.items()}
    # splits.csv names each study by the folder the user gave (issue #45 item 7), with the class of its folder
    import csv
    import io

    from ddcnn.data.prepare import split_manifest

    rows = list(csv.DictReader(io.StringIO(split_manifest(data))))
    assert len(rows) == 16 and len({r["file"] for r in rows}) == 16 and {r["file_is"] for r in rows} == {"path"}
    assert all(Path(r["file"]).is_dir() and Path(r["file"]).parent.name == r["class"] for r in rows)
    # A subset takes whole patients: every patient it holds comes with all of their training studies.
    small = prepare(splits, num_classes=2, in_channels=1, spatial_dims=3, val_fraction=0.25, split_seed=3,
                    train_subset=4)  # fmt: skip
    kept = small.groups["train"].tolist()
    assert 2 <= len(kept) <= 6 and all(kept.count(g) == data.groups["train"].tolist().count(g) for g in kept)
    carved = data.carve_val_target(0.5, 0)
    assert not set(carved.groups["val"].tolist()) & set(carved.groups["val_target"].tolist())

    from ddcnn.stages.local_oof import oof_folds

    folds = oof_folds(data.y["train"], 2, 0, data.groups["train"])
    assert not set(data.groups["train"][folds[0]].tolist()) & set(data.groups["train"][folds[1]].tolist())
    with pytest.raises(ValueError, match=r"folds=9 needs at least 9 patient groups .* of \d group\(s\)"):
        oof_folds(data.y["train"], 9, 0, data.groups["train"])


def test_a_split_the_groups_make_impossible_is_refused(tmp_path):
    from ddcnn.data.sources import dicom

    _dataset(tmp_path / "set", patients=1, studies_each=3)
    with pytest.raises(ValueError, match=r"the 3 samples come from 1 patient group\(s\)"):
        dicom(tmp_path / "set", target_shape=[16, 16, 8], progress=False)


def test_manifest_group_column_decides_the_groups(tmp_path):
    from ddcnn.data.sources import dicom

    owner = _dataset(tmp_path / "set", patients=4, studies_each=2)
    rows = ["path,label,group"]
    for folder in sorted((tmp_path / "set").glob("*/*")):
        rows.append(f"{folder.relative_to(tmp_path / 'set')},{folder.parent.name},g{owner[folder.name] // 2}")
    (tmp_path / "set" / "manifest.csv").write_text("\n".join(rows) + "\n")
    splits = dicom(tmp_path / "set" / "manifest.csv", target_shape=[16, 16, 8], test_fraction=0.4, progress=False)
    assert splits.report["dicom"]["patient_groups"] == 2 and splits.report["dicom"]["groups_from"] == "manifest"
    assert len(set(splits.groups["train"])) == 1 and len(set(splits.groups["test"])) == 1


def test_tiny_dicom_run_end_to_end_writes_no_identifying_tag(make_cfg, tmp_path, capsys):
    from ddcnn.pipeline import train

    root = tmp_path / "ct"
    _dataset(root, patients=10, studies_each=2)
    cfg = make_cfg(
        "data=dicom",
        f"data.root={root}",
        "data.source.target_shape=[16,16,8]",
        "data.augment=null",
        "data.val_fraction=0.25",
        "data.source.test_fraction=0.25",
        "data.batch_size=4",
        "decomposition=2x2x2",
    )
    results = train(cfg)
    assert len(results["accuracy"]["local"]) == 8
    run_dir = Path(cfg.paths.run_dir)
    saved = json.loads((run_dir / "results.json").read_text())
    assert saved["data"]["n_train"] + saved["data"]["n_val"] + saved["data"]["n_test"] == 20
    assert (run_dir / "coarse_val" / "done").is_file()  # its fit and selection halves drawn over whole patients
    # 10 patients in all, counted per split: no patient in two splits.
    assert saved["data"]["report"]["dicom"]["patient_groups"] == 10
    assert sum(saved["data"]["n_groups"].values()) == 10 and min(saved["data"]["n_groups"].values()) >= 1
    assert len((run_dir / "splits.csv").read_text().splitlines()) == 1 + 20  # checked for identifying tags below
    # ddcnn-predict classifies a study folder by the training's series rule and preprocessing.
    from ddcnn.predict import predict_main

    study = root / "dense" / "study10"
    assert predict_main([str(run_dir), str(study), "--json"]) == 0
    prediction = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert prediction["file"] == str(study) and prediction["class"] in ("dense", "plain")
    assert sum(prediction["probabilities"].values()) == pytest.approx(1.0, abs=1e-5)
    written = [p for p in [*run_dir.rglob("*"), *(root / ".ddcnn_cache").rglob("*")] if p.is_file()]
    assert len(written) > 20
    for path in written:
        blob = path.read_bytes()
        blob = __import__("gzip").decompress(blob) if path.suffix == ".gz" else blob
        for secret in (SECRET_ID, SECRET_NAME, "Doe", "SECRET"):
            assert secret.encode() not in blob, f"{secret!r} written to {path}"


def test_groups_survive_the_store_and_a_worker_process(tmp_path):
    import pickle

    from ddcnn.data.prepare import load_prepared
    from ddcnn.data.sources import dicom
    from ddcnn.store import Store
    from tests.conftest import prepare_settings

    _dataset(tmp_path / "set", patients=6, studies_each=2)
    spec = {"_target_": "ddcnn.data.sources.dicom", "root": str(tmp_path / "set"), "target_shape": [16, 16, 8]}
    settings = prepare_settings(num_classes=2, in_channels=1, spatial_dims=3, val_fraction=0.25)

    def load(mode: str):
        source = lambda: dicom(tmp_path / "set", target_shape=[16, 16, 8], progress=False, lazy=True)  # noqa: E731
        return load_prepared(source, spec, settings, mode=mode, store=Store(tmp_path / "store"), progress=False)

    mapped, memory = load("mapped"), load("memory")
    assert mapped.holding == "mapped"
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(mapped.groups[split], memory.groups[split])
    assert pickle.loads(pickle.dumps(mapped)).groups["val"].tolist() == mapped.groups["val"].tolist()


def test_a_stage_split_the_groups_make_impossible_is_refused_before_training(make_cfg, tmp_path):
    from ddcnn.pipeline import train

    root = tmp_path / "ct"
    _dataset(root, patients=4, studies_each=2)
    cfg = make_cfg("data=dicom", f"data.root={root}", "data.source.target_shape=[16,16,8]", "data.val_fraction=0.15",
                   "data.source.test_fraction=0.25", "decomposition=2x2x2")  # fmt: skip
    with pytest.raises(ValueError, match=r"coarse_val .* validation samples come from 1 patient group\(s\); raise"):
        train(cfg)
    assert not list(Path(cfg.paths.run_dir).glob("local/*/done"))
