"""Training runs that dump their scheduled graphs, on every rank of a gloo group (test_dump.py)."""

from __future__ import annotations

import os

import torch

import zerosched
from backend_cases import MLP
from train_cases import BUCKETING_COST
from zerosched.compiler import STATS


def train_and_dump(root: str, width: int, via_env: bool) -> list[str]:
    """Two SGD steps of a sharded MLP through ``zerosched.backend`` that dumps into ``root``
    (by its argument, or by $ZEROSCHED_DUMP); returns the files this rank wrote.  Each case
    uses a width no other case does, so that its graphs miss the backend's schedule cache."""
    torch.manual_seed(0)
    model = MLP(width)
    h = zerosched.shard(model)
    if via_env:
        os.environ["ZEROSCHED_DUMP"] = root
        backend = zerosched.backend(budget="16KiB")
        del os.environ["ZEROSCHED_DUMP"]
    else:
        backend = zerosched.backend(budget=16384, cost=BUCKETING_COST, dump=root)
    opt = torch.optim.SGD(h.parameters(), lr=0.1)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend)
        for _ in range(2):
            compiled(torch.randn(4, width)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        h.close()
        torch._dynamo.reset()
    rank = torch.distributed.get_rank()
    return sorted(os.listdir(os.path.join(root, f"rank{rank}")))


def dump_after_the_cache(root: str, width: int) -> tuple[list[str], int]:
    """A backend without a dump compiles a first model and then the MLP (its graphs are
    ``forward_1``, ``backward_1``); a dumping backend then compiles the same MLP, whose graphs
    (``forward_0``, ``backward_0``) the schedule cache serves under the other names.  Returns
    the files and the dumping backend's cache hits."""
    torch.manual_seed(0)
    first, model = MLP(width + 4), MLP(width)
    handles = [zerosched.shard(first), zerosched.shard(model)]
    plain, dumping = zerosched.backend(), zerosched.backend(dump=root)
    try:
        for m, backend in ((first, plain), (model, plain), (model, dumping)):
            hits = STATS.cache_hits
            torch._dynamo.reset()
            torch.compile(m, backend=backend)(torch.randn(4, m.width)).backward()
    finally:
        for h in handles:
            h.close()
        torch._dynamo.reset()
    files = sorted(os.listdir(os.path.join(root, f"rank{torch.distributed.get_rank()}")))
    return files, STATS.cache_hits - hits  # the dumping backend's
