"""DeepSpeed DeepCompile's ZeRO-3 pass on zerosched's scheduler (docs/python.md).

DeepCompile's ``zero3_compile`` pass inserts its ``dc`` ops (``allgather_param``,
``wait_allgather``, ``release_param``, ``reduce_grad``) into each AOT graph, profiles the
graph, then orders it with ``fast_free_schedule``. :func:`install` puts :func:`schedule_graph`
in that function's place. It undoes DeepSpeed's insertion, which is a reversible wrapping of
parameter placeholders and gradients, exports the plain graph to fx-graph v1 with its
parameters and gradients, lets zerosched insert and schedule the ZeRO-3 ops, and writes the
result back as ``dc`` ops with DeepSpeed's own arguments, names and node metadata, so
DeepSpeed's runtime and its later passes run it unchanged.

Redoing the insertion, not only the ordering, is what removes DeepSpeed's failure modes: a
parameter whose only consumer is the output is passed through as its shard instead of
returned gathered and never released; releases follow every real use through views and
``getitem``s, on the final order; dependency walks follow keyword arguments; the scheduler
is linear in the graph's size.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
from typing import Any

import torch
from torch.fx import Graph, Node

from . import dump as dumping
from . import export
from ._core import OverBudgetError, ZeroschedError
from ._core import schedule as _schedule

#: zerosched's passes the adapter runs: the rewrite stage can reshape view chains that
#: DeepSpeed's profile names, and keeping buffers across graphs needs both graphs of a step,
#: while DeepSpeed schedules one graph at a time.
DISABLED_PASSES = ["rewrite", "keep"]

_FUSED_CAST = torch.ops.prims.convert_element_type.default


def _dc(name: str):
    return getattr(torch.ops.dc, name).default


@dataclasses.dataclass
class _Param:
    """One gathered parameter of a DeepSpeed graph, by its ``ds_id``."""

    ds_id: int
    graph_id: int
    placeholder: Node | None = None  # in the stripped graph
    shape: list[int] | None = None
    dtype: torch.dtype | None = None
    gather: Node | None = None  # DeepSpeed's nodes, for names and metadata
    wait: Node | None = None
    release: Node | None = None
    reduce: Node | None = None

    @property
    def name(self) -> str:
        return f"ds_param_{self.ds_id}"


@dataclasses.dataclass
class _Stripped:
    """A DeepSpeed graph with its ``dc`` ops taken out: the graph AOTAutograd produced."""

    graph: Graph
    params: dict[int, _Param]
    grads: list[tuple[str, int]]
    casts: set[str]  # fused casts DeepSpeed's gathers carried, restored as nodes
    backward: bool


def _where(label: str, node: Node) -> str:
    return f"graph `{label}`, node `{node.name}`"


def _ds_ids(label: str, node: Node) -> tuple[Node, int, int]:
    args = node.args
    if len(args) < 3 or not isinstance(args[0], Node) or not all(isinstance(a, int) for a in args[1:3]):
        raise ZeroschedError(f"{_where(label, node)}: {node.target} needs (tensor, graph_id, ds_id) arguments, "
                             f"found {args!r}")
    return args[0], args[1], args[2]


def strip(graph: Graph, label: str) -> _Stripped:
    """The graph without DeepSpeed's ZeRO-3 ops, with the parameters and gradients they marked."""
    gather, wait, release, reduce = (_dc(n) for n in ("allgather_param", "wait_allgather", "release_param",
                                                      "reduce_grad"))
    out = Graph()
    env: dict[Node, Node] = {}
    params: dict[int, _Param] = {}
    casts: set[str] = set()
    graph_ids: set[int] = set()

    def param(node: Node, ds_id: int, graph_id: int) -> _Param:
        graph_ids.add(graph_id)
        if len(graph_ids) > 1:
            raise ZeroschedError(f"{_where(label, node)}: graph_id {graph_id} differs from the graph's "
                                 f"{min(graph_ids - {graph_id})}")
        return params.setdefault(ds_id, _Param(ds_id, graph_id))

    for node in graph.nodes:
        if node.op == "call_function" and node.target in (gather, wait, release, reduce):
            src, graph_id, ds_id = _ds_ids(label, node)
            p = param(node, ds_id, graph_id)
            value = env[src]
            if node.target is gather:
                if value.op != "placeholder":
                    raise ZeroschedError(f"{_where(label, node)}: gathers `{src.name}`, which is not a placeholder")
                if p.gather is not None:
                    raise ZeroschedError(f"{_where(label, node)}: ds_id {ds_id} is gathered twice "
                                         f"(also by `{p.gather.name}`)")
                full = node.meta.get("val")
                dtype = node.kwargs.get("dtype", node.args[3] if len(node.args) > 3 else None)
                p.placeholder, p.gather = value, node
                p.dtype = _val_dtype(value) or (full.dtype if isinstance(full, torch.Tensor) else None)
                p.shape = list(full.shape) if isinstance(full, torch.Tensor) else _val_shape(value)
                if p.dtype is None or p.shape is None:
                    raise ZeroschedError(f"{_where(label, node)}: no shape or dtype for the parameter "
                                         "(meta['val'] is missing)")
                if dtype is not None and dtype != p.dtype:
                    # DeepSpeed fused the parameter's only use, a downcast, into its gather.
                    value = out.call_function(_FUSED_CAST, (value, dtype))
                    value.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta", "tensor_size")}
                    casts.add(value.name)
            elif node.target is wait:
                p.wait = p.wait or node
            elif node.target is release:
                p.release = p.release or node
            else:
                p.reduce = node
            env[node] = value
            continue
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "dc":
            raise ZeroschedError(f"{_where(label, node)}: DeepSpeed op {node.target} has no zerosched equivalent; "
                                 "the adapter schedules graphs as zero3_compile leaves them")
        env[node] = out.node_copy(node, lambda n: env[n])

    grads = []
    for node in graph.nodes:
        if node.op == "output":
            results = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            for i, r in enumerate(results):
                if isinstance(r, Node) and r.target is reduce:
                    grads.append((params[r.args[2]].name, i))
    missing = [p.ds_id for p in params.values() if p.placeholder is None and p.reduce is None]
    if missing:
        raise ZeroschedError(f"graph `{label}`: ds_ids {missing} are waited on or released but never gathered")
    return _Stripped(out, params, grads, casts, any(p.reduce is not None for p in params.values()))


def _val_dtype(node: Node) -> torch.dtype | None:
    v = node.meta.get("val")
    return v.dtype if isinstance(v, torch.Tensor) else None


def _val_shape(node: Node) -> list[int] | None:
    v = node.meta.get("val")
    return [int(d) for d in v.shape] if isinstance(v, torch.Tensor) else None


class _Module:
    """What the exporter reads of a GraphModule: the graph, and the module's ``get_attr``
    targets (a GraphModule would also generate the graph's Python code, a third of the time)."""

    def __init__(self, graph: Graph, owner: torch.nn.Module | None):
        self.graph, self._owner = graph, owner

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or self._owner is None:
            raise AttributeError(name)
        return getattr(self._owner, name)


def to_doc(st: _Stripped, label: str, owner: torch.nn.Module | None) -> dict:
    """The stripped graph as an fx-graph v1 document, with DeepSpeed's profile as device times."""
    gm = _Module(st.graph, owner)
    gathered = [p for p in st.params.values() if p.placeholder is not None]
    doc = export.graph_to_doc(
        gm, name=label, kind="backward" if st.backward else "forward",
        params=[export.Param(p.name, p.placeholder.name, p.shape, export.dtype_name(p.dtype)) for p in gathered],
        grads=st.grads)
    full = {p.placeholder.name: p for p in gathered}
    for node, nd in zip(st.graph.nodes, doc["nodes"]):
        if node.name in full:
            # zero3_compile has replaced a forward parameter's value by an empty shard; zerosched
            # schedules the full parameter.
            p = full[node.name]
            stride = [1] * len(p.shape)
            for i in range(len(p.shape) - 2, -1, -1):
                stride[i] = stride[i + 1] * p.shape[i + 1]
            nd["meta"]["val"] = {"shape": p.shape, "dtype": export.dtype_name(p.dtype), "stride": stride}
        t = node.meta.get("device_time")
        if node.op == "call_function" and isinstance(t, (int, float)) and t > 0:
            nd["meta"]["device_time_ms"] = float(t)
    return doc


def _remap(py: Any, doc: Any, env: dict[str, Node], label: str, where: str) -> Any:
    """``py`` (a stripped node's argument) with each node reference replaced by the node that
    zerosched's document names at the same place (a wait where the graph read a parameter)."""
    if isinstance(py, Node):
        if not (isinstance(doc, dict) and isinstance(doc.get("node"), str) and doc["node"] in env):
            raise ZeroschedError(f"graph `{label}`, node `{where}`: the scheduled graph has {doc!r} where the "
                                 f"graph has a reference to `{py.name}`")
        return env[doc["node"]]
    if isinstance(py, (list, tuple)):
        if not isinstance(doc, list) or len(doc) != len(py):
            raise ZeroschedError(f"graph `{label}`, node `{where}`: the scheduled graph changed an argument list")
        items = [_remap(a, d, env, label, where) for a, d in zip(py, doc)]
        return tuple(items) if isinstance(py, tuple) else items
    if isinstance(py, dict):
        if not isinstance(doc, dict) or set(doc) != set(py):
            raise ZeroschedError(f"graph `{label}`, node `{where}`: the scheduled graph changed keyword arguments")
        return {k: _remap(v, doc[k], env, label, where) for k, v in py.items()}
    if isinstance(py, slice):
        parts = doc.get("slice") if isinstance(doc, dict) else None
        parts = _remap([py.start, py.stop, py.step], parts, env, label, where)
        return slice(*parts)
    return py


def _release_anchors(nodes: list[dict], label: str) -> dict[str, list[tuple[str, int]]]:
    """Where DeepSpeed's releases go: zerosched's release of a parameter names every real use of
    its gathered storage (``after``); DeepSpeed's runtime frees the buffer at the last of
    ``n_users`` releases, each chained behind one use (behind its first ``getitem`` when the
    use returns several tensors). Returns, per anchor node, the (param, n_users) releases."""
    by_name = {n["name"]: n for n in nodes}
    first_item: dict[str, str] = {}
    for n in nodes:
        if n.get("target") == "operator.getitem" and n["args"] and isinstance(n["args"][0], dict):
            first_item.setdefault(n["args"][0].get("node"), n["name"])
    anchors: dict[str, list[tuple[str, int]]] = {}
    for n in nodes:
        if n.get("target") != "zerosched.release.default":
            continue
        uses = list(dict.fromkeys(a["node"] for a in n["kwargs"].get("after", [])))
        for use in uses:
            anchor = use
            if isinstance(by_name[use]["meta"].get("val"), list):
                anchor = first_item.get(use)
                if anchor is None:
                    raise ZeroschedError(f"graph `{label}`, node `{use}`: uses the gathered parameter "
                                         f"{n['kwargs']['param']} but returns no tensor to chain its release to")
            anchors.setdefault(anchor, []).append((n["kwargs"]["param"], len(uses)))
    return anchors


def _name(like: Node | None, default: str) -> str:
    return like.name if like is not None else default


def rebuild(doc: dict, st: _Stripped, label: str) -> Graph:
    """zerosched's scheduled document as a DeepSpeed graph: its order, ``dc`` ops for its ops."""
    by_param = {p.name: p for p in st.params.values()}
    stripped = {n.name: n for n in st.graph.nodes}
    anchors = _release_anchors(doc["nodes"], label)
    out = Graph()
    env: dict[str, Node] = {}
    reduces: dict[str, list[str]] = {}  # end_backward -> its reductions
    emitted: set[str] = set()

    def dc_node(op: str, args: tuple, kwargs: dict, like: Node | None, name: str) -> Node:
        # DeepSpeed's names (its profile and later passes key on them) and metadata.
        n = out.create_node("call_function", _dc(op), args, kwargs, name=name)
        n.meta = copy.copy(like.meta) if like is not None else {"ds_id": args[2], "device_time": 0.0}
        return n

    for nd in doc["nodes"]:
        name, target, kw = nd["name"], nd["target"], nd.get("kwargs", {})
        ref = [a["node"] for a in nd.get("args", []) if isinstance(a, dict) and "node" in a]
        if target.startswith("zerosched."):
            p = by_param.get(kw.get("param"))
            if p is None and target != "zerosched.end_backward.default":
                raise ZeroschedError(f"graph `{label}`, node `{name}`: {target} of unknown parameter "
                                     f"{kw.get('param')!r}")
            if target == "zerosched.allgather.default":
                dtype = getattr(torch, kw["dtype"]["dtype"]) if isinstance(kw.get("dtype"), dict) else p.dtype
                env[name] = dc_node("allgather_param", (env[ref[0]], p.graph_id, p.ds_id), {"dtype": dtype},
                                    p.gather, _name(p.gather, f"allgather_ds_param_{p.placeholder.name}_{p.ds_id}"))
                val = env[name].meta.get("val")
                if isinstance(val, torch.Tensor) and val.dtype != dtype:
                    env[name].meta["val"] = val.to(dtype)
            elif target == "zerosched.wait.default":
                env[name] = dc_node("wait_allgather", (env[ref[0]], p.graph_id, p.ds_id), {}, p.wait,
                                    _name(p.wait, f"wait_allgather_ds_param__{p.placeholder.name}_{p.ds_id}"))
                env[name].meta["val"] = env[ref[0]].meta.get("val")
            elif target == "zerosched.reduce_grad.default":
                env[name] = dc_node("reduce_grad", (env[ref[0]], p.graph_id, p.ds_id), {}, p.reduce,
                                    _name(p.reduce, f"reduce_ds_param_{p.name}"))
            elif target == "zerosched.end_backward.default":
                reduces[name] = [a["node"] for a in nd["args"][0]]
            elif target != "zerosched.release.default":  # releases go behind their anchors
                raise ZeroschedError(f"graph `{label}`, node `{name}`: {target} has no DeepSpeed equivalent")
            continue
        if target == "operator.getitem" and ref and ref[0] in reduces:
            env[name] = env[reduces[ref[0]][nd["args"][1]]]
            continue
        sn = stripped.get(name)
        if sn is None:
            raise ZeroschedError(f"graph `{label}`, node `{name}`: the scheduled graph has a node the graph lacks")
        args = _remap(sn.args, nd["args"], env, label, name)
        kwargs = _remap(dict(sn.kwargs), nd["kwargs"], env, label, name)
        new = out.create_node(sn.op, sn.target, args, kwargs, name=sn.name, type_expr=sn.type)
        new.meta = copy.copy(sn.meta)
        env[name] = new
        emitted.add(name)
        for param, n_users in anchors.get(name, ()):
            p = by_param[param]
            user = env[name]
            env[name] = dc_node("release_param", (user, p.graph_id, p.ds_id, n_users), {}, p.release,
                                f"release_ds_param_{p.placeholder.name}_{name}_{p.ds_id}")
            env[name].meta["val"] = None
    lost = [n for n in stripped if n not in emitted and n not in st.casts]
    if lost:
        raise ZeroschedError(f"graph `{label}`, node `{lost[0]}`: missing from the scheduled graph")
    out.lint()
    return out


def schedule_graph(graph: Graph, *, budget: int | str | None = None, world_size: int = 1,
                   scheduler: str = "prefetch", cost: dict | None = None, label: str | None = None,
                   owner: torch.nn.Module | None = None,
                   dumper: dumping.Dumper | None = None) -> tuple[Graph, dict]:
    """Schedules a graph that DeepCompile's ``zero3_compile`` has inserted its ops into.

    Returns the scheduled graph (``dc`` ops, DeepSpeed's arguments) and zerosched's report.
    Raises :class:`zerosched.ZeroschedError` (the message names the graph and node) for a
    graph it cannot translate, and :class:`zerosched.OverBudgetError` when no schedule fits
    ``budget``. ``dumper`` writes the exported graph, the options and the result
    (``zerosched.dump``).
    """
    gid = next((n.args[1] for n in graph.nodes if n.op == "call_function" and len(n.args) > 2
                and getattr(n.target, "namespace", None) == "dc" and isinstance(n.args[1], int)), 0)
    label = label or f"deepcompile_graph_{gid}"
    options: dict[str, Any] = {"budget": budget, "world_size": world_size, "scheduler": scheduler,
                               "disable": list(DISABLED_PASSES)}
    if cost is not None:
        options["cost"] = cost
    # The translation allocates a few objects per node and frees them together at the end; the
    # cyclic collector's passes over a compiling process's heap (graphs, fake tensors) would
    # otherwise cost more than the translation itself (half the time on a 7,500-node graph).
    collecting = gc.isenabled()
    gc.disable()
    try:
        st = strip(graph, label)
        doc = to_doc(st, label, owner if owner is not None else graph.owning_module)
        data = json.dumps(doc).encode()
        scheduled, report = _schedule(data, options)
        if dumper is not None:
            dumper.write(label, data, options, scheduled, report)
        return rebuild(json.loads(scheduled), st, label), json.loads(report)
    finally:
        if collecting:
            gc.enable()


# --------------------------------------------------------------------------------------------
# installing into DeepSpeed
# --------------------------------------------------------------------------------------------

_saved: dict[str, Any] = {}


def _world_size() -> int:
    import deepspeed.comm as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _replacement(scheduler: str, cost: dict | None, world_size: int | None, dumper: dumping.Dumper | None):
    from deepspeed.compile.list_schedule import DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR

    def fast_free_schedule(graph: Graph, available_mem: int, output_size: int, debug_log: bool, *,
                           scheduler_budget=None) -> Graph:
        budget = None if scheduler_budget is None else int(scheduler_budget.max_gathered_bytes)
        ws = world_size or _world_size()
        overflows = []
        try:
            out, report = schedule_graph(graph, budget=budget, world_size=ws, scheduler=scheduler, cost=cost,
                                         dumper=dumper)
        except OverBudgetError as e:
            # As DeepSpeed's own scheduler does: a compile failure frees no memory, so run the
            # schedule that needs the least over the budget, and say so in the diagnostics.
            overflows.append({"source": scheduler_budget.source, "max_gathered_bytes": budget,
                              "needed_bytes": e.needed, "over_budget_bytes": e.needed - budget})
            out, report = schedule_graph(graph, budget=e.needed, world_size=ws, scheduler=scheduler, cost=cost,
                                         dumper=dumper)
        peak = max((g.get("peak_gathered_bytes", 0) for g in report.get("simulation", {}).get("graphs", [])),
                   default=0)
        setattr(out, DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR, {
            "budget": scheduler_budget, "budget_rejections": 0, "budget_rejected_candidates": [],
            "budget_overflows": overflows, "selected": [{"node": "zerosched", "peak_gathered_bytes": peak}],
            "zerosched": report,
        })
        return out

    fast_free_schedule.zerosched = True  # type: ignore[attr-defined]
    return fast_free_schedule


class Installed:
    """What :func:`install` returns: a context manager that uninstalls on exit."""

    def __enter__(self) -> "Installed":
        return self

    def __exit__(self, *exc: Any) -> None:
        uninstall()


def install(*, scheduler: str = "prefetch", cost: dict | None = None, world_size: int | None = None,
            dump: str | None = None) -> Installed:
    """Makes DeepCompile's ZeRO-3 pass schedule with zerosched.

    ``scheduler`` and ``cost`` are zerosched's options (docs/python.md); ``world_size``
    defaults to ``deepspeed.comm``'s (1 outside a distributed run). The memory budget is the
    one DeepCompile computes from its profile. ``dump`` (default ``$ZEROSCHED_DUMP``) is a
    directory that receives every graph scheduled (``zerosched.dump``). Installing again
    replaces the options.
    """
    from deepspeed.compile import list_schedule
    from deepspeed.compile.passes import zero3_compile

    if not _saved:
        _saved["list_schedule"] = list_schedule.fast_free_schedule
        _saved["zero3_compile"] = zero3_compile.fast_free_schedule
    fn = _replacement(scheduler, cost, world_size, dumping.resolve(dump))
    # zero3_compile imported the function by name: its module attribute is the call site.
    list_schedule.fast_free_schedule = fn
    zero3_compile.fast_free_schedule = fn
    return Installed()


def uninstall() -> None:
    """Restores DeepSpeed's own ``fast_free_schedule``; nothing happens if not installed."""
    if not _saved:
        return
    from deepspeed.compile import list_schedule
    from deepspeed.compile.passes import zero3_compile

    list_schedule.fast_free_schedule = _saved.pop("list_schedule")
    zero3_compile.fast_free_schedule = _saved.pop("zero3_compile")


def installed() -> bool:
    """Whether DeepCompile currently schedules with zerosched."""
    return bool(_saved)
