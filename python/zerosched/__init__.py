"""zerosched: ZeRO-3 communication scheduling for PyTorch training graphs (Python side)."""

from zerosched._core import (OverBudgetError, ZeroschedError, __version__, check, collective_ms, compute_costs,
                             schedule, simulate)
from zerosched import ops  # registers the zerosched ops with torch.library
from zerosched.compiler import backend
from zerosched.executor import run
from zerosched.named import configure
from zerosched.runtime import ShardedModel, shard
from zerosched import named

named.register()  # torch.compile(model, backend="zerosched")

__all__ = ["OverBudgetError", "ShardedModel", "ZeroschedError", "__version__", "backend", "check", "collective_ms",
           "compute_costs", "configure", "ops", "run", "schedule", "shard", "simulate"]
