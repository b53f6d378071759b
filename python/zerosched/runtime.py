"""The ZeRO-3 runtime on ``torch.distributed``: sharded parameters, gathers, releases, gradient
reductions, and the eager fallback for code that ``torch.compile`` did not compile.

:func:`shard` keeps every parameter object of the model with its full shape, frees its storage,
and holds the rank's slice of the flattened, padded parameter as a separate ``nn.Parameter``
(the *shard*), which is what an optimizer steps.  Compiled graphs reach the shard through the
``zerosched`` ops (``zerosched.ops``), which call the functions of this module by parameter
name.  docs/python.md describes the runtime.
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
        self.gathers: dict[str, tuple[dist.Work | None, torch.Tensor]] = {}  # in flight, per parameter
        self.reductions: list[tuple[dist.Work | None, ShardedParam, torch.Tensor]] = []
        self.gathered_bytes = 0  # gathered by compiled graphs and not yet released
        self.peak_gathered_bytes = 0
        self.live: dict[int, tuple[str, int]] = {}  # data_ptr of a gathered buffer -> (name, bytes)
        self.fallback: set[str] = set()  # gathered eagerly by the fallback, awaiting their backward
        self.fallback_release_queued = False
        self.fallback_gathers = 0
        self.coalesced_gathers = 0  # buckets issued as one collective
        self.shard_calls = 0

    def name_of(self, param: torch.Tensor) -> str | None:
        """The name of a model's parameter, or None for a tensor that is not one."""
        e = self.by_param.get(id(param))
        return e.name if e is not None else None

    def entry(self, name: str) -> ShardedParam:
        try:
            return self.params[name]
        except KeyError:
            raise ZeroschedError(
                f"parameter `{name}` is not sharded: call zerosched.shard(model) before compiling it"
            ) from None


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
        RUNTIME.reductions = [r for r in RUNTIME.reductions if r[1].name not in names]


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


def _join(work: dist.Work | None, t: torch.Tensor) -> None:
    """Makes the compute stream wait for ``work`` and tells the caching allocator that ``t``,
    allocated on the side stream, is used on the compute stream.  The wait is on the work's own
    completion (NCCL's ``wait`` makes the current stream wait for its end event), never on the
    whole side stream, which by then holds the gathers prefetched after this one."""
    if work is not None:
        work.wait()
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def _flat_source(e: ShardedParam, dtype: torch.dtype) -> torch.Tensor:
    s = e.shard.detach()
    return s if s.dtype == dtype else s.to(dtype)


def _count_alloc(name: str, buf: torch.Tensor, nbytes: int) -> None:
    RUNTIME.live[buf.untyped_storage().data_ptr()] = (name, nbytes)
    RUNTIME.gathered_bytes += nbytes
    RUNTIME.peak_gathered_bytes = max(RUNTIME.peak_gathered_bytes, RUNTIME.gathered_bytes)


def gather(names: list[str], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """Issues the all-gathers of ``names`` as one coalesced collective; returns the full
    parameters (their buffers are filled once :func:`wait` returns)."""
    entries = [RUNTIME.entry(n) for n in names]
    outs, pairs = [], []
    for e in entries:
        if e.persistent:
            raise ZeroschedError(f"parameter `{e.name}` is persistent (unsharded): nothing to gather")
        if e.name in RUNTIME.gathers:
            raise ZeroschedError(f"parameter `{e.name}` is gathered twice without a wait in between")
        dt = dtype or e.param.dtype
        buf = torch.empty(e.padded, dtype=dt, device=e.shard.device)
        outs.append(buf[: e.numel].view(e.param.shape).detach())  # not an autograd view of buf
        pairs.append((e, buf, _flat_source(e, dt)))
    group = entries[0].group if entries else None
    with _comm_stream(entries[0].shard.device if entries else torch.device("cpu")):
        if len(pairs) == 1:
            e, buf, src = pairs[0]
            works: list[dist.Work | None] = [dist.all_gather_into_tensor(buf, src, group=group, async_op=True)]
        else:
            with dist._coalescing_manager(group=group, async_ops=True) as cm:
                for e, buf, src in pairs:
                    dist.all_gather_into_tensor(buf, src, group=group)
            works = [cm] * len(pairs)  # every member's wait waits for the whole bucket
            RUNTIME.coalesced_gathers += 1
    for (e, buf, _), work, out in zip(pairs, works, outs):
        RUNTIME.gathers[e.name] = (work, out)
        _count_alloc(e.name, buf, buf.numel() * buf.element_size())
    return outs


def wait(name: str) -> None:
    """The compute stream waits for the gather of ``name`` (or of its whole bucket)."""
    try:
        work, out = RUNTIME.gathers.pop(name)
    except KeyError:
        raise ZeroschedError(f"wait for parameter `{name}`, which has no gather in flight") from None
    _join(work, out)


def release(name: str, value: torch.Tensor) -> None:
    """Frees the gathered storage that ``value`` lies in."""
    storage = value.untyped_storage()
    held = RUNTIME.live.pop(storage.data_ptr(), None)
    if held is None or held[0] != name:
        raise ZeroschedError(f"release of parameter `{name}`: the value is not its gathered buffer")
    RUNTIME.gathered_bytes -= held[1]
    storage.resize_(0)


def reduce_grad(name: str, grad: torch.Tensor) -> torch.Tensor:
    """Issues the gradient's reduction (a reduce-scatter into the shard's slice, or an
    all-reduce for a persistent parameter); :func:`end_backward` waits for it and averages it
    into the shard's ``.grad``.

    The parameter decides which, not the op's ``sharded`` flag: a backward graph that does not
    read a persistent parameter has no entry saying so, and the scheduler then takes it for
    sharded."""
    e = RUNTIME.entry(name)
    if grad.is_cuda:  # the side stream reads it after the graph may have dropped it
        grad.record_stream(_side_stream(grad.device))
    with _comm_stream(grad.device):
        if not e.persistent:
            out = torch.empty(e.chunk, dtype=grad.dtype, device=grad.device)
            work = dist.reduce_scatter_tensor(out, _padded_flat(e, grad), group=e.group, async_op=True)
        else:
            out = grad.detach().clone()
            work = dist.all_reduce(out, group=e.group, async_op=True)
    _accumulate_completed()
    RUNTIME.reductions.append((work, e, out))
    return out


def _padded_flat(e: ShardedParam, grad: torch.Tensor) -> torch.Tensor:
    """The gradient flattened to the padded length the reduce-scatter splits; a copy only where
    there is padding to add."""
    flat = grad.detach().reshape(-1)
    if e.padded == e.numel:
        return flat
    padded = flat.new_zeros(e.padded)
    padded[: e.numel] = flat
    return padded


def _accumulate_completed() -> None:
    """Accumulates the reductions in flight that have completed, oldest first, so that each one's
    input (the whole gradient) is dropped during the backward rather than held to its end."""
    done = 0
    for work, _, _ in RUNTIME.reductions:
        if work is not None and not work.is_completed():
            break
        done += 1
    finished, RUNTIME.reductions = RUNTIME.reductions[:done], RUNTIME.reductions[done:]
    for work, e, out in finished:
        _join(work, out)
        _accumulate(e, out)


def end_backward() -> None:
    """Waits for every reduction in flight and averages each into its shard's ``.grad``."""
    pending, RUNTIME.reductions = RUNTIME.reductions, []
    for work, e, out in pending:
        _join(work, out)
        _accumulate(e, out)
    _release_fallback_after_backward()


def _accumulate(e: ShardedParam, summed: torch.Tensor) -> None:
    # Gloo has no averaging reduction: sum, then divide (in place: the sum is ours).
    if e.world_size > 1:
        summed.div_(e.world_size)
    g = summed.to(e.shard.dtype).view(e.shard.shape)
    with torch.no_grad():
        if e.shard.grad is None:
            e.shard.grad = g
        else:
            e.shard.grad.add_(g)


def _gather_sync(e: ShardedParam) -> torch.Tensor:
    if e.persistent:
        return e.param.detach().clone()
    buf = torch.empty(e.padded, dtype=e.param.dtype, device=e.shard.device)
    dist.all_gather_into_tensor(buf, e.shard.detach(), group=e.group)
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
    dist.all_gather_into_tensor(flat, e.shard.detach(), group=e.group)
    RUNTIME.fallback.add(e.name)
    RUNTIME.fallback_gathers += 1


def _post_accumulate(e: ShardedParam):
    def hook(param: torch.Tensor) -> None:
        if param.grad is None:
            return
        out = torch.empty(e.chunk, dtype=param.grad.dtype, device=param.grad.device)
        dist.reduce_scatter_tensor(out, _padded_flat(e, param.grad), group=e.group)
        param.grad = None
        _accumulate(e, out)
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
