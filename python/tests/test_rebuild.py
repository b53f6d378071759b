"""Rebuilding an FX graph from its scheduled document: the inserted ops in the scheduled order,
and clear errors for documents the backend cannot run."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import zerosched
from zerosched import export, ops, rebuild


@pytest.fixture(scope="module")
def graph():
    gm = make_fx(lambda w, x: torch.mm(x, w).relu(), tracing_mode="fake")(torch.randn(4, 4), torch.randn(2, 4))
    w = [n.name for n in gm.graph.nodes if n.op == "placeholder"][0]
    doc = export.graph_to_doc(gm, name="g", params=[export.Param("w", w, [4, 4], "float32")])
    scheduled, _ = zerosched.schedule(export.dumps_graph(doc).encode(), {"world_size": 2})
    return gm, json.loads(scheduled)


def test_the_rebuilt_graph_holds_the_scheduled_order(graph):
    gm, doc = graph
    new = rebuild.rebuild(gm, doc)
    assert [n.name for n in new.graph.nodes] == [n["name"] for n in doc["nodes"]]
    targets = [n.target for n in new.graph.nodes if n.op == "call_function"]
    assert targets[:2] == [ops.allgather, ops.wait] and ops.release in targets
    mm = next(n for n in new.graph.nodes if n.target == torch.ops.aten.mm.default)
    assert mm.args[1].target is ops.wait, "the use reads the waited value, not the shard"


@pytest.mark.parametrize("target", ["zerosched.keep.default", "mylib.custom.default"])
def test_a_node_the_backend_cannot_run_is_named(graph, target):
    gm, doc = graph
    bad = copy.deepcopy(doc)
    node = next(n for n in bad["nodes"] if n["target"] == "zerosched.release.default")
    node["target"], node["name"] = target, "odd"
    with pytest.raises(zerosched.ZeroschedError, match=f"graph `g`, node `odd`: .*`{target}`"):
        rebuild.rebuild(gm, bad)


def test_a_reference_to_an_unknown_node_is_named(graph):
    gm, doc = graph
    bad = copy.deepcopy(doc)
    wait = next(n for n in bad["nodes"] if n["target"] == "zerosched.wait.default")
    wait["args"] = [{"node": "nowhere"}]
    with pytest.raises(zerosched.ZeroschedError, match=f"node `{wait['name']}`: reference to `nowhere`"):
        rebuild.rebuild(gm, bad)


@pytest.fixture(scope="module")
def graph_with_constant():
    """A graph whose constant make_fx lifts to a ``get_attr`` (``_tensor_constant0``)."""
    gm = make_fx(lambda w, x: torch.mm(x, w) * torch.tensor([1.0, 2.0, 3.0, 4.0]), tracing_mode="real")(
        torch.randn(4, 4), torch.randn(2, 4))
    w = [n.name for n in gm.graph.nodes if n.op == "placeholder"][0]
    doc = export.graph_to_doc(gm, name="g", params=[export.Param("w", w, [4, 4], "float32")])
    scheduled, _ = zerosched.schedule(export.dumps_graph(doc).encode(), {"world_size": 2})
    return gm, json.loads(scheduled)


def test_a_get_attr_constant_is_bound_again_in_the_rebuilt_graph(graph_with_constant):
    gm, doc = graph_with_constant
    consts = [n for n in doc["nodes"] if n["op"] == "get_attr"]
    assert [n["target"] for n in consts] == ["_tensor_constant0"], "the fixture must hold a lifted constant"
    new = rebuild.rebuild(gm, doc)
    node = next(n for n in new.graph.nodes if n.op == "get_attr")
    assert node.target == "_tensor_constant0"
    assert torch.equal(getattr(new, node.target), gm._tensor_constant0)
    assert [u.target for u in node.users] == [torch.ops.aten.lift_fresh_copy.default], "the constant keeps its use"


def test_a_get_attr_the_original_graph_does_not_have_is_named(graph_with_constant):
    gm, doc = graph_with_constant
    bad = copy.deepcopy(doc)
    node = next(n for n in bad["nodes"] if n["op"] == "get_attr")
    node["target"] = "_tensor_constant9"
    with pytest.raises(zerosched.ZeroschedError, match=f"node `{node['name']}`: a get_attr of `_tensor_constant9`"):
        rebuild.rebuild(gm, bad)


def test_a_bucket_of_reductions_rebuilds_as_the_runtime_reductions_in_order():
    """A scheduled backward's reductions may carry ``bucket`` (adjacent reductions issued as one
    collective): the rebuilt graph calls the runtime's ``reduce_grad`` for each, in the
    scheduled order, and the runtime's own queue coalesces them (``RUNTIME.reduce_bucket_bytes``)."""
    gm = make_fx(lambda w1, w2, x, g: (torch.mm(x.t(), g), torch.mm(x.t(), g.relu()), torch.mm(g, w1 + w2)),
                 tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4))
    w1, w2 = [n.name for n in gm.graph.nodes if n.op == "placeholder"][:2]
    doc = export.graph_to_doc(gm, name="bwd", kind="backward",
                              params=[export.Param("w1", w1, [4, 4], "float32"),
                                      export.Param("w2", w2, [4, 4], "float32")],
                              grads=[("w1", 0), ("w2", 1)])
    scheduled, _ = zerosched.schedule(export.dumps_graph(doc).encode(), {"world_size": 2, "scheduler": "jit"})
    doc = json.loads(scheduled)
    nodes = doc["nodes"]
    reduces = [i for i, n in enumerate(nodes) if n["target"] == "zerosched.reduce_grad.default"]
    assert len(reduces) == 2
    # The first right before the second, both in bucket 0: a valid bucketed schedule.
    first = nodes.pop(reduces[0])
    nodes.insert(reduces[1] - 1, first)
    for i in (reduces[1] - 1, reduces[1]):
        nodes[i]["kwargs"]["bucket"] = 0
    zerosched.check(json.dumps(doc).encode(), {"world_size": 2})
    new = rebuild.rebuild(gm, doc)
    calls = [n for n in new.graph.nodes if n.op == "call_function"]
    at = [i for i, n in enumerate(calls) if n.target is ops.reduce_grad]
    assert [calls[i].name for i in at] == [nodes[reduces[1] - 1]["name"], nodes[reduces[1]]["name"]]
    assert at[1] == at[0] + 1
