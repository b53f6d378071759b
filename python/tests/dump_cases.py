"""Training runs that dump their scheduled graphs, on every rank of a gloo group (test_dump.py)."""

from __future__ import annotations

import os

import torch

import zerosched
from backend_cases import MLP
from train_cases import BUCKETING_COST


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
