"""zerosched.deepspeed: DeepCompile's ZeRO-3 pass scheduling with zerosched, on the CPU.

As DeepSpeed's own scheduler tests do, DeepCompile's ``dc`` ops are stubs registered with
``torch.library`` (DeepSpeed builds the real ones only for CUDA). On one rank a shard is the
whole parameter, so the stubs are identities, and ``reduce_grad`` records the gradient it
would reduce: a scheduled graph must compute exactly what the graph AOTAutograd produced.
"""

from __future__ import annotations

import copy
import functools
import operator
from types import SimpleNamespace

import pytest
import torch
from torch.fx import Graph, GraphModule, Node

import deepspeed.compile.util as ds_util
from deepspeed.compile import list_schedule
from deepspeed.compile.graph_param import DSGraphParamManager
from deepspeed.compile.passes import zero3_compile
from deepspeed.compile.profilers.graph_profile import _backfill_missing_profile_metadata

import zerosched
from zerosched import deepspeed as zds
from zerosched import export, models

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# stub dc ops
# ---------------------------------------------------------------------------------------------

_REDUCED: dict[int, torch.Tensor] = {}
_LIBS = []


def _define_dc_ops() -> None:
    if hasattr(torch.ops, "dc") and hasattr(torch.ops.dc, "allgather_param"):
        return
    lib = torch.library.Library("dc", "DEF")
    lib.define("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype = None) -> Tensor")
    lib.define("wait_allgather(Tensor(a) a, int graph_id, int id) -> Tensor(a)")
    lib.define("release_param(Tensor(a) a, int graph_id, int id, int n_users) -> Tensor(a)")
    lib.define("reduce_grad(Tensor a, int graph_id, int id) -> Tensor")
    lib.define("end_backward(Any deps, int graph_id, bool release_reduce_buckets) -> ()")
    lib.define("offload_tensor(Tensor a, int id, int id) -> Tensor")

    def reduce_grad(a, graph_id, ds_id):
        _REDUCED[ds_id] = a.clone()
        return a.clone()

    impls = {
        "allgather_param": lambda a, graph_id, ds_id, dtype=None: a.to(dtype or a.dtype, copy=True),
        "wait_allgather": lambda a, graph_id, ds_id: a,
        "release_param": lambda a, graph_id, ds_id, n_users: a,
        "reduce_grad": reduce_grad,
        "end_backward": lambda deps, graph_id, release: None,
        "offload_tensor": lambda a, i, j: a.clone(),
    }
    for name, fn in impls.items():
        lib.impl(name, fn, "CompositeExplicitAutograd")
    _LIBS.append(lib)


_define_dc_ops()
GATHER, WAIT, RELEASE, REDUCE = (torch.ops.dc.allgather_param.default, torch.ops.dc.wait_allgather.default,
                                 torch.ops.dc.release_param.default, torch.ops.dc.reduce_grad.default)


@pytest.fixture(autouse=True)
def no_deepcompile_build(monkeypatch):
    # DeepSpeed's alias table (get_no_copy_ops) loads its CUDA extension first; the stubs stand in.
    monkeypatch.setattr(ds_util, "get_deepcompile_handle", lambda: None)
    yield
    zds.uninstall()


# ---------------------------------------------------------------------------------------------
# DeepCompile's zero3_compile pass without a GPU
# ---------------------------------------------------------------------------------------------


class _Profiler:
    """Stands in for DeepCompile's profiling interpreter: DeepSpeed's own backfill of profile
    metadata (zero device times, sizes from the values), as on a graph it could not profile."""

    def __init__(self, gm, debug_log=False, process_group=None):
        self.gm = gm

    def run(self, *args):
        _backfill_missing_profile_metadata(self.gm.graph)


@pytest.fixture
def deepcompile_pass(monkeypatch):
    """DeepCompile's ``add_z3_gather_release`` (insertion, profile, budget, schedule, end of
    backward) on one rank outside a process group; returns a function (gm, bwd) -> gm."""
    monkeypatch.setattr(zero3_compile, "get_deepcompile_handle",
                        lambda: SimpleNamespace(register_graph_z3=lambda *a: None))
    monkeypatch.setattr(zero3_compile, "ProfilingInterpreter", _Profiler)
    monkeypatch.setattr(zero3_compile.dist, "get_rank", lambda group=None: 0)
    # Debug mode makes DeepCompile validate the final schedule's ds_ids (collective projection).
    monkeypatch.setenv(zero3_compile.SCHEDULER_DEBUG_ENV, "1")

    def run(gm: GraphModule, bwd: bool, manager: DSGraphParamManager, param_indices) -> GraphModule:
        results = {0: SimpleNamespace(param_indices=param_indices)}
        n_inputs = len([n for n in gm.graph.nodes if n.op == "placeholder"])
        out = zero3_compile.add_z3_gather_release(gm, 0, [(0, True)], results, lambda: [None] * n_inputs, 0.0,
                                                  {0: manager}, bwd)
        out.recompile()
        return out

    return run


# ---------------------------------------------------------------------------------------------
# graphs of the fixture models, with the inputs they ran on
# ---------------------------------------------------------------------------------------------

FIXTURE_MODELS = {"llama": models.ModelSpec(model="llama"),
                  "qwen2_moe": models.ModelSpec(model="qwen2-moe", experts_impl="batched_mm"),
                  "gpt2": models.ModelSpec(model="gpt2")}


@functools.cache
def captured(name: str):
    """The first forward graph of the model's training step and its backward, each with the
    inputs it ran on (recorded as AOTAutograd's compiled functions were called)."""
    import functorch.compile as fc

    inputs: dict[int, list] = {}
    boxed = fc.make_boxed_func

    def recording(f):
        run = boxed(f)

        def record(args):
            inputs.setdefault(id(f.__self__), [a.detach().clone() if isinstance(a, torch.Tensor) else a
                                               for a in args])
            return run(args)

        record._boxed_call = True
        return record

    fc.make_boxed_func = recording
    try:
        model, step = models.build(FIXTURE_MODELS[name])
        graphs = export.capture(model, step)
    finally:
        fc.make_boxed_func = boxed
    fw = graphs[0]
    bw = next(g for g in graphs if g.kind == "backward" and g.dynamo_index == fw.dynamo_index)
    return fw, inputs[id(fw.gm)], bw, inputs[id(bw.gm)]


def _copy(gm: GraphModule) -> GraphModule:
    return GraphModule(gm, copy.deepcopy(gm.graph))


def _manager(fw: export.CapturedGraph):
    ph = [n for n in fw.gm.graph.nodes if n.op == "placeholder"]
    ds_id = {p.node: 100 + i for i, p in enumerate(fw.params)}
    indices = [(i, ds_id[n.name], tuple(n.meta["val"].shape)) for i, n in enumerate(ph) if n.name in ds_id]
    return DSGraphParamManager(fw.gm.graph, [n.meta["val"] for n in ph], indices), indices


def _run(gm: GraphModule, args: list) -> list:
    _REDUCED.clear()
    # The MoE backward's accumulating index_put runs in parallel on the CPU; deterministic mode
    # makes two runs of one graph bit-identical, so a reordered graph can be compared exactly.
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            out = gm(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    finally:
        torch.use_deterministic_algorithms(was)
    return list(out) if isinstance(out, (list, tuple)) else [out]


# ---------------------------------------------------------------------------------------------
# what a valid DeepSpeed schedule is, checked independently of both schedulers
# ---------------------------------------------------------------------------------------------


def check_schedule(graph: Graph) -> dict[int, int]:
    """Asserts that every use of a gathered parameter comes after its wait and before the last of
    its releases, and that each gather has one wait and as many releases as they say. Storage
    follows the alias annotations of aten schemas (``split`` returns ``Tensor(a)[]``, which
    DeepSpeed's alias table misses), ``getitem`` and ``release_param`` (which returns its
    argument).
    Returns the number of gathers per ds_id."""
    order = {n: i for i, n in enumerate(graph.nodes)}

    def aliases(n: Node, storage: set) -> bool:
        if n.target is operator.getitem or n.target is RELEASE:
            return n.args[0] in storage
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten":
            return any(n.args[i] in storage for i in export.schema_aliases_mutates(n.target, len(n.args))[0])
        return False
    gathers: dict[int, int] = {}
    for gather in [n for n in graph.nodes if n.target is GATHER]:
        ds_id = gather.args[2]
        gathers[ds_id] = gathers.get(ds_id, 0) + 1
        assert gather.args[0].op == "placeholder", gather.format_node()
        waits = [u for u in gather.users if u.target is WAIT]
        assert len(waits) == 1 and set(gather.users) == set(waits), f"{gather.name}: {list(gather.users)}"
        storage, uses, escapes = {waits[0]}, [], False
        for n in graph.nodes:
            if order[n] <= order[waits[0]] or not any(a in storage for a in n.all_input_nodes):
                continue
            if n.op == "output":
                escapes = True
            elif aliases(n, storage):
                storage.add(n)
            else:
                uses.append(n)
        releases = [n for n in graph.nodes if n.target is RELEASE and n.args[2] == ds_id
                    and order[n] > order[gather]]
        if escapes and not releases:
            continue
        assert releases, f"{gather.name} is never released"
        assert all(r.args[3] == len(releases) for r in releases), [r.format_node() for r in releases]
        last = max(order[r] for r in releases)
        late = [u.name for u in uses if order[u] > last]
        assert not late, f"ds_id {ds_id} released before its uses {late}"
    return gathers


def compute_nodes(graph: Graph) -> list[tuple[str, str]]:
    """The graph's own nodes (not DeepCompile's), as a sorted multiset of (op, target)."""
    return sorted((n.op, str(n.target)) for n in graph.nodes
                  if getattr(n.target, "namespace", None) != "dc")


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


def test_install_replaces_the_call_site_and_uninstall_restores_it():
    original = zero3_compile.fast_free_schedule
    with zds.install():
        assert zds.installed()
        assert zero3_compile.fast_free_schedule is not original
        assert list_schedule.fast_free_schedule is zero3_compile.fast_free_schedule
        zds.install(scheduler="jit")  # options change; DeepSpeed's function is still the one restored
    assert not zds.installed()
    assert zero3_compile.fast_free_schedule is original
    assert list_schedule.fast_free_schedule is original


@pytest.mark.parametrize("name", list(FIXTURE_MODELS))
def test_deepcompile_pass_schedules_the_fixture_models_with_zerosched(name, deepcompile_pass):
    fw, fw_in, bw, bw_in = captured(name)
    want_fw, want_bw = _run(fw.gm, fw_in), _run(bw.gm, bw_in)
    manager, indices = _manager(fw)
    reference = {"fw": compute_nodes(fw.gm.graph), "bw": compute_nodes(bw.gm.graph)}

    zds.install()
    got = {}
    for kind, cg, args in (("fw", fw, fw_in), ("bw", bw, bw_in)):
        gm = deepcompile_pass(_copy(cg.gm), kind == "bw", manager, indices)
        diagnostics = getattr(gm.graph, list_schedule.DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR)
        assert diagnostics["zerosched"]["scheduler"] == "prefetch"  # zerosched ran, not DeepSpeed
        gathers = check_schedule(gm.graph)
        assert gathers and all(k == 1 for k in gathers.values())
        nodes = compute_nodes(gm.graph)
        # Every node of the graph is kept (a downcast may move into its gather, as DeepSpeed does).
        assert [n for n in nodes if n not in reference[kind]] == []
        assert len(reference[kind]) - len(nodes) == sum(
            1 for n in gm.graph.nodes if n.target is GATHER and n.kwargs["dtype"] != n.args[0].meta["val"].dtype)
        got[kind] = (gm, _run(gm, args), dict(_REDUCED))

    for w, g in zip(want_fw, got["fw"][1], strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    grads = {i: ds_id for i, (_, ds_id, _) in enumerate(indices)}
    _, bw_out, reduced = got["bw"]
    assert sorted(reduced) == sorted(ds_id for i, ds_id in grads.items() if want_bw[indices[i][0]] is not None)
    for i, (pos, ds_id, _) in enumerate(indices):
        assert bw_out[pos] is None  # DeepCompile's runtime takes gradients from reduce_grad
        if want_bw[pos] is not None:
            torch.testing.assert_close(reduced[ds_id], want_bw[pos], rtol=0, atol=0)
    for pos, w in enumerate(want_bw):
        if pos not in {p for p, _, _ in indices}:
            torch.testing.assert_close(bw_out[pos], w, rtol=0, atol=0)


def test_the_same_graph_schedules_to_the_same_graph(deepcompile_pass):
    fw, _, _, _ = captured("gpt2")
    manager, indices = _manager(fw)
    zds.install()
    a, b = (deepcompile_pass(_copy(fw.gm), False, manager, indices) for _ in range(2))
    assert [n.format_node() for n in a.graph.nodes] == [n.format_node() for n in b.graph.nodes]


# Hand-written graphs for DeepSpeed's failure modes: two parameters w0, w1 [4, 4], an input x [2, 4].


def _graph(kind: str) -> tuple[Graph, list]:
    g = Graph()
    w0, w1, x = (g.placeholder(f"primals_{i}") for i in (1, 2, 3))
    for n, shape in ((w0, (4, 4)), (w1, (4, 4)), (x, (2, 4))):
        n.meta["val"] = torch.empty(shape)
    y = g.call_function(aten.mm.default, (x, w1))
    y.meta["val"] = torch.empty(2, 4)
    if kind == "output_only_param":
        g.output((y, w0))
    elif kind == "param_as_kwarg":
        z = g.call_function(aten.mm.default, (y,), {"mat2": w0})
        z.meta["val"] = torch.empty(2, 4)
        g.output((z,))
    elif kind == "param_through_split_views":
        parts = g.call_function(aten.split.Tensor, (w0, 2))
        parts.meta["val"] = [torch.empty(2, 4), torch.empty(2, 4)]
        first = g.call_function(operator.getitem, (parts, 0))
        second = g.call_function(operator.getitem, (parts, 1))
        first.meta["val"], second.meta["val"] = torch.empty(2, 4), torch.empty(2, 4)
        a = g.call_function(aten.mul.Tensor, (y, first))
        b = g.call_function(aten.add.Tensor, (a, second))
        a.meta["val"], b.meta["val"] = torch.empty(2, 4), torch.empty(2, 4)
        g.output((b,))
    elif kind == "param_cast_down_before_its_use":
        cast = g.call_function(torch.ops.prims.convert_element_type.default, (w0, torch.bfloat16))
        y16 = g.call_function(torch.ops.prims.convert_element_type.default, (y, torch.bfloat16))
        z = g.call_function(aten.mm.default, (y16, cast))
        cast.meta["val"] = torch.empty(4, 4, dtype=torch.bfloat16)
        y16.meta["val"] = torch.empty(2, 4, dtype=torch.bfloat16)
        z.meta["val"] = torch.empty(2, 4, dtype=torch.bfloat16)
        g.output((z,))
    elif kind == "param_read_by_a_multi_output_op":
        top = g.call_function(aten.max.dim, (w0, 1))
        top.meta["val"] = [torch.empty(4), torch.empty(4, dtype=torch.long)]
        values = g.call_function(operator.getitem, (top, 0))
        values.meta["val"] = torch.empty(4)
        z = g.call_function(aten.add.Tensor, (y, values))
        z.meta["val"] = torch.empty(2, 4)
        g.output((z,))
    torch.manual_seed(0)
    return g, [torch.randn(4, 4), torch.randn(4, 4), torch.randn(2, 4)]


def _insert(kind: str) -> tuple[Graph, list, GraphModule]:
    g, args = _graph(kind)
    original = GraphModule(torch.nn.Module(), copy.deepcopy(g))
    indices = [(0, 10, (4, 4)), (1, 11, (4, 4))]
    manager = DSGraphParamManager(g, [n.meta["val"] for n in g.nodes if n.op == "placeholder"], indices)
    g = zero3_compile.add_gather_and_release(0, g, manager, ds_util.get_param_nodes(g, indices))
    _backfill_missing_profile_metadata(g)
    return g, args, original


def _schedule(g: Graph) -> Graph:
    return zero3_compile.fast_free_schedule(copy.deepcopy(g), 0, 0, False, scheduler_budget=None)


def test_output_only_param_is_returned_as_its_shard_not_gathered():
    g, args, original = _insert("output_only_param")
    # DeepSpeed's own schedule gathers w0 only to return it: a full buffer that is never released.
    own = _schedule(g)
    returned = [a for a in next(n for n in own.nodes if n.op == "output").args[0]]
    assert returned[1].target is WAIT and not [n for n in own.nodes if n.target is RELEASE and n.args[2] == 10]

    zds.install()
    ours = _schedule(g)
    returned = [a for a in next(n for n in ours.nodes if n.op == "output").args[0]]
    assert returned[1].op == "placeholder" and returned[1].name == "primals_1"
    assert check_schedule(ours) == {11: 1}
    for w, o in zip(_run(original, args), _run(GraphModule(torch.nn.Module(), ours), args), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_param_passed_as_kwarg_schedules_where_deepspeed_fails():
    g, args, original = _insert("param_as_kwarg")
    with pytest.raises(KeyError, match="wait_allgather_ds_param__primals_1_10"):
        _schedule(g)
    zds.install()
    ours = _schedule(g)
    assert check_schedule(ours) == {10: 1, 11: 1}
    for w, o in zip(_run(original, args), _run(GraphModule(torch.nn.Module(), ours), args), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_param_used_through_split_views_is_released_after_every_view_use():
    g, args, original = _insert("param_through_split_views")
    # DeepSpeed's releases follow the getitems, views that use no data, before the real uses.
    with pytest.raises(AssertionError, match="ds_id 10 released before its uses"):
        check_schedule(_schedule(g))
    zds.install()
    ours = _schedule(g)
    assert check_schedule(ours) == {10: 1, 11: 1}
    releases = [n for n in ours.nodes if n.target is RELEASE and n.args[2] == 10]
    # Both uses of w0's views (mul of the first half, add of the second) hold a release.
    assert sorted(str(r.args[0].target) for r in releases) == ["aten.add.Tensor", "aten.mul.Tensor"]
    for w, o in zip(_run(original, args), _run(GraphModule(torch.nn.Module(), ours), args), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_a_downcast_param_is_gathered_in_the_smaller_dtype():
    g, args, original = _insert("param_cast_down_before_its_use")
    # DeepSpeed's insertion moved the cast into the gather; the adapter restores it, zerosched fuses it.
    assert next(n for n in g.nodes if n.target is GATHER and n.args[2] == 10).kwargs["dtype"] is torch.bfloat16
    zds.install()
    ours = _schedule(g)
    assert "zerosched" in getattr(ours, list_schedule.DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR)
    assert check_schedule(ours) == {10: 1, 11: 1}
    gather = next(n for n in ours.nodes if n.target is GATHER and n.args[2] == 10)
    assert gather.kwargs["dtype"] is torch.bfloat16
    casts = [n for n in ours.nodes if n.target is torch.ops.prims.convert_element_type.default]
    assert len(casts) == 1 and casts[0].args[0].op != "placeholder"  # y's cast stays; w0's is the gather's
    for w, o in zip(_run(original, args), _run(GraphModule(torch.nn.Module(), ours), args), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_a_param_read_by_a_multi_output_op_is_released_behind_its_getitem():
    g, args, original = _insert("param_read_by_a_multi_output_op")
    zds.install()
    ours = _schedule(g)
    assert "zerosched" in getattr(ours, list_schedule.DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR)
    assert check_schedule(ours) == {10: 1, 11: 1}
    (release,) = [n for n in ours.nodes if n.target is RELEASE and n.args[2] == 10]
    assert release.args[0].target is operator.getitem and release.args[0].args[0].target is aten.max.dim
    for w, o in zip(_run(original, args), _run(GraphModule(torch.nn.Module(), ours), args), strict=True):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_a_budget_no_schedule_fits_runs_the_smallest_that_does_and_reports_it():
    g, _, _ = _insert("param_as_kwarg")
    zds.install()
    budget = list_schedule.SchedulerMemoryBudget.minimum_gather_residency(1)
    out = zero3_compile.fast_free_schedule(copy.deepcopy(g), 0, 0, False, scheduler_budget=budget)
    diagnostics = getattr(out, list_schedule.DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR)
    (overflow,) = diagnostics["budget_overflows"]
    assert overflow["max_gathered_bytes"] == 1 and overflow["needed_bytes"] >= 4 * 4 * 4
    assert diagnostics["zerosched"]["budget_bytes"] == overflow["needed_bytes"]
    assert 0 < diagnostics["selected"][0]["peak_gathered_bytes"] <= overflow["needed_bytes"]
    check_schedule(out)
    with pytest.raises(zerosched.OverBudgetError) as e:
        zds.schedule_graph(copy.deepcopy(g), budget=1)
    assert e.value.needed == overflow["needed_bytes"]


def test_a_deepcompile_op_without_an_equivalent_is_named_in_the_error():
    g, _, _ = _insert("param_as_kwarg")
    mm = next(n for n in g.nodes if n.target is aten.mm.default)
    with g.inserting_after(mm):
        off = g.call_function(torch.ops.dc.offload_tensor.default, (mm, 0, 1))
    off.meta.update(mm.meta)
    zds.install()
    with pytest.raises(zerosched.ZeroschedError, match=f"node `{off.name}`: DeepSpeed op dc.offload_tensor"):
        _schedule(g)


def test_a_gather_of_a_computed_value_is_named_in_the_error():
    g = Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 4)
    neg = g.call_function(aten.neg.default, (x,))
    gather = g.call_function(GATHER, (neg, 0, 5), {"dtype": torch.float32})
    wait = g.call_function(WAIT, (gather, 0, 5))
    g.output((g.call_function(aten.mm.default, (wait, wait)),))
    for n in (neg, gather, wait):
        n.meta["val"] = torch.empty(4, 4)
    with pytest.raises(zerosched.ZeroschedError, match=f"node `{gather.name}`: gathers `{neg.name}`"):
        zds.schedule_graph(g)


def test_a_parameter_gathered_twice_is_named_in_the_error():
    g, _, _ = _insert("param_as_kwarg")
    second = next(n for n in g.nodes if n.target is GATHER and n.args[2] == 11)
    second.args = (second.args[0], 0, 10)
    with pytest.raises(zerosched.ZeroschedError, match=f"node `{second.name}`: ds_id 10 is gathered twice"):
        zds.schedule_graph(g)


def test_install_with_dump_writes_graphs_the_command_line_reschedules_to_the_same_bytes(deepcompile_pass, tmp_path):
    import json

    from test_core import cli
    from zerosched import dump

    fw, _, bw, _ = captured("gpt2")
    manager, indices = _manager(fw)
    zds.install(dump=str(tmp_path))
    for kind, cg in (("fw", fw), ("bw", bw)):
        deepcompile_pass(_copy(cg.gm), kind == "bw", manager, indices)
    d = tmp_path / "rank0"
    stems = sorted(p.name[: -len(".options.json")] for p in d.glob("*.options.json"))
    assert len(stems) == 2 and all(s.startswith("deepcompile_graph_") for s in stems), stems
    for s in stems:
        options = json.loads((d / f"{s}.options.json").read_text())
        assert options["disable"] == zds.DISABLED_PASSES
        args = dump.command_args(options, str(d / f"{s}.json"), str(d / f"{s}.cli.json"))
        r = cli(*args)
        assert r.returncode == 0, r.stderr
        assert (d / f"{s}.cli.json").read_bytes() == (d / f"{s}.scheduled.json").read_bytes(), s
