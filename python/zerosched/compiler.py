"""The ``torch.compile`` backend: ``torch.compile(model, backend=zerosched.backend(...))``.

AOTAutograd splits each dynamo graph into a forward and a backward graph.  Each is exported to
fx-graph v1 (``zerosched.export``), scheduled by the Rust core in-process, rebuilt as an FX
graph with zerosched's ops in the scheduled order (``zerosched.rebuild``), and handed to the
inner compiler (eager FX, or Inductor).  docs/python.md describes it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from zerosched import _core, dump as dumping, export, rebuild, runtime
from zerosched._core import ZeroschedError

INNER = ("eager", "inductor")


@dataclasses.dataclass
class Stats:
    """Seconds spent in zerosched by the backends of this process, and graphs compiled:
    export (FX graph to fx-graph v1 bytes), schedule (the Rust core), rebuild (parsing the
    scheduled document and building the FX graph), and, with ``inner="inductor"``, Inductor's
    compile of the rebuilt graph (``inductor_s``: not zerosched's own time)."""

    export_s: float = 0.0
    schedule_s: float = 0.0
    rebuild_s: float = 0.0
    inductor_s: float = 0.0
    graphs: int = 0
    cache_hits: int = 0

    def total_s(self) -> float:
        """zerosched's own seconds (Inductor's compile left out)."""
        return self.export_s + self.schedule_s + self.rebuild_s


STATS = Stats()

#: sha256 of (exported graph, options) -> (scheduled graph, report).
_CACHE: dict[bytes, tuple[bytes, str]] = {}


def backend(budget: int | str | None = None, scheduler: str = "prefetch", inner: str = "eager", *,
            memory: int | str | None = None, cost: dict | None = None, debug: bool = False,
            dump: str | None = None) -> Callable:
    """A ``torch.compile`` backend for a model that :func:`zerosched.shard` has sharded.

    ``budget`` bounds the gathered parameter bytes alive at once in each graph, ``memory`` every
    byte alive at once on a rank as the simulator counts it (activations, gathered parameters,
    gradients until reduced, buffers kept from the forward; ``"80GiB"``), ``scheduler`` is
    ``prefetch``, ``jit`` or ``deepcompile`` (docs/passes.md), ``inner`` compiles the scheduled
    graphs (``"eager"``: run the FX graph; ``"inductor"``), ``cost`` is the cost model.  With
    ``debug``, every rank all-reduces a hash of each schedule and a disagreement raises.
    ``dump`` (default ``$ZEROSCHED_DUMP``) is a directory that receives every graph scheduled,
    with its options and result (``zerosched.dump``).
    """
    if inner not in INNER:
        raise ZeroschedError(f"zerosched.backend: inner must be one of {INNER}, not {inner!r}")
    options: dict[str, Any] = {"budget": budget, "memory": memory, "scheduler": scheduler}
    if cost is not None:
        options["cost"] = cost
    _core.schedule(b'{"format":"fx-graph","version":1,"nodes":[{"name":"o","op":"output","target":"output",'
                   b'"args":[[]],"kwargs":{}}]}', {**options, "world_size": 1})  # refuses bad options now
    counter = [0]
    dumper = dumping.resolve(dump)

    def compile_aot(dyn_gm: torch.fx.GraphModule, example_inputs: list,
                    entries: list[runtime.ShardedParam | None]) -> Callable:
        from torch._dynamo.backends.common import aot_autograd

        k = counter[0]
        counter[0] += 1
        param_obj = {e.name: e.param for e in entries if e is not None}
        persistent = {e.name for e in entries if e is not None and e.persistent}
        step = export.StepParams(k, dyn_gm, example_inputs, [e.name if e else None for e in entries], param_obj,
                                 lambda fqn, p: fqn in persistent)
        world = {e.world_size for e in entries if e is not None}
        opts = {**options, "world_size": world.pop() if world else 1}

        # A budget the forward cannot meet is reported with the backward's figure too, so that the
        # smallest it names works for both graphs: the forward is then compiled at its own
        # smallest, and the backward (lowered with the forward, not at its first run) raises.
        over: list[_core.OverBudgetError] = []

        def fw(gm: torch.fx.GraphModule, ex: list, kind: str = "forward") -> Callable:
            params, rg = step.forward(gm)
            name = f"{kind}_{k}"
            try:
                return _compile(gm, ex, name, kind, params, [], rg, opts, inner, debug, dumper=dumper)
            except _core.OverBudgetError as e:
                if kind != "forward":
                    raise
                over.append(e)
                return _compile(gm, ex, name, kind, params, [], rg, {**opts, e.kind: e.needed}, inner, debug,
                                dumper=dumper)

        def bw(gm: torch.fx.GraphModule, ex: list) -> Callable:
            _drop_grad_of(gm)
            params, grads, rg = step.backward(gm)
            try:
                compiled = _compile(gm, ex, f"backward_{k}", "backward", params, grads, rg, opts, inner, debug,
                                    persistent=step.persistent(grads), dumper=dumper)
            except _core.OverBudgetError as e:
                over.append(e)
                compiled = None
            if over:
                raise _over_both(over, k, opts)
            return compiled

        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            return aot_autograd(
                fw_compiler=fw,
                bw_compiler=bw,
                inference_compiler=lambda gm, ex: fw(gm, ex, "inference"),
                decompositions=_decompositions(inner),
                partition_fn=_partition([i for i, e in enumerate(entries) if e is not None]),
                keep_inference_input_mutations=True,
            )(dyn_gm, example_inputs)

    def compile_dynamo_graph(dyn_gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        entries = _entries(dyn_gm, example_inputs)
        first = compile_aot(dyn_gm, example_inputs, entries)
        if all(e is None for e in entries):
            return first
        compiled = {_reuse_key(example_inputs): first}

        # Dynamo passes parameters as graph inputs and runs one compiled graph for every module
        # of the same code (each decoder block compiled on its own, or each after a graph
        # break).  The inserted ops find their parameters from those inputs, so the graph
        # serves every set of parameters that its schedule and fake kernels hold for; another
        # set gets a graph of its own.
        @torch.compiler.disable
        def run(*args: Any) -> Any:
            key = _reuse_key(args)
            fn = compiled.get(key)
            if fn is None:
                fn = compiled[key] = compile_aot(dyn_gm, list(args), _entries(dyn_gm, args))
            return fn(*args)

        return run

    return compile_dynamo_graph


def _over_both(errors: list, k: int, opts: dict) -> Exception:
    """One graph's error as it was, or, where both of the pair failed, one naming the smallest
    budget of each kind that works for both."""
    if len(errors) == 1:
        return errors[0]
    kinds = {e.kind for e in errors}
    worst = max(errors, key=lambda e: e.needed)
    needed = {kind: max(e.needed for e in errors if e.kind == kind) for kind in kinds}
    what = "; ".join(f"the smallest {kind} budget that works is {n} bytes" for kind, n in sorted(needed.items()))
    err = _core.OverBudgetError(f"graphs `forward_{k}` and `backward_{k}`: no schedule fits the {worst.kind} budget "
                                f"given; {what}")
    err.needed, err.kind = worst.needed, worst.kind
    return err


def _reuse_key(args: Sequence[Any]) -> tuple:
    """What a compiled graph assumes of its inputs beyond dynamo's guards: which are sharded
    parameters, their shapes, strides, dtypes and ``requires_grad`` (the schedule's bytes and
    gradients), persistence and world size (what is gathered, and the reductions' sizes)."""
    key = []
    for a in args:
        e = runtime.RUNTIME.by_param.get(id(a)) if isinstance(a, torch.Tensor) else None
        key.append(None if e is None else
                   (tuple(a.shape), a.stride(), a.dtype, a.requires_grad, e.persistent, e.world_size))
    return tuple(key)


#: Ops that change a tensor's dtype or layout only: what stands between a parameter and its use.
_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default")
_VIEWS = ("aten.t.default", "aten.transpose.int", "aten.permute.default", "aten.view.default",
          "aten._unsafe_view.default", "aten.reshape.default", "aten.expand.default", "aten.unsqueeze.default",
          "aten.squeeze.dim", "aten.alias.default", "aten.detach.default", "aten.clone.default")


# A gradient's reduction reads its parameter (``zerosched.ops``), but a backward need not read
# the parameter otherwise (a bias's or an embedding's gradient does not): the partitioner
# passes it to the backward only if a backward node reads it.  ``grad_of(grad, param)``, put
# on each parameter's gradient output in the joint graph, is that node; the backward compiler
# takes it out again (``_drop_grad_of``) before the graph is scheduled.  Saving the parameter
# costs nothing: it is the model's parameter, alive anyway, with its storage freed.
_MARKER_LIB = torch.library.Library("zerosched", "FRAGMENT")
_MARKER_LIB.define("grad_of(Tensor grad, Tensor param) -> Tensor")
_GRAD_OF = torch.ops.zerosched.grad_of.default


def _drop_grad_of(gm: torch.fx.GraphModule) -> None:
    for n in list(gm.graph.nodes):
        if n.target is _GRAD_OF:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
    gm.recompile()


def _partition(param_inputs: list[int]) -> Callable:
    """AOTAutograd's min-cut partitioner, which passes every parameter with a gradient to the
    backward (``grad_of`` above), told to recompute in the backward every cast of a parameter
    (and the views around it) instead of saving it.

    Under ``torch.autocast`` a Linear reads ``weight.to(bfloat16)``.  Saved for the backward,
    that copy is the parameter's gathered buffer (the scheduler gathers straight into the
    compute dtype): the forward could not release it, the backward does not read the parameter,
    and the gathered copy outlived the step.  Recomputed, the backward reads the parameter and
    gathers it again, as it does without autocast."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        primals = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("primals")]
        out = joint.graph.output_node()
        outs = list(out.args[0])
        grads = outs[kwargs["num_fwd_outputs"]:]
        if len(grads) != len(primals):
            raise ZeroschedError(f"joint graph: {len(grads)} gradient outputs for {len(primals)} inputs")
        for i in param_inputs:
            if i < len(grads) and isinstance(grads[i], torch.fx.Node):
                with joint.graph.inserting_before(out):
                    marked = joint.graph.call_function(_GRAD_OF, (grads[i], primals[i]))
                marked.meta = dict(grads[i].meta)
                outs[kwargs["num_fwd_outputs"] + i] = marked
        out.args = (type(out.args[0])(outs), *out.args[1:])
        for i in param_inputs:
            if i >= len(primals):
                continue
            chain: list[torch.fx.Node] = []
            todo = [primals[i]]
            while todo:
                node = todo.pop()
                for user in node.users:
                    if (user.op == "call_function" and export.target_name(user) in _CASTS + _VIEWS
                            and user.args and user.args[0] is node and user not in chain):
                        chain.append(user)
                        todo.append(user)
            if any(export.target_name(n) in _CASTS for n in chain):
                for n in chain:
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    return partition


def _decompositions(inner: str) -> dict:
    """Inductor lowers the graphs it is given only after its own decompositions; the eager
    inner compiler gets the exporter's (core ATen), built once per process (it took 0.65 s at
    every compiled graph, and a model with graph breaks compiles many); each caller gets its own
    copy.  Inductor's table follows its config, so it is looked up each time (a cheap call)."""
    if inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    return dict(_core_decompositions())


@functools.cache
def _core_decompositions() -> dict:
    return export.default_decompositions()


def _entries(dyn_gm: torch.fx.GraphModule, example_inputs: list) -> list[runtime.ShardedParam | None]:
    """The runtime's entry of each example input that is a parameter; a parameter zerosched has
    not sharded is an error."""
    names = [n.name for n in dyn_gm.graph.nodes if n.op == "placeholder"]
    out: list[runtime.ShardedParam | None] = []
    for name, x in zip(names, example_inputs):
        e = runtime.RUNTIME.by_param.get(id(x))
        if e is None and isinstance(x, torch.nn.Parameter):
            raise ZeroschedError(
                f"graph input `{name}` is a parameter ({tuple(x.shape)}) that zerosched.shard() has not sharded: "
                "shard the model before compiling it with zerosched.backend()"
            )
        out.append(e)
    worlds = {e.world_size for e in out if e is not None}
    if len(worlds) > 1:
        raise ZeroschedError(f"one graph reads parameters sharded over different world sizes {sorted(worlds)}")
    return out


def _compile(gm: torch.fx.GraphModule, ex: list, name: str, kind: str, params: list, grads: list,
             rg: dict, opts: dict, inner: str, debug: bool, persistent: frozenset[str] = frozenset(),
             dumper: dumping.Dumper | None = None) -> Callable:
    t0 = time.perf_counter()
    doc = export.graph_to_doc(gm, name=name, kind=kind, params=params, grads=grads, requires_grad=rg,
                              persistent=persistent)
    # The key leaves out the graph's name, which only labels reports and messages.  It keeps the
    # parameters' names: the rebuilt graph no longer depends on them, but the scheduled document
    # names them (reports, dumps, the debug hash), and it must be that of this graph.
    unnamed = export.dumps_graph({k: v for k, v in doc.items() if k != "name"})
    key = hashlib.sha256(unnamed.encode() + json.dumps(opts, sort_keys=True).encode()).digest()
    hit = _CACHE.get(key)
    if hit is None:
        data = export.dumps_graph(doc).encode()
    t1 = time.perf_counter()
    if hit is None:
        hit = _CACHE[key] = _core.schedule(data, opts)
    else:
        STATS.cache_hits += 1
    if dumper is not None:
        dumper.compiled(doc, opts, hit)
    t2 = time.perf_counter()
    doc = json.loads(hit[0])
    new_gm = rebuild.rebuild(gm, doc, drop_outputs=[i for _, i in grads], world_size=opts["world_size"])
    t3 = time.perf_counter()
    STATS.export_s += t1 - t0
    STATS.schedule_s += t2 - t1
    STATS.rebuild_s += t3 - t2
    STATS.graphs += 1
    if debug:
        _assert_same_schedule(doc)
    if inner == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx_inner

        # No fake-tensor propagation here: compile_fx_inner runs its own over the whole graph
        # (``additional_fake_tensor_prop``), which gives the new nodes their values.
        # A release frees its gathered buffer's storage where Inductor cannot see it: Inductor must
        # not hand that buffer to a later kernel (the caching allocator still recycles the memory).
        # Inductor's reordering for peak memory moves gathers ahead of releases that the schedule
        # put before them (it does not hold to the order of effectful ops that return nothing),
        # which breaks the budget: the graph runs in the scheduled order.  Inductor's graph cache
        # is off: it reused a graph compiled on one rank on two while the fake kernels read the
        # runtime's world size; they now read it from the graph, but the cache is untested here.
        with inductor_config.patch(allow_buffer_reuse=False, inplace_buffers=False, reorder_for_peak_memory=False,
                                   fx_graph_cache=False):
            compiled = compile_fx_inner(new_gm, ex, is_backward=kind == "backward", is_inference=kind == "inference")
        STATS.inductor_s += time.perf_counter() - t3
        return compiled
    from functorch.compile import make_boxed_func

    return make_boxed_func(new_gm.forward)


def _assert_same_schedule(doc: dict) -> None:
    """Ranks that reach different schedules issue collectives in different orders and hang:
    compare a hash of the schedule across ranks (docs/design.md §4, mode 6).  The schedule is
    the node order and the inserted ops' arguments; tensor metadata may legitimately differ
    (a rank's input slice has another storage offset)."""
    # A graph without zerosched's ops issues no collectives; ranks may compile such graphs
    # differently (code that runs eagerly after a graph break recompiles for data-dependent shapes).
    if not dist.is_initialized() or not any(n["target"].startswith("zerosched.") for n in doc["nodes"]):
        return
    name = doc.get("name", "<graph>")
    order = [(n["name"], n["target"], n["kwargs"] if n["target"].startswith("zerosched.") else None)
             for n in doc["nodes"]]
    h = int.from_bytes(hashlib.sha256(json.dumps(order, sort_keys=True).encode()).digest()[:7], "little")
    from torch._dispatch.python import no_python_dispatcher
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # AOTAutograd calls the compilers under its fake mode: the hash must be a real tensor, and
    # on the device the group's backend reduces (NCCL reduces GPU tensors only).  It may also
    # call them with the Python dispatcher on, which runs the collective's kernel holding the
    # GIL; gloo's worker thread, freeing an earlier collective's tensors under the lock that
    # the enqueue waits for, needs the GIL too, and the rank deadlocks.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    with unset_fake_temporarily(), no_python_dispatcher():
        lo = torch.tensor([h], dtype=torch.int64, device=device)
        hi = lo.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        same = lo.item() == hi.item()
    if not same:
        raise ZeroschedError(f"graph `{name}`: the ranks reached different schedules (hashes differ)")
