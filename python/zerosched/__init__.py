"""zerosched: ZeRO-3 communication scheduling for PyTorch training graphs (Python side)."""

from zerosched._core import OverBudgetError, ZeroschedError, __version__, check, schedule

__all__ = ["OverBudgetError", "ZeroschedError", "__version__", "check", "schedule"]
