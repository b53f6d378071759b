"""Training graphs that hold get_attr constants through the backend, end to end on two ranks."""

from __future__ import annotations

import pytest

import constant_cases


def test_graphs_with_get_attr_constants_train_as_the_unsharded_eager_model(ranks):
    r0, r1 = ranks.run(constant_cases.train_with_constants)
    forward = [g for g in r0["graphs"] if g["name"].startswith("forward")]
    assert forward and "get_attr" in forward[0]["ops"], "the forward graph must hold a get_attr constant"
    assert any(t.startswith("zerosched.allgather") for t in forward[0]["targets"]), "and be scheduled"
    assert r0["loss"] == r1["loss"]
    for got, want in zip(r0["loss"], r0["ref_loss"]):
        assert got == pytest.approx(want, rel=1e-6)
    for r in (r0, r1):
        worst = max(r["param_err"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, f"{worst[0]} differs from the reference by {worst[1]:.2e}"
