"""zerosched.overlap: PyTorch's overlap scheduler on a fixture program, read back as a zerosched
schedule (the side-by-side benchmark, python/bench_overlap.py, runs the same on every program)."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
import torch

import zerosched
from zerosched import overlap

FIXTURES = pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures"
WORLD = 8


@pytest.fixture(scope="module")
def program() -> dict:
    return json.loads((FIXTURES / "llama.program.json").read_text())


@pytest.fixture(scope="module")
def torch_schedule(program) -> overlap.TorchSchedule:
    return overlap.schedule_program(program, world_size=WORLD)


def _targets(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target)]


def test_the_torch_form_gathers_each_used_parameter_and_reduces_each_gradient(program):
    with overlap.fake_process_group(WORLD) as group:
        fwd, bwd = (overlap.torch_form(g, WORLD, set(), group) for g in program["graphs"])
    for doc, tg in zip(program["graphs"], (fwd, bwd)):
        gathers = _targets(tg.gm, "all_gather_into_tensor")
        # One gather per parameter some node other than the output reads, of its flat shard.
        read = {r for d in doc["nodes"] if d["op"] != "output" for r in overlap._node_refs(d)}
        used = [p for p in doc["params"] if p["node"] in read]
        assert len(gathers) == len(used) > 0
        for ag in gathers:
            shard = ag.args[0]
            assert shard.op == "placeholder" and ag.args[1] == WORLD
            assert [u.target for u in ag.users] == [torch.ops._c10d_functional.wait_tensor.default]
            p = next(p for p in doc["params"] if p["node"] == shard.name)
            assert shard.meta["val"].numel() == math.ceil(math.prod(p["shape"]) / WORLD)
            assert shard.meta["val"].device.type == "cuda"  # the scheduler's memory tracker skips CPU
    assert not _targets(fwd.gm, "reduce_scatter")
    scatters = _targets(bwd.gm, "reduce_scatter_tensor")
    assert len(scatters) == len(program["graphs"][1]["grads"])
    assert set(bwd.grad_inputs.values()) == {g["param"] for g in program["graphs"][1]["grads"]}


def test_views_share_their_base_storage_so_the_memory_tracker_sees_one_buffer(program):
    with overlap.fake_process_group(WORLD) as group:
        tg = overlap.torch_form(program["graphs"][0], WORLD, set(), group)
    nodes = {n.meta[overlap.NAME]: n for n in tg.gm.graph.nodes}
    doc = {d["name"]: d for d in program["graphs"][0]["nodes"]}
    views = [d for d in doc.values() if d.get("meta", {}).get("aliases") and d["target"] != "operator.getitem"]
    assert views
    for d in views:
        # The FX node's own argument: for a parameter, the gathered value, not the shard.
        n = nodes[d["name"]]
        base = n.args[d["meta"]["aliases"][0]].meta["val"]
        val = n.meta["val"]
        assert val.untyped_storage()._cdata == base.untyped_storage()._cdata, d["name"]


def test_pytorchs_schedule_is_read_back_whole_and_the_checker_takes_it(program, torch_schedule):
    doc = json.loads(torch_schedule.document)
    summary = json.loads(zerosched.check(torch_schedule.document, {"world_size": WORLD}))
    inserted = json.loads(zerosched.schedule(json.dumps(program).encode(), {"disable": ["schedule", "keep"]})[0])
    for got, want, sched in zip(doc["graphs"], inserted["graphs"], summary["schedules"]):
        # The same nodes, reordered: nothing lost or added by the read-back.
        assert sorted(d["name"] for d in got["nodes"]) == sorted(d["name"] for d in want["nodes"])
        assert sched["gathers"] == sum(d["target"] == "zerosched.allgather.default" for d in want["nodes"])
    # PyTorch bucketed some gathers; each bucket is adjacent in the order and has one id
    # (gathers and reductions number theirs apart).
    assert sum(s["buckets"] for s in summary["schedules"]) > 0
    for g in doc["graphs"]:
        for target in ("zerosched.allgather.default", "zerosched.reduce_grad.default"):
            ids = [d.get("kwargs", {}).get("bucket") if d["target"] == target else None for d in g["nodes"]]
            runs = [b for i, b in enumerate(ids) if b is not None and (i == 0 or ids[i - 1] != b)]
            assert len(runs) == len(set(runs))
    assert torch_schedule.seconds > 0


def test_the_reductions_of_one_pytorch_collective_share_a_bucket():
    # GPT-2's backward, where PyTorch coalesces five pairs of reduce-scatters (Llama's has none).
    torch_schedule = overlap.schedule_program(json.loads((FIXTURES / "gpt2.program.json").read_text()),
                                              world_size=WORLD)
    doc = json.loads(torch_schedule.document)
    for g, plan in zip(doc["graphs"], torch_schedule.plans):
        bucket = {d["kwargs"]["param"]: d["kwargs"].get("bucket") for d in g["nodes"]
                  if d["target"] == "zerosched.reduce_grad.default"}
        by_collective: dict[int, list] = {}
        for param, (at, _) in plan.reductions.items():
            by_collective.setdefault(at, []).append(bucket[param])
        for ids in by_collective.values():
            # One bucket id for a coalesced collective's reductions, none for one alone.
            assert len(set(ids)) == 1 and (ids[0] is None) == (len(ids) == 1), ids
    collectives = [[at for at, _ in plan.reductions.values()] for plan in torch_schedule.plans]
    coalesced = sum(1 for ats in collectives for at in set(ats) if ats.count(at) > 1)
    sim = json.loads(zerosched.simulate(torch_schedule.document, {"world_size": WORLD}))["simulation"]["total"]
    assert sim["reduce_buckets"] == coalesced == 5


def test_the_read_back_keeps_pytorchs_order_and_issues_each_gather_where_pytorch_did(torch_schedule):
    doc = json.loads(torch_schedule.document)
    for g, plan in zip(doc["graphs"], torch_schedule.plans):
        placed = [d["name"] for d in g["nodes"] if d["name"] in plan.position]
        torch_at = [plan.position[n] for n in placed]
        assert torch_at == sorted(torch_at)  # the nodes both graphs have, in PyTorch's order
        assert len(placed) > len(g["nodes"]) // 2
        # Each gather has as many of those nodes before it as PyTorch's collective has.
        seen = 0
        for d in g["nodes"]:
            if d["name"] in plan.position:
                seen += 1
            elif d["target"] == "zerosched.allgather.default":
                at = plan.gathers[d["kwargs"]["param"]][0]
                assert seen == sum(1 for p in torch_at if p < at), d["name"]


def test_pytorch_plans_with_zerosched_costs_and_hides_most_communication(torch_schedule, program):
    sim = json.loads(zerosched.simulate(torch_schedule.document, {"world_size": WORLD}))["simulation"]["total"]
    _, jit = zerosched.schedule(json.dumps(program).encode(), {"scheduler": "jit", "disable": ["keep"]})
    jit = json.loads(jit)["simulation"]["total"]
    assert sim["compute_ms"] == pytest.approx(jit["compute_ms"])
    # Gathered at the first use, the jit schedule exposes the gathers; PyTorch's prefetches them.
    assert sim["exposed_comm_ms"] < jit["exposed_comm_ms"] / 2


def test_the_estimator_answers_zerosched_costs_for_collectives_and_compute():
    g = torch.fx.Graph()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        full = torch.empty(WORLD * 1024, dtype=torch.bfloat16, device="cuda")
    x = g.placeholder("x")
    ag = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, WORLD, "0"))
    ag.meta["val"] = full
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    mm.meta[overlap.NAME] = "mm_7"
    est = overlap.estimator({"mm_7": 0.25}, WORLD, {"world_size": WORLD})
    assert est(ag, None) == zerosched.collective_ms("all_gather", WORLD * 1024 * 2)
    # A bucket's size comes as input plus output bytes; zerosched prices the gathered message.
    assert est(ag, (WORLD + 1) * 1000) == pytest.approx(zerosched.collective_ms("all_gather", WORLD * 1000))
    assert est(mm, None) == 0.25


def test_the_benchmark_table_holds_every_scheduler_at_both_budgets_within_them():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_overlap", FIXTURES.parents[1] / "python" / "bench_overlap.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    args = argparse.Namespace(world_size=WORLD, bucketing=True, measure=bench.GATHERED)
    with overlap.fake_process_group(WORLD):
        rows = bench.compare(str(FIXTURES / "llama.program.json"), args)
    assert [r.scheduler.split(",")[0] for r in rows] == ["pytorch", *bench.SCHEDULERS] * 2
    reached = rows[0].total["peak_gathered_bytes"]
    for r in rows:
        limit = reached if r.memory.startswith("PyTorch") else int(reached * bench.TIGHTER)
        if r.total is not None:
            assert r.total["peak_gathered_bytes"] <= limit, (r.scheduler, r.memory)
            assert r.check == "accepted"
    table = bench.table(rows, args.measure)
    assert table.count("\n") == 1 + len(rows)
    assert len(bench.targets(rows)) == 1
