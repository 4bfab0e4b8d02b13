"""The global CNN's stage (ddcnn/stages/global_cnn.py): engine.activation_checkpointing=global reaches its training
alone."""

from __future__ import annotations

import ddcnn.engine.loop as loop
from ddcnn.pipeline import train


def test_global_checkpointing_reaches_the_global_cnn_alone(make_cfg, monkeypatch) -> None:
    applied: list[str] = []
    original = loop.apply_checkpointing

    def recording(net):
        applied.append(type(net).__name__)
        return original(net)

    monkeypatch.setattr(loop, "apply_checkpointing", recording)
    train(make_cfg("stage=local", "engine.activation_checkpointing=global", "decomposition.grid=[1,2]"))
    assert applied == []  # the local nets read global as none
    train(make_cfg("stage=global", "engine.activation_checkpointing=global", "decomposition.grid=[1,2]"))
    assert applied == ["VGG"]
