"""ddcnn: domain-decomposition training of CNNs (CNN-DNN)."""

__version__ = "0.1.0"
