"""The training side with public names: :func:`ddcnn.engine.train.fit` (the loop choice, ``engine.loop``), the plain
PyTorch loop (:mod:`ddcnn.engine.tensor_fit`), Lightning's Trainer for DDP and on request (:mod:`ddcnn.engine.fit`),
prediction and checkpoint I/O. Stages train through it; nothing below it imports Lightning, and neither do
``train.py`` and ``tensor_fit.py`` (Lightning is imported only when a training uses it).
"""
