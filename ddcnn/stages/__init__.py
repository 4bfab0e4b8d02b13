"""One module per stage of a run; the list of stages, in run order, is :mod:`ddcnn.registry`.

Each module defines ``run(ctx, device, ...) -> meta``. Import them through :func:`ddcnn.registry.load`, not
directly, where the caller must not pull the engine (Lightning Fabric) in at import time (the executors of
:mod:`ddcnn.parallel`).
"""
