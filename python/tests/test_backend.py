"""The backend's schedule cache and its cross-rank agreement check (debug mode)."""

from __future__ import annotations

import pytest

import backend_cases


def test_ranks_that_reach_different_schedules_raise_instead_of_hanging(ranks):
    for msg in ranks.run(backend_cases.disagreeing_ranks):
        assert msg.endswith("_0`: the ranks reached different schedules (hashes differ)"), msg


def test_a_graph_compiled_again_is_scheduled_from_the_cache(ranks):
    for hits in ranks.run(backend_cases.cache_hits):
        assert hits == [0, 2]  # the forward and the backward graph


# The other layers' graphs are compiled while the step runs, outside dynamo: Inductor too.
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_one_compiled_graph_run_for_several_layers_gathers_each_layers_parameters(ranks, inner):
    for r in ranks.run(backend_cases.layers_compiled_one_by_one, inner):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6)
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, f"{worst[0]}: gradient differs from the reference by {worst[1]:.2e}"
        assert len(r["grad_err"]) == 8
        # A forward and a backward graph for layer 0, and one of each for layers 1 to 3: the
        # graph dynamo reuses serves each layer's parameters without compiling again.
        assert r["graphs"] == 4
        names = [f"layers.{i}.{w}" for i in range(4) for w in ("weight", "bias")]
        assert sorted(set(r["gathered"])) == sorted(names)
        assert sorted(r["reduced"]) == sorted(names), "each gradient reduced once, into its own parameter"


def test_inductor_propagates_fake_tensors_once_per_graph(ranks):
    # Inductor propagates over the rebuilt graph itself; the backend must not do it first.
    for r in ranks.run(backend_cases.fake_propagations):
        assert r["graphs"] == 2 and r["propagations"] == r["graphs"], r


def test_a_persistent_parameter_the_backward_does_not_read_is_all_reduced(ranks):
    for r in ranks.run(backend_cases.persistent_bias_reduction):
        assert r["params"] == ["proj.bias", "proj.weight"], "the bias's reduction reads the bias"
        assert r["sharded"] == {"proj.weight": True, "proj.bias": False}


def test_no_collective_is_issued_holding_the_gil_through_the_python_dispatcher(ranks):
    for r in ranks.run(backend_cases.collectives_under_the_python_dispatcher):
        # Two schedule checks of two all-reduces each, the gathers, and the gradients'
        # reductions (one bucket).
        assert r["all_reduce"] == 4 and r["_all_gather"] >= 1 and r["_reduce_scatter"] >= 1, r
        assert r["python_dispatcher"] == 0, r


def test_a_memory_budget_too_small_names_the_smallest_that_works_for_forward_and_backward(ranks):
    for r in ranks.run(backend_cases.memory_named_for_both_graphs):
        assert r["kind"] == "memory" and r["needed"] > 1
        assert "`forward_0` and `backward_0`" in r["message"], r["message"]
        assert r["given_back"] == "None", "the named figure must compile and run the whole step"
        assert r["short"] == "OverBudgetError"
