"""Graphs that hold ``get_attr`` constants, trained through the backend on every rank of a gloo
group: a tensor built in ``forward`` (AOTAutograd lifts it to ``_tensor_constant0``, as it does
transformers' cache positions) and a buffer of a module that dynamo inlines as an attribute."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched
from zerosched import rebuild
from train_cases import mean_over_ranks, rel_err


class WithConstants(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0])  # a lifted tensor constant
        h = torch.tanh(self.proj(x) * scale)
        return (self.out(h) + torch.arange(8.0)).pow(2).mean()


def train_with_constants(steps: int = 3) -> dict:
    """Losses and parameters against the eager model on the whole batch, and the ops of every
    scheduled graph the backend rebuilt."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref, model = WithConstants(), WithConstants()
    model.load_state_dict(ref.state_dict())
    sharded = zerosched.shard(model)
    opt, opt_ref = torch.optim.SGD(sharded.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    seen: list[dict] = []
    original = rebuild.rebuild

    def recording(gm, doc, **kw):
        seen.append({"name": doc["name"], "ops": [n["op"] for n in doc["nodes"]],
                     "targets": [n["target"] for n in doc["nodes"]]})
        return original(gm, doc, **kw)

    rebuild.rebuild = recording
    torch._dynamo.reset()
    out: dict = {"loss": [], "ref_loss": []}
    try:
        compiled = torch.compile(model, backend=zerosched.backend(debug=True))
        g = torch.Generator().manual_seed(7)
        for _ in range(steps):
            x = torch.randn(2 * world, 8, generator=g)
            loss = compiled(x[2 * rank : 2 * rank + 2])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["loss"].append(mean_over_ranks(loss.item()))
            ref_loss = ref(x)
            ref_loss.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            out["ref_loss"].append(ref_loss.item())
        full = sharded.full_parameters()
        out["param_err"] = {n: rel_err(full[n], p.detach()) for n, p in ref.named_parameters()}
    finally:
        rebuild.rebuild = original
        sharded.close()
        torch._dynamo.reset()
    out["graphs"] = seen
    return out
