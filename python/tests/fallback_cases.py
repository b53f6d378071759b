"""The skipped-frame fallback, run on every rank of a gloo process group (see ranks.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched
from train_cases import mean_over_ranks, rel_err, step
from zerosched import runtime

STEPS = 5
WIDTH = 16


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Skipped(Block):
    """Runs eagerly inside a compiled model: its parameters never appear in a compiled graph."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.lin.weight.sum()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, WIDTH)
        self.a = Block()
        self.skipped = Skipped()
        self.b = Block()
        self.out = torch.nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.b(self.skipped(self.a(self.inp(x)))))


def train(with_fallback: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Net()
    model = Net()
    model.load_state_dict(ref.state_dict())
    sharded = zerosched.shard(model, persistence_threshold=0)
    if not with_fallback:
        sharded.remove_fallback()
    # AdamW here (SGD in train_cases): any torch.optim optimizer steps the shards.
    opt = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=zerosched.backend(budget=None))
    g = torch.Generator().manual_seed(7)
    out: dict = {"loss": [], "ref_loss": [], "gathered_between": [], "tracked_between": [], "tracked_after_forward": []}
    gathers0 = runtime.RUNTIME.fallback_gathers
    try:
        for _ in range(STEPS):
            x = torch.randn(world * 4, 8, generator=g)
            y = torch.randn(world * 4, 4, generator=g)
            mine = slice(rank * 4, (rank + 1) * 4)
            loss = torch.nn.functional.mse_loss(compiled(x[mine]), y[mine])
            out["tracked_after_forward"].append(sorted(runtime.RUNTIME.fallback))
            out["loss"].append(mean_over_ranks(step(loss, opt)))
            out["ref_loss"].append(step(torch.nn.functional.mse_loss(ref(x), y), opt_ref))
            out["gathered_between"].append(sharded.gathered())
            out["tracked_between"].append(sorted(runtime.RUNTIME.fallback))
        full = sharded.full_parameters()
        out["param_err"] = {n: rel_err(full[n], p.detach()) for n, p in ref.named_parameters()}
        out["fallback_gathers"] = runtime.RUNTIME.fallback_gathers - gathers0
    finally:
        sharded.close()
        torch._dynamo.reset()
    return out
