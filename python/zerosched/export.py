"""Export AOTAutograd forward/backward graphs to fx-graph v1 JSON.

The format is specified in docs/format.md, with its JSON Schema in
docs/fx-graph-v1.schema.json; docs/export.md describes the exporter.  The entry points are:

* :func:`capture` -- run one training step of a module under ``torch.compile`` with a
  recording AOTAutograd backend and return every forward and backward graph, in execution
  order, with the parameter each placeholder carries;
* :func:`graph_to_doc` -- one ``torch.fx.GraphModule`` to an fx-graph v1 document (a dict);
* :func:`program_doc` / :func:`write_program` -- the program bundle and the files on disk;
* :func:`export_step` -- capture one step of any module and write its files (``--module``;
  ``--config``/``--arch`` build their model in ``zerosched.arch``);
* :func:`decomposition_table` -- the tables of ``--decompositions``;
* ``python -m zerosched.export`` -- the command line (see :func:`main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import math
import operator
import os
import re
import sys
import time
from typing import Any, Callable, Collection, Iterable, Sequence

import torch
import torch.fx

from zerosched._core import ZeroschedError

FORMAT = "fx-graph"
PROGRAM_FORMAT = "fx-program"
VERSION = 1
#: Files whose JSON text is larger than this are written as ``.json.gz``.
GZIP_THRESHOLD = 1_000_000


class ExportError(ZeroschedError):
    """A graph (or a model) that fx-graph v1 cannot represent; the message names the node."""


# --------------------------------------------------------------------------------------------
# ARG encoding
# --------------------------------------------------------------------------------------------

_ADDR = re.compile(r" at 0x[0-9a-fA-F]+")
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _strip_torch(s: str) -> str:
    return s[len("torch.") :] if s.startswith("torch.") else s


def dtype_name(dtype: torch.dtype) -> str:
    return _strip_torch(str(dtype))


def _clean_repr(x: Any) -> str:
    """repr() without memory addresses, so that output stays byte-identical across runs."""
    if isinstance(x, torch.Tensor):
        return f"Tensor(shape={list(x.shape)}, dtype={dtype_name(x.dtype)}, device={x.device})"
    try:
        r = repr(x)
    except Exception:  # pragma: no cover - exotic objects
        r = f"<{type(x).__module__}.{type(x).__qualname__}>"
    return _ADDR.sub("", r)


def _sym(s: torch.SymInt) -> dict:
    node = s.node
    hint = node.hint if getattr(node, "hint", None) is not None else None
    if hint is None:
        try:
            hint = node.shape_env.size_hint(node.expr)
        except Exception as e:  # pragma: no cover
            raise ExportError(f"symbolic int {s} has no concrete hint") from e
    return {"sym": str(node.expr), "hint": int(hint)}


def encode_arg(a: Any, where: str = "?") -> Any:
    """One FX argument to an fx-graph v1 ARG value (the spec's ARG table)."""
    if a is None or isinstance(a, bool):
        return a
    if isinstance(a, torch.fx.Node):
        return {"node": a.name}
    if isinstance(a, int):
        if _I64_MIN <= a <= _I64_MAX:
            return a
        return {"repr": repr(a)}
    if isinstance(a, float):
        if math.isnan(a):
            return {"float": "nan"}
        if math.isinf(a):
            return {"float": "inf" if a > 0 else "-inf"}
        return a
    if isinstance(a, str):
        return a
    if isinstance(a, torch.SymInt):
        return _sym(a)
    if isinstance(a, (list, tuple)):  # includes immutable_list, torch.Size
        return [encode_arg(x, where) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, torch.layout):
        return {"layout": _strip_torch(str(a))}
    if isinstance(a, torch.memory_format):
        return {"memory_format": _strip_torch(str(a))}
    if isinstance(a, slice):
        return {"slice": [encode_arg(a.start, where), encode_arg(a.stop, where), encode_arg(a.step, where)]}
    if isinstance(a, torch._ops.OpOverload):  # the op an RNG wrapper runs: named as targets are
        return {"repr": str(a)}
    return {"repr": _clean_repr(a)}


# --------------------------------------------------------------------------------------------
# meta.val
# --------------------------------------------------------------------------------------------


def _dim(d: Any) -> Any:
    if isinstance(d, torch.SymInt):
        return _sym(d)
    return int(d)


def encode_tensor(t: torch.Tensor) -> dict:
    out = {
        "shape": [_dim(d) for d in t.shape],
        "dtype": dtype_name(t.dtype),
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
    }
    if t.layout == torch.strided:
        out["stride"] = [_dim(d) for d in t.stride()]
        out["storage_offset"] = _dim(t.storage_offset())
    return out


def encode_val(v: Any) -> Any:
    """``node.meta['val']`` to a TENSOR, a list of TENSOR-or-null, a SYM, or null."""
    if isinstance(v, torch.Tensor):
        return encode_tensor(v)
    if isinstance(v, torch.SymInt):
        return _sym(v)
    if isinstance(v, (list, tuple)):
        return [encode_tensor(x) if isinstance(x, torch.Tensor) else None for x in v]
    return None


# --------------------------------------------------------------------------------------------
# alias / mutation information from operator schemas
# --------------------------------------------------------------------------------------------

_ALIAS_CACHE: dict[Any, tuple[list[int], list[int]]] = {}


def _schema_alias_sets(op: torch._ops.OpOverload):
    """(per-argument (alias set, is_write)), (union of the returns' alias sets)."""
    schema = op._schema
    try:
        # torchgen keeps the alias annotation of list elements (``Tensor(a)[]``), which the
        # C++ binding's Argument.alias_info does not expose for list returns.
        from torchgen.model import FunctionSchema

        fs = FunctionSchema.parse(str(schema).split("::", 1)[-1])
        args = []
        for a in schema.arguments:
            ann = None
            for b in fs.arguments.flat_all:
                if b.name == a.name:
                    ann = b.annotation
            args.append((set(ann.alias_set) if ann else set(), bool(ann and ann.is_write)))
        rets: set[str] = set()
        for r in fs.returns:
            if r.annotation is not None:
                rets |= set(r.annotation.alias_set)
        return args, rets
    except Exception:
        args = [
            (set(a.alias_info.before_set) if a.alias_info else set(), bool(a.alias_info and a.alias_info.is_write))
            for a in schema.arguments
        ]
        rets = set()
        for r in schema.returns:
            if r.alias_info is not None:
                rets |= set(r.alias_info.before_set)
        return args, rets


def schema_aliases_mutates(op: torch._ops.OpOverload, n_args: int) -> tuple[list[int], list[int]]:
    """Indexes into a node's positional ``args``: which the output may alias, which are written.

    Output aliases argument i when a return's alias set intersects argument i's; argument i
    is mutated when its annotation is a write (``Tensor(a!)``).  Only positional arguments can
    be named (the format indexes ``args``); schema arguments that the node passes as keywords
    are therefore not listed (AOT graphs pass tensor arguments positionally).
    """
    key = op
    if key not in _ALIAS_CACHE:
        args, rets = _schema_alias_sets(op)
        aliases = [i for i, (s, _) in enumerate(args) if s and (s & rets)]
        mutates = [i for i, (s, w) in enumerate(args) if w]
        _ALIAS_CACHE[key] = (aliases, mutates)
    aliases, mutates = _ALIAS_CACHE[key]
    return [i for i in aliases if i < n_args], [i for i in mutates if i < n_args]


# --------------------------------------------------------------------------------------------
# graph -> document
# --------------------------------------------------------------------------------------------


def target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op in ("placeholder", "get_attr"):
        return str(t)
    if node.op == "output":
        return "output"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)  # "aten.mm.default": already without the torch.ops. prefix
    if t is operator.getitem:
        return "operator.getitem"
    from torch.fx.node import _get_qualified_name

    name = _get_qualified_name(t)
    if name.startswith("_operator."):
        name = "operator." + name[len("_operator.") :]
    if name.startswith("torch.ops."):
        name = name[len("torch.ops.") :]
    return name


def _check_representable(gm: torch.fx.GraphModule, node: torch.fx.Node, label: str) -> None:
    where = f"graph {label!r}, node {node.name!r}"
    if node.op in ("call_method", "call_module"):
        raise ExportError(
            f"{where}: op {node.op!r} (target {node.target!r}) cannot be represented in fx-graph v1; "
            "export AOTAutograd graphs, which hold only placeholder/get_attr/call_function/output"
        )
    if node.op not in ("placeholder", "get_attr", "call_function", "output"):
        raise ExportError(f"{where}: unknown FX op {node.op!r}")
    if (node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)
            and _rng_wrapped_op(node) is None):
        raise ExportError(
            f"{where}: higher-order operator {node.target.name()!r} carries subgraphs, which "
            "fx-graph v1 cannot represent (inline it or disable the feature that introduces it)"
        )
    if node.op == "get_attr":
        obj = _get_attr(gm, node.target)
        if isinstance(obj, torch.nn.Module):
            raise ExportError(
                f"{where}: get_attr of a submodule {node.target!r} ({type(obj).__name__}) cannot be "
                "represented in fx-graph v1 (only tensor attributes can)"
            )


#: AOTAutograd's wrappers of a random op that activation checkpointing recomputes in the
#: backward: ``run_and_save_rng_state(op, *args)`` returns the RNG state before the op and its
#: result, ``run_with_rng_state(state, op, *args)`` runs it again from that state.  Neither
#: carries a subgraph: the node is the wrapped op, its tensor arguments shifted by this many.
_RNG_WRAPPERS = {"run_and_save_rng_state": 1, "run_with_rng_state": 2}


def _rng_wrapped_op(node: torch.fx.Node) -> tuple[torch._ops.OpOverload, int] | None:
    """The op an RNG wrapper node runs, and where its arguments start; None for other nodes."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    shift = _RNG_WRAPPERS.get(node.target.name())
    if shift is None or len(node.args) < shift or not isinstance(node.args[shift - 1], torch._ops.OpOverload):
        return None
    return node.args[shift - 1], shift


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def node_to_doc(gm: torch.fx.GraphModule, node: torch.fx.Node, label: str,
                requires_grad: dict[str, bool] | None = None) -> dict:
    _check_representable(gm, node, label)
    where = f"{label}:{node.name}"
    doc: dict[str, Any] = {
        "name": node.name,
        "op": node.op,
        "target": target_name(node),
        "args": [encode_arg(a, where) for a in node.args],
        "kwargs": {k: encode_arg(v, where) for k, v in node.kwargs.items()},
    }
    meta: dict[str, Any] = {}
    if node.op != "output":
        if "val" in node.meta:
            val = node.meta["val"]
        elif node.op == "get_attr":
            val = _get_attr(gm, node.target)
        else:
            val = node.meta.get("example_value")
        meta["val"] = encode_val(val)
        # AOT graphs are traced on detached fake tensors (requires_grad False everywhere);
        # for placeholders the exporter knows the real input's flag.
        if requires_grad and node.name in requires_grad and isinstance(meta["val"], dict):
            meta["val"]["requires_grad"] = requires_grad[node.name]
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            aliases, mutates = schema_aliases_mutates(node.target, len(node.args))
            meta["aliases"], meta["mutates"] = aliases, mutates
        elif (wrapped := _rng_wrapped_op(node)) is not None:
            # run_and_save_rng_state's result is a (state, value) pair, which getitem takes apart;
            # the aliasing is the wrapped op's, at its arguments' places.
            op, shift = wrapped
            aliases, mutates = schema_aliases_mutates(op, len(node.args) - shift)
            meta["aliases"], meta["mutates"] = [i + shift for i in aliases], [i + shift for i in mutates]
        elif node.target is operator.getitem:
            # The element shares the storage of the tuple/list it is taken from.
            meta["aliases"], meta["mutates"] = [0], []
    doc["meta"] = meta
    return doc


@dataclasses.dataclass
class Param:
    name: str  # fully qualified parameter name
    node: str  # placeholder in this graph
    shape: list[int]
    dtype: str
    persistent: bool = False

    def to_doc(self) -> dict:
        d = {"name": self.name, "node": self.node, "shape": list(self.shape), "dtype": self.dtype}
        if self.persistent:
            d["persistent"] = True
        return d


def graph_to_doc(
    gm: torch.fx.GraphModule,
    *,
    name: str | None = None,
    kind: str = "forward",
    params: Sequence[Param] = (),
    grads: Sequence[tuple[str, int]] = (),
    requires_grad: dict[str, bool] | None = None,
    persistent: Collection[str] = (),
    forward: str | None = None,
) -> dict:
    """One FX graph to an fx-graph v1 document.

    ``requires_grad`` overrides ``meta.val.requires_grad`` of the named placeholders;
    ``persistent`` names the parameters kept unsharded, whose gradient entries say so (the
    graph need not carry the parameter itself); ``forward`` is a backward graph's forward
    graph, by name."""
    label = name or "<graph>"
    nodes = [node_to_doc(gm, n, label, requires_grad) for n in gm.graph.nodes]
    outputs = [n for n in nodes if n["op"] == "output"]
    if len(outputs) != 1:
        raise ExportError(f"graph {label!r}: expected exactly one output node, found {len(outputs)}")
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if name is not None:
        doc["name"] = name
    doc["kind"] = kind
    if forward is not None:
        doc["forward"] = forward
    doc["nodes"] = nodes
    doc["params"] = [p.to_doc() for p in params]
    if kind == "backward" or grads:
        doc["grads"] = [{"param": p, "output_index": i, **({"persistent": True} if p in persistent else {})}
                        for p, i in grads]
    return doc


# --------------------------------------------------------------------------------------------
# capture
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CapturedGraph:
    kind: str  # "forward" | "backward" | "inference"
    dynamo_index: int  # which dynamo graph (torch.compile frame/graph-break segment)
    gm: torch.fx.GraphModule
    params: list[Param]
    grads: list[tuple[str, int]]
    run_order: int = -1  # first execution, across all graphs
    name: str = ""
    requires_grad: dict[str, bool] = dataclasses.field(default_factory=dict)
    persistent: frozenset[str] = frozenset()  # parameters kept unsharded, for the gradient entries
    forward: str | None = None  # a backward graph's forward graph, by name (set by name_graphs)

    def to_doc(self) -> dict:
        return graph_to_doc(self.gm, name=self.name, kind=self.kind, params=self.params, grads=self.grads,
                            requires_grad=self.requires_grad, persistent=self.persistent, forward=self.forward)


#: Ops removed from PyTorch's core-ATen decomposition table, and why.
KEPT_FUSED = {
    # Its decomposition (math attention) does not match the fused backward that autograd
    # records (``..._for_cpu_backward``), and in bfloat16 the two disagree on the logsumexp
    # dtype, so the backward graph fails to run.  Kept fused: one attention op in the forward
    # and one in the backward, as on a GPU.
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
}


def default_decompositions() -> dict:
    """The decomposition table applied by AOTAutograd: PyTorch's core ATen decompositions
    (``torch._decomp.core_aten_decompositions()``) less :data:`KEPT_FUSED`."""
    from torch._decomp import core_aten_decompositions

    return {k: v for k, v in core_aten_decompositions().items() if str(k) not in KEPT_FUSED}


#: ``--decompositions``: the table AOTAutograd applies while it traces.
DECOMPOSITIONS = ("core", "none", "inductor")


def decomposition_table(name: str) -> dict:
    """``core``: :func:`default_decompositions`; ``none``: no table, AOTAutograd's default (what
    DeepCompile and most backends receive); ``inductor``: Inductor's own table."""
    if name == "core":
        return default_decompositions()
    if name == "none":
        return {}
    if name == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        return select_decomp_table()
    raise ExportError(f"unknown decompositions {name!r}; expected one of {DECOMPOSITIONS}")


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _output_args(gm: torch.fx.GraphModule) -> list[Any]:
    out = [n for n in gm.graph.nodes if n.op == "output"][0]
    vals = out.args[0]
    return list(vals) if isinstance(vals, (list, tuple)) else [vals]


def _val_shape(node: torch.fx.Node) -> tuple | None:
    v = node.meta.get("val", node.meta.get("example_value"))
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


class StepParams:
    """The parameters of one dynamo graph's AOT forward and backward graphs.

    ``input_fqn[i]`` names the parameter that dynamo example input ``i`` is (``None`` for other
    inputs); ``param_obj`` maps names to parameters.  AOT primals follow the dynamo graph's
    placeholder order; a backward placeholder is a parameter when it has the name of a forward
    parameter placeholder (the partitioner keeps the names of saved values).  Every assumption
    is checked by shape, with an :class:`ExportError` naming the graph otherwise.
    """

    def __init__(self, k: int, dyn_gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 input_fqn: Sequence[str | None], param_obj: dict[str, torch.nn.Parameter],
                 is_persistent: Callable[[str, torch.nn.Parameter], bool]) -> None:
        if len(_placeholders(dyn_gm)) != len(example_inputs):
            raise ExportError(
                f"dynamo graph {k}: {len(_placeholders(dyn_gm))} placeholders but {len(example_inputs)} example inputs"
            )
        self.k = k
        self.example_inputs = example_inputs
        self.input_fqn = list(input_fqn)
        self.param_obj = param_obj
        self.is_persistent = is_persistent
        self.fw_param_ph: dict[str, str] = {}  # forward placeholder -> parameter name
        self.n_primals = 0

    def _param(self, fqn: str, node: str) -> Param:
        p = self.param_obj[fqn]
        return Param(fqn, node, list(p.shape), dtype_name(p.dtype), self.is_persistent(fqn, p))

    def forward(self, gm: torch.fx.GraphModule) -> tuple[list[Param], dict[str, bool]]:
        """The forward's parameters and the ``requires_grad`` of its placeholders."""
        k, ph = self.k, _placeholders(gm)
        if len(ph) != len(self.example_inputs):
            raise ExportError(
                f"dynamo graph {k}: AOT forward has {len(ph)} inputs, dynamo graph {len(self.example_inputs)}"
            )
        self.n_primals = len(ph)
        params = []
        for n, fqn in zip(ph, self.input_fqn):
            if fqn is None:
                continue
            p = self.param_obj[fqn]
            if _val_shape(n) != tuple(p.shape):
                raise ExportError(
                    f"dynamo graph {k}: primal {n.name} has shape {_val_shape(n)} but parameter "
                    f"{fqn} has shape {tuple(p.shape)}: placeholder order assumption broken"
                )
            params.append(self._param(fqn, n.name))
            self.fw_param_ph[n.name] = fqn
        rg = {n.name: bool(x.requires_grad) for n, x in zip(ph, self.example_inputs) if isinstance(x, torch.Tensor)}
        return params, rg

    def backward(self, gm: torch.fx.GraphModule) -> tuple[list[Param], list[tuple[str, int]], dict[str, bool]]:
        """The backward's parameters, its gradient outputs and the ``requires_grad`` of its
        parameter placeholders."""
        k = self.k
        params = []
        for n in _placeholders(gm):
            fqn = self.fw_param_ph.get(n.name)
            if fqn is not None:
                if _val_shape(n) != tuple(self.param_obj[fqn].shape):
                    raise ExportError(f"backward of dynamo graph {k}: saved {n.name} is not parameter {fqn}")
                params.append(self._param(fqn, n.name))
        outs = _output_args(gm)
        if len(outs) != self.n_primals:
            raise ExportError(f"backward of dynamo graph {k}: {len(outs)} outputs for {self.n_primals} forward inputs")
        grads = []
        for i, fqn in enumerate(self.input_fqn):
            if fqn is None:
                continue
            p = self.param_obj[fqn]
            o = outs[i]
            if o is None:
                if p.requires_grad:
                    raise ExportError(f"backward of dynamo graph {k}: no gradient output for {fqn}")
                continue
            if not isinstance(o, torch.fx.Node) or _val_shape(o) != tuple(p.shape):
                raise ExportError(
                    f"backward of dynamo graph {k}: output {i} has shape "
                    f"{_val_shape(o) if isinstance(o, torch.fx.Node) else o} but parameter {fqn} has {tuple(p.shape)}"
                )
            grads.append((fqn, i))
        rg = {p.node: bool(self.param_obj[p.name].requires_grad) for p in params}
        return params, grads, rg

    def persistent(self, grads: Sequence[tuple[str, int]]) -> frozenset[str]:
        """Which of these gradients' parameters are kept unsharded."""
        return frozenset(fqn for fqn, _ in grads if self.is_persistent(fqn, self.param_obj[fqn]))


def capture(
    model: torch.nn.Module,
    run_step: Callable[[torch.nn.Module], Any],
    *,
    decompositions: dict | None = None,
    partition: str = "min_cut",
    persistent: Callable[[str, torch.nn.Parameter], bool] | None = None,
) -> list[CapturedGraph]:
    """Compile ``model`` with a recording AOTAutograd backend and run ``run_step`` once.

    ``run_step(compiled_model)`` must run a forward and ``loss.backward()`` so that the
    backward graphs are compiled too.  Returns the graphs in execution order (forward graphs
    as they first ran, then backward graphs as they first ran).
    """
    from functorch.compile import default_partition, make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    decomps = default_decompositions() if decompositions is None else decompositions
    partition_fn = {"min_cut": min_cut_rematerialization_partition, "default": default_partition}[partition]

    # Parameter identity -> fully qualified name; a tied parameter gets its first name.
    by_id: dict[int, str] = {}
    for fqn, p in model.named_parameters():
        by_id.setdefault(id(p), fqn)
    param_obj = {fqn: p for fqn, p in model.named_parameters()}
    is_persistent = persistent or (lambda fqn, p: False)

    graphs: list[CapturedGraph] = []
    counter = [0]
    n_dynamo = [0]

    def runner(cg: CapturedGraph, fn: Callable) -> Callable:
        def run(args):
            if cg.run_order < 0:
                cg.run_order = counter[0]
                counter[0] += 1
            return fn(args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def backend(dyn_gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        k = n_dynamo[0]
        n_dynamo[0] += 1
        # Which example input is which parameter, by object identity.
        input_fqn = [by_id.get(id(x)) if isinstance(x, torch.Tensor) else None for x in example_inputs]
        step = StepParams(k, dyn_gm, example_inputs, input_fqn, param_obj, is_persistent)

        def fw_compiler(gm: torch.fx.GraphModule, ex: list) -> Callable:
            params, rg = step.forward(gm)
            cg = CapturedGraph("forward", k, gm, params, [], requires_grad=rg)
            graphs.append(cg)
            return runner(cg, make_boxed_func(gm.forward))

        def bw_compiler(gm: torch.fx.GraphModule, ex: list) -> Callable:
            params, grads, rg = step.backward(gm)
            cg = CapturedGraph("backward", k, gm, params, grads, requires_grad=rg, persistent=step.persistent(grads))
            graphs.append(cg)
            return runner(cg, make_boxed_func(gm.forward))

        aot = aot_autograd(
            fw_compiler=fw_compiler,
            bw_compiler=bw_compiler,
            decompositions=decomps,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )
        return aot(dyn_gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    run_step(compiled)
    torch._dynamo.reset()

    never_ran = [g for g in graphs if g.run_order < 0]
    if never_ran:
        raise ExportError(f"{len(never_ran)} compiled graph(s) never ran (dynamo graphs {[g.dynamo_index for g in never_ran]})")
    fw = sorted((g for g in graphs if g.kind != "backward"), key=lambda g: g.run_order)
    bw = sorted((g for g in graphs if g.kind == "backward"), key=lambda g: g.run_order)
    bw_of = {g.dynamo_index for g in bw}
    for g in fw:
        if g.kind == "forward" and g.dynamo_index not in bw_of:
            g.kind = "inference"  # nothing in it needed a gradient
    return fw + bw


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------


def _dumps(x: Any) -> str:
    return json.dumps(x, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def dumps_graph(doc: dict, indent: str = "") -> str:
    """Deterministic text: sorted keys, one node per line (diffs stay readable)."""
    head = {k: v for k, v in doc.items() if k not in ("nodes", "params", "grads")}
    parts = [f'{indent}{{']
    fields = []
    for k in sorted(list(head) + [k for k in ("nodes", "params", "grads") if k in doc]):
        v = doc[k]
        if k in ("nodes", "params", "grads") and v:
            inner = (",\n").join(f"{indent}  {_dumps(x)}" for x in v)
            fields.append(f'{indent} {_dumps(k)}:[\n{inner}\n{indent} ]')
        else:
            fields.append(f"{indent} {_dumps(k)}:{_dumps(v)}")
    parts.append(",\n".join(fields))
    parts.append(f"{indent}}}")
    return "\n".join(parts)


def program_doc(docs: Sequence[dict]) -> dict:
    return {"format": PROGRAM_FORMAT, "version": VERSION, "graphs": list(docs)}


def dumps_program(docs: Sequence[dict]) -> str:
    graphs = ",\n".join(dumps_graph(d, "  ") for d in docs)
    return f'{{"format":"{PROGRAM_FORMAT}","graphs":[\n{graphs}\n],"version":{VERSION}}}\n'


def write_text(path_no_ext: str, text: str, gzip_threshold: int = GZIP_THRESHOLD) -> str:
    """Writes ``<path>.json``, or ``<path>.json.gz`` (mtime 0, no file name) when large."""
    data = text.encode("utf-8")
    for ext in (".json", ".json.gz"):  # never leave a stale file of the other kind behind
        if os.path.exists(path_no_ext + ext):
            os.remove(path_no_ext + ext)
    if len(data) > gzip_threshold:
        path = path_no_ext + ".json.gz"
        buf = io.BytesIO()
        with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
            f.write(data)
        with open(path, "wb") as f:
            f.write(buf.getvalue())
    else:
        path = path_no_ext + ".json"
        with open(path, "wb") as f:
            f.write(data)
    return path


def name_graphs(prefix: str, graphs: Sequence[CapturedGraph]) -> None:
    """Names the graphs in execution order, and each backward graph's forward: the forward
    of the same dynamo graph, whose outputs its saved-value placeholders read."""
    fi = bi = 0
    forward_of: dict[int, str] = {}
    for g in graphs:
        if g.kind == "backward":
            g.name, bi = f"{prefix}_bwd_{bi}", bi + 1
            g.forward = forward_of.get(g.dynamo_index)
        else:
            g.name, fi = f"{prefix}_fwd_{fi}", fi + 1
            forward_of[g.dynamo_index] = g.name


def write_program(
    out_dir: str, prefix: str, graphs: Sequence[CapturedGraph], gzip_threshold: int = GZIP_THRESHOLD
) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    name_graphs(prefix, graphs)
    docs = [g.to_doc() for g in graphs]
    paths = []
    for d in docs:
        paths.append(write_text(os.path.join(out_dir, d["name"]), dumps_graph(d) + "\n", gzip_threshold))
    paths.append(write_text(os.path.join(out_dir, f"{prefix}.program"), dumps_program(docs), gzip_threshold))
    return paths


def load(path: str) -> dict:
    """Reads a .json or .json.gz document."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    return json.loads(data)


# --------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------


def export_model(spec, out_dir: str, *, prefix: str | None = None, program_only: bool = False,
                 gzip_threshold: int = GZIP_THRESHOLD, decompositions: str = "core", log=print) -> dict:
    """Build the model that ``spec`` describes (a :class:`zerosched.models.ModelSpec` or a
    :class:`zerosched.arch.ArchSpec`), capture one training step and write its files.
    Returns a small report."""
    from . import arch, models

    t0 = time.perf_counter()
    if isinstance(spec, arch.ArchSpec):
        model, step, default_prefix = arch.build(spec)
    else:
        (model, step), default_prefix = models.build(spec), models.file_prefix(spec.model)
    return export_step(model, step, out_dir, prefix=prefix or default_prefix, program_only=program_only,
                       gzip_threshold=gzip_threshold, decompositions=decompositions, log=log, t0=t0)


def export_step(model: torch.nn.Module, step: Callable[[torch.nn.Module], Any], out_dir: str, *, prefix: str,
                program_only: bool = False, gzip_threshold: int = GZIP_THRESHOLD, decompositions: str = "core",
                log=print, t0: float | None = None) -> dict:
    """Capture one training step (``step(compiled_model)``) of ``model`` and write its files."""
    t1 = time.perf_counter()
    t0 = t1 if t0 is None else t0
    graphs = capture(model, step, decompositions=decomposition_table(decompositions))
    t2 = time.perf_counter()
    name_graphs(prefix, graphs)
    os.makedirs(out_dir, exist_ok=True)
    docs = [g.to_doc() for g in graphs]
    paths = []
    if not program_only:
        for d in docs:
            paths.append(write_text(os.path.join(out_dir, d["name"]), dumps_graph(d) + "\n", gzip_threshold))
    paths.append(write_text(os.path.join(out_dir, f"{prefix}.program"), dumps_program(docs), gzip_threshold))
    t3 = time.perf_counter()
    n_params = sum(1 for _ in model.named_parameters())
    seen = {p.name for g in graphs for p in g.params}
    report = {
        "prefix": prefix,
        "graphs": [(g.name, g.kind, len(g.gm.graph.nodes), len(g.params), len(g.grads)) for g in graphs],
        "params_in_graphs": len(seen),
        "params_in_model": n_params,
        "build_s": round(t1 - t0, 2),
        "capture_s": round(t2 - t1, 2),
        "write_s": round(t3 - t2, 2),
        "files": {p: os.path.getsize(p) for p in paths},
    }
    log(json.dumps(report, indent=1))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    from . import arch, factory, models

    ap = argparse.ArgumentParser(prog="python -m zerosched.export", description=__doc__.split("\n\n")[0])
    source = ap.add_argument_group("the model (one of)")
    source.add_argument("--model", choices=sorted(models.MODELS), help="a built-in model, sized by the flags below")
    source.add_argument("--config", metavar="FILE", help="a transformers config file (config.json)")
    source.add_argument("--arch", metavar="NAME",
                        help="a transformers model type (bert, t5, ...) or class (BertForMaskedLM) with its defaults")
    source.add_argument("--module", metavar="PKG.MOD:FACTORY",
                        help="a factory returning (model, example_batch) or (model, step_fn)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=arch.parse_set,
                    help="override a config field of --config/--arch (JSON value; dotted keys for sub-configs)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"])
    ap.add_argument("--attn", choices=["sdpa", "eager", "flash"],
                    help="attention implementation (default: sdpa; flash with --fake; the architecture's own "
                         "with --config/--arch)")
    ap.add_argument("--experts-impl", choices=["grouped_mm", "batched_mm", "eager"],
                    help="MoE experts implementation (default grouped_mm)")
    ap.add_argument("--fake", action="store_true", help="meta-device model and inputs: no real weights")
    ap.add_argument("--decompositions", choices=DECOMPOSITIONS, default="core",
                    help="AOTAutograd's table: core ATen (default), none (what DeepCompile sees), inductor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix", help="file name prefix (default: the model name)")
    ap.add_argument("--program-only", action="store_true", help="write only the program bundle")
    ap.add_argument("-o", "--out", help="output directory")
    ap.add_argument("--fixtures", metavar="DIR", help="regenerate the checked-in fixtures into DIR")
    ap.add_argument("--benches", metavar="DIR", help="regenerate the benchmark programs into DIR")
    try:
        a = ap.parse_args(argv)
    except ExportError as e:  # a malformed --set
        ap.error(str(e))

    if a.fixtures:
        for spec, prefix in models.fixture_specs():
            export_model(spec, a.fixtures, prefix=prefix)
        for family, spec in arch.FAMILY_FIXTURES.items():
            for mode in arch.FAMILY_DECOMPOSITIONS:
                export_model(spec, os.path.join(a.fixtures, "families"), prefix=f"{family}_{mode}", program_only=True,
                             gzip_threshold=0, decompositions=mode)
        return 0
    if a.benches:
        for spec, prefix in models.bench_specs():
            export_model(spec, a.benches, prefix=prefix, program_only=True, gzip_threshold=0)
        return 0
    sources = [f for f in ("model", "config", "arch", "module") if getattr(a, f)]
    if len(sources) != 1 or not a.out:
        ap.error("-o and one of --model, --config, --arch, --module are required "
                 "(or use --fixtures DIR / --benches DIR)")
    built_in = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "experts", "top_k",
                "experts_impl")
    shared = ("seq", "batch", "dtype", "attn")
    if a.module:
        given = [f"--{k.replace('_', '-')}" for k in built_in + shared if getattr(a, k) is not None]
        if given or a.set or a.fake:
            ap.error(f"{', '.join(given + (['--set'] if a.set else []) + (['--fake'] if a.fake else []))}: "
                     "the factory builds the model and its batch")
        try:
            model, step, prefix = factory.build(a.module)
            export_step(model, step, a.out, prefix=a.prefix or prefix, program_only=a.program_only,
                        decompositions=a.decompositions)
        except ExportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if a.model:
        if a.set:
            ap.error("--set applies to --config/--arch; size a built-in model with its flags (--layers ...)")
        overrides = {k: getattr(a, k) for k in built_in + shared if getattr(a, k) is not None}
        spec: Any = models.ModelSpec(model=a.model, fake=a.fake, seed=a.seed, **overrides)
    else:
        given = [f"--{k.replace('_', '-')}" for k in built_in if getattr(a, k) is not None]
        if given:
            ap.error(f"{', '.join(given)} size the built-in models; with --config/--arch use --set KEY=VALUE")
        overrides = {k: getattr(a, k) for k in shared if getattr(a, k) is not None}
        spec = arch.ArchSpec(config=a.config, arch=a.arch, sets=tuple(a.set), fake=a.fake, seed=a.seed, **overrides)
    try:
        export_model(spec, a.out, prefix=a.prefix, program_only=a.program_only, decompositions=a.decompositions)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
