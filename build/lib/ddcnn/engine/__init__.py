"""The Lightning side of ddcnn with public names: the classifier module, Trainer construction, ``fit`` with resume,
prediction and checkpoint I/O (:mod:`ddcnn.engine.fit`). Stages train through it; nothing below it imports Lightning.
"""
