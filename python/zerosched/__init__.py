"""zerosched: ZeRO-3 communication scheduling for PyTorch training graphs (Python side)."""

__version__ = "0.1.0"
