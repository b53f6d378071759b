"""Bad use of the backend and the runtime, run on every rank of a gloo process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched


def _compile_error(model: torch.nn.Module, x: torch.Tensor) -> tuple[str, str]:
    """The zerosched exception that compiling and running ``model`` raises (dynamo wraps what a
    backend raises in BackendCompilerFailed)."""
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=zerosched.backend())(x).sum().backward()
    except torch._dynamo.exc.BackendCompilerFailed as e:
        inner = e.inner_exception
        assert isinstance(inner, zerosched.ZeroschedError), repr(inner)
        return type(inner).__name__, str(inner)
    finally:
        torch._dynamo.reset()
    raise AssertionError("no error")


def not_sharded() -> tuple[str, str]:
    return _compile_error(torch.nn.Linear(4, 3), torch.randn(2, 4))


class TwoGroups(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def mixed_world_sizes() -> tuple[str, str]:
    """One graph reads parameters sharded over the world (2 ranks) and over each rank alone."""
    torch.manual_seed(0)
    model = TwoGroups()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    handles = [zerosched.shard(model.a), zerosched.shard(model.b, group=alone[dist.get_rank()])]
    try:
        return _compile_error(model, torch.randn(2, 4))
    finally:
        for h in handles:
            h.close()


class Branchy(torch.nn.Module):
    """A data-dependent branch: torch.cond stays a higher-order operator with subgraphs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: self.lin(x), lambda x: 2 * self.lin(x), (x,))


def unrepresentable() -> tuple[str, str]:
    torch.manual_seed(0)
    model = Branchy()
    h = zerosched.shard(model)
    try:
        return _compile_error(model, torch.randn(2, 4))
    finally:
        h.close()


def shard_twice() -> str:
    model = torch.nn.Linear(4, 4)
    h = zerosched.shard(model)
    try:
        zerosched.shard(model)
    except zerosched.ZeroschedError as e:
        return str(e)
    finally:
        h.close()
    raise AssertionError("no error")
