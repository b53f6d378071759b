"""The runtime's collectives called directly, as the compiled graphs call them (no compile):
gathers of a bucket, waits, releases, and gradient reductions queued into buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerosched
from zerosched import runtime


class Odd(torch.nn.Module):
    """Parameters whose sizes need padding on two ranks (7, 15) and one that does not (12), and
    a bias small enough to stay whole (persistent)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.arange(7.0))
        self.b = torch.nn.Parameter(torch.arange(15.0).reshape(3, 5) / 10)
        self.c = torch.nn.Parameter(torch.arange(12.0).reshape(4, 3) - 5)
        self.bias = torch.nn.Parameter(torch.ones(2))


def _counting(counts: dict[str, int]):
    originals = {n: getattr(runtime, n) for n in ("_reduce_scatter", "_all_reduce")}

    def wrap(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    for n, fn in originals.items():
        setattr(runtime, n, wrap(n, fn))
    return originals


def gather_wait_release() -> dict:
    """A bucket of three gathers: the full parameters, the bytes counted while they are held."""
    model = Odd()
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = zerosched.shard(model, persistence_threshold=2)
    names = ["a", "b", "c"]
    try:
        outs = runtime.gather([getattr(model, n) for n in names], None)
        held = runtime.RUNTIME.gathered_bytes
        for o in outs:
            runtime.wait(o)
        got = {n: o.clone() for n, o in zip(names, outs)}
        for o in outs:
            runtime.release(o)
        return {"equal": {n: torch.equal(got[n], want[n]) for n in names}, "held": held,
                "after": runtime.RUNTIME.gathered_bytes, "freed": [o.untyped_storage().nbytes() for o in outs]}
    finally:
        h.close()


def reductions(bucket_bytes: int) -> dict:
    """Rank r's gradient of each parameter is (r + 1) * (its index + 1); each shard's .grad must be
    its slice of the average, whatever the bucket size, reduced in as many collectives as the
    bucket size makes."""
    model = Odd()
    h = zerosched.shard(model, persistence_threshold=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = {"_reduce_scatter": 0, "_all_reduce": 0}
    originals = _counting(counts)
    saved = runtime.RUNTIME.reduce_bucket_bytes
    runtime.RUNTIME.reduce_bucket_bytes = bucket_bytes
    try:
        params = dict(model.named_parameters())
        order = ["c", "bias", "b", "a"]
        for step in range(2):  # the second step adds into the first step's .grad
            for i, n in enumerate(order):
                runtime.reduce_grad(params[n], torch.full(params[n].shape, float((rank + 1) * (i + 1))))
            runtime.end_backward()
        err = {}
        mean = (world + 1) / 2  # the average of rank + 1 over the ranks
        for e in h.entries:
            i = order.index(e.name)
            full = torch.full((e.padded,), 2 * mean * (i + 1))
            full[e.numel:] = 0
            want = full if e.persistent else full[rank * e.chunk:(rank + 1) * e.chunk]
            err[e.name] = (e.shard.grad.reshape(-1) - want).abs().max().item()
        return {"err": err, "counts": counts, "queued": len(runtime.RUNTIME.queued),
                "in_flight": len(runtime.RUNTIME.reductions)}
    finally:
        runtime.RUNTIME.reduce_bucket_bytes = saved
        for n, fn in originals.items():
            setattr(runtime, n, fn)
        h.close()
