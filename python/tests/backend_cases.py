"""The backend's cache and its cross-rank schedule check, run on every rank of a gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched
from train_cases import BUCKETING_COST
from zerosched import compiler as zb


class MLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers(x)).sum()


def _run(model: torch.nn.Module, backend) -> None:
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(torch.randn(4, model.width)).backward()
    finally:
        torch._dynamo.reset()


def disagreeing_ranks() -> str:
    """Rank 0 schedules with a cost model that coalesces gathers, rank 1 with the default one."""
    torch.manual_seed(0)
    model = MLP(16)
    h = zerosched.shard(model)
    cost = BUCKETING_COST if dist.get_rank() == 0 else None
    try:
        _run(model, zerosched.backend(cost=cost, debug=True))
    except torch._dynamo.exc.BackendCompilerFailed as e:  # the forward graph's compilation
        return str(e.inner_exception)
    except zerosched.ZeroschedError as e:  # the backward graph's, which AOTAutograd runs lazily
        return str(e)
    finally:
        h.close()
    raise AssertionError("no error")


def cache_hits() -> list[int]:
    """Cache hits after compiling the same model twice (dynamo forgets it in between); a width
    no other case uses, so that the first compilation misses."""
    torch.manual_seed(0)
    model = MLP(24)
    h = zerosched.shard(model)
    backend = zerosched.backend()
    hits = []
    try:
        for _ in range(2):
            before = zb.STATS.cache_hits
            _run(model, backend)
            hits.append(zb.STATS.cache_hits - before)
    finally:
        h.close()
    return hits
