"""A scheduled fx-graph v1 document back to a runnable ``torch.fx.GraphModule``.

The scheduled document keeps the names of the original graph's nodes; the passes add the
inserted ops of docs/format.md and may add aten views and casts (the rewrite stage).  Nodes
of the original graph keep their Python targets and arguments, with node references taken
from the document (which redirects uses to waits); new nodes are decoded from the document.
A run of gathers of one bucket becomes one ``zerosched.allgather_bucket``.  The ops do not
name their parameters: a gather reads the parameter's placeholder, as in the document, and a
gradient's reduction reads it too (``zerosched.ops``).
"""

from __future__ import annotations

import json
import operator
from typing import Any, Sequence

import torch
import torch.fx

from zerosched import ops
from zerosched._core import ZeroschedError

_ZS = "zerosched."


def torch_target(name: str) -> Any | None:
    """The callable a target name in fx-graph v1 stands for: ``operator.getitem`` or an
    aten/prims overload; None for any other name."""
    if name == "operator.getitem":
        return operator.getitem
    ns, _, rest = name.partition(".")
    if ns in ("aten", "prims") and rest.count(".") == 1:
        op, overload = rest.split(".")
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except AttributeError:
            pass
    return None


def _target(name: str, where: str) -> Any:
    t = torch_target(name)
    if t is None:
        raise ZeroschedError(f"{where}: target `{name}` is not an operator zerosched can run")
    return t


def _as_permute(target: str, args: list, d: dict) -> tuple[str, list]:
    """``t`` and ``transpose`` the rewrite stage adds, as ``permute``: Inductor decomposes them
    before lowering and refuses them in the graphs it lowers."""
    val = d.get("meta", {}).get("val")
    rank = len(val["shape"]) if isinstance(val, dict) and "shape" in val else None
    if target == "aten.t.default" and rank == 2:
        return "aten.permute.default", [args[0], [1, 0]]
    if target == "aten.transpose.int" and rank and len(args) == 3:
        dims = list(range(rank))
        i, j = args[1] % rank, args[2] % rank
        dims[i], dims[j] = dims[j], dims[i]
        return "aten.permute.default", [args[0], dims]
    return target, args


def _decode(a: Any, orig: Any, env: dict[str, torch.fx.Node], where: str) -> Any:
    """One ARG of the document to a Python value.  ``orig`` is the original node's argument at
    the same place (or ``None``): literals keep their original Python objects."""
    if isinstance(a, dict) and "node" in a:
        try:
            return env[a["node"]]
        except KeyError:
            raise ZeroschedError(f"{where}: reference to `{a['node']}`, which is not defined before it") from None
    if isinstance(a, list):
        subs = orig if isinstance(orig, (list, tuple)) and len(orig) == len(a) else [None] * len(a)
        out = [_decode(x, o, env, where) for x, o in zip(a, subs)]
        return type(orig)(out) if isinstance(orig, tuple) else out
    if orig is not None and not isinstance(orig, torch.fx.Node):
        return orig
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, dict) and "dtype" in a:
        return getattr(torch, a["dtype"])
    if isinstance(a, dict) and "float" in a:
        return float(a["float"])
    if isinstance(a, dict) and "device" in a:
        return torch.device(a["device"])
    raise ZeroschedError(f"{where}: argument {a!r} of a new node cannot be decoded")


class _Graph:
    """The graph being built; nodes of the document keep their names, nodes only the rebuild
    adds get names the document does not use."""

    def __init__(self, doc_names: set[str]) -> None:
        self.g = torch.fx.Graph()
        self.doc_names = doc_names
        self.fresh = 0

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, name: str | None = None) -> torch.fx.Node:
        if name is None:
            while f"zs_{self.fresh}" in self.doc_names:
                self.fresh += 1
            name, self.fresh = f"zs_{self.fresh}", self.fresh + 1
        return self.g.create_node("call_function", target, args, kwargs or {}, name=name)


def _first_tensor(node: torch.fx.Node, g: _Graph) -> torch.fx.Node:
    """``node`` itself, or a getitem of its first tensor if it returns several values (a
    release's ``after`` list holds tensors)."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        for i, v in enumerate(val):
            if isinstance(v, torch.Tensor):
                return g.call(operator.getitem, (node, i))
        raise ZeroschedError(f"node `{node.name}` is a use of gathered storage but returns no tensor")
    return node


def _bucket_runs(nodes: Sequence[dict]) -> dict[str, list[dict]]:
    """First gather of each bucket -> the bucket's gathers (adjacent, as format guarantee 4 says)."""
    runs: dict[str, list[dict]] = {}
    i = 0
    while i < len(nodes):
        n = nodes[i]
        b = n.get("kwargs", {}).get("bucket") if n.get("target") == _ZS + "allgather.default" else None
        if b is None:
            i += 1
            continue
        j = i
        while (j < len(nodes) and nodes[j].get("target") == _ZS + "allgather.default"
               and nodes[j].get("kwargs", {}).get("bucket") == b):
            j += 1
        runs[n["name"]] = list(nodes[i:j])
        i = j
    return runs


def rebuild(gm: torch.fx.GraphModule, doc: dict, drop_outputs: Sequence[int] = (),
            world_size: int = 1) -> torch.fx.GraphModule:
    """The GraphModule of the scheduled document ``doc`` of ``gm``, for parameters sharded over
    ``world_size`` ranks.

    ``drop_outputs``: output positions that become ``None`` (the backward's gradient slots,
    whose reduced values the runtime has already put into the shards' ``.grad``)."""
    label = doc.get("name", "<graph>")
    orig = {n.name: n for n in gm.graph.nodes}
    g = _Graph({d["name"] for d in doc["nodes"]})
    env: dict[str, torch.fx.Node] = {}
    # The calling convention is positional: placeholders in the original order.
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n.name] = g.g.placeholder(n.name)
            env[n.name].meta = dict(n.meta)
    placeholders = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    param_node = {p["name"]: p["node"] for p in doc.get("params", [])}
    buckets = _bucket_runs(doc["nodes"])
    in_bucket: set[str] = set()
    for d in doc["nodes"]:
        name, op, target = d["name"], d["op"], d["target"]
        where = f"graph `{label}`, node `{name}`"
        if op == "placeholder":
            if name not in placeholders:
                raise ZeroschedError(f"{where}: a placeholder the original graph does not have")
            continue
        if name in in_bucket:
            continue
        kwargs = d.get("kwargs", {})
        if op == "output":
            (outs,) = _decode(d["args"], orig["output"].args if "output" in orig else None, env, where)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            for i in drop_outputs:
                outs[i] = None
            g.g.output(tuple(outs))
            continue
        if op == "get_attr":
            env[name] = _get_attr_node(g, orig.get(name), d, where)
            continue
        if op != "call_function":
            raise ZeroschedError(f"{where}: op `{op}` cannot appear in a scheduled graph")
        if name in buckets and len(buckets[name]) > 1:
            members = buckets[name]
            if len({json.dumps(m.get("kwargs", {}).get("dtype")) for m in members}) != 1:
                raise ZeroschedError(f"{where}: the gathers of bucket {kwargs['bucket']} differ in dtype")
            dt = _decode(members[0].get("kwargs", {}).get("dtype"), None, env, where)
            call = g.call(ops.allgather_bucket, ([_decode(m["args"][0], None, env, where) for m in members],),
                          {"dtype": dt})
            for k, m in enumerate(members):
                env[m["name"]] = g.call(operator.getitem, (call, k), name=m["name"])
                in_bucket.add(m["name"])
            continue
        if target.startswith(_ZS):
            node = _zerosched_node(g, d, env, param_node, world_size, where)
        else:
            o = orig.get(name)
            if o is not None and o.op == "call_function":
                args = _decode(d["args"], o.args, env, where)
                kw = {k: _decode(v, o.kwargs.get(k), env, where) for k, v in kwargs.items()}
                node = g.call(o.target, tuple(args), kw, name=name)
                node.meta = dict(o.meta)
            else:
                args = _decode(d["args"], None, env, where)
                kw = {k: _decode(v, None, env, where) for k, v in kwargs.items()}
                target, args = _as_permute(target, args, d)
                node = g.call(_target(target, where), tuple(args), kw, name=name)
        env[name] = node
    g.g.lint()
    return torch.fx.GraphModule(gm, g.g, class_name=type(gm).__name__)


def _get_attr_node(g: _Graph, o: torch.fx.Node | None, d: dict, where: str) -> torch.fx.Node:
    """A constant of the original graph (a lifted tensor constant, a buffer read as an
    attribute), bound again to the same attribute: ``GraphModule(gm, ...)`` copies the
    attributes its ``get_attr`` nodes name from ``gm``.  The passes never add one."""
    if o is None or o.op != "get_attr" or o.target != d["target"]:
        raise ZeroschedError(f"{where}: a get_attr of `{d['target']}` the original graph does not have")
    node = g.g.create_node("get_attr", o.target, name=d["name"])
    node.meta = dict(o.meta)
    return node


def _zerosched_node(g: _Graph, d: dict, env: dict[str, torch.fx.Node], param_node: dict[str, str],
                    world_size: int, where: str) -> torch.fx.Node:
    target, kwargs, name = d["target"], d.get("kwargs", {}), d["name"]
    args = [_decode(a, None, env, where) for a in d["args"]]
    if target == _ZS + "allgather.default":
        dtype = _decode(kwargs.get("dtype"), None, env, where)
        return g.call(ops.allgather, (args[0],), {"dtype": dtype}, name)
    if target == _ZS + "wait.default":
        return g.call(ops.wait, (args[0],), {}, name)
    if target == _ZS + "release.default":
        after = [_first_tensor(_decode(a, None, env, where), g) for a in kwargs.get("after", [])]
        return g.call(ops.release, (args[0],), {"after": after}, name)
    if target == _ZS + "reduce_grad.default":
        # A `bucket` keyword is accepted and left to the runtime: its queue already issues
        # adjacent reductions as one collective (up to `RUNTIME.reduce_bucket_bytes`).
        param = param_node.get(kwargs["param"])
        if param is None or param not in env:
            raise ZeroschedError(f"{where}: the graph does not carry parameter `{kwargs['param']}`, "
                                 "whose gradient it reduces")
        return g.call(ops.reduce_grad, (args[0], env[param]),
                      {"sharded": bool(kwargs["sharded"]), "world_size": world_size}, name)
    if target == _ZS + "end_backward.default":
        return g.call(ops.end_backward, (args[0],), {}, name)
    # keep/reuse carry a parameter from the forward into the backward; the backend schedules
    # each graph on its own, so they never occur.
    raise ZeroschedError(f"{where}: `{target}` is not supported by the torch.compile backend")
