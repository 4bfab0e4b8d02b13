"""A run's settings, typed, frozen and checked once: :class:`RunSettings` (:mod:`ddcnn.settings.run`) and the training
loop's :class:`LoopSettings` (:mod:`ddcnn.settings.loop`)."""

from ddcnn.settings.loop import LoopSettings
from ddcnn.settings.run import *  # noqa: F403
from ddcnn.settings.run import __all__ as _run_all

__all__ = [*_run_all, "LoopSettings"]
