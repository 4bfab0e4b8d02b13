"""The run directory's one torch reader (ddcnn/io.py load_run_file): tensors and plain types come back, a file that
holds other Python objects is refused with the fix, and read only with the explicit opt-in."""

from __future__ import annotations

import collections

import pytest
import torch

from ddcnn.io import TRUST_RUN_FILES, UntrustedRunFile, atomic_torch_save, load_run_file


class _Payload:
    """A class a pickle names by reference: reading it could run anything its module does."""


def test_tensors_and_plain_types_are_read(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_RUN_FILES, raising=False)
    saved = {
        "net": collections.OrderedDict(w=torch.arange(3.0)),
        "record": {"fold": 1, "time_s": 0.5, "converged": None, "name": "fold_1", "epochs": [1, 2], "pair": (1, 2)},
    }
    atomic_torch_save(saved, tmp_path / "done.pt")
    out = load_run_file(tmp_path / "done.pt", map_location="cpu")
    assert torch.equal(out["net"]["w"], saved["net"]["w"]) and out["record"] == saved["record"]


def test_a_file_holding_other_objects_is_refused_with_the_fix_unless_trusted(tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_RUN_FILES, raising=False)
    path = tmp_path / "last.ckpt"
    torch.save({"epoch": 3, "callback": _Payload()}, path)
    with pytest.raises(UntrustedRunFile) as raised:
        load_run_file(path)
    message = str(raised.value)
    assert str(path) in message and "_Payload" in message  # the file, and what it holds
    assert "delete it and run the same command again" in message and f"{TRUST_RUN_FILES}=1" in message
    assert isinstance(raised.value, ValueError)  # ddcnn-train prints it as one sentence, no traceback
    monkeypatch.setenv(TRUST_RUN_FILES, "1")
    assert isinstance(load_run_file(path)["callback"], _Payload)
