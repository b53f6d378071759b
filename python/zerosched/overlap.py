"""PyTorch's overlap scheduler on zerosched's programs, read back as a zerosched schedule.

``schedule_overlap_bucketing`` (torch/_inductor/fx_passes/overlap_scheduling.py) reorders and
buckets the functional collectives of one graph. This module gives it each graph of an
unscheduled fx-graph v1 program in the form SimpleFSDP traces: every sharded parameter
placeholder holds its flat shard and is gathered by ``_c10d_functional.all_gather_into_tensor``
and ``wait_tensor`` right before its first use; every gradient a backward graph returns goes
through ``reduce_scatter_tensor`` and ``wait_tensor`` right after its producer (``all_reduce``
for a persistent parameter). Values are fake CUDA tensors built from the document's
``meta.val``, views sharing their base's storage per ``meta.aliases``, so that the scheduler's
memory tracker counts them; the process group is PyTorch's fake one. Every runtime the
scheduler asks for is zerosched's cost model (``custom_runtime_estimation``).

The scheduled graph's order and buckets are then laid onto zerosched's own inserted graph
(the pipeline with ``schedule`` and ``keep`` switched off): compute nodes at PyTorch's
positions, each parameter's gather and wait at those of the collective that carries it (the
gathers of one PyTorch bucket adjacent, with one ``bucket`` id), each reduction at its
reduce-scatter's (the reductions of one PyTorch bucket adjacent, with one ``bucket`` id of the
reductions' own), releases right after the last use. The result is an fx-graph v1 schedule
that zerosched's checker and simulator read like any other.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.fx as fx

import zerosched
from zerosched.rebuild import torch_target

_FUNCOL = torch.ops._c10d_functional
#: The document's name of an FX node (FX renames a node whose name shadows a builtin).
NAME = "zerosched_name"
_ZS = "zerosched."


@dataclass
class TorchGraph:
    """One graph in PyTorch's form, and what the read-back needs to find its parameters."""

    gm: fx.GraphModule
    #: shard placeholder name -> parameter name
    shards: dict[str, str] = field(default_factory=dict)
    #: name of the node a gradient's collective reads -> parameter name
    grad_inputs: dict[str, str] = field(default_factory=dict)
    #: nodes this module added that are not in the document (views of gathered values, pads):
    #: no cost of their own in zerosched's model
    helpers: set[str] = field(default_factory=set)


@dataclass
class Plan:
    """PyTorch's schedule of one graph: positions in its final order."""

    position: dict[str, int]
    #: parameter -> (gather position, wait position, bucket key, index in the bucket)
    gathers: dict[str, tuple[int, int, int, int]]
    #: parameter -> (reduction position, index in its bucket)
    reductions: dict[str, tuple[int, int]]
    seconds: float


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise zerosched.ZeroschedError(f"dtype `{name}` is not a torch dtype")
    return dt


def _dim(d: Any) -> int:
    return int(d["hint"]) if isinstance(d, dict) else int(d)


def _contiguous(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return stride[::-1]


def _fresh(val: dict) -> torch.Tensor:
    shape = [_dim(d) for d in val["shape"]]
    stride = [_dim(d) for d in val.get("stride") or _contiguous(shape)]
    return torch.empty_strided(shape, stride, dtype=_torch_dtype(val["dtype"]), device="cuda")


def _view(base: torch.Tensor, val: dict) -> torch.Tensor:
    """A tensor of ``val``'s shape in ``base``'s storage (the memory tracker follows storage)."""
    shape = [_dim(d) for d in val["shape"]]
    stride = [_dim(d) for d in val.get("stride") or _contiguous(shape)]
    try:
        return base.as_strided(shape, stride, int(val.get("storage_offset") or 0))
    except RuntimeError:
        # Out of the base's bounds as recorded (an exporter's view of a padded buffer): the
        # scheduler then counts it as an allocation of its own, which only overstates memory.
        return _fresh(val)


def _refs(a: Any) -> Iterator[str]:
    if isinstance(a, dict) and "node" in a:
        yield a["node"]
    elif isinstance(a, list):
        for x in a:
            yield from _refs(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _refs(x)


def _node_refs(d: dict) -> list[str]:
    return [*_refs(d.get("args", [])), *_refs(d.get("kwargs", {}))]


def _target(name: str) -> Any:
    """The callable FX records: the aten/prims overload where there is one (the scheduler tells
    compute from the rest by it), else an opaque stand-in of the same name."""
    t = torch_target(name)
    return _opaque(name) if t is None else t


_OPAQUE: dict[str, Callable] = {}


def _opaque(name: str) -> Callable:
    if name not in _OPAQUE:
        def op(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"`{name}` is a stand-in: the overlap benchmark never runs a graph")
        op.__name__ = name.replace(".", "_")
        _OPAQUE[name] = op
    return _OPAQUE[name]


def _decode(a: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(a, dict) and "node" in a:
        return env[a["node"]]
    if isinstance(a, list):
        return [_decode(x, env) for x in a]
    if isinstance(a, dict):
        # dtypes, devices, symbolic ints: opaque to the scheduler, which reads only tensors
        return json.dumps(a, sort_keys=True)
    return a


def persistent_params(program: dict) -> set[str]:
    """The program's persistent parameters: its top-level list and every graph's flags."""
    out = set(program.get("persistent", []))
    for g in program["graphs"]:
        out |= {p["name"] for p in g.get("params", []) if p.get("persistent")}
        out |= {p["param"] for p in g.get("grads", []) if p.get("persistent")}
    return out


def torch_form(doc: dict, world_size: int, persistent: set[str], group: str) -> TorchGraph:
    """``doc`` (an unscheduled fx-graph v1 graph) as SimpleFSDP traces it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    g = fx.Graph()
    shards: dict[str, str] = {}
    grad_inputs: dict[str, str] = {}
    helpers: set[str] = set()
    constants: dict[str, torch.Tensor] = {}
    env: dict[str, fx.Node] = {}
    nodes = doc["nodes"]
    sharded = {p["node"]: p for p in doc.get("params", []) if p["name"] not in persistent}
    outputs = next((n for n in nodes if n["op"] == "output"), None)
    out_args = outputs["args"][0] if outputs else []
    out_list = out_args if isinstance(out_args, list) else [out_args]
    grad_of: dict[str, list[tuple[int, str]]] = {}
    for gr in doc.get("grads", []):
        k = gr["output_index"]
        ref = out_list[k] if k < len(out_list) else None
        if isinstance(ref, dict) and "node" in ref:
            grad_of.setdefault(ref["node"], []).append((k, gr["param"]))
    gathered: dict[str, fx.Node] = {}
    reduced: dict[int, fx.Node] = {}

    def helper(target: Any, args: tuple, val: Any, name: str) -> fx.Node:
        n = g.create_node("call_function", target, args, {}, name=name)
        n.meta["val"] = val
        n.meta[NAME] = name
        helpers.add(name)
        return n

    def gather(ph: str) -> fx.Node:
        p = sharded[ph]
        shape = [_dim(d) for d in p["shape"]]
        numel = math.prod(shape)
        shard = env[ph]
        with mode:
            full = _FUNCOL.all_gather_into_tensor.default(shard.meta["val"], world_size, group)
            done = _FUNCOL.wait_tensor.default(full)
        start = helper(_FUNCOL.all_gather_into_tensor.default, (shard, world_size, group), full, f"ag_{ph}")
        wait = helper(_FUNCOL.wait_tensor.default, (start,), done, f"wait_ag_{ph}")
        with mode:
            v = done[:numel].view(shape)
        return helper(torch.ops.aten.view.default, (wait, shape), v, f"param_{ph}")

    def reduce(node: fx.Node, k: int, param: str) -> None:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return
        numel = val.numel()
        with mode:
            flat = val.view(-1) if val.is_contiguous() else val.reshape(-1)
        x = helper(torch.ops.aten.view.default, (node, [numel]), flat, f"rs_in_{node.name}_{k}")
        if param in persistent:
            with mode:
                red = _FUNCOL.all_reduce.default(flat, "sum", group)
                done = _FUNCOL.wait_tensor.default(red)
            start = helper(_FUNCOL.all_reduce.default, (x, "sum", group), red, f"ar_{node.name}_{k}")
        else:
            pad = (-numel) % world_size
            if pad:
                with mode:
                    flat = torch.constant_pad_nd(flat, [0, pad])
                x = helper(torch.ops.aten.constant_pad_nd.default, (x, [0, pad]), flat, f"rs_pad_{node.name}_{k}")
            with mode:
                red = _FUNCOL.reduce_scatter_tensor.default(flat, "sum", world_size, group)
                done = _FUNCOL.wait_tensor.default(red)
            start = helper(_FUNCOL.reduce_scatter_tensor.default, (x, "sum", world_size, group), red,
                           f"rs_{node.name}_{k}")
        grad_inputs[x.meta[NAME]] = param
        reduced[k] = helper(_FUNCOL.wait_tensor.default, (start,), done, f"wait_{start.name}")

    for d in nodes:
        name, op = d["name"], d["op"]
        meta = d.get("meta", {})
        val = meta.get("val")
        if op == "placeholder":
            n = g.placeholder(name)
            n.meta[NAME] = name
            with mode:
                if name in sharded:
                    p = sharded[name]
                    numel = math.prod(_dim(x) for x in p["shape"])
                    n.meta["val"] = torch.empty(-(-numel // world_size), dtype=_torch_dtype(p["dtype"]), device="cuda")
                    shards[name] = p["name"]
                elif isinstance(val, dict) and "shape" in val:
                    n.meta["val"] = _fresh(val)
            env[name] = n
            continue
        if op == "output":
            outs = [_decode(a, env) for a in out_list]
            for k, r in reduced.items():
                outs[k] = r
            g.output(outs if isinstance(out_args, list) else outs[0]).meta[NAME] = name
            continue
        if op == "get_attr":
            # A constant the module owns; the scheduler reads only its value's size.
            n = g.get_attr(d["target"])
            n.meta[NAME] = name
            constants[d["target"]] = torch.empty(0)
            with mode:
                n.meta["val"] = _value(d, val, ())
            env[name] = n
            continue
        refs = [r for r in _node_refs(d) if r in sharded]
        for r in refs:
            if r not in gathered:
                gathered[r] = gather(r)
        local = dict(env)
        local.update(gathered)
        args = tuple(_decode(a, local) for a in d.get("args", []))
        kwargs = {k: _decode(v, local) for k, v in d.get("kwargs", {}).items()}
        target = _target(d["target"]) if op == "call_function" else d["target"]
        n = g.create_node(op, target, args, kwargs, name=name)
        n.meta[NAME] = name
        with mode:
            n.meta["val"] = _value(d, val, args)
        env[name] = n
        for k, param in grad_of.get(name, []):
            reduce(n, k, param)
    g.lint()
    return TorchGraph(fx.GraphModule(constants, g), shards, grad_inputs, helpers)


def _value(d: dict, val: Any, args: tuple) -> Any:
    """The fake value of a document node: a view of the argument ``meta.aliases`` names, an
    element of a tuple for a getitem, else fresh storage."""
    if d["target"] == "operator.getitem" and len(args) == 2 and isinstance(args[0], fx.Node):
        parent = args[0].meta.get("val")
        if isinstance(parent, (list, tuple)) and isinstance(args[1], int) and args[1] < len(parent):
            return parent[args[1]]
    if isinstance(val, list):
        return tuple(_fresh(v) if isinstance(v, dict) and "shape" in v else None for v in val)
    if not (isinstance(val, dict) and "shape" in val):
        return None
    for i in d.get("meta", {}).get("aliases") or []:
        base = args[i].meta.get("val") if i < len(args) and isinstance(args[i], fx.Node) else None
        if isinstance(base, torch.Tensor):
            return _view(base, val)
    return _fresh(val)


def _is(n: fx.Node, name: str) -> bool:
    """Whether ``n`` is the functional collective ``name`` (``all_gather``, ``reduce_scatter``,
    ``all_reduce``, in any variant such as the bucketer's ``_out`` ones) or ``wait_tensor``; the
    bucketer's helpers (``bucketing._pre_bucket_all_gather``) are not."""
    t = n.target
    return (n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace == "_c10d_functional"
            and t._opname.startswith(name))


def estimator(costs: dict[str, float], world_size: int, options: dict) -> Callable[[fx.Node, int | None], float]:
    """``custom_runtime_estimation``: zerosched's time of each node, ms.

    For a collective PyTorch passes ``override_size`` as input plus output bytes (of a bucket,
    or 0 for the latency alone); zerosched prices the full message."""
    def message(n: fx.Node, override: int | None) -> int:
        if override is not None:
            share = 0.5 if _is(n, "all_reduce") else world_size / (world_size + 1)
            return int(override * share)
        key = n.meta.get("val") if _is(n, "all_gather") else (n.args[0].meta.get("val") if n.args else None)
        return key.numel() * key.element_size() if isinstance(key, torch.Tensor) else 0

    def estimate(n: fx.Node, override: int | None) -> float:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            if _is(n, kind):
                return zerosched.collective_ms(kind, message(n, override), options)
        return costs.get(n.meta.get(NAME, ""), 0.0)
    return estimate


@contextmanager
def fake_process_group(world_size: int) -> Iterator[str]:
    """PyTorch's fake process group as the default group (the scheduler all-gathers its
    runtime estimates over it); yields its name."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield dist.group.WORLD.group_name
    finally:
        if owned:
            dist.destroy_process_group()


def run_scheduler(tg: TorchGraph, estimate: Callable, bucketing: bool, **options: Any) -> Plan:
    """Runs ``schedule_overlap_bucketing`` on ``tg`` and reads back its order and buckets.

    Compute nodes are priced by ``estimate`` where PyTorch would benchmark them on the GPU
    (``benchmark_node_with_cache_key``, which allocates real tensors on the nodes' device and
    caches by shape on disk), and the roofline figure it only logs beside them
    (``estimate_runtime_analytical``, which asks CUDA for the device's capabilities) is 0:
    the two things patched."""
    from torch._inductor.fx_passes import overlap_scheduling as osched

    def priced(n: fx.Node, custom: Callable | None = None) -> tuple[float, None]:
        return estimate(n, None), None

    with (mock.patch.object(osched, "benchmark_node_with_cache_key", priced),
          mock.patch.object(osched, "estimate_runtime_analytical", lambda n: 0.0)):
        t0 = time.perf_counter()
        gm = osched.schedule_overlap_bucketing(tg.gm, collective_bucketing=bucketing,
                                               custom_runtime_estimation=estimate, **options)
        seconds = time.perf_counter() - t0
    return read_back(gm, tg, seconds)


def _reach(start: fx.Node, step: Callable[[fx.Node], list[fx.Node]], stop: Callable[[fx.Node], bool]) -> list[fx.Node]:
    """Nodes where ``stop`` holds, reached from ``start`` along ``step``, in first-found order."""
    seen, found, stack = {start}, [], list(reversed(step(start)))
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if stop(n):
            found.append(n)
            continue
        stack.extend(reversed(step(n)))
    return found


def read_back(gm: fx.GraphModule, tg: TorchGraph, seconds: float) -> Plan:
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathers: dict[str, tuple[int, int, int, int]] = {}
    reductions: dict[str, tuple[int, int]] = {}
    inputs = lambda n: list(n.all_input_nodes)  # noqa: E731
    users = lambda n: list(n.users)  # noqa: E731
    for n in nodes:
        if _is(n, "all_gather"):
            shards = _reach(n, inputs, lambda m: m.op == "placeholder" or _is(m, "wait_tensor"))
            waits = _reach(n, users, lambda m: _is(m, "wait_tensor"))
            w = min((pos[m] for m in waits), default=pos[n])
            members = [tg.shards[s.meta[NAME]] for s in shards if s.meta.get(NAME) in tg.shards]
            for j, p in enumerate(members):
                gathers[p] = (pos[n], w, pos[n], j)
        elif _is(n, "reduce_scatter") or _is(n, "all_reduce"):
            grads = _reach(n, inputs, lambda m: m.meta.get(NAME) in tg.grad_inputs or m.op == "placeholder")
            members = [tg.grad_inputs[m.meta[NAME]] for m in grads if m.meta.get(NAME) in tg.grad_inputs]
            for j, p in enumerate(members):
                reductions[p] = (pos[n], j)
    position = {n.meta[NAME]: i for n, i in pos.items() if NAME in n.meta}
    return Plan(position, gathers, reductions, seconds)


def lay_out(inserted: dict, plan: Plan) -> dict:
    """zerosched's inserted graph ``inserted`` in the order and buckets of ``plan``."""
    nodes = inserted["nodes"]
    by_name = {d["name"]: d for d in nodes}
    end = len(plan.position) + 1
    keys: dict[str, tuple] = {}
    bucket_of: dict[str, int] = {}
    #: each reduction's PyTorch collective (its position)
    reduce_bucket_of: dict[str, int] = {}
    missing = []
    for i, d in enumerate(nodes):
        name, target = d["name"], d.get("target", "")
        param = d.get("kwargs", {}).get("param")
        deps = [keys[r] for r in _node_refs(d) if r in keys]
        after = max(deps, default=(-1.0, 0, 0))
        if d["op"] == "placeholder":
            keys[name] = (-1.0, 0, i)
        elif d["op"] == "output":
            keys[name] = (end + 1.0, 0, i)
        elif target == _ZS + "allgather.default":
            if param not in plan.gathers:
                missing.append(f"gather of `{param}`")
                continue
            at, _, b, j = plan.gathers[param]
            keys[name] = (float(at), j, i)
            bucket_of[name] = b
        elif target == _ZS + "wait.default":
            at = plan.gathers.get(param)
            keys[name] = (float(at[1]), 1 << 20, i) if at else (after[0], 1 << 30, i)
        elif target == _ZS + "reduce_grad.default":
            if param not in plan.reductions:
                missing.append(f"reduction of `{param}`")
                continue
            at, j = plan.reductions[param]
            keys[name] = (max(float(at), after[0]), 1 << 20 | j, i)
            reduce_bucket_of[name] = at
        elif target == _ZS + "end_backward.default":
            keys[name] = (float(end), 0, i)
        elif name in plan.position:
            keys[name] = (float(plan.position[name]), 0, i)
        else:
            # Releases, keeps and what the rewrite stage added: as soon as their inputs are.
            keys[name] = (after[0], 1 << 30, i)
    if missing:
        raise zerosched.ZeroschedError(
            f"graph `{inserted.get('name')}`: PyTorch's schedule has no {', '.join(missing[:3])}")
    # Kahn's algorithm, the smallest key first: PyTorch's order wherever the edges allow.
    indeg = {d["name"]: 0 for d in nodes}
    users: dict[str, list[str]] = {d["name"]: [] for d in nodes}
    for d in nodes:
        for r in set(_node_refs(d)):
            indeg[d["name"]] += 1
            users[r].append(d["name"])
    ready = [(keys[n], n) for n, k in indeg.items() if k == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (keys[u], u))
    ids: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for n, b in bucket_of.items():
        sizes[b] = sizes.get(b, 0) + 1
    out = []
    for n in order:
        d = dict(by_name[n])
        b = bucket_of.get(n)
        if b is not None and sizes[b] > 1:
            d["kwargs"] = dict(d.get("kwargs", {}), bucket=ids.setdefault(b, len(ids)))
        out.append(d)
    _bucket_reductions(out, reduce_bucket_of)
    return dict(inserted, nodes=out)


def _bucket_reductions(nodes: list[dict], collective_of: dict[str, int]) -> None:
    """Gives the reductions of one PyTorch collective a ``bucket`` id of their own (reductions
    number their buckets apart from gathers), where the order left them adjacent and of one
    kind and dtype, as docs/format.md requires; each run of two or more is one bucket."""
    def key(d: dict):
        return (collective_of.get(d["name"]), d.get("kwargs", {}).get("sharded"),
                json.dumps(d.get("meta", {}).get("val", {}).get("dtype")))
    runs: list[list[dict]] = []
    for d in nodes:
        if d["name"] in collective_of and runs and runs[-1] and key(runs[-1][-1]) == key(d):
            runs[-1].append(d)
        else:
            runs.append([d] if d["name"] in collective_of else [])
    for b, run in enumerate(r for r in runs if len(r) > 1):
        for d in run:
            d["kwargs"] = dict(d.get("kwargs", {}), bucket=b)


@dataclass
class TorchSchedule:
    """PyTorch's schedule of a whole program as a zerosched document, and its scheduling time."""

    document: bytes
    seconds: float
    #: per graph, PyTorch's order and buckets as read back
    plans: list[Plan]


def schedule_program(program: dict, world_size: int = 8, cost: dict | None = None, bucketing: bool = True,
                     **options: Any) -> TorchSchedule:
    """Runs PyTorch's overlap scheduler on every graph of ``program`` (parsed fx-program JSON)
    and returns its schedule laid onto zerosched's inserted graphs."""
    zs_options: dict[str, Any] = {"world_size": world_size}
    if cost is not None:
        zs_options["cost"] = cost
    data = json.dumps(program).encode()
    inserted_bytes, _ = zerosched.schedule(data, dict(zs_options, disable=["schedule", "keep"]))
    inserted = json.loads(inserted_bytes)
    costs = {c["graph"]: c["ms"] for c in json.loads(zerosched.compute_costs(inserted_bytes, zs_options))}
    persistent = persistent_params(program)
    graphs, plans = [], []
    with fake_process_group(world_size) as group:
        for doc, ins in zip(program["graphs"], inserted["graphs"]):
            tg = torch_form(doc, world_size, persistent, group)
            plan = run_scheduler(tg, estimator(costs[ins["name"]], world_size, zs_options), bucketing, **options)
            plans.append(plan)
            graphs.append(lay_out(ins, plan))
    return TorchSchedule(json.dumps(dict(inserted, graphs=graphs)).encode(), sum(p.seconds for p in plans), plans)
