"""Lightning checkpoints written atomically (temporary file + rename), like every other artifact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from ddcnn.rundir import atomic_torch_save

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """A killed process leaves either the previous ``last.ckpt`` or the new one, never half of one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}.")
        atomic_torch_save(checkpoint, path)
