"""The ``trainer`` and ``engine`` settings the training loop implements: :mod:`ddcnn.settings.fit`, where the run's
settings are built and checked once; importable from here by the engine's modules."""

from ddcnn.settings.fit import *  # noqa: F403
from ddcnn.settings.fit import __all__  # noqa: F401
