"""Training through ``torch.compile(backend=zerosched.backend(...))`` on two gloo ranks, against
an unsharded eager run of the same model from the same seed."""

from __future__ import annotations

import pytest

import train_cases

# float32 throughout.  Sharded training reduces gradients in another order than the reference
# (two half batches, then an average), which moves the last bits; 1e-5 of the largest value of
# each parameter after five steps leaves two orders of magnitude over what we observe.
RTOL = 1e-5
BUDGET = 256 * 1024  # bytes of gathered parameters per graph; the largest parameter is 64 KiB


# Two cases per model use a cost model of slow compute and a large collective latency, under
# which gathers are coalesced into buckets (zerosched.allgather_bucket) for certain; the others
# use the default one, under which these tiny latency-bound gathers may coalesce as well.  GPT-2 keeps its parameters of at
# most 256 elements whole (biases, norms: persistent, their gradients all-reduced); the others
# shard every parameter.
CASES = [
    ("llama", "eager", None, 0),
    ("qwen2-moe", "eager", None, 0),
    ("gpt2", "eager", train_cases.BUCKETING_COST, 256),
    ("qwen2-moe-eager", "eager", None, 0),
    ("llama", "inductor", train_cases.BUCKETING_COST, 0),
    ("qwen2-moe", "inductor", train_cases.BUCKETING_COST, 0),
    ("gpt2", "inductor", None, 256),
]
IDS = [f"{m}-{i}-{'buckets' if c else 'default'}" for m, i, c, _ in CASES]

# What the eager fallback gathered in each forward.  Whole-graph models: nothing.  With the
# graph break in Qwen2-MoE's experts, dynamo runs the decoder's forward eagerly: the embedding
# and the experts' weights (read in the eager expert loop) are gathered on access, and so is the
# final norm, whose pre-hook runs eagerly although its forward is then compiled (the end of the
# backward releases it).
FALLBACK = {
    "qwen2-moe-eager": ["model.embed_tokens.weight"]
    + [f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("down_proj", "gate_up_proj")]
    + ["model.norm.weight"],
}


@pytest.mark.parametrize("model,inner,cost,persistence", CASES, ids=IDS)
def test_training_matches_the_unsharded_eager_run(ranks, model, inner, cost, persistence):
    r0, r1 = ranks.run(train_cases.train, model, inner, BUDGET, cost, persistence)
    assert r0["loss"] == r1["loss"], "the all-reduced loss differs between ranks"
    assert len(r0["loss"]) == train_cases.STEPS
    for step, (got, want) in enumerate(zip(r0["loss"], r0["ref_loss"])):
        assert got == pytest.approx(want, rel=RTOL), f"step {step}: loss {got} != reference {want}"
    assert r0["moved"] > 10 * RTOL, "every parameter must move well beyond the tolerance"
    for r in (r0, r1):
        worst = max(r["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= RTOL, f"parameter {worst[0]} differs from the reference by {worst[1]:.2e}"
        assert len(r["param_err"]) == r["params"]
        # Between steps nothing stays gathered, and no full-size gradient lands on the model.
        assert r["gathered_between"] == [[]] * train_cases.STEPS
        assert r["bytes_between"] == [0] * train_cases.STEPS
        assert r["model_grads"] == [[]] * train_cases.STEPS
        # Every reduction is waited for once, at the end of the backward pass.
        assert r["waits"] == [1] * train_cases.STEPS
        assert r["in_flight_between"] == [0] * train_cases.STEPS
        assert 0 < r["peak"] <= BUDGET
        if cost is not None:
            assert r["buckets"] > 0
        assert (r["persistent"] > 0) == (persistence > 0)
        assert r["fallback_after_forward"] == [FALLBACK.get(model, [])] * train_cases.STEPS
        assert r["fallback_between"] == [[]] * train_cases.STEPS


# Each decoder block compiled on its own (nn.Module.compile), the embedding, final norm and head
# eager, gathered on access by the fallback: dynamo compiles the blocks' code once, and the
# graphs it reuses for the second block are scheduled and compiled once (a forward and a
# backward graph), yet gather and reduce each block's own parameters (the losses and the
# parameters would differ otherwise: the blocks' weights differ).  No persistent parameters:
# the fallback does not all-reduce the gradient of one that runs eagerly (GPT-2's final norm).
PER_BLOCK = [("llama", "eager", None, 0), ("llama", "inductor", train_cases.BUCKETING_COST, 0),
             ("gpt2", "inductor", None, 0)]


@pytest.mark.parametrize("model,inner,cost,persistence", PER_BLOCK,
                         ids=[f"{m}-{i}-{'buckets' if c else 'default'}" for m, i, c, _ in PER_BLOCK])
def test_blocks_compiled_one_by_one_compile_once_and_match_the_unsharded_eager_run(ranks, model, inner, cost,
                                                                                   persistence):
    r0, r1 = ranks.run(train_cases.train, model, inner, BUDGET, cost, persistence, train_cases.STEPS, "cpu", True)
    for step, (got, want) in enumerate(zip(r0["loss"], r0["ref_loss"])):
        assert got == pytest.approx(want, rel=RTOL), f"step {step}: loss {got} != reference {want}"
    for r in (r0, r1):
        assert r["graphs"] == 2, "one forward and one backward graph for every block"
        worst = max(r["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= RTOL, f"parameter {worst[0]} differs from the reference by {worst[1]:.2e}"
        assert r["gathered_between"] == [[]] * train_cases.STEPS
        assert r["model_grads"] == [[]] * train_cases.STEPS
        assert r["fallback_between"] == [[]] * train_cases.STEPS
        # Each block's backward graph ends with end_backward; the pass waits for its reductions once.
        assert r["waits"] == [1] * train_cases.STEPS
        assert r["in_flight_between"] == [0] * train_cases.STEPS
        outside = r["fallback_after_forward"][0]
        assert outside and not any(".layers." in n or ".h." in n for n in outside), outside
