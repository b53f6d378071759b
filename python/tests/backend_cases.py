"""The backend's cache and its cross-rank schedule check, run on every rank of a gloo group."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import zerosched
from train_cases import BUCKETING_COST
from zerosched import compiler as zb
from zerosched import runtime


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
    """Rank 0 prefetches with a cost model that coalesces gathers, rank 1 gathers just in time."""
    torch.manual_seed(0)
    model = MLP(16)
    h = zerosched.shard(model)
    first = dist.get_rank() == 0
    backend = zerosched.backend(scheduler="prefetch" if first else "jit", cost=BUCKETING_COST if first else None,
                                debug=True)
    try:
        _run(model, backend)
    except torch._dynamo.exc.BackendCompilerFailed as e:  # the forward's or the backward's, lowered together
        return str(e.inner_exception)
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


def layers_compiled_one_by_one(inner: str) -> dict:
    """Each layer of the MLP compiled on its own: dynamo runs one compiled graph for layers 1 to
    3 (layer 0's input needs no gradient: a graph of its own), with their parameters as inputs.
    The layers' weights differ, so a gather of another layer's parameter changes the loss, and a
    reduction into another layer's shard its gradient.  Every rank runs the whole batch, so each
    shard's averaged gradient is its slice of the unsharded model's.  Also returns the
    parameters gathered and those whose gradients were reduced, by name, in order."""
    torch.manual_seed(0)
    ref, model = MLP(16), MLP(16)
    model.load_state_dict(ref.state_dict())
    h = zerosched.shard(model)
    backend = zerosched.backend(inner=inner, debug=True)
    x = torch.randn(4, 16)
    torch._dynamo.reset()
    graphs0 = zb.STATS.graphs
    gathered, reduced = [], []
    gather, reduce_grad = runtime.gather, runtime.reduce_grad

    def recording_gather(params, dtype):
        gathered.extend(runtime.RUNTIME.entry_of(p).name for p in params)
        return gather(params, dtype)

    def recording_reduce_grad(param, grad):
        reduced.append(runtime.RUNTIME.entry_of(param).name)
        return reduce_grad(param, grad)

    runtime.gather, runtime.reduce_grad = recording_gather, recording_reduce_grad
    try:
        for i, layer in enumerate(model.layers):
            model.layers[i] = torch.compile(layer, backend=backend)
        loss = model(x)
        loss.backward()
        ref_loss = ref(x)
        ref_loss.backward()
        grad_err = {}
        for (name, p), e in zip(ref.named_parameters(), h.entries):
            flat = torch.zeros(e.padded)
            flat[: e.numel] = p.grad.reshape(-1)
            want = flat[e.rank * e.chunk : (e.rank + 1) * e.chunk]
            got = e.shard.grad
            grad_err[name] = float("inf") if got is None else float((got - want).abs().max() / p.grad.abs().max())
        return {"loss": loss.item(), "ref_loss": ref_loss.item(), "grad_err": grad_err,
                "graphs": zb.STATS.graphs - graphs0, "gathered": gathered, "reduced": reduced}
    finally:
        runtime.gather, runtime.reduce_grad = gather, reduce_grad
        h.close()
        torch._dynamo.reset()


def fake_propagations() -> dict:
    """Fake-tensor propagations over the graphs compiled with Inductor (a width no other case
    uses: compiled afresh), and the graphs compiled."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    torch.manual_seed(0)
    model = MLP(20)
    h = zerosched.shard(model)
    calls = [0]
    init = FakeTensorProp.__init__

    def counting(self, *args, **kwargs):
        calls[0] += 1
        init(self, *args, **kwargs)

    graphs0 = zb.STATS.graphs
    FakeTensorProp.__init__ = counting
    try:
        _run(model, zerosched.backend(inner="inductor"))
    finally:
        FakeTensorProp.__init__ = init
        h.close()
    return {"propagations": calls[0], "graphs": zb.STATS.graphs - graphs0}


class Projection(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)).sum()


def persistent_bias_reduction() -> dict:
    """The backward graph of a linear layer whose bias is persistent: the bias gradient never
    reads the bias, but its reduction does, so the graph carries it. Returns, from the
    scheduled backward graph, the parameters it carries and each reduction's ``sharded``
    keyword."""
    torch.manual_seed(0)
    model = Projection(20)  # a width no other case uses: its graphs are not in the cache yet
    h = zerosched.shard(model, persistence_threshold=20)  # the bias (20), not the weight (400)
    try:
        _run(model, zerosched.backend())
    finally:
        h.close()
    for scheduled, _ in zb._CACHE.values():
        doc = json.loads(scheduled)
        if doc.get("kind") != "backward" or not any(g["param"] == "proj.bias" for g in doc["grads"]):
            continue
        return {
            "params": sorted(p["name"] for p in doc["params"]),
            "sharded": {n["kwargs"]["param"]: n["kwargs"]["sharded"] for n in doc["nodes"]
                        if n["target"] == "zerosched.reduce_grad.default"},
        }
    raise AssertionError("no scheduled backward graph with the bias gradient")


def collectives_under_the_python_dispatcher() -> dict:
    """Counts the collectives a compiled step issues (the schedule check's included), and those
    issued with the Python dispatcher on: their kernel then runs holding the GIL, which gloo's
    worker thread may need before it lets the enqueue proceed."""
    counts = {"all_reduce": 0, "_all_gather": 0, "_reduce_scatter": 0, "_all_reduce": 0, "python_dispatcher": 0}
    # The schedule check's all-reduces, and the runtime's gathers and reductions.
    wrapped = [(dist, "all_reduce"), (runtime, "_all_gather"), (runtime, "_reduce_scatter"), (runtime, "_all_reduce")]
    originals = [getattr(m, n) for m, n in wrapped]

    def counting(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            counts["python_dispatcher"] += torch._C._dispatch_tls_is_dispatch_key_included(
                torch._C.DispatchKey.PythonDispatcher)
            return fn(*args, **kwargs)
        return call

    torch.manual_seed(0)
    model = MLP(28)  # a width no other case uses: both graphs are scheduled and checked
    h = zerosched.shard(model)
    for (m, n), fn in zip(wrapped, originals):
        setattr(m, n, counting(n, fn))
    try:
        _run(model, zerosched.backend(debug=True))
    finally:
        for (m, n), fn in zip(wrapped, originals):
            setattr(m, n, fn)
        h.close()
    return counts


def memory_named_for_both_graphs() -> dict:
    """``memory=1`` fits neither graph of the step; the figure the error names, given back, compiles
    and runs the forward and the backward, and one byte less does not."""
    torch.manual_seed(0)
    model = MLP(16)
    h = zerosched.shard(model)

    def attempt(memory: int) -> Exception | None:
        try:
            _run(model, zerosched.backend(memory=memory))
        except torch._dynamo.exc.BackendCompilerFailed as e:
            return e.inner_exception
        except zerosched.OverBudgetError as e:
            return e
        return None

    try:
        first = attempt(1)
        assert isinstance(first, zerosched.OverBudgetError), first
        given_back = attempt(first.needed)
        short = attempt(first.needed - 1)
    finally:
        h.close()
    return {"needed": first.needed, "kind": first.kind, "message": str(first), "given_back": repr(given_back),
            "short": type(short).__name__}
