"""The ZeRO-3 runtime on ``torch.distributed``: sharded parameters, gathers, releases, gradient
reductions, and the eager fallback for code that ``torch.compile`` did not compile.

:func:`shard` keeps every parameter object of the model with its full shape, frees its storage,
and holds the rank's slice of the flattened, padded parameter as a separate ``nn.Parameter``
(the *shard*), which is what an optimizer steps.  Compiled graphs reach the shard through the
``zerosched`` ops (``zerosched.ops``), which call the functions of this module with the tensors
they receive: the model's parameter, or the buffer a gather returned.  docs/python.md describes
the runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Iterator

import torch
import torch.distributed as dist
from torch.optim import optimizer as optimizer_hooks

from zerosched._core import ZeroschedError


@dataclasses.dataclass(eq=False)
class ShardedParam:
    """One parameter of a sharded model (a tied parameter is one entry, under its first name)."""

    name: str
    param: torch.nn.Parameter  # the model's parameter: full shape, storage freed while not gathered
    shard: torch.nn.Parameter  # this rank's flat slice (padded), or the full parameter if persistent
    persistent: bool
    group: dist.ProcessGroup | None
    world_size: int
    rank: int

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def chunk(self) -> int:
        """Elements per rank: ``ceil(numel / world_size)``."""
        return math.ceil(self.numel / self.world_size)

    @property
    def padded(self) -> int:
        return self.chunk * self.world_size

    def gathered_bytes(self, dtype: torch.dtype) -> int:
        """The gathered buffer's size as docs/format.md counts it (the padded full size)."""
        return self.padded * _itemsize(dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class Runtime:
    """Process-wide state: the registered parameters, collectives in flight, byte counters."""

    def __init__(self) -> None:
        self.params: dict[str, ShardedParam] = {}
        self.by_param: dict[int, ShardedParam] = {}  # id of the model's parameter -> its entry
        self.gathers: dict[str, tuple[_InFlight, torch.Tensor]] = {}  # in flight, per parameter
        # Gradients queued by reduce_grad (entry, gradient, output), not yet issued, and their bytes.
        self.queued: list[tuple[ShardedParam, torch.Tensor, torch.Tensor]] = []
        self.queued_bytes = 0
        #: Gradient bytes queued before their reductions are issued as one collective: a
        #: backward holds up to this much more than the simulator counts (each gradient freed at
        #: its reduce_grad); 0 issues every reduction on its own.
        self.reduce_bucket_bytes = 64 << 20
        self.reductions: list[_Reduction] = []  # issued, oldest first, not yet accumulated
        self.finish_queued_for: int | None = None  # the backward pass whose end will wait for them
        self.backward_waits = 0  # waits for every reduction in flight (one per backward pass)
        self.gathered_bytes = 0  # gathered by compiled graphs and not yet released
        self.peak_gathered_bytes = 0
        self.live: dict[int, tuple[str, int]] = {}  # data_ptr of a gathered buffer -> (name, bytes)
        self.fallback: set[str] = set()  # gathered eagerly by the fallback, awaiting their backward
        self.fallback_release_queued = False
        self.fallback_gathers = 0
        self.coalesced_gathers = 0  # buckets issued as one collective
        self.shard_calls = 0

    def entry_of(self, param: torch.Tensor) -> ShardedParam:
        """The entry of a model's parameter, the tensor a compiled graph receives for it."""
        e = self.by_param.get(id(param))
        if e is None:
            raise ZeroschedError(
                f"a tensor of shape {tuple(param.shape)} is not a parameter that zerosched.shard() has sharded"
            )
        return e

    def gathered_name(self, value: torch.Tensor) -> str:
        """The parameter whose gathered buffer holds ``value``'s storage."""
        held = self.live.get(value.untyped_storage().data_ptr())
        if held is None:
            raise ZeroschedError(f"a tensor of shape {tuple(value.shape)} is not a gathered parameter buffer")
        return held[0]


RUNTIME = Runtime()


# --------------------------------------------------------------------------------------------
# sharding
# --------------------------------------------------------------------------------------------


class ShardedModel:
    """What :func:`shard` returns: the model's shards for the optimizer and checks on the runtime."""

    def __init__(self, model: torch.nn.Module, entries: list[ShardedParam]) -> None:
        self.model = model
        self.entries = entries
        self._hooks: list = []

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The tensors an optimizer steps: each parameter's shard (or the parameter, if persistent)."""
        return iter([e.shard for e in self.entries])

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered into a new full tensor (a collective: call it on every rank)."""
        return {e.name: _gather_sync(e) for e in self.entries}

    def gathered(self) -> list[str]:
        """Names of the parameters whose full storage is allocated now (persistent ones excluded)."""
        held = {name for name, _ in RUNTIME.live.values()}
        return [
            e.name
            for e in self.entries
            if not e.persistent and (e.param.untyped_storage().nbytes() > 0 or e.name in held)
        ]

    def remove_fallback(self) -> None:
        """Removes the eager fallback's hooks: code that torch.compile skips then reads freed
        parameters and fails."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def close(self) -> None:
        """Unregisters the model's parameters (the model cannot run afterwards)."""
        self.remove_fallback()
        names = {e.name for e in self.entries}
        for e in self.entries:
            RUNTIME.params.pop(e.name, None)
            RUNTIME.by_param.pop(id(e.param), None)
            RUNTIME.fallback.discard(e.name)
            RUNTIME.gathers.pop(e.name, None)
        for ptr in [p for p, (n, _) in RUNTIME.live.items() if n in names]:
            RUNTIME.gathered_bytes -= RUNTIME.live.pop(ptr)[1]
        RUNTIME.queued = [q for q in RUNTIME.queued if q[0].name not in names]
        RUNTIME.queued_bytes = sum(g.numel() * g.element_size() for _, g, _ in RUNTIME.queued)
        RUNTIME.reductions = [r for r in RUNTIME.reductions if all(e.name not in names for e in r.entries)]


def shard(model: torch.nn.Module, group: dist.ProcessGroup | None = None,
          persistence_threshold: int = 0) -> ShardedModel:
    """Shards every parameter of ``model`` over ``group`` (default: the whole world).

    A parameter of at most ``persistence_threshold`` elements stays whole on every rank
    (*persistent*; its gradient is all-reduced).  Every other parameter keeps its shape but
    its storage is freed; this rank's slice of the flattened parameter, padded with zeros to
    a multiple of the group size, becomes its shard.  The ranks must hold the same weights.
    """
    if not dist.is_initialized():
        raise ZeroschedError("zerosched.shard: torch.distributed is not initialized (call init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 1 or rank < 0:
        raise ZeroschedError("zerosched.shard: this process is not a member of the group")
    named: list[tuple[str, torch.nn.Parameter]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if getattr(p, "_zerosched_sharded", False):
            raise ZeroschedError(f"zerosched.shard: parameter `{name}` is already sharded")
        named.append((name, p))
    # Names are the runtime's keys.  A model whose names another live sharded model already
    # uses gets a prefix from the number of shard() calls, the same on every rank.
    RUNTIME.shard_calls += 1
    if any(n in RUNTIME.params for n, _ in named):
        named = [(f"m{RUNTIME.shard_calls}.{n}", p) for n, p in named]
    entries: list[ShardedParam] = []
    for name, p in named:
        persistent = p.numel() <= persistence_threshold
        e = ShardedParam(name, p, p, persistent, group, world, rank)
        if not persistent:
            flat = torch.zeros(e.padded, dtype=p.dtype, device=p.device)
            flat[: e.numel] = p.detach().reshape(-1)
            e.shard = torch.nn.Parameter(flat[rank * e.chunk : (rank + 1) * e.chunk].clone(),
                                         requires_grad=p.requires_grad)
            p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            p.untyped_storage().resize_(0)
        p._zerosched_sharded = True
        entries.append(e)
    handle = ShardedModel(model, entries)
    for e in entries:
        RUNTIME.params[e.name] = e
        RUNTIME.by_param[id(e.param)] = e
    handle._hooks = _install_fallback(model, entries)
    global _STEP_HOOK
    if _STEP_HOOK is None:
        _STEP_HOOK = optimizer_hooks.register_optimizer_step_post_hook(_clear_stepped_shards)
    return handle


_STEP_HOOK = None


def _clear_stepped_shards(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """After an optimizer has stepped shards, their gradients are cleared, as DeepSpeed's
    engine does.  Training loops that zero the model's gradients rather than the optimizer's
    (transformers' ``Trainer``, on the compiled wrapper) never reach the shards, and every
    step's gradient would be added to the last one's."""
    shards = {id(e.shard) for e in RUNTIME.params.values() if not e.persistent}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in shards:
                p.grad = None


# --------------------------------------------------------------------------------------------
# collectives
# --------------------------------------------------------------------------------------------
#
# Host time per inserted op is most of a small model's step (docs/training-benchmark.md,
# "Host overhead"), so the paths below issue each bucket of collectives as one call on the
# process group (no per-tensor pass through torch.distributed's Python wrappers), switch to the
# side stream once per bucket, and avoid record_stream: every buffer a collective touches is
# allocated on the compute stream and referenced by the runtime until the compute stream has
# waited for that collective, so the caching allocator cannot hand it out early.


def _comm_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """On a GPU, collectives are issued from a side stream that first waits for the compute
    stream (the shard may have just been written); on the CPU there is one stream."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


_SIDE_STREAMS: dict[int | None, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device.index)
    if stream is None:
        stream = _SIDE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


def _process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


# The collectives the runtime issues, each over a list of tensors in one call (the tests wrap
# these three to count them).


def _all_gather(group: dist.ProcessGroup | None, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> dist.Work:
    return _process_group(group).allgather_into_tensor_coalesced(outs, ins)


def _reduce_scatter(group: dist.ProcessGroup | None, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> dist.Work:
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # gloo has no averaging reduction: _accumulate divides
    return _process_group(group).reduce_scatter_tensor_coalesced(outs, ins, opts)


def _all_reduce(group: dist.ProcessGroup | None, tensors: list[torch.Tensor]) -> dist.Work:
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return _process_group(group).allreduce_coalesced(tensors, opts)


class _InFlight:
    """One collective in flight, shared by the members of its bucket: the first member's wait
    joins it, the others find it joined."""

    __slots__ = ("work",)

    def __init__(self, work: dist.Work) -> None:
        self.work: dist.Work | None = work

    def join(self) -> None:
        if self.work is not None:
            self.work.wait()  # NCCL: the current stream waits for the collective's end event
            self.work = None


def _count_alloc(name: str, buf: torch.Tensor, nbytes: int) -> None:
    RUNTIME.live[buf.data_ptr()] = (name, nbytes)
    RUNTIME.gathered_bytes += nbytes
    if RUNTIME.gathered_bytes > RUNTIME.peak_gathered_bytes:
        RUNTIME.peak_gathered_bytes = RUNTIME.gathered_bytes


def gather(params: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Issues the all-gathers of the model's parameters ``params`` as one coalesced collective;
    returns the full parameters (their buffers are filled once :func:`wait` returns)."""
    rt = RUNTIME
    outs, bufs, srcs, entries = [], [], [], []
    for p in params:
        e = rt.entry_of(p)
        if e.persistent:
            raise ZeroschedError(f"parameter `{e.name}` is persistent (unsharded): nothing to gather")
        if e.name in rt.gathers:
            raise ZeroschedError(f"parameter `{e.name}` is gathered twice without a wait in between")
        src = e.shard.detach()
        dt = dtype or e.param.dtype
        if src.dtype != dt:
            src = src.to(dt)
        if e.padded == e.numel:  # no padding: the buffer is the parameter
            out = torch.empty(e.param.shape, dtype=dt, device=src.device)
            buf = out.view(-1)
        else:
            buf = torch.empty(e.padded, dtype=dt, device=src.device)
            out = buf[: e.numel].view(e.param.shape)
        outs.append(out)
        bufs.append(buf)
        srcs.append(src)
        entries.append(e)
    if not entries:
        return outs
    with _comm_stream(srcs[0].device):
        flight = _InFlight(_all_gather(entries[0].group, bufs, srcs))
    if len(entries) > 1:
        rt.coalesced_gathers += 1
    for e, buf, out in zip(entries, bufs, outs):
        rt.gathers[e.name] = (flight, out)
        _count_alloc(e.name, buf, buf.numel() * buf.element_size())
    return outs


def wait(gathered: torch.Tensor) -> None:
    """The compute stream waits for the gather that fills ``gathered`` (or for its whole
    bucket: the bucket's first wait joins the collective, the others return at once)."""
    name = RUNTIME.gathered_name(gathered)
    try:
        flight, _ = RUNTIME.gathers.pop(name)
    except KeyError:
        raise ZeroschedError(f"wait for parameter `{name}`, which has no gather in flight") from None
    flight.join()


def release(value: torch.Tensor) -> None:
    """Frees the gathered storage that ``value`` lies in."""
    storage = value.untyped_storage()
    held = RUNTIME.live.pop(storage.data_ptr(), None)
    if held is None:
        raise ZeroschedError(f"release of a tensor of shape {tuple(value.shape)}, which is not a gathered buffer")
    RUNTIME.gathered_bytes -= held[1]
    storage.resize_(0)


@dataclasses.dataclass(eq=False)
class _Reduction:
    """A bucket of gradient reductions issued as one collective (two where it holds persistent
    parameters too): its inputs are kept until the compute stream has joined it."""

    flights: list[_InFlight]
    entries: list[ShardedParam]
    outs: list[torch.Tensor]
    inputs: list[torch.Tensor]

    def completed(self) -> bool:
        return all(f.work is None or f.work.is_completed() for f in self.flights)


def reduce_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Queues the reduction of the gradient of the model's parameter ``param`` (a
    reduce-scatter into the shard's slice, or an all-reduce for a persistent parameter) and
    returns the buffer it lands in.  The queue is issued as one coalesced collective once it
    holds ``RUNTIME.reduce_bucket_bytes`` of gradients (or at :func:`end_backward`);
    :func:`end_backward` waits for every reduction and averages it into the shard's ``.grad``."""
    rt = RUNTIME
    e = rt.entry_of(param)
    if rt.queued and rt.queued[0][0].group is not e.group:
        _issue_queued()
    if e.persistent:
        out = grad.detach().clone()  # all-reduced in place
    else:
        out = torch.empty(e.chunk, dtype=grad.dtype, device=grad.device)
    rt.queued.append((e, grad.detach(), out))
    rt.queued_bytes += grad.numel() * grad.element_size()
    if rt.queued_bytes >= rt.reduce_bucket_bytes:
        _issue_queued()
        _accumulate_completed()
    return out


def _issue_queued() -> None:
    """Issues the queued reductions: one reduce-scatter of the sharded parameters' gradients,
    one all-reduce of the persistent ones'."""
    rt = RUNTIME
    queued, rt.queued, rt.queued_bytes = rt.queued, [], 0
    if not queued:
        return
    group = queued[0][0].group
    sharded = [(e, _padded_flat(e, g), out) for e, g, out in queued if not e.persistent]
    persistent = [out for e, _, out in queued if e.persistent]
    flights = []
    with _comm_stream(queued[0][1].device):
        if sharded:
            flights.append(_InFlight(_reduce_scatter(group, [o for _, _, o in sharded], [i for _, i, _ in sharded])))
        if persistent:
            flights.append(_InFlight(_all_reduce(group, persistent)))
    rt.reductions.append(_Reduction(flights, [e for e, _, _ in queued], [o for _, _, o in queued],
                                    [i for _, i, _ in sharded]))


def _padded_flat(e: ShardedParam, grad: torch.Tensor) -> torch.Tensor:
    """The gradient flattened to the padded length the reduce-scatter splits; a copy only where
    there is padding to add."""
    flat = grad.reshape(-1)
    if e.padded == e.numel:
        return flat
    padded = flat.new_zeros(e.padded)
    padded[: e.numel] = flat
    return padded


def _accumulate_completed() -> None:
    """Accumulates the reductions in flight that have completed, oldest first, so that their
    inputs (the whole gradients) are dropped during the backward rather than held to its end."""
    rt = RUNTIME
    while rt.reductions and rt.reductions[0].completed():
        _accumulate(rt.reductions.pop(0))


def end_backward() -> None:
    """Issues the queued reductions and, once the backward pass is over, waits for every
    reduction in flight and averages each into its shard's ``.grad``.  A backward graph ends
    before the pass does when each block is compiled on its own: waiting at every block's end
    would put each block's reductions in the way of the next block's backward compute, so inside
    a pass the wait runs once, from an autograd engine callback at its end (as FSDP2 finishes its
    reductions); outside one it runs now."""
    _issue_queued()
    _accumulate_completed()
    task = torch._C._current_graph_task_id()
    if task == -1:
        _finish_backward()
    elif RUNTIME.finish_queued_for != task:  # once per pass (a task id: a failed pass runs no callback)
        RUNTIME.finish_queued_for = task
        # The callback runs on the engine's thread: the wait goes to this graph's compute stream.
        stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish_backward(stream))
    _release_fallback_after_backward()


def _finish_backward(stream: torch.cuda.Stream | None = None) -> None:
    RUNTIME.finish_queued_for = None
    RUNTIME.backward_waits += 1
    pending, RUNTIME.reductions = RUNTIME.reductions, []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for r in pending:
            _accumulate(r)


def _accumulate(r: _Reduction) -> None:
    for f in r.flights:
        f.join()
    world = r.entries[0].world_size
    if world > 1:  # sums (gloo has no averaging reduction): average in place, the sums are ours
        torch._foreach_div_(r.outs, world)
    # Each slice has its shard's shape: (chunk,) for a sharded parameter, the parameter's own
    # for a persistent one.
    new, into, adds = [], [], []
    for e, out in zip(r.entries, r.outs):
        g = out if out.dtype == e.shard.dtype else out.to(e.shard.dtype)
        if e.shard.grad is None:
            new.append((e, g))
        else:
            into.append(e.shard.grad)
            adds.append(g)
    with torch.no_grad():
        for e, g in new:
            e.shard.grad = g
        if adds:
            torch._foreach_add_(into, adds)


def _gather_sync(e: ShardedParam) -> torch.Tensor:
    if e.persistent:
        return e.param.detach().clone()
    buf = torch.empty(e.padded, dtype=e.param.dtype, device=e.shard.device)
    _all_gather(e.group, [buf], [e.shard.detach()]).wait()
    return buf[: e.numel].view(e.param.shape)


# --------------------------------------------------------------------------------------------
# eager fallback (docs/python.md, "Code that torch.compile skipped")
# --------------------------------------------------------------------------------------------


def _install_fallback(model: torch.nn.Module, entries: list[ShardedParam]) -> list:
    """A forward pre-hook on every module that owns sharded parameters gathers them when the
    module runs eagerly; the parameter's post-accumulate-grad hook reduces its gradient into
    the shard and frees the storage once its backward use is over."""
    by_id = {id(e.param): e for e in entries if not e.persistent}
    hooks = []
    for module in model.modules():
        own = [by_id[id(p)] for p in module.parameters(recurse=False) if id(p) in by_id]
        if own:
            hooks.append(module.register_forward_pre_hook(_pre_forward(own)))
    for e in by_id.values():
        if e.param.requires_grad:
            hooks.append(e.param.register_post_accumulate_grad_hook(_post_accumulate(e)))
    return hooks


def _pre_forward(own: list[ShardedParam]):
    def hook(module, args):
        # Inside a frame that dynamo traces, the compiled graph gathers; the hook is a no-op.
        if torch.compiler.is_compiling():
            return
        for e in own:
            if e.param.untyped_storage().nbytes() == 0:
                _fallback_gather(e)

    # After a graph break dynamo runs the rest of the frame eagerly but still compiles every
    # frame that code calls, this hook's included: compiled on its own, it would see
    # is_compiling() and gather nothing, and the module would read freed storage.  So dynamo
    # never compiles the hook as a frame of its own; it still inlines it, as a no-op, into
    # frames it traces.
    torch._dynamo.eval_frame.skip_code(hook.__code__)
    return hook


@torch.compiler.disable  # eager code: dynamo must not turn the gather into a graph
def _fallback_gather(e: ShardedParam) -> None:
    storage = e.param.untyped_storage()
    storage.resize_(e.padded * e.param.element_size())
    flat = torch.empty(0, dtype=e.param.dtype, device=e.param.device).set_(storage, 0, (e.padded,))
    _all_gather(e.group, [flat], [e.shard.detach()]).wait()
    RUNTIME.fallback.add(e.name)
    RUNTIME.fallback_gathers += 1


def _post_accumulate(e: ShardedParam):
    def hook(param: torch.Tensor) -> None:
        if param.grad is None:
            return
        out = torch.empty(e.chunk, dtype=param.grad.dtype, device=param.grad.device)
        flat = _padded_flat(e, param.grad.detach())
        flight = _InFlight(_reduce_scatter(e.group, [out], [flat]))
        param.grad = None
        _accumulate(_Reduction([flight], [e], [out], [flat]))
        if e.name in RUNTIME.fallback:
            RUNTIME.fallback.discard(e.name)
            param.untyped_storage().resize_(0)
        _release_fallback_after_backward()

    return hook


def _release_fallback_after_backward() -> None:
    """Called during a backward: once it has run to the end, frees every parameter the fallback
    still holds.  Those are parameters whose module ran its pre-hook eagerly but its body in a
    compiled graph (which gathered its own copy), or whose eager use needed no gradient: no
    post-accumulate-grad hook releases them, and the backward's end is the end of their use."""
    if RUNTIME.fallback and not RUNTIME.fallback_release_queued and torch._C._current_graph_task_id() != -1:
        RUNTIME.fallback_release_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(_release_fallback)


def _release_fallback() -> None:
    RUNTIME.fallback_release_queued = False
    for name in sorted(RUNTIME.fallback):
        RUNTIME.params[name].param.untyped_storage().resize_(0)
    RUNTIME.fallback.clear()
